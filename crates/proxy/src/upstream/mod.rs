//! The upstreams: pooled HTTP clients that forward a request to one of the
//! configured origins, as a Tower service.
//!
//! It rewrites the path onto the upstream's base, removes hop-by-hop headers
//! both ways and the console's cookie on the way out, and adds `X-Forwarded-For`/`-Proto`/`-Host`. The `Host` header
//! becomes the upstream's own authority, as most reverse proxies do. Its
//! errors say whether the request may have reached the upstream, which
//! decides between `failed` (safe to retry) and `unknown`.

mod pool;
mod settings;
mod timing;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Request, Response, Uri};
use http_body_util::BodyExt;
use hyper_rustls::HttpsConnectorBuilder;
use hyper_util::client::legacy::connect::HttpConnector;
use tokio::sync::watch;

use self::pool::Pool;

use crate::budget::Charge;
use crate::http::{hop, spelling, Body, ClientAddr, ProvenClient};
use idemgate_domain::BoxError;
pub use pool::MAX_ANSWER_HEAD;
pub use settings::{UpstreamId, UpstreamSettings, DEFAULT_IDLE_TIMEOUT};
pub use timing::{Stopwatch, Timings, Waited};

/// Which upstream a request goes to, put into request extensions by the
/// idempotency layer; a request without one goes to the first configured
/// upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target(pub UpstreamId);

/// How forwarding failed, by whether the request may have had an effect.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The connection could not be made: the request was never sent.
    #[error("the upstream refused the connection; the request was not sent")]
    Refused(#[source] BoxError),
    /// Failed after the request may have been sent (reset, protocol error).
    #[error("the upstream connection failed after the request was sent")]
    Broken(#[source] BoxError),
    /// It answered, but not the request: an MCP server's answer without
    /// the call's response, or with its cancellation. It may have acted.
    #[error("the upstream answered without an answer to the request: {0}")]
    Unanswered(String),
    /// It answered, but the answer broke the route's contract.
    #[error("the upstream's answer broke the route's contract: {0}")]
    ContractViolation(String),
    /// No answer within the upstream timeout.
    #[error("the upstream did not answer within {0:?}")]
    TimedOut(Duration),
    /// It answered with more than can be recorded.
    #[error("the upstream response is larger than {limit} bytes and cannot be recorded")]
    ResponseTooLarge {
        /// The limit.
        limit: usize,
    },
    /// It answered with more than the memory budget has room for
    /// (`docs/design.md` §18): the rest was not read.
    #[error(
        "the upstream's answer does not fit the gateway's memory budget and cannot be recorded"
    )]
    OverBudget,
    /// The request named an upstream this gateway does not have (a defect:
    /// configuration makes every [`UpstreamId`]); nothing was sent.
    #[error("no upstream {0} is configured")]
    Unconfigured(UpstreamId),
}

/// [`UpstreamError`]s by what they mean for the attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamErrorKind {
    /// Nothing was sent: safe to retry.
    NotSent,
    /// It may have acted: the outcome is unknown.
    MayHaveActed,
    /// It answered, but the answer cannot be used.
    Unusable,
}

impl UpstreamError {
    /// What the error means for the attempt.
    pub fn kind(&self) -> UpstreamErrorKind {
        match self {
            UpstreamError::Refused(_) | UpstreamError::Unconfigured(_) => {
                UpstreamErrorKind::NotSent
            }
            UpstreamError::Broken(_)
            | UpstreamError::Unanswered(_)
            | UpstreamError::TimedOut(_)
            | UpstreamError::ResponseTooLarge { .. }
            | UpstreamError::OverBudget => UpstreamErrorKind::MayHaveActed,
            UpstreamError::ContractViolation(_) => UpstreamErrorKind::Unusable,
        }
    }
}

const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
/// The forwarding headers, replaced on an untrusted peer's requests.
const FORWARDING: [HeaderName; 4] = [
    X_FORWARDED_FOR,
    X_FORWARDED_HOST,
    X_FORWARDED_PROTO,
    header::FORWARDED,
];

/// A pooled client bound to one upstream.
#[derive(Clone)]
pub struct Upstream {
    pool: Arc<Pool>,
    target: Arc<UpstreamSettings>,
    /// `idemgate_upstream_response_seconds{upstream,outcome}`, looked up
    /// once.
    timing: Arc<Timings>,
    /// The `Host` every forwarded request carries: the base's authority,
    /// without the scheme's default port.
    host: HeaderValue,
}

