//! What a whole event stream says about itself, besides its status
//! (`docs/design.md` §10, "In-band errors and whole streams"): an AI
//! backend that fails after its `200` head reports it in an event, and a
//! provider marks a whole answer's end with an event of its own. Pure: the
//! attempt that recorded the stream decides what follows.

use serde_json::Value;

/// One event of a stream as a client's parser dispatches it: its `event`
/// field (the last one) and its `data` lines, joined by `\n`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Event {
    /// The `event` field, if it has one.
    pub name: Option<String>,
    /// The `data` field's lines, joined by `\n`.
    pub data: String,
    /// Whether it has a `data` field at all.
    has_data: bool,
}

/// The events of a whole stream, in order: each block of lines ended by a
/// blank line that holds a field. A last block the stream never ended is
/// not an event (the format's rule: a client never dispatches it).
pub fn events(body: &[u8]) -> Vec<Event> {
    let mut all = Vec::new();
    let mut current = Event::default();
    let mut fields = false;
    for line in lines(strip_bom(body)) {
        if line.is_empty() {
            if fields {
                all.push(std::mem::take(&mut current));
            }
            fields = false;
            continue;
        }
        if line.first() == Some(&b':') {
            continue;
        }
        fields = true;
        let (name, value) = field(line);
        match name {
            b"event" => current.name = Some(String::from_utf8_lossy(value).into_owned()),
            b"data" => {
                if current.has_data {
                    current.data.push('\n');
                }
                current.data.push_str(&String::from_utf8_lossy(value));
                current.has_data = true;
            }
            _ => {}
        }
    }
    all
}

/// The lines of `body`, each without its end (CRLF, LF or CR). A last line
/// without an end is given too: its block is still never an event, as no
/// blank line follows it.
fn lines(body: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = body;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = rest.iter().position(|b| *b == b'\n' || *b == b'\r');
        let Some(at) = end else {
            let line = rest;
            rest = &[];
            return Some(line);
        };
        let line = &rest[..at];
        let skip = if rest[at..].starts_with(b"\r\n") {
            2
        } else {
            1
        };
        rest = &rest[at + skip..];
        Some(line)
    })
}

fn strip_bom(body: &[u8]) -> &[u8] {
    body.strip_prefix("\u{feff}".as_bytes()).unwrap_or(body)
}

/// A field's name and value: the value after the first colon, one space
/// after it dropped (the format's rule).
fn field(line: &[u8]) -> (&[u8], &[u8]) {
    match line.iter().position(|b| *b == b':') {
        Some(at) => {
            let value = &line[at + 1..];
            (&line[..at], value.strip_prefix(b" ").unwrap_or(value))
        }
        None => (line, &[]),
    }
}

/// An error the stream reports in band, and its type:
/// - data that is a JSON object with a top-level `error` member beside
///   nothing but a provider's envelope ([`ENVELOPE`]: OpenAI's chat
///   chunks, Anthropic's `error` event, OpenRouter's): `/error/type`, else
///   `/error/code`. An item of the answer that reports its own failure
///   (`{"recipient": 2, "error": …}`) is no error of the stream's;
/// - the Responses API's `error` event, whose code is the data's own
///   (`{"type": "error", "code": "server_error", …}`): `/code`;
/// - the Responses API's `response.failed`, a response that ended failed:
///   `/response/error/code`;
/// - any other event named `error`: `unknown`, as any of these whose type
///   cannot be read.
///
/// An event without an `event` field is named by its data's `type`, as
/// the Responses API's events are; a named event by its name alone.
pub fn in_band_error(event: &Event) -> Option<String> {
    let json: Option<Value> = serde_json::from_str(&event.data).ok();
    let object = json.as_ref().and_then(Value::as_object);
    let named = |name: &str| named(event, json.as_ref()) == Some(name);
    let enveloped = |o: &serde_json::Map<String, Value>| {
        o.keys()
            .all(|k| k == "error" || ENVELOPE.contains(&k.as_str()))
    };
    let error = match object.and_then(|o| o.get("error")) {
        Some(error) if named("error") || object.is_some_and(enveloped) => Some(error),
        Some(_) => return None,
        None if named("response.failed") => {
            json.as_ref().and_then(|v| v.pointer("/response/error"))
        }
        None if named("error") => json.as_ref(),
        None => return None,
    };
    let kind = error.and_then(|e| {
        let read = |key: &str| match e.get(key)? {
            Value::String(s) if !s.is_empty() && s != "error" => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            _ => None,
        };
        read("type").or_else(|| read("code"))
    });
    Some(kind.unwrap_or_else(|| "unknown".to_owned()))
}

