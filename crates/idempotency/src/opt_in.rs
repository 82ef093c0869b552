//! Which requests opt in (`docs/design.md` §2): a request on an opted-in
//! route (method and path) that carries an `Idempotency-Key`. Told from the
//! head alone, with no await and no allocation, because most traffic
//! through a gateway does not opt in and deciding that must cost next to
//! nothing. An opted-in request is then [prepared](prepare): its owner
//! derived, its body read (bounded, and held against the memory budget)
//! and its fingerprint taken.

use std::sync::Arc;

use bytes::Bytes;
use http::header::CONTENT_ENCODING;
use http::{HeaderName, HeaderValue, Request};
use tracing::Span;

use crate::error::{ClientError, GatewayError};
use crate::method_override;
use crate::route::{self, Protocol, Route};
use idemgate_domain::fingerprint::{
    canonical_footprint, fingerprint, multipart_boundary, BodyRule, RequestParts,
};
use idemgate_domain::key::{IdempotencyKey, KeyError, Owner};
use idemgate_domain::sse::ResumePoint;
use idemgate_proxy::budget::Charge;
use idemgate_proxy::http::{
    collect_charged, detach_head, spelling, Body, CollectError, EVENTS_RECEIVED, IDEMPOTENCY_KEY,
    LAST_EVENT_ID, TAKEN_AHEAD,
};
use idemgate_proxy::upstream::Target;
use idemgate_trust::Trust;

use super::keyed::{Intent, Keyed};
use super::shared::Shared;

/// What a request is, told from its head.
pub(crate) enum Classified {
    /// Not opted in: forward it untouched.
    PassThrough(Request<Body>),
    /// Opted in, but refused before touching the store.
    Refused(GatewayError),
    /// Opted in: its body is read and fingerprinted by [`prepare`].
    OptedIn(OptedIn),
}

/// An opted-in request whose key parsed (an MCP route's `POST`, whose key
/// may be in its body, with the header's key if any).
pub(crate) struct OptedIn {
    pub(crate) route: Arc<Route>,
    pub(crate) key: HeaderKey,
    pub(crate) req: Request<Body>,
    /// The methods a method-override names beside the line's, on the
    /// line's own route: part of the fingerprint (`method_override`).
    pub(crate) also: Vec<http::Method>,
}

/// What the `Idempotency-Key` header says. On an MCP route a key may be in
/// the body instead, and one the header spells badly is refused only for a
/// keyed tool call that carries none there (`mcp::prepare`): `initialize`
/// and the rest pass through as they came.
pub(crate) enum HeaderKey {
    Absent,
    Valid(IdempotencyKey),
    Invalid(KeyError),
}

/// What a prepared request is: keyed, or, on an MCP route, a message that
/// is not a keyed tool call, to be passed through with its body as read.
pub(crate) enum Prepared {
    /// Keyed: it runs through the flow.
    Keyed(Keyed),
    /// Not keyed after all: forwarded as it is.
    Passing(Request<Body>),
    /// Answered here, never forwarded: an agent's cancel of a keyed call
    /// in flight (`docs/design.md` §19, "An agent's cancel").
    Answered(http::Response<Body>),
}

/// Why a request was refused while it was prepared, and, for a tool call,
/// the JSON-RPC `id` its refusal is addressed to.
pub(crate) struct Refused {
    pub(crate) error: GatewayError,
    pub(crate) rpc_id: Option<Vec<u8>>,
}

impl From<GatewayError> for Refused {
    fn from(error: GatewayError) -> Self {
        Refused {
            error,
            rpc_id: None,
        }
    }
}

impl From<ClientError> for Refused {
    fn from(error: ClientError) -> Self {
        GatewayError::from(error).into()
    }
}

impl From<idemgate_trust::TrustError> for Refused {
    fn from(error: idemgate_trust::TrustError) -> Self {
        GatewayError::from(error).into()
    }
}

impl Refused {
    /// The answer: a JSON-RPC error to a tool call, for what its key met
    /// (`docs/design.md` §19); a problem otherwise.
    pub(crate) fn into_response(self) -> http::Response<Body> {
        match self.rpc_id {
            Some(id) if self.error.is_the_calls() => self.error.into_jsonrpc(&id),
            _ => self.error.into_response(),
        }
    }
}

/// Marks an MCP route's `DELETE`: the end of the session it names, on the
/// route it names (its keyed calls at their server hold it back:
/// `mcp::Calls::quiet`).
#[derive(Clone)]
pub(crate) struct SessionEnd {
    pub(crate) route: String,
}

