//! A tool call's event stream that its MCP server ends before the call's
//! response, on purpose: the Streamable HTTP transport (2025-11-25) lets a
//! server send an event id, close the stream of a long call, and send the
//! response to the client that reconnects with `GET` and `Last-Event-ID`
//! (the official SDK's `close_sse_stream`). The attempt reconnects as that
//! client does, so the response reaches the attempt's recording, every
//! reader of it, and the commit (`docs/design.md` §19, "A stream its
//! server closes before the response").

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response};
use idemgate_domain::response::StoredResponse;
use idemgate_domain::sse::{Blocks, Kind};
use idemgate_proxy::http::{full, Body};
use tower::ServiceExt;

use super::UpstreamService;

/// How many times one attempt reconnects to its stream.
pub(super) const TIMES: usize = 5;

/// The longest pause a server's `retry:` may ask for before a reconnect.
const LONGEST_PAUSE: Duration = Duration::from_secs(10);

/// What reconnects to a tool call's stream: its request's target, headers
/// (its session, protocol version and credentials) and extensions, as a
/// `GET` for an event stream.
pub(super) struct Reconnect {
    upstream: UpstreamService,
    parts: http::request::Parts,
}

impl Reconnect {
    /// For `request`, a tool call sent through `upstream`.
    pub(super) fn of(upstream: &UpstreamService, request: &Request<Body>) -> Reconnect {
        let (mut parts, ()) = Request::new(()).into_parts();
        parts.method = Method::GET;
        parts.uri = request.uri().clone();
        parts.headers = request.headers().clone();
        parts.extensions = request.extensions().clone();
        for framing in [header::CONTENT_TYPE, header::CONTENT_LENGTH] {
            parts.headers.remove(framing);
        }
        let events = HeaderValue::from_static("text/event-stream");
        parts.headers.insert(header::ACCEPT, events);
        Reconnect {
            upstream: upstream.clone(),
            parts,
        }
    }

    /// The stream again from after `last_id`: its body, when the server
    /// answers it with an event stream within `patience`.
    pub(super) async fn open(&self, last_id: &str, patience: Duration) -> Option<Body> {
        let mut request = Request::from_parts(self.parts.clone(), full(Bytes::new()));
        let id = HeaderValue::from_str(last_id).ok()?;
        request.headers_mut().insert("last-event-id", id);
        let call = self.upstream.clone().oneshot(request);
        let response: Response<Body> = tokio::time::timeout(patience, call).await.ok()?.ok()?;
        let streams = crate::recording::is_event_stream_head(response.headers());
        (response.status().is_success() && streams).then(|| response.into_body())
    }
}

/// Where a stream that ended may be taken up again: the id of its last
/// event with one, and the pause its server asked for (`retry:`, at most
/// [`LONGEST_PAUSE`]); `None` when no event had an id.
pub(super) fn resume_point(stored: &StoredResponse) -> Option<(String, Duration)> {
    let mut blocks = Blocks::default();
    let mut all = blocks.push(&stored.body);
    all.extend(blocks.finish());
    let last_id = all.iter().rev().find_map(|block| match &block.kind {
        Kind::Event { id: Some(id), .. } => Some(id.clone()),
        _ => None,
    })?;
    let pause = retry_field(&stored.body).map_or(Duration::ZERO, Duration::from_millis);
    Some((last_id, pause.min(LONGEST_PAUSE)))
}

/// The value of the stream's last `retry:` field (milliseconds, digits
/// only: the format's rule).
fn retry_field(body: &[u8]) -> Option<u64> {
    body.split(|b| *b == b'\n' || *b == b'\r')
        .filter_map(|line| line.strip_prefix(b"retry:"))
        .filter_map(|value| std::str::from_utf8(value.trim_ascii()).ok()?.parse().ok())
        .next_back()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(body: &str) -> StoredResponse {
        StoredResponse {
            status: 200,
            headers: vec![],
            body: Bytes::from(body.to_owned()),
        }
    }

    #[test]
    fn the_point_is_the_last_id_and_the_pause_the_last_retry() {
        let primed = stored("id: e1\nretry: 250\ndata:\n\nid: e2\ndata: {}\n\n: beat\n\n");
        assert_eq!(
            resume_point(&primed),
            Some(("e2".to_owned(), Duration::from_millis(250)))
        );
        assert_eq!(resume_point(&stored("data: {}\n\n")), None, "no id");
        let long = stored("id: 7\nretry: 999999\ndata:\n\n");
        assert_eq!(resume_point(&long), Some(("7".to_owned(), LONGEST_PAUSE)));
    }
}
