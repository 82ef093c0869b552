//! Tool calls of the Model Context Protocol, exactly once (`docs/design.md`
//! §19): on a route with `protocol = "mcp"` (Streamable HTTP, JSON-RPC 2.0)
//! a `POST` is read before it is known to be keyed. A `tools/call` with a
//! key (`params._meta.idempotencyKey`, else the header) is a job like any
//! keyed request, whose intent is the tool and its canonical arguments;
//! everything else passes through as it came, but an agent's cancel of a
//! keyed call in flight, held back ([`calls`]). Every answer a call gets
//! that its own attempt did not make is addressed to the call's own `id`.

mod calls;

use std::sync::Arc;

pub(crate) use calls::{ends_session, mark, mark_resend, AtServer, Calls, Marked};

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::{header, HeaderValue, Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tracing::Span;

use crate::error::ClientError;
use crate::keyed::{Intent, Keyed};
use crate::opt_in::{parse_charge, read, resume_point, HeaderKey, OptedIn, Prepared, Refused};
use crate::route::Mcp;
use crate::shared::Shared;
use idemgate_domain::fingerprint::{
    fingerprint, AmbiguousJson, BodyRule, Fingerprint, RequestParts,
};
use idemgate_domain::jsonrpc::{self, ToolCall};
use idemgate_domain::key::IdempotencyKey;
use idemgate_domain::sse::{self, Block, Blocks, Kind};
use idemgate_proxy::http::{detach_head, full, Body, BodyError};
use idemgate_proxy::upstream::Target;

/// Reads an MCP route's `POST`: a keyed tool call, prepared like any keyed
/// request; a keyed batch, refused; anything else, passed through.
pub(crate) async fn prepare(
    shared: &Shared,
    mcp: &Mcp,
    opted: OptedIn,
) -> Result<Prepared, Refused> {
    let OptedIn {
        route, key, req, ..
    } = opted;
    let (parts, body) = req.into_parts();
    // Its owner, if its evidence holds, for its share of the budget; a tool
    // call without it is refused below, once it is known to be one.
    let sharer = shared.trust.owner(&route.owner, &parts).ok();
    let (body, charge) = read(shared, &route, sharer.as_ref(), body).await?;
    // Every message is parsed whole to see what it is, and a tool call's
    // arguments again in canonical form: counted while that runs.
    let parsing = parse_charge(shared, &CANONICAL, (sharer.as_ref(), &charge), &body)?;
    let passing = |parts, body: Bytes| {
        let mut req = Request::from_parts(parts, full(body));
        req.extensions_mut()
            .insert(Target(route.primary.id.clone()));
        Ok(Prepared::Passing(req))
    };
    let call = match jsonrpc::request(&body) {
        jsonrpc::Request::ToolCall(call) if mcp.keys(&call.name) => call,
        // A batch's calls go unkeyed: refused where a call in it is keyed,
        // or the route requires every call to be.
        jsonrpc::Request::BatchWithToolCall { keyed }
            if keyed || !matches!(key, HeaderKey::Absent) || route.require_key =>
        {
            return Err(ClientError::KeyedBatch.into())
        }
        // Read one way here and another by the server: neither passed nor
        // keyed (docs/design.md §19).
        jsonrpc::Request::Miscased(pointer) | jsonrpc::Request::NamedTwice(pointer) => {
            return Err(ClientError::from(AmbiguousJson { pointer }).into())
        }
        // What the gateway cannot read may be a keyed call a lenient
        // server reads: neither passed nor keyed (docs/design.md §19);
        // but a form or a file is no message (an OAuth `/token` under a
        // route of `/`), and passes.
        jsonrpc::Request::Unreadable if may_be_a_message(&parts.headers) => {
            return Err(ClientError::UnreadableMessage.into())
        }
        _ => {
            let (store, instance) = (shared.runner.store.as_ref(), shared.runner.instance);
            let message = (&parts, &body[..]);
            let calls = &shared.runner.calls;
            if calls
                .holds_cancel(store, instance, &route.name, message)
                .await
            {
                let mut accepted = Response::new(full(Bytes::new()));
                *accepted.status_mut() = http::StatusCode::ACCEPTED;
                return Ok(Prepared::Answered(accepted));
            }
            return passing(parts, body);
        }
    };
    let refused = |error: ClientError| Refused {
        error: error.into(),
        rpc_id: Some(call.id.clone()),
    };
    // The body's key first; else the header's, refused here (as the call's
    // JSON-RPC error) only now that it is known to be a keyed tool call's.
    let key = match (call.key.clone(), key) {
        (Some(written), _) => Some(
            written
                .and_then(IdempotencyKey::new)
                .map_err(|e| refused(e.into()))?,
        ),
        (None, HeaderKey::Absent) => None,
        (None, HeaderKey::Valid(key)) => Some(key),
        (None, HeaderKey::Invalid(e)) => return Err(refused(e.into())),
    };
    let Some(key) = key else {
        if route.require_key {
            return Err(refused(ClientError::MissingKey));
        }
        return passing(parts, body);
    };
    // Keyed, its answer must be addressed: one spelled as a notification
    // would otherwise pass, and run on every retry.
    if !call.has_id() {
        return Err(refused(ClientError::KeyedCallWithoutId));
    }
    let owner = shared.trust.owner(&route.owner, &parts)?;
    let resume = resume_point(&parts)?;
    let path = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let fingerprint = intent_of(&call, path).map_err(|e| refused(e.into()))?;
    drop(parsing);
    let mut parts = parts;
    // As `opt_in::prepare` does: a held call lets the read buffer go.
    detach_head(&mut parts);
    Ok(Prepared::Keyed(Keyed {
        intent: Arc::new(Intent {
            route: route.clone(),
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
        rpc_id: Some(call.id),
    }))
}

/// Whether a body the gateway could not read may still be a JSON-RPC
/// message to the server: it is encoded (`Content-Encoding`), not typed,
/// or any of its types mentions JSON however it is spelled. Servers read
/// types loosely (the Python SDK takes `application/json, text/plain`, an
/// older TypeScript one `application/json-rpc; charset=utf-16le`), so
/// only a type that is plainly something else (a form, a file) passes.
fn may_be_a_message(headers: &http::HeaderMap) -> bool {
    if headers.contains_key(header::CONTENT_ENCODING) {
        return true;
    }
    let mut kinds = headers.get_all(header::CONTENT_TYPE).iter().peekable();
    if kinds.peek().is_none() {
        return true;
    }
    kinds.any(|kind| {
        let kind = String::from_utf8_lossy(kind.as_bytes()).to_ascii_lowercase();
        kind.trim().is_empty() || kind.contains("json")
    })
}

/// An `id` as JSON text, however it was spelled.
fn id_text(id: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(id).map_or_else(
        |_| String::from_utf8_lossy(id).into_owned(),
        |v| v.to_string(),
    )
}

/// A call's intent: its method, the endpoint, the tool and its arguments
/// (and any other member of its `params`: `ToolCall::asked`) in canonical
/// form. Never its `id`, its `_meta` (a progress token, the
/// key itself) or its session: an agent that reconnected as a new session
/// asks the same.
fn intent_of(
    call: &ToolCall,
    path: &str,
) -> Result<Fingerprint, idemgate_domain::fingerprint::AmbiguousJson> {
    let parts = RequestParts {
        method: "tools/call",
        path_and_query: path,
        headers: Vec::new(),
        body: &call.asked,
        boundary: None,
    };
    fingerprint(&parts, &CANONICAL)
}

/// How a tool call's arguments are fingerprinted: in canonical form.
const CANONICAL: BodyRule = BodyRule {
    canonical_json: true,
    ignore: Vec::new(),
};

/// The transport's session header: the server names the session on its
/// answers, and a client adopts the one any answer names.
pub(crate) const MCP_SESSION_ID: header::HeaderName =
    header::HeaderName::from_static("mcp-session-id");

/// Names on a tool call's answer the session the call was made in
/// (`asked_in`, its `Mcp-Session-Id`), when its server named none: the
/// transport asks a server to name the session only where it sets one up,
/// and the stored answer must still say which session its server's
/// questions asked, so that a retry in that session gets them
/// ([`readdressed`]). A session the server named is kept. The client whose
/// call it is reads the session it sent.
pub(crate) fn name_session(answer: &mut http::HeaderMap, asked_in: Option<HeaderValue>) {
    if let Some(session) = asked_in {
        answer.entry(MCP_SESSION_ID).or_insert(session);
    }
}

/// `response`, which another request's attempt made, addressed to `id`:
/// the JSON-RPC response in a JSON body, or the response event of an event
/// stream, readdressed as it comes; the server's requests to the client
/// that made the call (`elicitation/create`, `sampling/createMessage`)
/// left out of the stream unless the call asks in the session the answer
/// was made in (that client answered them, or answers them now); every
/// other byte as it was, but the session it names: the one the call asked
/// in (`session`), or none. The session of the call that made it is another
/// client's, or gone (`docs/design.md` §19, "The answer").
pub(crate) fn readdressed(
    response: Response<Body>,
    id: Vec<u8>,
    session: Option<http::HeaderValue>,
) -> Response<Body> {
    readdress(response, Some(id), session)
}

/// `response` for a caller in no session (a poll of the call's job,
/// `poll.rs`): the session it names removed, and the server's requests to
/// the client whose call ran left out of its stream, as for a call in
/// another session; its `id` kept, the call's own (the poll is its
/// owner's).
pub(crate) fn in_no_session(response: Response<Body>) -> Response<Body> {
    readdress(response, None, None)
}

/// [`readdressed`] to `id`, or keeping the answer's own where `None`.
fn readdress(
    response: Response<Body>,
    id: Option<Vec<u8>>,
    session: Option<http::HeaderValue>,
) -> Response<Body> {
    let (mut parts, body) = response.into_parts();
    // The server's requests asked the session the call ran in: a retry
    // in that very session (its first connection lost) still answers them.
    let made_in = parts.headers.remove(MCP_SESSION_ID);
    let asks = session.is_some() && session == made_in;
    if let Some(session) = session {
        parts.headers.insert(MCP_SESSION_ID, session);
    }
    let coding = parts.headers.get(header::CONTENT_ENCODING);
    if !sse::is_plain(coding.map(HeaderValue::as_bytes)) {
        // Compressed (keyed calls ask for it plain, so only a server that
        // ignores that sends one): no id can be read in it.
        return Response::from_parts(parts, body);
    }
    let streams = crate::recording::is_event_stream_head(&parts.headers);
    let body = match (streams, id) {
        // A message holds no request of the server's: its own id, as it is.
        (false, None) => return Response::from_parts(parts, body),
        (false, Some(id)) => readdressed_message(body, id),
        (true, id) => readdressed_events(body, id, asks),
    };
    // Written anew: the length may change with the id, or the requests
    // left out.
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, body)
}

/// A JSON body with its response addressed to `id`.
fn readdressed_message(body: Body, id: Vec<u8>) -> Body {
    let whole = async move {
        let bytes = body.collect().await?.to_bytes();
        let readdressed = jsonrpc::with_id(&bytes, &id).map_or(bytes, Bytes::from);
        Ok::<_, BodyError>(Frame::data(readdressed))
    };
    BodyExt::boxed(StreamBody::new(futures_util::stream::once(whole)))
}

/// An event stream's body with its response event addressed to `id` (or
/// left as it is, `None`), cut at its lines as it comes (`docs/design.md`
/// §10, "Events and heartbeats"), each event read whole ([`Readdress`]).
fn readdressed_events(body: Body, id: Option<Vec<u8>>, asks: bool) -> Body {
    let state = (
        Some(body.into_data_stream()),
        Blocks::default(),
        Readdress::new(id, asks, HELD_EVENT),
    );
    let frames = futures_util::stream::unfold(state, |(stream, mut blocks, mut readdress)| async {
        let mut stream = stream?;
        let mut out = Vec::new();
        // A chunk that only adds to an event held gives out no frame.
        loop {
            match stream.next().await {
                Some(Ok(chunk)) => {
                    readdress.take(blocks.push(&chunk), &mut out);
                    if !out.is_empty() {
                        let frame = Frame::data(Bytes::from(out));
                        return Some((Ok(frame), (Some(stream), blocks, readdress)));
                    }
                }
                // What is held is dropped: a client discards an event the
                // stream never ended.
                Some(Err(e)) => return Some((Err(e), (None, blocks, readdress))),
                None => {
                    readdress.take(blocks.finish(), &mut out);
                    readdress.end(&mut out);
                    let frame = Frame::data(Bytes::from(out));
                    return Some((Ok(frame), (None, blocks, readdress)));
                }
            }
        }
    });
    BodyExt::boxed(StreamBody::new(frames))
}

/// The most of one event held to be read whole: a tool's result of
/// thousands of lines fits; past it, the rest of the event goes on as it
/// comes, unread (its response under the first call's id).
const HELD_EVENT: usize = 4 << 20;

/// Readdresses an answer's events as their blocks come. An event is held
/// until its blank line and read whole: its `data:` lines may come in
/// several chunks (a replay's frames, a live upstream's writes), and no
/// client dispatches it before its end. Heartbeats between events go out
/// at once; an event longer than `most` goes on as it comes, unread, so
/// a client joining a live stream is neither kept waiting nor charged for
/// more; what the stream's end leaves pending (an event never ended) goes
/// out last, as it came.
struct Readdress {
    /// What the response is addressed to; `None`: its own id.
    id: Option<Vec<u8>>,
    asks: bool,
    most: usize,
    /// The event's blocks so far.
    event: BytesMut,
    /// The event outgrew `most`: the rest of it goes on as it comes.
    passing: bool,
}

impl Readdress {
    fn new(id: Option<Vec<u8>>, asks: bool, most: usize) -> Self {
        Readdress {
            id,
            asks,
            most,
            event: BytesMut::new(),
            passing: false,
        }
    }

    /// Takes in the stream's next blocks; what may go out goes to `out`.
    fn take(&mut self, blocks: impl IntoIterator<Item = Block>, out: &mut Vec<u8>) {
        for block in blocks {
            let between = self.event.is_empty() && !self.passing;
            match block.kind {
                // As does the LF of a CRLF that ended the last event.
                Kind::Beat if between => out.extend_from_slice(&block.bytes),
                Kind::Part if between && block.bytes.as_ref() == b"\n" => {
                    out.extend_from_slice(&block.bytes)
                }
                _ if self.passing => {
                    out.extend_from_slice(&block.bytes);
                    self.passing = !matches!(block.kind, Kind::Event { .. });
                }
                Kind::Event { .. } => {
                    self.event.extend_from_slice(&block.bytes);
                    let whole = self.event.split();
                    out.extend_from_slice(&readdressed_event(
                        &whole,
                        self.id.as_deref(),
                        self.asks,
                    ));
                }
                _ => self.event.extend_from_slice(&block.bytes),
            }
        }
        if self.event.len() > self.most {
            tracing::warn!(
                bytes = self.event.len(),
                "an MCP answer's event is too long to read for its response: passed on as the \
                 server sent it"
            );
            out.extend_from_slice(&self.event.split());
            self.passing = true;
        }
    }

    /// The stream ended: what is held goes out as it came.
    fn end(&mut self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.event.split());
    }
}

/// A whole event of an answer, as a call that did not make it gets it:
/// the response addressed to `id` (where one is given); a request of the
/// server's left out unless the call `asks` in the session it was made in.
fn readdressed_event<'a>(
    event: &'a [u8],
    id: Option<&[u8]>,
    asks: bool,
) -> std::borrow::Cow<'a, [u8]> {
    // Asked of the call's own client: asked again here, the user would
    // consent again to what is done, or a model would be paid to sample
    // for nothing.
    if !asks && jsonrpc::is_request_event(event) {
        return std::borrow::Cow::Borrowed(&[]);
    }
    let Some(id) = id else {
        return std::borrow::Cow::Borrowed(event);
    };
    match jsonrpc::readdress_event(event, id) {
        Some(readdressed) => std::borrow::Cow::Owned(readdressed),
        None => std::borrow::Cow::Borrowed(event),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What goes out after each of `chunks`, and at the end, from an answer
    /// readdressed to `7` for another session.
    fn readdressed(chunks: &[&[u8]], most: usize) -> Vec<Vec<u8>> {
        let (mut blocks, mut readdress) = (
            Blocks::default(),
            Readdress::new(Some(b"7".to_vec()), false, most),
        );
        let mut outs: Vec<Vec<u8>> = chunks
            .iter()
            .map(|chunk| {
                let mut out = Vec::new();
                readdress.take(blocks.push(chunk), &mut out);
                out
            })
            .collect();
        let mut out = Vec::new();
        readdress.take(blocks.finish(), &mut out);
        readdress.end(&mut out);
        outs.push(out);
        outs
    }

    const ANSWER: &[u8] = b"data: {\"method\": \"notifications/progress\"}\n\n\
        data: {\"id\": 3,\ndata:  \"method\": \"elicitation/create\"}\n\n\
        event: message\ndata: {\"id\": 1,\nid: e9\ndata:  \"result\": {}}\n\n";

    /// Byte by byte, each event is read whole: the question left out, the
    /// response readdressed where its id stands, every other byte as it
    /// came.
    #[test]
    fn an_answer_cut_anywhere_is_read_by_whole_events() {
        let bytes: Vec<&[u8]> = ANSWER.chunks(1).collect();
        let out = readdressed(&bytes, HELD_EVENT).concat();
        let expected = b"data: {\"method\": \"notifications/progress\"}\n\n\
            event: message\ndata: {\"id\": 7,\nid: e9\ndata:  \"result\": {}}\n\n";
        assert_eq!(
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(expected)
        );
    }

    /// A heartbeat after an event whose CRLF was cut before its LF goes
    /// out at once, not with the next event.
    #[test]
    fn a_heartbeat_after_a_cut_line_end_is_not_held() {
        let chunks: [&[u8]; 3] = [
            b"data: {\"id\": 1, \"result\": {}}\r\n\r",
            b"\n",
            b": ping\r\n\r\n",
        ];
        let outs = readdressed(&chunks, HELD_EVENT);
        assert_eq!(outs[0], b"data: {\"id\": 7, \"result\": {}}\r\n\r");
        assert_eq!(outs[1], b"\n");
        assert_eq!(outs[2], b": ping\r\n\r\n");
    }

    /// An event longer than the most held goes on as it came, unread; the
    /// next is read again.
    #[test]
    fn an_event_too_long_to_hold_passes_as_it_came() {
        let long = format!(
            "data: {{\"id\": 1,\ndata: \"result\": \"{}\"}}\n\n",
            "x".repeat(100)
        );
        let chunks: Vec<&[u8]> = long.as_bytes().chunks(8).chain([ANSWER]).collect();
        let out = readdressed(&chunks, 64).concat();
        let expected = format!(
            "{long}data: {{\"method\": \"notifications/progress\"}}\n\n\
             event: message\ndata: {{\"id\": 7,\nid: e9\ndata:  \"result\": {{}}}}\n\n"
        );
        assert_eq!(String::from_utf8_lossy(&out), expected);
    }
}