impl Upstream {
    /// A client for `target`; connecting gives up after its connect timeout
    /// (still a safe failure: nothing was sent).
    pub fn new(target: Arc<UpstreamSettings>) -> Self {
        let mut tcp = HttpConnector::new();
        tcp.set_connect_timeout(Some(target.connect_timeout));
        tcp.set_nodelay(true);
        tcp.enforce_http(false);
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(tls_config(&target.extra_roots))
            .https_or_http()
            .enable_http1()
            .wrap_connector(tcp);
        let base = &target.base;
        let host = match (base.host(), base.port_u16()) {
            (Some(host), Some(port)) if Some(port) != default_port(base) => {
                format!("{host}:{port}")
            }
            (host, _) => host.unwrap_or_default().to_owned(),
        };
        let host = HeaderValue::try_from(host).expect("an authority is a valid header value");
        let pool = Pool::new(connector, base.clone(), target.idle_timeout, pool::MAX_IDLE);
        let timing = Arc::new(Timings::upstream(target.name()));
        Upstream {
            pool,
            target,
            host,
            timing,
        }
    }

    /// Its settings.
    pub fn settings(&self) -> &UpstreamSettings {
        &self.target
    }

    /// Points `req` at this upstream. Fails, nothing sent, when the base's
    /// path and the request's target do not make a URI together (longer
    /// than one may be: the path layer bounds the target, not the base).
    fn rewrite(&self, req: &mut Request<Body>) -> Result<(), UpstreamError> {
        let base = &self.target.base;
        let prefix = base.path().trim_end_matches('/');
        // An HTTP/2 client names the host in `:authority` (the URI), not
        // `Host`: `X-Forwarded-Host` is the one it named either way.
        let authority = req.uri().authority().cloned();
        let path_and_query = match req.uri().path_and_query() {
            // Most bases have no path: the request's own is reused as is.
            Some(pq) if prefix.is_empty() => pq.clone(),
            pq => format!("{prefix}{}", pq.map_or("/", |pq| pq.as_str()))
                .parse()
                .map_err(|e| {
                    UpstreamError::Refused(
                        format!(
                            "the base path and the request's target make no URI ({e}): not sent"
                        )
                        .into(),
                    )
                })?,
        };
        // Origin form: the connection already goes to the base's authority.
        *req.uri_mut() = Uri::from(path_and_query);
        let client = req.extensions().get::<ClientAddr>().cloned();
        let proven = req.extensions().get::<ProvenClient>().is_some();
        let headers = req.headers_mut();
        // Hop-by-hop headers were removed as the request came in, before the
        // gateway added its own (docs/design.md §15), so a client's
        // `Connection` header cannot remove those.
        let host = headers
            .insert(header::HOST, self.host.clone())
            .or_else(|| authority.as_ref().and_then(host_of));
        forwarding(headers, client.as_ref(), host);
        // The trace continues upstream from the current span (the attempt's).
        idemgate_telemetry::trace::propagate(headers);
        // The gateway's own client key is never spent upstream, whether or
        // not the request was routed; it is removed before the upstream's
        // own headers go in, so an upstream's `authorization` is kept.
        // Every spelling of either (docs/design.md §15): a CGI-style upstream
        // reads `X_Tenant` as `X-Tenant`, beside the value put in.
        if let Some(withheld) = &self.target.withheld {
            spelling::remove_every_spelling(headers, std::slice::from_ref(withheld));
        }
        // The upstream's own headers; its credentials (which clients never
        // hold) only for a client that proved itself, those marked
        // `credential = false` for every request (docs/design.md §15).
        for (name, value) in &self.target.headers {
            if proven || !self.target.credentials.contains(name) {
                spelling::remove_every_spelling(headers, std::slice::from_ref(name));
                headers.insert(name.clone(), value.clone());
            }
        }
        // HTTP/2 clients arrive with version 2; the upstream speaks HTTP/1.1.
        *req.version_mut() = http::Version::HTTP_11;
        Ok(())
    }
}

/// The host (and port) `authority` names, without any `user:password@`
/// a client put before it: what `X-Forwarded-Host` carries.
fn host_of(authority: &http::uri::Authority) -> Option<HeaderValue> {
    let host = match authority.port() {
        Some(port) => format!("{}:{port}", authority.host()),
        None => authority.host().to_owned(),
    };
    HeaderValue::from_str(&host).ok()
}

impl tower::Service<Request<Body>> for Upstream {
    type Response = Response<Body>;
    type Error = UpstreamError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The pooled client is always ready; it queues connections itself.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        self.forward(req)
    }
}

impl Upstream {
    /// Sends `req` to this upstream (no clone of the client per request).
    fn forward(&self, mut req: Request<Body>) -> ResponseFuture {
        if let Err(e) = self.rewrite(&mut req) {
            return ResponseFuture {
                kind: Kind::Unconfigured(Some(e)),
            };
        }
        let watch = req.extensions_mut().remove::<Stopwatch>();
        let clock = timing::Clock::start(watch, &self.timing);
        ResponseFuture {
            kind: Kind::Forwarded(self.pool.send(req), clock),
        }
    }
}

