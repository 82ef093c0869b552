//! JSON-RPC 2.0 as the Model Context Protocol carries it (`docs/design.md`
//! §19): which request is a tool call, what its intent is (the tool and its
//! arguments, never the request's `id`), where its key is, and an answer
//! readdressed to another request's `id`, byte for byte otherwise.
//!
//! Members are found by a small scanner over the bytes, not by parsing into
//! values and writing them again: the arguments are fingerprinted as the
//! client wrote them (numbers as written), and an answer is replayed as the
//! server sent it, only its `id` changed.

use std::ops::Range;

use serde_json::Value;

use crate::key::KeyError;

/// A `tools/call` request: what its answer is addressed to, what it asks,
/// and the key it carries in `params._meta.idempotencyKey`, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// The request's `id`, as written (a number or a string; `null` when
    /// it has none, or a null one: [`ToolCall::has_id`]).
    pub id: Vec<u8>,
    /// The tool (`""` when its name is not a string).
    pub name: String,
    /// What it asks, as one JSON object to fingerprint: `name` and
    /// `arguments` as written (`null` and `{}` when absent), and every
    /// other member of `params` but `_meta` (a `task`, which changes what
    /// the answer is). A name that is not a string is not `""`, and a call
    /// with more members is another call; one without hashes as it did.
    pub asked: Vec<u8>,
    /// `params._meta.idempotencyKey`, which must be a string.
    pub key: Option<Result<String, KeyError>>,
}

/// What a POST to an MCP endpoint is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// A `tools/call` request (not a notification): it may be keyed.
    ToolCall(ToolCall),
    /// A batch holding a `tools/call`: never keyed, refused when a call in
    /// it carries a key (one answer would have to hold several ids).
    BatchWithToolCall {
        /// Whether a call in it carries `params._meta.idempotencyKey`.
        keyed: bool,
    },
    /// A message whose envelope spells a name it is read by (`method`,
    /// `params`, `name`, `arguments`, …) another way but for case, at this
    /// pointer: read one way here and another by a server that matches
    /// names without case (Go's `encoding/json`), which could run another
    /// tool, or a tool call the gateway took for another message, unkeyed.
    /// Refused, as a member named twice is.
    Miscased(String),
    /// A message whose envelope names a member twice (or twice but for
    /// case), at this pointer: its top, and a tool call's `params` and
    /// `params._meta`. Read two ways (the first here, the last by most
    /// servers), `"method":"tools/call",…,"method":"ping"` is a ping here
    /// and a tool call, unkeyed, to a parser that keeps the first; a
    /// call's `id` or `arguments` would be one thing to the gateway and
    /// another to the server. Refused.
    NamedTwice(String),
    /// Not JSON in UTF-8 (a UTF-8 byte order mark aside): another charset,
    /// a `Content-Encoding`, not JSON at all. MCP's messages are JSON in
    /// UTF-8, and one the gateway cannot read could be a keyed tool call
    /// that a lenient server reads and runs, on every retry. Refused.
    Unreadable,
    /// Anything else: another method, a notification, a response, a batch
    /// without a tool call, JSON that is not JSON-RPC. Passed through.
    Other,
}

/// The names a message's envelope is read by, at each level.
const TOP: &[&str] = &["jsonrpc", "id", "method", "params"];
const PARAMS: &[&str] = &["name", "arguments", "_meta"];
const META: &[&str] = &["idempotencyKey"];

/// The pointer (under `at`) of the first of `names` that spells one of
/// `read` (the names its level is read by) but for case.
fn miscased_at<'n>(
    names: impl IntoIterator<Item = &'n str>,
    read: &[&str],
    at: &str,
) -> Option<String> {
    names
        .into_iter()
        .filter(|name| !read.contains(name))
        .find(|name| {
            let folded = crate::fingerprint::fold_name(name);
            read.iter()
                .any(|r| crate::fingerprint::fold_name(r) == folded)
        })
        .map(|name| pointer(at, name))
}