/// The members a provider's streamed chunk carries beside an `error`
/// (OpenAI's, Azure's, Groq's and OpenRouter's chat chunks, the Responses
/// API's events, text-generation-inference's `error_type`).
const ENVELOPE: &[&str] = &[
    "id",
    "object",
    "created",
    "model",
    "provider",
    "choices",
    "usage",
    "type",
    "sequence_number",
    "system_fingerprint",
    "service_tier",
    "obfuscation",
    "prompt_filter_results",
    "x_groq",
    "citations",
    "request_id",
    "error_type",
];

/// What an event is: its `event` field, else (unnamed) its data's `type`,
/// as the Responses API's and Anthropic's data name themselves.
fn named<'e>(event: &'e Event, json: Option<&'e Value>) -> Option<&'e str> {
    let said_type = || json?.get("type")?.as_str();
    event.name.as_deref().or_else(said_type)
}

/// Whether `event` is one of a route's end events: its name, or its whole
/// `data` (`[DONE]`), is one of `ends`.
pub fn is_end(event: &Event, ends: &[impl AsRef<str>]) -> bool {
    if ends.is_empty() {
        return false;
    }
    let json: Option<Value> = serde_json::from_str(&event.data).ok();
    ends_as(event, named(event, json.as_ref()), ends)
}

/// [`is_end`], for an event already known to be `name`.
fn ends_as(event: &Event, name: Option<&str>, ends: &[impl AsRef<str>]) -> bool {
    ends.iter()
        .map(AsRef::as_ref)
        .any(|end| name == Some(end) || event.data == end)
}

/// The Responses API's events that say a tool it runs itself, inside the
/// call, was run or is running. A remote MCP server's tool counts from
/// its `in_progress` on (its effects leave the provider: erring early
/// costs a retry, erring late a second charge); the others from their
/// search, run or generation. The model writing a call's arguments or
/// code (`…_arguments.delta`, `…_code.delta`) runs nothing, and a
/// function call is the client's to run.
const PROVIDER_TOOL_EVENTS: &[&str] = &[
    "response.mcp_call.in_progress",
    "response.mcp_call_arguments.done",
    "response.mcp_call.completed",
    "response.mcp_call.failed",
    "response.web_search_call.searching",
    "response.web_search_call.completed",
    "response.file_search_call.searching",
    "response.file_search_call.completed",
    "response.code_interpreter_call.interpreting",
    "response.code_interpreter_call.completed",
    "response.image_generation_call.generating",
    "response.image_generation_call.partial_image",
    "response.image_generation_call.completed",
];

/// The Responses API's output items of the tools it runs itself.
const PROVIDER_TOOL_ITEMS: &[&str] = &[
    "mcp_call",
    "web_search_call",
    "file_search_call",
    "code_interpreter_call",
    "image_generation_call",
];

/// Whether `events` say the provider ran a tool of its own on the
/// caller's behalf (`docs/design.md` §10, "A tool the provider ran"):
/// - one of the Responses API's [`PROVIDER_TOOL_EVENTS`], or its
///   `response.output_item.done` of one of [`PROVIDER_TOOL_ITEMS`];
/// - Anthropic's server tools and MCP connector: the end
///   (`content_block_stop`) of a `server_tool_use` or `mcp_tool_use`
///   block, after which the API runs the tool, or the start of a tool's
///   result block (`web_search_tool_result`, `mcp_tool_result`, …).
pub fn ran_a_tool(events: &[Event]) -> bool {
    // Anthropic's tool blocks begun and not yet ended, by index.
    let mut uses = Vec::new();
    events.iter().any(|event| {
        let json: Option<Value> = serde_json::from_str(&event.data).ok();
        let said_type = json.as_ref().and_then(|v| v.get("type")?.as_str());
        let Some(name) = event.name.as_deref().or(said_type) else {
            return false;
        };
        let index = json.as_ref().and_then(|v| v.get("index")?.as_u64());
        let block = json
            .as_ref()
            .and_then(|v| v.pointer("/content_block/type")?.as_str());
        match (name, block) {
            ("content_block_start", Some("server_tool_use" | "mcp_tool_use")) => {
                uses.extend(index);
                false
            }
            ("content_block_start", Some(block)) => block.ends_with("_tool_result"),
            ("content_block_stop", _) => index.is_some_and(|i| uses.contains(&i)),
            // An item of a provider's tool done, for a server that sends
            // only the items' events.
            ("response.output_item.done", _) => json
                .as_ref()
                .and_then(|v| v.pointer("/item/type")?.as_str())
                .is_some_and(|item| PROVIDER_TOOL_ITEMS.contains(&item)),
            (name, _) => PROVIDER_TOOL_EVENTS.contains(&name),
        }
    })
}

