//! HTTP plumbing shared by the proxy and admin listeners: the body type,
//! bounded body collection (against the memory budget for keyed requests),
//! the body-read timeout, hop-by-hop headers, every spelling of a header
//! removed, the console's cookie (kept from the upstream) and the header
//! names of the contract.

mod collect;
pub mod cookie;
mod detach;
mod holding;
pub mod hop;
pub mod idle;
pub mod linger;
pub mod request_id;
pub mod spelling;

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use http_body_util::{combinators::BoxBody, BodyExt, Full};

pub use collect::{collect_charged, collect_limited, CollectError, TAKEN_AHEAD};
pub use detach::detach_head;
pub use holding::Holding;

pub use idemgate_domain::BoxError;

/// The one body type of the request path: streamed or buffered, boxed.
pub type Body = BoxBody<Bytes, BodyError>;

/// A body that failed mid-stream. A named type rather than a bare boxed
/// error, which keeps request types free of trait-object lifetimes (those
/// defeat `Send` inference across the attempt task's awaits).
#[derive(Debug)]
pub struct BodyError(BoxError);

impl BodyError {
    /// Wraps any body error.
    pub fn new(e: impl Into<BoxError>) -> Self {
        BodyError(e.into())
    }
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for BodyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// `Idempotency-Key`: the client's key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// `Idempotency-Job`: the job id, on every answer once the job exists.
pub const IDEMPOTENCY_JOB: HeaderName = HeaderName::from_static("idempotency-job");
/// `Idempotent-Replayed: true` on replays.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// `Last-Event-ID`: the id of the last server-sent event a client has.
pub const LAST_EVENT_ID: HeaderName = HeaderName::from_static(idemgate_domain::sse::LAST_EVENT_ID);
/// `Idempotency-Events-Received: <n>`: a client resuming a stream of events
/// without ids has this many already (`docs/design.md` §10, "Resume").
pub const EVENTS_RECEIVED: HeaderName =
    HeaderName::from_static(idemgate_domain::sse::EVENTS_RECEIVED);
/// `Idempotency-Events-Skipped: <n>` on a resumed answer: the events it
/// leaves out, before the first it sends.
pub const EVENTS_SKIPPED: HeaderName = HeaderName::from_static("idempotency-events-skipped");

/// The headers only the gateway sets on a keyed answer (`docs/design.md`
/// §15, "Headers"): an upstream's own are removed from every answer it
/// gives an attempt ([`without_gateway_headers`]) and from every stored
/// answer replayed, so that a first answer never passes for a replay, nor
/// names another job (the gateway names its job only where no
/// `Idempotency-Job` is set yet), nor says events were skipped.
pub const GATEWAY_ANSWER_HEADERS: [HeaderName; 3] =
    [IDEMPOTENCY_JOB, IDEMPOTENT_REPLAYED, EVENTS_SKIPPED];

/// Whether `name` is one of [`GATEWAY_ANSWER_HEADERS`].
pub fn gateway_answer_header(name: &HeaderName) -> bool {
    GATEWAY_ANSWER_HEADERS.contains(name)
}

/// An upstream's answer to a keyed request, without any header of
/// [`GATEWAY_ANSWER_HEADERS`] it set. A pass-through answer keeps them: an
/// upstream idempotent by itself speaks for itself there.
pub fn without_gateway_headers<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    if headers.keys().any(gateway_answer_header) {
        for name in &GATEWAY_ANSWER_HEADERS {
            headers.remove(name);
        }
    }
    response
}

/// A body holding `bytes`.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// How the gateway answered a request, carried on the answer as an
/// extension for whoever logs and counts answers; an answer without one was
/// passed through. The job an answer belongs to rides along as a
/// [`JobId`](idemgate_domain::id::JobId) extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The gateway refused or failed the request with a problem answer.
    Problem,
    /// A recorded answer, replayed.
    Replayed,
    /// An attempt's answer: the job's result, or a failure passed on.
    Executed,
}

/// The attempt whose answer a keyed request got, carried on the answer for
/// the access log (`docs/design.md` §12). A pass-through answer carries
/// none: its upstream is the one its route (or none) sends it to.
#[derive(Debug, Clone)]
pub struct AnsweredBy {
    /// The attempt.
    pub attempt: idemgate_domain::id::AttemptId,
    /// 1, 2, … in the order the job's attempts were made.
    pub number: i32,
    /// The upstream it went to.
    pub upstream: std::sync::Arc<str>,
}

/// The client's address, put into request extensions by the server.
#[derive(Debug, Clone)]
pub struct ClientAddr {
    /// Its socket address.
    pub addr: SocketAddr,
    /// Whether it is one of the `trusted_proxies`: only then are its
    /// forwarding headers (and `trusted_header` owners) believed.
    pub trusted: bool,
    /// Its IP as a header value, made once per connection rather than per
    /// forwarded request.
    pub(crate) ip: HeaderValue,
    /// Its `Forwarded` element (`for=192.0.2.7`, `for="[2001:db8::1]"`).
    pub(crate) forwarded_for: HeaderValue,
}

impl ClientAddr {
    /// The address of a client connected from `addr`, a trusted proxy or not.
    pub fn new(addr: SocketAddr, trusted: bool) -> Self {
        let ip = HeaderValue::try_from(addr.ip().to_string())
            .expect("an IP address is a valid header value");
        let element = match addr.ip() {
            std::net::IpAddr::V4(v4) => format!("for={v4}"),
            std::net::IpAddr::V6(v6) => format!("for=\"[{v6}]\""),
        };
        let forwarded_for =
            HeaderValue::try_from(element).expect("an IP address is a valid header value");
        ClientAddr {
            addr,
            trusted,
            ip,
            forwarded_for,
        }
    }
}

/// A client of the gateway that proved itself with its client key
/// (`docs/design.md` §15), put into request extensions on a route that
/// requires one. Only a request carrying it is sent with an upstream's
/// injected credentials.
#[derive(Debug, Clone)]
pub struct ProvenClient(pub std::sync::Arc<str>);