/// The first member of `message`'s envelope (its top, `params` and
/// `params._meta`) that spells a name it is read by but for case.
fn miscased(message: &Value) -> Option<String> {
    fn keys(v: Option<&Value>) -> Option<impl Iterator<Item = &str>> {
        v.and_then(Value::as_object)
            .map(|o| o.keys().map(String::as_str))
    }
    miscased_at(keys(Some(message))?, TOP, "")
        .or_else(|| miscased_at(keys(message.get("params"))?, PARAMS, "/params"))
        .or_else(|| {
            miscased_at(
                keys(message.pointer("/params/_meta"))?,
                META,
                "/params/_meta",
            )
        })
}

fn pointer(at: &str, name: &str) -> String {
    format!("{at}/{}", name.replace('~', "~0").replace('/', "~1"))
}

/// `body` past a UTF-8 byte order mark: no part of the JSON, and parsers
/// skip it (Python's, Node's body parsers), so it is read past as they do.
pub fn without_bom(body: &[u8]) -> &[u8] {
    body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body)
}

/// What `body`, a POST to an MCP endpoint, is.
pub fn request(body: &[u8]) -> Request {
    let body = without_bom(body);
    let trimmed = body.trim_ascii_start();
    if trimmed.first() == Some(&b'[') {
        let Ok(Value::Array(items)) = serde_json::from_slice::<Value>(body) else {
            return Request::Unreadable;
        };
        if let Some(at) = items
            .iter()
            .enumerate()
            .find_map(|(n, item)| miscased(item).map(|at| format!("/{n}{at}")))
        {
            return Request::Miscased(at);
        }
        // The elements' spans, in the array's order, as `items`.
        let spans = elements(body).unwrap_or_default();
        if let Some(at) = spans
            .iter()
            .zip(&items)
            .enumerate()
            .find_map(|(n, (at, item))| {
                let item_at = &body[at.clone()];
                envelope_twice(
                    item_at,
                    &members(item_at)?,
                    is_tool_call(item),
                    &format!("/{n}"),
                )
            })
        {
            return Request::NamedTwice(at);
        }
        let calls: Vec<&Value> = items.iter().filter(|item| is_tool_call(item)).collect();
        if calls.is_empty() {
            return Request::Other;
        }
        let keyed = calls.iter().any(|call| call.pointer(KEY).is_some());
        return Request::BatchWithToolCall { keyed };
    }
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        return Request::Unreadable;
    };
    if let Some(at) = miscased(&value) {
        return Request::Miscased(at);
    }
    let top = members(body).unwrap_or_default();
    let call = is_tool_call(&value);
    if let Some(at) = envelope_twice(body, &top, call, "") {
        return Request::NamedTwice(at);
    }
    if !call {
        return Request::Other;
    }
    let key = value.pointer(KEY).map(|key| match key {
        Value::String(key) => Ok(key.clone()),
        _ => Err(KeyError::NotAString),
    });
    let name = value
        .pointer("/params/name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let id = span(body, &top, "id").unwrap_or(b"null").to_vec();
    let asked = asked(span(body, &top, "params").unwrap_or(b"{}"));
    Request::ToolCall(ToolCall {
        id,
        name,
        asked,
        key,
    })
}

/// A tool call's [`ToolCall::asked`], from its `params`.
fn asked(params: &[u8]) -> Vec<u8> {
    let all = members(params).unwrap_or_default();
    let member = |name: &str| span(params, &all, name);
    let mut asked = Vec::with_capacity(params.len() + 32);
    asked.extend_from_slice(b"{\"name\":");
    asked.extend_from_slice(member("name").unwrap_or(b"null"));
    asked.extend_from_slice(b",\"arguments\":");
    asked.extend_from_slice(member("arguments").unwrap_or(b"{}"));
    for (name, at) in &all {
        if matches!(name.as_str(), "name" | "arguments" | "_meta") {
            continue;
        }
        asked.push(b',');
        asked.extend_from_slice(&serde_json::to_vec(name).unwrap_or_default());
        asked.push(b':');
        asked.extend_from_slice(&params[at.clone()]);
    }
    asked.push(b'}');
    asked
}

