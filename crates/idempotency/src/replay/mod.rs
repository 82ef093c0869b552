//! Turning upstream answers into stored responses and stored responses back
//! into answers.

use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, Response, StatusCode};

use crate::route::Route;
use idemgate_domain::id::JobId;
use idemgate_domain::response::StoredResponse;
use idemgate_proxy::http::{
    full, gateway_answer_header, hop, Body, Outcome, IDEMPOTENCY_JOB, IDEMPOTENT_REPLAYED,
};
use idemgate_proxy::upstream::Fetched;

mod cache;
mod redis_first;
pub(crate) mod tiers;

pub(crate) use cache::{Kept, ReplayCache};

/// What is kept of an upstream answer: status, end-to-end headers (the
/// upstream service already removed hop-by-hop ones; the length is
/// recomputed from the stored body) and the body bytes.
pub(crate) fn capture(fetched: &Fetched) -> StoredResponse {
    StoredResponse {
        status: fetched.parts.status.as_u16(),
        headers: capture_headers(&fetched.parts.headers),
        body: fetched.body.clone(),
    }
}

/// The end-to-end headers kept of an answer, in order, without its length
/// or any header only the gateway sets (an upstream's own, on an answer a
/// lookup of an adopted attempt brought, which no attempt's service
/// stripped: `docs/design.md` §15, "Headers").
pub(crate) fn capture_headers(headers: &http::HeaderMap) -> Vec<(String, Bytes)> {
    headers
        .iter()
        .filter(|(name, _)| **name != header::CONTENT_LENGTH && !gateway_answer_header(name))
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                Bytes::copy_from_slice(value.as_bytes()),
            )
        })
        .collect()
}

/// How a replayed body is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// Whole, with its length.
    Whole,
    /// As a stream (chunked, no length), as a streamed answer was first sent.
    Streamed,
}

impl Framing {
    /// How `route` replays `stored`: as a stream when it was one.
    pub(crate) fn of(route: &Route, stored: &StoredResponse) -> Framing {
        if route.streamed(stored) {
            Framing::Streamed
        } else {
            Framing::Whole
        }
    }
}

/// Frames of a streamed replay: small enough that a client reading events
/// as they come sees them without waiting for the whole body.
const STREAM_FRAME: usize = 16 * 1024;

/// The answer for a stored response: the one first sent (`replayed` false)
/// or a replay of it (`Idempotent-Replayed: true`), both naming the job.
pub(crate) fn response(
    stored: &StoredResponse,
    job: JobId,
    replayed: bool,
    framing: Framing,
) -> Response<Body> {
    let mut response = Response::new(body(stored, framing));
    *response.status_mut() = replayed_status(stored.status);
    set_headers(&mut response, &stored.headers);
    set_job(&mut response, job);
    if replayed {
        mark_replayed(&mut response);
    }
    response
}

/// The status a stored answer is replayed with: its own, unless it is no
/// final status (a `1xx` stored before upstreams' were refused, which
/// would switch or stall the client's connection), then `502`: the
/// upstream's answer cannot be given.
pub(crate) fn replayed_status(stored: u16) -> StatusCode {
    match StatusCode::from_u16(stored) {
        Ok(status) if !status.is_informational() => status,
        _ => StatusCode::BAD_GATEWAY,
    }
}

/// Marks an answer as a replay: for the client (`Idempotent-Replayed:
/// true`) and for the gateway's own logs and metrics ([`Outcome`]). A
/// replayed error is what every retry of the key gets until it expires,
/// so it tells SDKs that retry by themselves not to (`x-should-retry:
/// false`, over the upstream's own, which spoke of its first sending:
/// `docs/design.md` §11, "Refusals no retry can win say so").
pub(crate) fn mark_replayed<B>(response: &mut Response<B>) {
    let error = response.status().is_client_error() || response.status().is_server_error();
    let headers = response.headers_mut();
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if error {
        headers.insert(
            crate::error::SHOULD_RETRY,
            HeaderValue::from_static("false"),
        );
    }
    response.extensions_mut().insert(Outcome::Replayed);
}