/// An upstream's answer on its way, its hop-by-hop headers stripped when its
/// head arrives. Named rather than boxed (see `pool::Sending` for the one
/// allocation left on a reused connection).
pub struct ResponseFuture {
    kind: Kind,
}

#[expect(
    clippy::large_enum_variant,
    reason = "the large variant is the one every request takes; boxing it is what this type avoids"
)]
enum Kind {
    /// Sent, and timed by this clock until its head comes.
    Forwarded(pool::Sending, timing::Clock),
    /// Nothing sent: the request named no configured upstream.
    Unconfigured(Option<UpstreamError>),
}

impl Future for ResponseFuture {
    type Output = Result<Response<Body>, UpstreamError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().kind {
            Kind::Forwarded(sending, clock) => {
                let answer = ready!(Pin::new(sending).poll(cx));
                clock.observe(match answer {
                    Ok(_) => Waited::Answered,
                    Err(_) => Waited::Error,
                });
                let mut response = answer?;
                hop::strip(response.headers_mut());
                Poll::Ready(Ok(response))
            }
            Kind::Unconfigured(error) => Poll::Ready(Err(error
                .take()
                .expect("a ResponseFuture is not polled after it completed"))),
        }
    }
}

/// The forwarding headers (`X-Forwarded-For`, `-Host`, `-Proto`,
/// `Forwarded`): appended to when the peer is a trusted proxy, whose word
/// they carry; otherwise what the client wrote is dropped and only what the
/// gateway saw is sent, so a client cannot pass for another address: in
/// any spelling, as an upstream reading `_` as `-` would take
/// `X_Forwarded_For` for the header.
fn forwarding(headers: &mut HeaderMap, client: Option<&ClientAddr>, host: Option<HeaderValue>) {
    let trusted = client.is_some_and(|c| c.trusted);
    if !trusted {
        spelling::remove_every_spelling(headers, &FORWARDING);
    }
    if let Some(host) = host {
        if !headers.contains_key(X_FORWARDED_HOST) {
            headers.insert(X_FORWARDED_HOST, host);
        }
    }
    // The scheme the client used to reach the gateway (plain HTTP), unless a
    // trusted proxy in front said otherwise.
    if !headers.contains_key(X_FORWARDED_PROTO) {
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    }
    let Some(client) = client else {
        return;
    };
    append(headers, X_FORWARDED_FOR, &client.ip);
    append(headers, header::FORWARDED, &client.forwarded_for);
}

/// `value` after what `name` already lists (comma-separated), or alone.
fn append(headers: &mut HeaderMap, name: HeaderName, value: &HeaderValue) {
    let joined = match headers.get(&name).map(HeaderValue::as_bytes) {
        Some(prior) if !prior.is_empty() => {
            let mut bytes = Vec::with_capacity(prior.len() + 2 + value.len());
            bytes.extend_from_slice(prior);
            bytes.extend_from_slice(b", ");
            bytes.extend_from_slice(value.as_bytes());
            HeaderValue::from_bytes(&bytes).ok()
        }
        _ => Some(value.clone()),
    };
    if let Some(joined) = joined {
        headers.insert(name, joined);
    }
}

/// The port a URI's scheme implies.
fn default_port(uri: &Uri) -> Option<u16> {
    match uri.scheme_str() {
        Some("https") => Some(443),
        Some("http") => Some(80),
        _ => None,
    }
}

/// TLS for `https://` upstreams: the public web PKI roots plus any CA the
/// upstream's `ca_file` adds. A failed handshake happens before anything is
/// sent, so it is a safe failure like a refused connection.
fn tls_config(extra_roots: &[rustls::pki_types::CertificateDer<'static>]) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    for cert in extra_roots {
        if let Err(e) = roots.add(cert.clone()) {
            tracing::warn!(error = %e, "ignoring an unusable certificate from ca_file");
        }
    }
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth()
}

/// Every configured upstream, as one service: each request goes to its
/// [`Target`], each upstream keeping its own connection pool.
#[derive(Clone)]
pub struct Upstreams {
    /// Never empty. One `Arc`, so the per-request clone of the stack costs
    /// one reference count here.
    all: Arc<[Upstream]>,
}

impl Upstreams {
    /// Clients for every configured upstream, in order; `None` without any.
    pub fn new(settings: &[Arc<UpstreamSettings>]) -> Option<Self> {
        let all: Arc<[Upstream]> = settings.iter().map(|s| Upstream::new(s.clone())).collect();
        if all.is_empty() {
            return None;
        }
        Some(Upstreams { all })
    }

    /// The client of upstream `id`.
    pub fn get(&self, id: &UpstreamId) -> Option<&Upstream> {
        self.all.get(id.index()).filter(|u| u.settings().id == *id)
    }