/// The pointer (under `at`) of the first member `members` names twice,
/// or twice but for case: a server that matches names without case (Go's
/// `encoding/json`) reads `Arguments` as `arguments`, and the last one.
fn twice(members: &[(String, Range<usize>)], at: &str) -> Option<String> {
    let mut seen = std::collections::HashSet::new();
    let name = members
        .iter()
        .map(|(name, _)| name)
        .find(|name| !seen.insert(crate::fingerprint::fold_name(name)))?;
    Some(pointer(at, name))
}

/// The pointer (under `at`) of the first member `message` (whose members
/// are `top`) names twice at its top, or, for a tool call (`call`), in
/// its `params` or `params._meta`.
fn envelope_twice(
    message: &[u8],
    top: &[(String, Range<usize>)],
    call: bool,
    at: &str,
) -> Option<String> {
    if let Some(twice) = twice(top, at) {
        return Some(twice);
    }
    let params = span(message, top, "params").filter(|_| call)?;
    let inner = members(params)?;
    twice(&inner, &format!("{at}/params")).or_else(|| {
        let meta = members(span(params, &inner, "_meta")?)?;
        twice(&meta, &format!("{at}/params/_meta"))
    })
}

/// Where a tool call carries its key.
const KEY: &str = "/params/_meta/idempotencyKey";

/// A message whose method is `tools/call`: a request, or one spelled as
/// a notification (no `id`, or a null one) that a server may run all
/// the same, so that it cannot pass a key by unseen.
fn is_tool_call(value: &Value) -> bool {
    value.get("method").and_then(Value::as_str) == Some("tools/call")
}

impl ToolCall {
    /// Whether it has an `id` its answer can be addressed to: a string or
    /// a number (JSON-RPC 2.0 §4; not `null`, an object, `true`).
    pub fn has_id(&self) -> bool {
        matches!(self.id.first(), Some(b'"' | b'-' | b'0'..=b'9'))
    }
}

/// `response`, a JSON-RPC response object, addressed to `id` instead: its
/// top-level `id` member's value replaced, every other byte as it was.
/// `None` when it is not an object with an `id`.
pub fn with_id(response: &[u8], id: &[u8]) -> Option<Vec<u8>> {
    let members = members(response)?;
    // The last, as clients' parsers read a member named twice.
    let (_, at) = members.iter().rfind(|(name, _)| name == "id")?;
    let mut out = Vec::with_capacity(response.len() + id.len());
    out.extend_from_slice(&response[..at.start]);
    out.extend_from_slice(id);
    out.extend_from_slice(&response[at.end..]);
    Some(out)
}

/// `event`, a server-sent event's bytes (a whole event), addressed to
/// `id` when its data is a JSON-RPC response: its `id` member's value
/// replaced where it stands, every other byte as it was. The data is read
/// as a client's parser reads it, its `data:` lines joined by line feeds:
/// MCP servers write a message on one line, and one that writes its JSON
/// over several is readdressed too, or the caller's client would never
/// match the answer to its request. `None` when it carries no response (a
/// notification, a heartbeat), or its `id` is written over several lines.
pub fn readdress_event(event: &[u8], id: &[u8]) -> Option<Vec<u8>> {
    let lines = data_lines(event);
    let data = data(&lines);
    let members = members(&data)?;
    let has = |key: &str| members.iter().any(|(name, _)| name == key);
    if !has("result") && !has("error") {
        return None;
    }
    // The last, as clients' parsers read a member named twice.
    let (_, at) = members.iter().rfind(|(name, _)| name == "id")?;
    // The line its value stands on, and where on it.
    let mut start = 0;
    let (line, from) = lines.iter().find_map(|line| {
        let on = start..start + line.value.len();
        start = on.end + 1;
        (on.start <= at.start && at.end <= on.end).then(|| (line, at.start - on.start))
    })?;
    let id = one_line(id);
    let mut out = Vec::with_capacity(event.len() + id.len());
    for (i, part) in lines_of(event).enumerate() {
        if i == line.index {
            let value_at = line.prefix.len();
            out.extend_from_slice(&part[..value_at + from]);
            out.extend_from_slice(&id);
            out.extend_from_slice(&part[value_at + from + at.len()..]);
        } else {
            out.extend_from_slice(part);
        }
    }
    Some(out)
}