/// What a whole event stream that ended cleanly says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Said {
    /// Nothing against it: it may be committed.
    Whole,
    /// It reports an error in band.
    Error {
        /// The error's type.
        kind: String,
        /// Whether the events before it say the provider ran a tool of
        /// its own ([`ran_a_tool`]): the call acted, whatever the error.
        after_a_tool: bool,
    },
    /// It ended without any of the route's end events: it stopped short.
    Unended,
}

/// The events providers end a whole answer with (OpenAI's `[DONE]`,
/// Anthropic's `message_stop`, the Responses API's three ends): after an
/// in-band error, one of these does not say the stream went on, whether
/// or not the route names its end events.
const PROVIDER_ENDS: &[&str] = &[
    "[DONE]",
    "message_stop",
    "response.completed",
    "response.incomplete",
    "response.failed",
];

/// What `body`, a whole event stream, says: the first in-band error it
/// reports (when `errors` are looked for) that ended it, else whether its
/// last event is one of `ends` (when the route names any).
///
/// A provider's in-band error is its stream's last word: only end events,
/// other errors (the Responses API's `error`, then `response.failed`) and
/// Anthropic's `ping` may follow it. An error-shaped event the stream went
/// on past (one item of a bulk call that failed, reported among the
/// others) did not fail the call, which went on to act: it is part of the
/// answer (`docs/design.md` §10, "In-band errors and whole streams").
pub fn said(body: &[u8], errors: bool, ends: &[String]) -> Said {
    let events = events(body);
    if errors {
        // Where the stream's last words begin: every event from there is
        // an end, an error or a ping.
        let last_words = events
            .iter()
            .rposition(|event| !closes(event, ends))
            .map_or(0, |at| at + 1);
        let first_error = events[last_words..]
            .iter()
            .enumerate()
            .find_map(|(at, event)| Some((last_words + at, in_band_error(event)?)));
        if let Some((at, kind)) = first_error {
            let after_a_tool = ran_a_tool(&events[..at]);
            return Said::Error { kind, after_a_tool };
        }
    }
    match events.last() {
        _ if ends.is_empty() => Said::Whole,
        Some(last) if is_end(last, ends) => Said::Whole,
        _ => Said::Unended,
    }
}

/// Whether `event` may follow a stream's in-band error without saying the
/// stream went on: an end event (the route's or a provider's), another
/// error, or an event that carries nothing (no data, or a heartbeat:
/// [`HEARTBEATS`]), which no client reads as more of the answer.
fn closes(event: &Event, ends: &[String]) -> bool {
    if !event.has_data || event.data.trim().is_empty() {
        return true;
    }
    let json: Option<Value> = serde_json::from_str(&event.data).ok();
    let name = named(event, json.as_ref());
    name.is_some_and(|n| HEARTBEATS.contains(&n))
        || ends_as(event, name, PROVIDER_ENDS)
        || ends_as(event, name, ends)
        || in_band_error(event).is_some()
}

/// Events that only keep a connection open.
const HEARTBEATS: &[&str] = &["ping", "heartbeat", "keepalive", "keep-alive"];

#[cfg(test)]
mod tests {
    use super::*;

    /// An in-band error of `kind`, with no tool of the provider's before it.
    fn error_of(kind: &str) -> Said {
        Said::Error {
            kind: kind.to_owned(),
            after_a_tool: false,
        }
    }

