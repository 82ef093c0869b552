//! Which requests opt in (`docs/design.md` §2): a request on an opted-in
//! route (method and path) that carries an `Idempotency-Key`. Told from the
//! head alone, with no await and no allocation, because most traffic
//! through a gateway does not opt in and deciding that must cost next to
//! nothing. An opted-in request is then [prepared](prepare): its owner
//! derived, its body read (bounded, and held against the memory budget)
//! and its fingerprint taken.

use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Request};
use tracing::Span;

use crate::error::{ClientError, GatewayError};
use crate::route::{self, Route};
use idemgate_domain::fingerprint::{fingerprint, RequestParts};
use idemgate_domain::key::IdempotencyKey;
use idemgate_domain::sse::ResumePoint;
use idemgate_proxy::budget::Charge;
use idemgate_proxy::http::{
    collect_charged, discard, Body, CollectError, EVENTS_RECEIVED, IDEMPOTENCY_KEY, LAST_EVENT_ID,
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

/// An opted-in request whose key parsed.
pub(crate) struct OptedIn {
    route: Arc<Route>,
    key: IdempotencyKey,
    req: Request<Body>,
}

/// Tells pass-through from opted-in by the first route that matches. On a
/// route that serves only proven clients, the client is proven first,
/// keyed request or not (`docs/design.md` §15).
pub(crate) fn classify(routes: &[Arc<Route>], trust: &Trust, mut req: Request<Body>) -> Classified {
    let Some(route) = route::find(routes, req.method(), req.uri().path()) else {
        return Classified::PassThrough(req);
    };
    if route.require_client {
        match trust.prove_client(req.headers()) {
            Ok(client) => drop(req.extensions_mut().insert(client)),
            Err(refused) => return Classified::Refused(refused.into()),
        }
    }
    // Every line of the header: a key sent twice is refused, not the first taken.
    let lines = req.headers().get_all(IDEMPOTENCY_KEY).iter();
    let key = match IdempotencyKey::from_lines(lines.map(HeaderValue::as_bytes)) {
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
        key,
        req,
    })
}

/// Reads what the decision needs: the owner (as the route's owner rule
/// says, `401` when it cannot be established), the resume point (`400`
/// when it cannot be read), the body (within the route's
/// limit, `413` past it; within the memory budget, `503` past it; `408`
/// when its client pauses past the body-read timeout) and the fingerprint
/// (`400` for a body the route canonicalises that names a JSON member
/// twice).
pub(crate) async fn prepare(shared: &Shared, opted: OptedIn) -> Result<Keyed, GatewayError> {
    let OptedIn { route, key, req } = opted;
    let (parts, body) = req.into_parts();
    let owner = shared.trust.owner(&route.owner, &parts)?;
    let lines = |name| {
        parts
            .headers
            .get_all(name)
            .iter()
            .map(HeaderValue::as_bytes)
    };
    let resume = ResumePoint::parse(lines(LAST_EVENT_ID), lines(EVENTS_RECEIVED))
        .map_err(ClientError::from)?;
    let (body, charge) = read(shared, &route, &parts, body).await?;
    let fingerprint = fingerprint(
        &RequestParts {
            method: parts.method.as_str(),
            path_and_query: parts.uri.path_and_query().map_or("/", |pq| pq.as_str()),
            headers: route
                .significant_headers
                .iter()
                .map(|name| {
                    (
                        name.as_str(),
                        parts.headers.get(name).map(HeaderValue::as_bytes),
                    )
                })
                .collect(),
            body: &body,
        },
        &route.body,
    )
    .map_err(ClientError::from)?;
    Ok(Keyed {
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
    })
}

/// The whole body, held against the memory budget: a request is taken only
/// while the budget has room for the length it declares, and one without a
/// length only while its body keeps fitting. A refused body's rest is read
/// and dropped, so its client reads the `503` (`docs/design.md` §18).
async fn read(
    shared: &Shared,
    route: &Route,
    parts: &http::request::Parts,
    mut body: Body,
) -> Result<(Bytes, Arc<Charge>), GatewayError> {
    let limit = route.body_limit;
    let hint = http_body::Body::size_hint(&body);
    if hint.lower() > limit as u64 {
        return Err(ClientError::BodyTooLarge { limit }.into());
    }
    let declared = hint.exact().map_or(0, |n| n as usize);
    let refused = |body: Body| {
        // A client waiting for `100 Continue` has sent no body: none to read.
        let expects = parts.headers.get(header::EXPECT);
        if !expects.is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue")) {
            discard(body, limit);
        }
        Err(GatewayError::OverBudget {
            retry_after: shared.config.retry_after,
        })
    };
    let Some(charge) = shared.budget.admit(declared) else {
        return refused(body);
    };
    match collect_charged(&mut body, limit, &charge).await {
        Ok(bytes) => Ok((bytes, charge)),
        Err(CollectError::OverBudget) => {
            drop(charge);
            refused(body)
        }
        Err(e) => Err(ClientError::from(e).into()),
    }
}