/// `id` written on one line: a request's id as its client wrote it
/// (JSON, as the request was read), unless that spans lines (an object or
/// an array with line feeds between its members), which in an event would
/// end its `data:` line early.
fn one_line(id: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if !id.iter().any(|b| matches!(b, b'\r' | b'\n')) {
        return std::borrow::Cow::Borrowed(id);
    }
    let compact = serde_json::from_slice::<Value>(id)
        .ok()
        .and_then(|value| serde_json::to_vec(&value).ok());
    compact.map_or(std::borrow::Cow::Borrowed(id), std::borrow::Cow::Owned)
}

/// The lines of an event, each with its end, which is CRLF, LF or a lone
/// CR (the format's rule).
fn lines_of(event: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = event;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = match rest.iter().position(|b| matches!(b, b'\r' | b'\n')) {
            None => rest.len(),
            Some(at) if rest[at..].starts_with(b"\r\n") => at + 2,
            Some(at) => at + 1,
        };
        let (line, tail) = rest.split_at(end);
        rest = tail;
        Some(line)
    })
}

const BOM: &[u8] = "\u{feff}".as_bytes();

/// One `data` field of an event.
struct DataLine<'a> {
    /// Its index among the event's lines.
    index: usize,
    /// What comes before its value: `data`, `data:` or `data: ` (after
    /// the stream's byte order mark, on its first line).
    prefix: &'a [u8],
    /// Its value, without the line's end.
    value: &'a [u8],
}

/// The `data` fields of `event`, in order.
fn data_lines(event: &[u8]) -> Vec<DataLine<'_>> {
    lines_of(event)
        .enumerate()
        .filter_map(|(index, line)| {
            let content = line.strip_suffix(b"\n").unwrap_or(line);
            let content = content.strip_suffix(b"\r").unwrap_or(content);
            // A stream's byte order mark, before its first line.
            let bom = match index == 0 && content.starts_with(BOM) {
                true => BOM.len(),
                false => 0,
            };
            let field = match &content[bom..] {
                [b'd', b'a', b't', b'a', b':', b' ', ..] => 6,
                [b'd', b'a', b't', b'a', b':', ..] => 5,
                b"data" => 4,
                _ => return None,
            };
            Some(DataLine {
                index,
                prefix: &content[..bom + field],
                value: &content[bom + field..],
            })
        })
        .collect()
}

/// An event's data as a client's parser dispatches it: the values of its
/// `data` fields joined by `\n`.
fn data<'a>(lines: &[DataLine<'a>]) -> std::borrow::Cow<'a, [u8]> {
    match lines {
        [one] => std::borrow::Cow::Borrowed(one.value),
        _ => {
            let values: Vec<&[u8]> = lines.iter().map(|line| line.value).collect();
            std::borrow::Cow::Owned(values.join(&b'\n'))
        }
    }
}

/// Whether `event`, a server-sent event's bytes (a whole event), carries a
/// JSON-RPC request in its data (it has an `id` and a `method`), on one
/// `data:` line or several: the server asking its client something
/// (`elicitation/create`, `sampling/createMessage`), in the session of the
/// call it serves.
pub fn is_request_event(event: &[u8]) -> bool {
    let lines = data_lines(event);
    !lines.is_empty()
        && members(&data(&lines)).is_some_and(|members| {
            let has = |key: &str| members.iter().any(|(name, _)| name == key);
            has("id") && has("method")
        })
}

/// What a JSON-RPC response to a request says: a result, or an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// A `result`.
    Result,
    /// An `error`, with its `code` (`None`: it has no integer code).
    Error(Option<i64>),
}

/// The response to the request `id` that `answer`, an MCP server's answer
/// to that request, carries (`docs/design.md` §19, "What an answer
/// means"): the body itself when it is that response, or in an event
/// stream (`stream`) the first event whose data is. `None` when it carries
/// none: an error whose `id` is `null` (the transport refused the
/// message), another request's response, a stream that ended first.
pub fn answer_to(answer: &[u8], id: &[u8], stream: bool) -> Option<Answer> {
    if !stream {
        return response_to(answer, id);
    }
    crate::sse::verdict::events(answer)
        .iter()
        .find_map(|event| response_to(event.data.as_bytes(), id))
}