/// The body of a stored response, framed as `framing` says.
fn body(stored: &StoredResponse, framing: Framing) -> Body {
    match framing {
        Framing::Whole => full(stored.body.clone()),
        Framing::Streamed => {
            let body = stored.body.clone();
            let frames = (0..body.len().div_ceil(STREAM_FRAME)).map(move |i| {
                let end = ((i + 1) * STREAM_FRAME).min(body.len());
                Ok(http_body::Frame::data(body.slice(i * STREAM_FRAME..end)))
            });
            http_body_util::BodyExt::boxed(http_body_util::StreamBody::new(
                futures_util::stream::iter(frames),
            ))
        }
    }
}

/// Appends stored end-to-end headers to an answer, in their order. A
/// header that frames a message (its length, a hop-by-hop one), or one
/// only the gateway sets (`Idempotency-Job`, …, stored before upstreams'
/// own were removed), is never taken from a stored answer, however it got
/// there (an operator's
/// resolution before they were refused, a row written by hand): the
/// replay is framed by its own body, or its connection would carry stray
/// bytes into the next answer.
pub(crate) fn set_headers<B>(response: &mut Response<B>, stored: &[(String, Bytes)]) {
    let headers = response.headers_mut();
    for (name, value) in stored {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value.clone()),
        ) {
            if !hop::frames(&name) && !gateway_answer_header(&name) {
                headers.append(name, value);
            }
        }
    }
}

/// Names the job on an answer.
pub(crate) fn set_job<B>(response: &mut Response<B>, job: JobId) {
    if let Ok(v) = HeaderValue::from_str(&job.to_string()) {
        response.headers_mut().insert(IDEMPOTENCY_JOB, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stored answer that carries its own length or a hop-by-hop
    /// header is replayed framed by its body alone.
    #[test]
    fn a_stored_length_or_hop_by_hop_header_is_never_replayed() {
        let header = |name: &str, value: &'static str| (name.to_owned(), Bytes::from(value));
        let stored = StoredResponse {
            status: 200,
            headers: vec![
                header("content-length", "2"),
                header("transfer-encoding", "chunked"),
                header("connection", "upgrade"),
                header("upgrade", "websocket"),
                header("content-type", "text/plain"),
            ],
            body: Bytes::from_static(b"hello world"),
        };
        let replay = response(&stored, JobId::new(), true, Framing::Whole);
        let names: Vec<&str> = replay.headers().keys().map(HeaderName::as_str).collect();
        for framing in [
            "content-length",
            "transfer-encoding",
            "connection",
            "upgrade",
        ] {
            assert!(!names.contains(&framing), "{framing}: {names:?}");
        }
        assert_eq!(replay.headers()["content-type"], "text/plain");
    }

    /// A `101` stored before upstreams' were refused is replayed as `502`,
    /// never switching the client's connection.
    #[test]
    fn a_stored_informational_status_is_never_replayed() {
        assert_eq!(replayed_status(101), StatusCode::BAD_GATEWAY);
        assert_eq!(replayed_status(100), StatusCode::BAD_GATEWAY);
        assert_eq!(replayed_status(1000), StatusCode::BAD_GATEWAY);
        assert_eq!(replayed_status(201), StatusCode::CREATED);
        assert_eq!(replayed_status(503), StatusCode::SERVICE_UNAVAILABLE);
    }

    /// A stored answer kept before an upstream's own gateway headers were
    /// removed replays only the gateway's: its job, and no events skipped.
    #[test]
    fn a_stored_gateway_header_is_never_replayed() {
        let header = |name: &str, value: &'static str| (name.to_owned(), Bytes::from(value));
        let stored = StoredResponse {
            status: 200,
            headers: vec![
                header("idempotency-job", "forged"),
                header("idempotency-events-skipped", "3"),
                header("idempotent-replayed", "true"),
            ],
            body: Bytes::new(),
        };
        let job = JobId::new();
        let first = response(&stored, job, false, Framing::Whole);
        let jobs: Vec<_> = first.headers().get_all(IDEMPOTENCY_JOB).iter().collect();
        assert_eq!(jobs, [job.to_string().as_str()]);
        assert!(!first.headers().contains_key(IDEMPOTENT_REPLAYED));
        assert!(!first.headers().contains_key("idempotency-events-skipped"));
    }
}