    /// All of them, in configured order.
    pub fn iter(&self) -> impl Iterator<Item = &Upstream> {
        self.all.iter()
    }
}

impl tower::Service<Request<Body>> for Upstreams {
    type Response = Response<Body>;
    type Error = UpstreamError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let upstream = match req.extensions().get::<Target>() {
            None => &self.all[0],
            Some(Target(id)) => match self.get(id) {
                Some(upstream) => upstream,
                None => {
                    return ResponseFuture {
                        kind: Kind::Unconfigured(Some(UpstreamError::Unconfigured(id.clone()))),
                    }
                }
            },
        };
        upstream.forward(req)
    }
}

/// A fully read upstream answer.
#[derive(Debug)]
pub struct Fetched {
    /// Status and headers.
    pub parts: http::response::Parts,
    /// The whole body.
    pub body: Bytes,
}

/// Sends `req` and reads the whole answer, at most `limit` bytes of body,
/// counting every received frame on `progress` so the caller can tell
/// silence from a slow but live answer.
pub async fn fetch<S>(
    upstream: S,
    req: Request<Body>,
    limit: usize,
    progress: watch::Sender<u64>,
) -> Result<Fetched, UpstreamError>
where
    S: tower::Service<Request<Body>, Response = Response<Body>, Error = UpstreamError>,
{
    use tower::ServiceExt;
    let response = upstream.oneshot(req).await?;
    progress.send_modify(|n| *n += 1);
    let (parts, body) = response.into_parts();
    read_body(parts, body, limit, &progress, None).await
}

/// Reads the rest of an answer whose head arrived, at most `limit` bytes,
/// counting every received frame on `progress`, and the head
/// (`head_size`: it is stored and replayed too) and the buffer it fills
/// on
/// `charge`, each byte `weight` times (itself and the copies its commit
/// makes): an answer the memory budget has no room for is not read on
/// ([`UpstreamError::OverBudget`], `docs/design.md` §18). The buffer is
/// sized by the answer's length when it gives one.
pub async fn read_body(
    parts: http::response::Parts,
    mut body: Body,
    limit: usize,
    progress: &watch::Sender<u64>,
    charge: Option<(&Charge, usize)>,
) -> Result<Fetched, UpstreamError> {
    let declared = http_body::Body::size_hint(&body).exact();
    let declared = declared.map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX));
    // The head is stored and replayed with the body: it is counted, held
    // whatever the budget says (it was read). `limit` is the body's, as
    // operators size it; the head has its own bound (`MAX_ANSWER_HEAD`).
    if let Some((charge, weight)) = charge {
        charge.add(head_size(&parts.headers) * weight);
    }
    let mut buf = bytes::BytesMut::new();
    let mut room = Room { charge, taken: 0 };
    room.grow(&mut buf, declared.min(limit))?;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| UpstreamError::Broken(Box::new(e)))?;
        if let Some(data) = frame.data_ref() {
            if buf.len() + data.len() > limit {
                return Err(UpstreamError::ResponseTooLarge { limit });
            }
            if buf.len() + data.len() > buf.capacity() {
                let wanted = (buf.len() + data.len()).max(buf.capacity() * 2).min(limit);
                room.grow(&mut buf, wanted)?;
            }
            buf.extend_from_slice(data);
            progress.send_modify(|n| *n += 1);
        }
    }
    Ok(Fetched {
        parts,
        body: buf.freeze(),
    })
}

/// The bytes of an answer's head as HTTP/1 spells it: each header's
/// name, value, `: ` and line end, and a status line's worth.
fn head_size(headers: &http::HeaderMap) -> usize {
    let lines = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4);
    lines.sum::<usize>() + 16
}

/// An answer's buffer, grown only once the memory budget has room for its
/// new capacity (`docs/design.md` §18): the bytes are counted before they
/// are allocated, so a burst of large answers cannot outrun the budget.
struct Room<'a> {
    charge: Option<(&'a Charge, usize)>,
    /// The capacity counted so far.
    taken: usize,
}

impl Room<'_> {
    fn grow(&mut self, buf: &mut bytes::BytesMut, capacity: usize) -> Result<(), UpstreamError> {
        if capacity <= buf.capacity() {
            return Ok(());
        }
        if let Some((charge, weight)) = self.charge {
            if !charge.try_add((capacity - self.taken) * weight) {
                return Err(UpstreamError::OverBudget);
            }
            self.taken = capacity;
        }
        buf.reserve(capacity - buf.len());
        if let Some((charge, weight)) = self.charge.filter(|_| buf.capacity() > self.taken) {
            // The allocator may round up: count what it gave.
            charge.add((buf.capacity() - self.taken) * weight);
            self.taken = buf.capacity();
        }
        Ok(())
    }
}