/// What `message` answers, if it is a response to the request `id`: its
/// top-level `id` the same value (as JSON: the server may spell it
/// otherwise), with a `result` or an `error`.
fn response_to(message: &[u8], id: &[u8]) -> Option<Answer> {
    let top = members(message)?;
    let its = span(message, &top, "id")?;
    let same = its == id
        || matches!(
            (serde_json::from_slice::<Value>(its), serde_json::from_slice::<Value>(id)),
            (Ok(a), Ok(b)) if a == b && !a.is_null()
        );
    if !same || id == b"null" {
        return None;
    }
    if span(message, &top, "error").is_some() {
        return Some(Answer::Error(error_code(message)));
    }
    span(message, &top, "result").map(|_| Answer::Result)
}

/// The code an MCP server answers a request with when it cancelled it
/// mid-run, as its client asked (`notifications/cancelled`): "Request
/// cancelled". The tool may have acted.
pub const CANCELLED: i64 = -32800;

/// The `code` of a JSON-RPC error response, if `message` is one.
pub fn error_code(message: &[u8]) -> Option<i64> {
    let top = members(message)?;
    let error = span(message, &top, "error")?;
    let inner = members(error)?;
    let code = span(error, &inner, "code")?;
    std::str::from_utf8(code).ok()?.parse().ok()
}

fn span<'a>(json: &'a [u8], members: &[(String, Range<usize>)], key: &str) -> Option<&'a [u8]> {
    members
        .iter()
        .find(|(name, _)| name == key)
        .map(|(_, at)| &json[at.clone()])
}

/// The members of `json`, which must hold one JSON object (whitespace
/// around it allowed): each key, unescaped, and where its value lies.
pub fn members(json: &[u8]) -> Option<Vec<(String, Range<usize>)>> {
    let start = skip_ws(json, 0);
    let list = members_from(json, start)?;
    (skip_ws(json, value_end(json, start)?) == json.len()).then_some(list)
}

/// Where each element of `json`, which must hold one JSON array
/// (whitespace around it allowed), lies.
fn elements(json: &[u8]) -> Option<Vec<Range<usize>>> {
    let start = skip_ws(json, 0);
    if json.get(start) != Some(&b'[') {
        return None;
    }
    let mut out = Vec::new();
    let mut i = skip_ws(json, start + 1);
    if json.get(i) == Some(&b']') {
        return Some(out);
    }
    loop {
        let end = value_end(json, i)?;
        out.push(i..end);
        i = skip_ws(json, end);
        match json.get(i)? {
            b',' => i = skip_ws(json, i + 1),
            b']' => return Some(out),
            _ => return None,
        }
    }
}