/// Tells pass-through from opted-in by the first route that matches. On a
/// route that serves only proven clients, the client is proven first,
/// keyed request or not (`docs/design.md` §15).
pub(crate) fn classify(routes: &[Arc<Route>], trust: &Trust, mut req: Request<Body>) -> Classified {
    let found = route::find(routes, req.method(), req.uri().path());
    let also = match method_override::read(routes, found, &req) {
        Ok(also) => also,
        Err(named) => {
            let sent = req.method().to_string();
            return Classified::Refused(ClientError::AmbiguousMethod { sent, named }.into());
        }
    };
    let Some(route) = found else {
        return Classified::PassThrough(req);
    };
    if route.require_client {
        match trust.prove_client(req.headers()) {
            Ok(client) => drop(req.extensions_mut().insert(client)),
            Err(refused) => return Classified::Refused(refused.into()),
        }
    }
    if matches!(route.protocol, Protocol::Mcp(_)) && req.method() != http::Method::POST {
        // The transport's event stream (`GET`) and session end (`DELETE`),
        // with the client proven above: they reach the route's upstream,
        // with its credentials, only from a proven client.
        req.extensions_mut()
            .insert(Target(route.primary.id.clone()));
        if req.method() == http::Method::DELETE {
            let end = SessionEnd {
                route: route.name.clone(),
            };
            req.extensions_mut().insert(end);
        }
        return Classified::PassThrough(req);
    }
    // Every line of the header: a key sent twice is refused, not the first taken.
    let lines = req.headers().get_all(IDEMPOTENCY_KEY).iter();
    let key = match IdempotencyKey::from_lines(lines.map(HeaderValue::as_bytes)) {
        // A tool call's key may be in its body: its route reads it there.
        read if matches!(route.protocol, Protocol::Mcp(_)) => {
            let key = match read {
                None => HeaderKey::Absent,
                Some(Ok(key)) => HeaderKey::Valid(key),
                Some(Err(e)) => HeaderKey::Invalid(e),
            };
            return Classified::OptedIn(OptedIn {
                route: route.clone(),
                key,
                req,
                also,
            });
        }
        None if route.require_key => return Classified::Refused(ClientError::MissingKey.into()),
        None => {
            let mut req = req;
            req.extensions_mut()
                .insert(Target(route.primary.id.clone()));
            return Classified::PassThrough(req);
        }
        Some(Ok(key)) => key,
        Some(Err(e)) => return Classified::Refused(ClientError::from(e).into()),
    };
    Classified::OptedIn(OptedIn {
        route: route.clone(),
        key: HeaderKey::Valid(key),
        req,
        also,
    })
}

/// The lines of each of a route's significant headers, in its order, and
/// `Content-Encoding`'s after them when the request has one the route does
/// not list: the same bytes gzipped and not are two requests to the
/// upstream (`docs/design.md` §11). A request without one, or with only
/// `identity` (no encoding), hashes as it did.
fn significant_lines<'h>(
    significant: &'h [HeaderName],
    headers: &'h http::HeaderMap,
) -> Vec<(&'h str, Vec<&'h [u8]>)> {
    let encoding = &http::header::CONTENT_ENCODING;
    let encoded = !significant.contains(encoding)
        && (headers.get_all(encoding).iter())
            .any(|v| !v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"identity"));
    let names = significant.iter().chain(encoded.then_some(encoding));
    names
        .map(|name| {
            let lines = headers.get_all(name).iter();
            (name.as_str(), lines.map(HeaderValue::as_bytes).collect())
        })
        .collect()
}

/// Reads what the decision needs: the owner (as the route's owner rule
/// says, `401` when it cannot be established), the resume point (`400`
/// when it cannot be read), the body (within the route's
/// limit, `413` past it; within the memory budget, `503` past it; `408`
/// when its client pauses past the body-read timeout) and the fingerprint
/// (`400` for a body the route canonicalises that names a JSON member
/// twice, or a significant header sent in a spelling with `_`). An MCP
/// route's messages are prepared by `mcp::prepare` instead.
pub(crate) async fn prepare(shared: &Shared, opted: OptedIn) -> Result<Prepared, Refused> {
    let OptedIn {
        route,
        key,
        req,
        also,
    } = opted;
    let HeaderKey::Valid(key) = key else {
        return Err(ClientError::MissingKey.into());
    };
    let (parts, body) = req.into_parts();
    let owner = shared.trust.owner(&route.owner, &parts)?;
    let resume = resume_point(&parts)?;
    // A significant header in a spelling only some upstreams read as it
    // would hash as absent: the same fingerprint for two requests.
    // So would `Content-Encoding` (`significant_lines`).
    let (significant, encoding) = (&route.significant_headers, &[CONTENT_ENCODING]);
    let spelled = |names| spelling::spelled_otherwise(&parts.headers, names);
    if let Some((sent, name)) = spelled(significant).or_else(|| spelled(encoding)) {
        return Err(ClientError::AmbiguousHeader {
            sent: sent.to_string(),
            reads_as: name.to_string(),
        }
        .into());
    }
    let (body, charge) = read(shared, &route, Some(&owner), body).await?;
    let parsing = parse_charge(shared, &route.body, (Some(&owner), &charge), &body)?;
    // docs/design.md §11, "A multipart boundary is framing".
    let types = parts.headers.get_all(http::header::CONTENT_TYPE);
    let boundary = multipart_boundary(types.iter().map(HeaderValue::as_bytes));
    let fingerprint = fingerprint(
        &RequestParts {
            method: &method_override::fingerprinted(&parts.method, &also),
            path_and_query: parts.uri.path_and_query().map_or("/", |pq| pq.as_str()),
            headers: significant_lines(&route.significant_headers, &parts.headers),
            body: &body,
            boundary: boundary.as_deref().map(str::as_bytes),
        },
        &route.body,
    )
    .map_err(ClientError::from)?;
    drop(parsing);
    // A held duplicate keeps its head for as long as it is held (it may yet
    // run the job's next attempt): copied out of the connection's read
    // buffer, it lets that buffer go (docs/performance.md, item 11).
    let mut parts = parts;
    detach_head(&mut parts);
    Ok(Prepared::Keyed(Keyed {
        intent: Arc::new(Intent {
            route,
            owner,
            key,
            fingerprint,
        }),
        parts,
        body,
        charge,
        resume,
        span: Span::current(),
        waiting: None,
        rpc_id: None,
    }))
}