    /// An error-shaped event the stream went on past is not its failure:
    /// one item of a bulk call that failed, among the others, leaves the
    /// answer whole. One followed only by ends, other errors and pings
    /// ended the stream, and counts (the first of them), with the route's
    /// end events named or not.
    #[test]
    fn only_an_error_that_ended_the_stream_counts() {
        let item = |n: u32, error: &str| format!("data: {{\"recipient\":{n}{error}}}\n\n");
        let timeout = ",\"error\":{\"code\":\"timeout\"}";
        let went_on = [
            item(1, ""),
            item(2, timeout),
            item(3, ""),
            "data: [DONE]\n\n".into(),
        ];
        let ends = ["[DONE]".to_owned()];
        assert_eq!(said(went_on.concat().as_bytes(), true, &[]), Said::Whole);
        assert_eq!(said(went_on.concat().as_bytes(), true, &ends), Said::Whole);
        let overloaded = "event: error\ndata: {\"error\":{\"type\":\"overloaded_error\"}}\n\n";
        let ping = "event: ping\ndata: {\"type\":\"ping\"}\n\n";
        let last = [
            item(1, ""),
            item(2, timeout),
            item(3, ""),
            overloaded.into(),
            ping.into(),
        ];
        for ends in [&[][..], &ends[..]] {
            assert_eq!(
                said(last.concat().as_bytes(), true, ends),
                error_of("overloaded_error")
            );
        }
        // An item's own failure, last or not, is no error of the stream's;
        // a provider's chunk of the same error is.
        let done = [item(1, ""), item(2, timeout), "data: [DONE]\n\n".into()];
        assert_eq!(said(done.concat().as_bytes(), true, &[]), Said::Whole);
        let chunk = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"provider\":\"p\",\
            \"choices\":[],\"error\":{\"code\":\"timeout\"}}\n\n";
        let cut = [item(1, ""), chunk.into(), "data: [DONE]\n\n".into()];
        assert_eq!(
            said(cut.concat().as_bytes(), true, &[]),
            error_of("timeout")
        );
        // text-generation-inference's: a string beside its `error_type`.
        let tgi = "data:{\"error\":\"CUDA out of memory\",\"error_type\":\"generation\"}\n\n";
        let tgi = format!("{}{tgi}", item(1, ""));
        assert_eq!(said(tgi.as_bytes(), true, &[]), error_of("unknown"));
        // Nothing a client reads as more of the answer follows it: a block
        // without data, an empty event, a heartbeat, an end named by its
        // data's `type`.
        for after in [
            "retry: 3000\n\n",
            "id: 9\n\n",
            "data:\n\n",
            "event: heartbeat\ndata: {}\n\n",
            "data: {\"type\":\"keepalive\"}\n\n",
            "data: {\"type\":\"message_stop\"}\n\n",
        ] {
            let body = format!("{}{overloaded}{after}", item(1, ""));
            assert_eq!(
                said(body.as_bytes(), true, &[]),
                error_of("overloaded_error"),
                "{after}"
            );
        }
        let failed =
            "data: {\"type\":\"response.failed\",\"response\":{\"error\":{\"code\":\"x\"}}}\n\n";
        let responses = [
            "data: {\"type\":\"error\",\"code\":\"server_error\"}\n\n",
            failed,
        ];
        assert_eq!(
            said(responses.concat().as_bytes(), true, &[]),
            error_of("server_error")
        );
    }