fn members_from(b: &[u8], start: usize) -> Option<Vec<(String, Range<usize>)>> {
    if b.get(start) != Some(&b'{') {
        return None;
    }
    let mut out = Vec::new();
    let mut i = skip_ws(b, start + 1);
    if b.get(i) == Some(&b'}') {
        return Some(out);
    }
    loop {
        let key_end = string_end(b, i)?;
        let key: String = serde_json::from_slice(&b[i..key_end]).ok()?;
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        let from = skip_ws(b, i + 1);
        let to = value_end(b, from)?;
        out.push((key, from..to));
        i = skip_ws(b, to);
        match b.get(i)? {
            b',' => i = skip_ws(b, i + 1),
            b'}' => return Some(out),
            _ => return None,
        }
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b
        .get(i)
        .is_some_and(|c| matches!(c, b' ' | b'\t' | b'\n' | b'\r'))
    {
        i += 1;
    }
    i
}

/// Where the string starting at `i` (its opening quote) ends, past its
/// closing quote.
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    if b.get(i) != Some(&b'"') {
        return None;
    }
    let mut j = i + 1;
    loop {
        match b.get(j)? {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
}

/// Where the value starting at `i` ends.
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match b.get(j)? {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let end = b[i..]
                .iter()
                .position(|c| matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                .map_or(b.len(), |at| i + at);
            (end > i).then_some(end)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool_call(body: &str) -> ToolCall {
        match request(body.as_bytes()) {
            Request::ToolCall(call) => call,
            other => panic!("not a tool call: {other:?}"),
        }
    }

    #[test]
    fn a_tool_call_is_read_with_its_id_key_and_arguments_as_written() {
        let body = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge","arguments":{"amount": 1.50, "to":"acct"},"_meta":{"idempotencyKey":"k-1","progressToken":3}}}"#;
        let call = tool_call(body);
        assert_eq!(call.id, b"7");
        assert_eq!(call.name, "charge");
        let asked = br#"{"name":"charge","arguments":{"amount": 1.50, "to":"acct"}}"#;
        assert_eq!(call.asked, asked, "as written, without its _meta");
        assert_eq!(call.key, Some(Ok("k-1".to_owned())));
        let no_key = tool_call(
            r#"{"jsonrpc":"2.0","id":"a\"b","method":"tools/call","params":{"name":"x"}}"#,
        );
        assert_eq!(no_key.id, br#""a\"b""#);
        assert_eq!(no_key.asked, br#"{"name":"x","arguments":{}}"#);
        assert_eq!(no_key.key, None);
        // A name that is not a string is not `""`, and another member of
        // `params` is part of what the call asks.
        let other = tool_call(
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":5,"task":{"ttl":9}}}"#,
        );
        assert_eq!(
            (other.name.as_str(), other.asked.as_slice()),
            ("", &br#"{"name":5,"arguments":{},"task":{"ttl":9}}"#[..])
        );
    }

    /// A name the envelope is read by, spelled another way but for case
    /// (alone, or beside its own spelling), is refused at its pointer: a
    /// server that matches names without case would read `Method` as the
    /// method (a tool call the gateway took for another message) and
    /// `Name` as the tool.
    #[test]
    fn an_envelope_name_spelled_another_way_but_for_case_is_refused() {
        let miscased = |body: &str| match request(body.as_bytes()) {
            Request::Miscased(at) => at,
            other => panic!("{body}: {other:?}"),
        };
        assert_eq!(
            miscased(
                r#"{"jsonrpc":"2.0","id":1,"Method":"tools/call","params":{"name":"charge"}}"#
            ),
            "/Method"
        );
        assert_eq!(
            miscased(
                r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"lookup","Name":"charge"}}"#
            ),
            "/params/Name"
        );
        assert_eq!(
            miscased(
                r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","_meta":{"IdempotencyKey":"k"}}}"#
            ),
            "/params/_meta/IdempotencyKey"
        );
        assert_eq!(
            miscased(
                r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list"},{"jsonrpc":"2.0","id":2,"method":"tools/call","paramſ":{}}]"#
            ),
            "/1/paramſ"
        );
        assert_eq!(
            miscased(
                r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","_meta":{"idempotencykey":"k"}}}"#
            ),
            "/params/_meta/idempotencykey"
        );
        // Other members, in any case, are the server's business.
        assert_eq!(
            request(br#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"Cursor":"c"}}"#),
            Request::Other
        );
    }

    /// `arguments` and `Arguments` are one member to a server that
    /// matches names without case: named twice.
    #[test]
    fn a_member_named_twice_but_for_case_is_named_twice() {
        let body = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge","arguments":{"amount":1},"Arguments":{"amount":1000}}}"#;
        assert_eq!(
            request(body.as_bytes()),
            Request::Miscased("/params/Arguments".into())
        );
        let other = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge","task":1,"Task":2}}"#;
        assert_eq!(
            request(other.as_bytes()),
            Request::NamedTwice("/params/Task".into())
        );
        let plain = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge","arguments":{}}}"#;
        assert!(matches!(request(plain.as_bytes()), Request::ToolCall(_)));
        // Another method's params are the server's business.
        let list =
            r#"{"jsonrpc":"2.0","id":7,"method":"tools/list","params":{"cursor":1,"Cursor":2}}"#;
        assert_eq!(request(list.as_bytes()), Request::Other);
    }

    #[test]
    fn other_messages_pass_and_a_keyed_batch_is_told_apart() {
        for other in [
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
            r#"{"jsonrpc":"2.0","id":1,"result":{}}"#,
            r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list"}]"#,
        ] {
            assert_eq!(request(other.as_bytes()), Request::Other, "{other}");
        }
        for no_id in [
            r#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"x"}}"#,
            r#"{"jsonrpc":"2.0","id":null,"method":"tools/call","params":{"name":"x"}}"#,
        ] {
            assert!(!tool_call(no_id).has_id(), "{no_id}");
        }
        assert!(tool_call(r#"{"id":"null","method":"tools/call"}"#).has_id());
        assert!(tool_call(r#"{"id":-1,"method":"tools/call"}"#).has_id());
        for odd in [
            r#"{"id":{},"method":"tools/call"}"#,
            r#"{"id":true,"method":"tools/call"}"#,
        ] {
            assert!(!tool_call(odd).has_id(), "{odd}");
        }
        for unreadable in ["not json", "[1,", "\u{feff}\u{feff}{}"] {
            assert_eq!(request(unreadable.as_bytes()), Request::Unreadable);
        }
        let bom = "\u{feff}{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\",\"params\":{\"name\":\"x\"}}";
        assert!(matches!(request(bom.as_bytes()), Request::ToolCall(_)));
        let twice = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{},"method":"ping"}"#;
        assert_eq!(
            request(twice.as_bytes()),
            Request::NamedTwice("/method".into())
        );
        let batch = format!("[{{}}, {twice}]");
        assert_eq!(
            request(batch.as_bytes()),
            Request::NamedTwice("/1/method".into())
        );
        let meta = r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","_meta":{"idempotencyKey":"k"},"_meta":{}}}]"#;
        assert_eq!(
            request(meta.as_bytes()),
            Request::NamedTwice("/0/params/_meta".into())
        );
        let batch = r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x"}}]"#;
        assert_eq!(
            request(batch.as_bytes()),
            Request::BatchWithToolCall { keyed: false }
        );
        let keyed = r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","_meta":{"idempotencyKey":"k"}}}]"#;
        assert_eq!(
            request(keyed.as_bytes()),
            Request::BatchWithToolCall { keyed: true }
        );
        let bad = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","_meta":{"idempotencyKey":5}}}"#;
        assert_eq!(tool_call(bad).key, Some(Err(KeyError::NotAString)));
    }

    #[test]
    fn an_answer_is_readdressed_byte_for_byte() {
        let answer = br#"{"result":{"content":[{"type":"text","text":"id: 7"}],"isError":false},"jsonrpc":"2.0","id": 7 }"#;
        let readdressed = with_id(answer, br#""req-9""#).unwrap();
        assert_eq!(
            readdressed,
            br#"{"result":{"content":[{"type":"text","text":"id: 7"}],"isError":false},"jsonrpc":"2.0","id": "req-9" }"#
        );
        assert_eq!(with_id(b"[1]", b"2"), None);
        assert_eq!(with_id(b"{\"result\":1}", b"2"), None);
    }

    #[test]
    fn a_response_event_is_readdressed_and_a_notification_left_alone() {
        let event =
            b"event: message\nid: 12\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\r\n\r\n";
        assert_eq!(
            readdress_event(event, b"99").unwrap(),
            b"event: message\nid: 12\ndata: {\"jsonrpc\":\"2.0\",\"id\":99,\"result\":{}}\r\n\r\n"
        );
        let note = b"data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\n";
        assert_eq!(readdress_event(note, b"99"), None);
        assert_eq!(readdress_event(b": ping\n\n", b"99"), None);
    }

    #[test]
    fn an_event_written_over_several_data_lines_is_read_as_its_client_reads_it() {
        let event = b"event: message\ndata: {\"jsonrpc\": \"2.0\",\ndata:  \"id\": 1,\nid: 4\ndata:  \"result\": {}}\n\n";
        assert_eq!(
            readdress_event(event, b"\"r-2\"").unwrap(),
            b"event: message\ndata: {\"jsonrpc\": \"2.0\",\ndata:  \"id\": \"r-2\",\nid: 4\ndata:  \"result\": {}}\n\n",
            "the id replaced where it stands, every other byte as it was"
        );
        // Lines ended by a lone CR, the second field without its space.
        let cr = b"data: {\"jsonrpc\":\"2.0\",\rdata:\"id\":1,\"result\":{}}\r\r";
        assert_eq!(
            readdress_event(cr, b"2").unwrap(),
            b"data: {\"jsonrpc\":\"2.0\",\rdata:\"id\":2,\"result\":{}}\r\r"
        );
        // After the stream's byte order mark; a member named twice
        // replaced where clients read it, last.
        assert_eq!(
            readdress_event(
                "\u{feff}data: {\"id\":1,\"id\":1,\"result\":{}}\n\n".as_bytes(),
                b"2"
            )
            .unwrap(),
            "\u{feff}data: {\"id\":1,\"id\":2,\"result\":{}}\n\n".as_bytes()
        );
        // A request's id written over lines is written on one.
        assert_eq!(
            readdress_event(cr, b"{\"a\":\n1}").unwrap(),
            b"data: {\"jsonrpc\":\"2.0\",\rdata:\"id\":{\"a\":1},\"result\":{}}\r\r"
        );
        let asks = b"data: {\"jsonrpc\": \"2.0\", \"id\": 7,\r\ndata: \"method\": \"elicitation/create\"}\r\n\r\n";
        assert!(is_request_event(asks));
        assert!(is_request_event(
            b"data: {\"id\": 7,\rdata\rdata: \"method\": \"sampling/createMessage\"}\r\r"
        ));
        assert!(!is_request_event(
            b"data: {\"jsonrpc\": \"2.0\",\ndata: \"method\": \"notifications/progress\"}\n\n"
        ));
        assert!(!is_request_event(b": ping\n\n"));
        // Cut inside a member, the lines are no message at all.
        assert_eq!(
            readdress_event(b"data: {\"id\": 1, \"res\ndata: ult\": {}}\n\n", b"2"),
            None
        );
    }

    #[test]
    fn an_error_response_says_its_code() {
        let error = br#"{"jsonrpc":"2.0","id":1,"error":{"code":-32603,"message":"boom"}}"#;
        assert_eq!(error_code(error), Some(-32603));
        assert_eq!(error_code(br#"{"jsonrpc":"2.0","id":1,"result":{}}"#), None);
    }

    #[test]
    fn an_answer_is_the_calls_only_when_it_responds_to_its_id() {
        let result = br#"{"jsonrpc":"2.0","id":7,"result":{}}"#;
        assert_eq!(answer_to(result, b"7", false), Some(Answer::Result));
        assert_eq!(answer_to(result, b"8", false), None, "another call's");
        let spelled = br#"{"jsonrpc":"2.0","id":"ab","error":{"code":-32800}}"#;
        assert_eq!(
            answer_to(spelled, br#""ab""#, false),
            Some(Answer::Error(Some(CANCELLED))),
            "the same id spelled otherwise"
        );
        for none in [
            &br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Session not found"}}"#[..],
            br#"{"jsonrpc":"2.0","id":7}"#,
            br#"{"jsonrpc":"2.0","id":7,"method":"ping"}"#,
            b"",
            b"Not Found",
        ] {
            assert_eq!(answer_to(none, b"7", false), None, "{none:?}");
        }
        assert_eq!(answer_to(none_null(), b"null", false), None);
        let stream = b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\n\
                       event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"error\":{\"code\":-32603}}\n\n";
        assert_eq!(
            answer_to(stream, b"7", true),
            Some(Answer::Error(Some(-32603)))
        );
        let ended_first = b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\n";
        assert_eq!(answer_to(ended_first, b"7", true), None);
        let unended = b"data: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{}}";
        assert_eq!(answer_to(unended, b"7", true), None, "never dispatched");
    }

    fn none_null() -> &'static [u8] {
        br#"{"jsonrpc":"2.0","id":null,"result":{}}"#
    }

    #[test]
    fn the_scanner_refuses_what_is_not_one_object() {
        assert_eq!(members(b"{\"a\":1} {}"), None);
        assert_eq!(members(b"{\"a\":}"), None);
        assert_eq!(members(b"{\"a\":\"unterminated}"), None);
        let nested = members(br#" {"a":[1,{"b":"]}"}],"c":null} "#).unwrap();
        assert_eq!(
            nested.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
            ["a", "c"]
        );
    }
}