/// Where a retry of a streamed job picks its stream up (`400` when that
/// cannot be read).
pub(crate) fn resume_point(
    parts: &http::request::Parts,
) -> Result<Option<ResumePoint>, ClientError> {
    let lines = |name| {
        parts
            .headers
            .get_all(name)
            .iter()
            .map(HeaderValue::as_bytes)
    };
    Ok(ResumePoint::parse(
        lines(LAST_EVENT_ID),
        lines(EVENTS_RECEIVED),
    )?)
}

/// The charge for parsing `body` as `rule` canonicalises it (for `owner`,
/// whose request holds `body_charge` for the body itself), held while the
/// parse runs: its tree takes many times the body on a body of
/// many small values, and is refused past the budget as a body that
/// outgrew it is, `413` when it could never fit (`docs/design.md` §18).
/// `None` when nothing is parsed.
pub(crate) fn parse_charge(
    shared: &Shared,
    rule: &BodyRule,
    (owner, body_charge): (Option<&Owner>, &Charge),
    body: &[u8],
) -> Result<Option<Arc<Charge>>, GatewayError> {
    let bytes = canonical_footprint(body, rule);
    if bytes == 0 {
        return Ok(None);
    }
    let share = owner
        .filter(|o| **o != Owner::anonymous())
        .map(Owner::as_str);
    // Beside the body it parses, within what this owner may ever hold: past
    // that no retry would fit, so no retry is asked for.
    let room = shared.budget.room_for(share);
    if bytes.saturating_add(body_charge.bytes()) > room {
        return Err(ClientError::TooManyValues {
            footprint: bytes,
            budget: room,
        }
        .into());
    }
    match shared.budget.admit_for(share, bytes) {
        Some(charge) => Ok(Some(charge)),
        None => Err(GatewayError::OverBudget {
            retry_after: shared.config.retry_after,
        }),
    }
}

/// The whole body, held against the memory budget: a request is taken only
/// while the budget has room for the first [`TAKEN_AHEAD`] bytes of the
/// length it declares, and goes on only while the rest, taken as it
/// arrives, keeps fitting (as one without a length does). A refused body's rest (past
/// the route's `body_limit`, `413`; past the budget, `503`) is read and
/// dropped after the answer, as any body answered unread is
/// (`idemgate_proxy::http::linger`, `docs/design.md` §18). Its `owner`
/// (when known and not the anonymous one) holds at most its share.
pub(crate) async fn read(
    shared: &Shared,
    route: &Route,
    owner: Option<&Owner>,
    mut body: Body,
) -> Result<(Bytes, Arc<Charge>), GatewayError> {
    let limit = route.body_limit;
    let over_budget = || GatewayError::OverBudget {
        retry_after: shared.config.retry_after,
    };
    let hint = http_body::Body::size_hint(&body);
    if hint.lower() > limit as u64 {
        return Err(ClientError::BodyTooLarge { limit }.into());
    }
    let declared = hint.exact().map_or(0, |n| n as usize);
    let share = owner
        .filter(|o| **o != Owner::anonymous())
        .map(Owner::as_str);
    // A length its owner's share could never hold is refused at once;
    // any other is admitted with its first `TAKEN_AHEAD` bytes, the rest
    // taken once the body is past them (`collect_charged`).
    if declared > shared.budget.room_for(share) {
        return Err(over_budget());
    }
    let Some(charge) = shared.budget.admit_for(share, declared.min(TAKEN_AHEAD)) else {
        return Err(over_budget());
    };
    match collect_charged(&mut body, limit, &charge).await {
        Ok(bytes) => Ok((bytes, charge)),
        Err(CollectError::OverBudget) => Err(over_budget()),
        Err(e) => Err(ClientError::from(e).into()),
    }
}