    /// An error after a tool the provider ran is told apart: the call
    /// acted, whatever the error. A tool the client runs, a server tool
    /// whose input the model is still writing, or the model writing a
    /// call's arguments or code, is no such tool.
    #[test]
    fn an_error_after_a_tool_the_provider_ran_says_so() {
        let failed = "event: response.failed\ndata: {\"type\":\"response.failed\",\"response\":\
            {\"error\":{\"code\":\"server_error\"}}}\n\n";
        let after = |before: &str| said(format!("{before}{failed}").as_bytes(), true, &[]);
        let block = |event: &str, index: u32, kind: &str| {
            format!(
                "event: {event}\ndata: {{\"type\":\"{event}\",\"index\":{index},\
                 \"content_block\":{{\"type\":\"{kind}\"}}}}\n\n"
            )
        };
        let stop = |index: u32| {
            format!("event: content_block_stop\ndata: {{\"type\":\"content_block_stop\",\"index\":{index}}}\n\n")
        };
        let ran = [
            "event: response.mcp_call.in_progress\ndata: {\"type\":\"response.mcp_call.in_progress\"}\n\n".to_owned(),
            // From its earliest sign, the model still writing its arguments.
            "event: response.mcp_call.in_progress\ndata: {}\n\n\
             event: response.mcp_call_arguments.delta\ndata: {\"delta\":\"{\"}\n\n"
                .to_owned(),
            "data: {\"type\":\"response.web_search_call.searching\"}\n\n".to_owned(),
            "event: response.code_interpreter_call.interpreting\ndata: {}\n\n".to_owned(),
            format!("{}{}", block("content_block_start", 1, "mcp_tool_use"), stop(1)),
            format!("{}{}", block("content_block_start", 0, "server_tool_use"), stop(0)),
            block("content_block_start", 2, "web_search_tool_result"),
            "data: {\"type\":\"response.output_item.done\",\"item\":{\"type\":\"mcp_call\"}}\n\n"
                .to_owned(),
        ];
        for ran in ran {
            let expected = Said::Error {
                kind: "server_error".into(),
                after_a_tool: true,
            };
            assert_eq!(after(&ran), expected, "{ran}");
        }
        let not_run = [
            String::new(),
            "event: response.mcp_call_arguments.delta\ndata: {\"delta\":\"{\\\"a\"}\n\n".to_owned(),
            "event: response.function_call_arguments.done\ndata: {}\n\n".to_owned(),
            "event: response.code_interpreter_call.in_progress\ndata: {}\n\n".to_owned(),
            "event: response.code_interpreter_call_code.delta\ndata: {}\n\n".to_owned(),
            "event: response.computer_call.in_progress\ndata: {}\n\n".to_owned(),
            "data: {\"type\":\"response.output_item.done\",\"item\":{\"type\":\"function_call\"}}\n\n"
                .to_owned(),
            block("content_block_start", 1, "server_tool_use"),
            format!("{}{}", block("content_block_start", 1, "tool_use"), stop(1)),
            format!(
                "{}{}",
                block("content_block_start", 1, "mcp_tool_use"),
                stop(0)
            ),
        ];
        for not_run in not_run {
            assert_eq!(after(&not_run), error_of("server_error"), "{not_run}");
        }
        // A tool run after the error: the stream went on past it, so the
        // error did not end the call, which is whole (and never run again).
        let late = format!("{failed}event: response.mcp_call.completed\ndata: {{}}\n\n");
        assert_eq!(said(late.as_bytes(), true, &[]), Said::Whole);
    }

    const ANTHROPIC_OVERLOADED: &str = "event: message_start\ndata: {\"type\":\"message_start\"}\n\n\
        event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"Hi\"}}\n\n\
        event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n";

    #[test]
    fn an_anthropic_error_event_is_read_with_its_type() {
        let events = events(ANTHROPIC_OVERLOADED.as_bytes());
        assert_eq!(events.len(), 3);
        assert_eq!(events[2].name.as_deref(), Some("error"));
        assert_eq!(
            said(ANTHROPIC_OVERLOADED.as_bytes(), true, &[]),
            error_of("overloaded_error")
        );
        assert_eq!(
            said(ANTHROPIC_OVERLOADED.as_bytes(), false, &[]),
            Said::Whole,
            "not looked for"
        );
    }

    /// The Responses API's ways to fail after its head: an `error` event
    /// with its code at the top, and a response that ended `failed`.
    #[test]
    fn a_responses_api_error_is_read_with_its_code() {
        let delta = "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n";
        let error = format!(
            "{delta}event: error\ndata: {{\"type\":\"error\",\"code\":\"server_error\",\
             \"message\":\"boom\",\"param\":null,\"sequence_number\":3}}\n\n"
        );
        assert_eq!(said(error.as_bytes(), true, &[]), error_of("server_error"));
        let failed = format!(
            "{delta}event: response.failed\ndata: {{\"type\":\"response.failed\",\"response\":\
             {{\"status\":\"failed\",\"error\":{{\"code\":\"rate_limit_exceeded\",\
             \"message\":\"slow down\"}}}}}}\n\n"
        );
        assert_eq!(
            said(failed.as_bytes(), true, &[]),
            error_of("rate_limit_exceeded")
        );
        // Its name in the data alone, as some gateways send it.
        let unnamed = failed.replace("event: response.failed\n", "");
        assert_eq!(
            said(unnamed.as_bytes(), true, &[]),
            error_of("rate_limit_exceeded")
        );
        // Named otherwise, its data's type is the application's own.
        let logged = "event: log\ndata: {\"type\":\"error\",\"code\":\"server_error\"}\n\n";
        assert_eq!(said(logged.as_bytes(), true, &[]), Said::Whole);
        let incomplete = format!(
            "{delta}event: response.incomplete\ndata: {{\"type\":\"response.incomplete\",\
             \"response\":{{\"status\":\"incomplete\",\"error\":null}}}}\n\n"
        );
        let ends = [
            "response.completed",
            "response.incomplete",
            "response.failed",
        ]
        .map(String::from);
        assert_eq!(said(incomplete.as_bytes(), true, &ends), Said::Whole);
    }

    #[test]
    fn an_openai_error_chunk_is_read_by_type_else_code() {
        let typed = "data: {\"choices\":[]}\n\ndata: {\"error\":{\"message\":\"boom\",\"type\":\"server_error\"}}\n\n";
        assert_eq!(said(typed.as_bytes(), true, &[]), error_of("server_error"));
        let coded = "data: {\"error\":{\"message\":\"slow down\",\"code\":\"rate_limit_exceeded\"}}\r\n\r\n";
        assert_eq!(
            said(coded.as_bytes(), true, &[]),
            error_of("rate_limit_exceeded")
        );
        let numbered = "data: {\"error\":{\"code\":529}}\r\r";
        assert_eq!(said(numbered.as_bytes(), true, &[]), error_of("529"));
        let bare = "event: error\ndata: not json\n\n";
        assert_eq!(said(bare.as_bytes(), true, &[]), error_of("unknown"));
    }

    #[test]
    fn error_words_elsewhere_are_not_errors() {
        for body in [
            "data: {\"choices\":[{\"delta\":{\"content\":\"error\"}}]}\n\n",
            "data: {\"result\":{\"error\":\"nested, not top-level\"}}\n\n",
            "data: [\"error\"]\n\n",
            ": error\n\n",
            "event: errors\ndata: {}\n\n",
            // Never ended: a client never dispatches it.
            "data: {\"error\":{\"type\":\"server_error\"}}",
        ] {
            assert_eq!(said(body.as_bytes(), true, &[]), Said::Whole, "{body:?}");
        }
    }

    #[test]
    fn a_stream_is_whole_only_when_its_last_event_is_an_end_event() {
        let ends: Vec<String> = ["[DONE]", "message_stop", "response.completed"]
            .map(String::from)
            .to_vec();
        let openai = "data: {\"choices\":[]}\n\ndata: [DONE]\n\n";
        let anthropic = "event: content_block_delta\ndata: {}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        let responses = "event: response.output_text.delta\ndata: {}\n\nevent: response.completed\ndata: {}\n\n";
        for whole in [openai, anthropic, responses] {
            assert_eq!(said(whole.as_bytes(), true, &ends), Said::Whole, "{whole}");
        }
        let short = "data: {\"choices\":[]}\n\n: keep-alive\n\n";
        assert_eq!(said(short.as_bytes(), true, &ends), Said::Unended);
        assert_eq!(said(b"", true, &ends), Said::Unended, "no event at all");
        let cut_end = "data: {\"choices\":[]}\n\ndata: [DONE]";
        assert_eq!(
            said(cut_end.as_bytes(), true, &ends),
            Said::Unended,
            "the end event itself never ended"
        );
        assert_eq!(
            said(short.as_bytes(), true, &[]),
            Said::Whole,
            "no end events named"
        );
    }

    #[test]
    fn data_lines_join_and_one_space_after_the_colon_is_dropped() {
        let events = events(b"\xef\xbb\xbfdata:a\ndata:  b\nevent:x\n\n");
        assert_eq!(events[0].data, "a\n b");
        assert_eq!(events[0].name.as_deref(), Some("x"));
    }
}
