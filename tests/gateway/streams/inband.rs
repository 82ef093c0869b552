//! Answers that fail after their `200` head, through the real binary: an
//! error an event stream reports in band that the route retries ends the
//! attempt `failed` (the next retry runs again); any other is the answer;
//! a stream that stops before its route's end event is cut, unknown
//! (`docs/design.md` §10, "In-band errors and whole streams").

use std::time::Duration;

use crate::support::scripted_sse::ScriptedSse;
use crate::support::sse::{Finish, Reader};
use crate::support::{eventually, post, Gate, Gateway, TestStore};

/// An Anthropic Messages stream: its start, `text`, then `ending` (events).
fn anthropic(text: &str, ending: &[&str]) -> Vec<String> {
    let mut events = vec![
        "event: message_start\ndata: {\"type\":\"message_start\"}\n\n".to_owned(),
        format!(
            "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\
             \"delta\":{{\"type\":\"text_delta\",\"text\":\"{text}\"}}}}\n\n"
        ),
    ];
    events.extend(ending.iter().map(|e| (*e).to_owned()));
    events
}

const MESSAGE_STOP: &str = "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";

/// Anthropic's in-band error event, of `kind`.
fn error_event(kind: &str) -> String {
    format!(
        "event: error\ndata: {{\"type\":\"error\",\"error\":{{\"type\":\"{kind}\",\
         \"message\":\"{kind}\"}}}}\n\n"
    )
}

/// The contract's schemas: events that are a message's own (an error event
/// breaks it, and must be seen as an error before the contract could
/// reject it), and any whole answer.
fn schemas() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let event = serde_json::json!({
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"enum": [
            "message_start", "content_block_start", "content_block_delta",
            "content_block_stop", "message_delta", "message_stop", "ping"
        ]}}
    });
    std::fs::write(dir.path().join("event.json"), event.to_string()).unwrap();
    std::fs::write(dir.path().join("any.json"), "{}").unwrap();
    dir
}

async fn gateway(store: &TestStore, upstream: &ScriptedSse, tables: &str) -> Gateway {
    let schemas = schemas();
    Gateway::builder(store, &upstream.url())
        .set("upstream_timeout", "\"5s\"")
        .tables(tables)
        .files_from(schemas.path())
        .start()
        .await
}

/// The route the worked chat example has: every provider's end event; and
/// a contract on the events of Anthropic's messages.
const CHAT_ROUTE: &str = r#"
[contracts.messages]
schema = "any.json"
events = "event.json"

[[routes]]
path_prefix = "/v1/messages"
contract = "messages"
stream_end_events = ["[DONE]", "message_stop", "response.completed", "response.incomplete", "response.failed"]

[[routes]]
path_prefix = "/v1"
stream_end_events = ["[DONE]", "message_stop", "response.completed", "response.incomplete", "response.failed"]
"#;

async fn read_all(url: &str, key: &str) -> (Reader, Finish) {
    let mut reader = Reader::post(url, key, "{}").await;
    let finish = reader.finish().await;
    (reader, finish)
}

fn text(reader: &Reader) -> String {
    String::from_utf8(reader.read.clone()).unwrap()
}

async fn an_overloaded_stream_is_run_again_then_its_whole_answer_replayed(store: TestStore) {
    let overloaded = anthropic("Hel", &[&error_event("overloaded_error")]);
    let whole = anthropic("Hello", &[MESSAGE_STOP]);
    let upstream = ScriptedSse::start(vec![overloaded, whole.clone()], None).await;
    let gateway = gateway(&store, &upstream, CHAT_ROUTE).await;
    let url = gateway.path("/v1/messages");

    let (first, finish) = read_all(&url, "busy").await;
    assert_eq!(first.status, 200);
    assert_eq!(finish, Finish::Complete, "the events as sent, then the end");
    assert!(text(&first).ends_with(&error_event("overloaded_error")));
    let job = first.header("idempotency-job").unwrap().to_owned();
    let detail = gateway.job(&job).await;
    assert_eq!(detail["state"], "open", "{detail}");
    assert_eq!(detail["attempts"][0]["state"], "failed");
    let why = detail["attempts"][0]["detail"].as_str().unwrap();
    assert!(why.contains("overloaded_error"), "{why}");

    let (retry, finish) = read_all(&url, "busy").await;
    assert_eq!((retry.status, finish), (200, Finish::Complete));
    assert_eq!(text(&retry), whole.concat(), "the upstream ran again");
    assert_eq!(upstream.hits(), 2);

    let (third, finish) = read_all(&url, "busy").await;
    assert_eq!((third.status, finish), (200, Finish::Complete));
    assert_eq!(third.header("idempotent-replayed"), Some("true"));
    assert_eq!(text(&third), whole.concat());
    assert_eq!(upstream.hits(), 2, "replayed, not run a third time");
    let counted = "idemgate_stream_errors_total{route=\"route-0\",upstream=\"primary\",\
                   type=\"overloaded_error\",retryable=\"true\"}";
    assert_eq!(gateway.metric(counted).await, 1.0);
}

/// An OpenAI Responses API stream: its start, a delta of `text`, then
/// `last`, an event `name`d with `data` (a JSON object's members).
fn responses(text: &str, name: &str, data: &str) -> Vec<String> {
    let event = |name: &str, data: &str| format!("event: {name}\ndata: {{{data}}}\n\n");
    vec![
        event("response.created", r#""type":"response.created""#),
        event(
            "response.output_text.delta",
            &format!(r#""type":"response.output_text.delta","delta":"{text}""#),
        ),
        event(name, data),
    ]
}

/// The Responses API's ways to end: a transient failure (an `error`
/// event with its code at the top, then a `response.failed` whose error
/// code is a rate limit) had no effect, and the key's retries run again;
/// a `response.incomplete` (cut short by `max_output_tokens`) is a whole
/// answer, committed and replayed. Before, the `error` event's code went
/// unread: `unknown`, committed, and the key's every retry replayed the
/// error; and `response.incomplete` or `response.failed` under the
/// documented end events was cut, the attempt unknown, the retry `409`.
async fn a_responses_api_stream_ends_and_fails_as_the_api_says(store: TestStore) {
    let error = responses(
        "Hel",
        "error",
        r#""type":"error","code":"server_error","message":"boom","param":null"#,
    );
    let failed = responses(
        "Hel",
        "response.failed",
        r#""type":"response.failed","response":{"status":"failed","error":{"code":"rate_limit_exceeded","message":"slow down"}}"#,
    );
    let incomplete = responses(
        "Hello",
        "response.incomplete",
        r#""type":"response.incomplete","response":{"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"}}"#,
    );
    let scripts = vec![error, failed, incomplete.clone()];
    let upstream = ScriptedSse::start(scripts, None).await;
    let gateway = gateway(&store, &upstream, CHAT_ROUTE).await;
    let url = gateway.path("/v1/responses");
    for (run, expected) in [(1, "server_error"), (2, "rate_limit_exceeded")] {
        let (failing, finish) = read_all(&url, "resp").await;
        assert_eq!((failing.status, finish), (200, Finish::Complete));
        let job = failing.header("idempotency-job").unwrap().to_owned();
        let detail = gateway.job(&job).await;
        assert_eq!(detail["state"], "open", "{detail}");
        let why = detail["attempts"][run - 1]["detail"].as_str().unwrap();
        assert!(why.contains(expected), "{why}");
    }
    let (whole, finish) = read_all(&url, "resp").await;
    assert_eq!((whole.status, finish), (200, Finish::Complete));
    assert_eq!(text(&whole), incomplete.concat());
    let (again, finish) = read_all(&url, "resp").await;
    assert_eq!((again.status, finish), (200, Finish::Complete));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(text(&again), incomplete.concat());
    assert_eq!(upstream.hits(), 3, "run again twice, then replayed");
}

/// A response that called a remote MCP tool (the Responses API runs it,
/// inside the call) and then failed with a transient `server_error`: the
/// error is the answer, replayed to the retry, because running the call
/// again would run the tool again. Before, the retry ran the call (and the
/// tool) a second time. The same call failing the same way before any
/// tool ran is still run again.
async fn an_error_after_a_tool_the_provider_ran_is_the_answer(store: TestStore) {
    let failed = |text: &str| {
        let data = r#""type":"response.failed","response":{"status":"failed","error":{"code":"server_error","message":"boom"}}"#;
        responses(text, "response.failed", data)
    };
    let called = |text: &str| {
        let mut events = failed(text);
        let tool = "event: response.mcp_call.in_progress\n\
                    data: {\"type\":\"response.mcp_call.in_progress\",\"item_id\":\"mcp_1\"}\n\n";
        events.insert(1, tool.to_owned());
        events
    };
    let scripts = vec![failed("Hel"), called("Charged")];
    let upstream = ScriptedSse::start(scripts, None).await;
    let gateway = gateway(&store, &upstream, CHAT_ROUTE).await;
    let url = gateway.path("/v1/responses");
    let (first, finish) = read_all(&url, "tool").await;
    assert_eq!((first.status, finish), (200, Finish::Complete));
    let job = first.header("idempotency-job").unwrap().to_owned();
    assert_eq!(gateway.job(&job).await["state"], "open");
    let (second, finish) = read_all(&url, "tool").await;
    assert_eq!((second.status, finish), (200, Finish::Complete));
    assert_eq!(text(&second), called("Charged").concat());
    let detail = gateway.job(&job).await;
    assert_eq!(detail["state"], "completed", "{detail}");
    let (again, finish) = read_all(&url, "tool").await;
    assert_eq!((again.status, finish), (200, Finish::Complete));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(text(&again), called("Charged").concat());
    assert_eq!(upstream.hits(), 2, "the tool's call never run again");
}

/// The same on Anthropic's Messages API: a web search (a server tool,
/// which the API runs once its `server_tool_use` block ends), then an
/// `overloaded_error`. Committed and replayed; before, run again.
async fn an_overload_after_an_anthropic_server_tool_is_the_answer(store: TestStore) {
    let searched = anthropic(
        "Searching",
        &[
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,\
             \"content_block\":{\"type\":\"server_tool_use\",\"name\":\"web_search\"}}\n\n",
            "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":1}\n\n",
            &error_event("overloaded_error"),
        ],
    );
    let upstream = ScriptedSse::start(vec![searched.clone()], None).await;
    let gateway = gateway(&store, &upstream, CHAT_ROUTE).await;
    let url = gateway.path("/v1/messages");
    let (first, finish) = read_all(&url, "search").await;
    assert_eq!((first.status, finish), (200, Finish::Complete));
    let (again, finish) = read_all(&url, "search").await;
    assert_eq!((again.status, finish), (200, Finish::Complete));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(text(&again), searched.concat());
    assert_eq!(upstream.hits(), 1, "the search never run again");
}

async fn an_invalid_request_error_is_the_answer_and_is_replayed(store: TestStore) {
    let invalid = anthropic("", &[&error_event("invalid_request_error")]);
    let upstream = ScriptedSse::start(vec![invalid.clone()], None).await;
    // The contract's events would refuse the error event: the upstream's
    // own verdict is never checked against it.
    let gateway = gateway(&store, &upstream, CHAT_ROUTE).await;
    let url = gateway.path("/v1/messages");
    let (first, finish) = read_all(&url, "bad").await;
    assert_eq!((first.status, finish), (200, Finish::Complete));
    let (again, finish) = read_all(&url, "bad").await;
    assert_eq!((again.status, finish), (200, Finish::Complete));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(text(&again), invalid.concat());
    assert_eq!(upstream.hits(), 1, "committed, never run again");
}

async fn an_openai_error_chunk_is_retried(store: TestStore) {
    let chunk = |content: &str| {
        format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{content}\"}}}}]}}\n\n"
        )
    };
    let failing = vec![
        chunk("He"),
        "data: {\"error\":{\"message\":\"The server had an error\",\"type\":\"server_error\"}}\n\n"
            .to_owned(),
    ];
    let whole = vec![chunk("Hello"), "data: [DONE]\n\n".to_owned()];
    let upstream = ScriptedSse::start(vec![failing, whole.clone()], None).await;
    let gateway = gateway(&store, &upstream, CHAT_ROUTE).await;
    let url = gateway.path("/v1/chat/completions");
    let (first, finish) = read_all(&url, "oai").await;
    assert_eq!((first.status, finish), (200, Finish::Complete));
    assert!(text(&first).contains("server_error"));
    let (retry, _) = read_all(&url, "oai").await;
    assert_eq!(text(&retry), whole.concat());
    assert_eq!(upstream.hits(), 2);
}

/// A bulk call's stream that reports one item's error among the others
/// and goes on to its end did act: it is committed and replayed, never run
/// again (before, the error-shaped item made the attempt `failed` and
/// every retry sent the mail again), on a route that names its end events
/// and on one that does not.
async fn an_error_the_stream_went_on_past_is_part_of_the_answer(store: TestStore) {
    let item = |n: u32, error: &str| format!("data: {{\"recipient\":{n}{error}}}\n\n");
    let bulk = vec![
        item(1, ""),
        item(2, ",\"error\":{\"code\":\"timeout\"}"),
        item(3, ""),
        "data: [DONE]\n\n".to_owned(),
    ];
    let upstream = ScriptedSse::start(vec![bulk.clone()], None).await;
    let routes = format!("{CHAT_ROUTE}\n[[routes]]\npath_prefix = \"/bulk\"\n");
    let gateway = gateway(&store, &upstream, &routes).await;
    for (path, key) in [("/v1/bulk", "named"), ("/bulk", "unnamed")] {
        let url = gateway.path(path);
        let (first, finish) = read_all(&url, key).await;
        assert_eq!((first.status, finish), (200, Finish::Complete));
        let (again, finish) = read_all(&url, key).await;
        assert_eq!((again.status, finish), (200, Finish::Complete));
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{path}");
        assert_eq!(text(&again), bulk.concat());
    }
    assert_eq!(upstream.hits(), 2, "each key ran once");
}

async fn a_live_joiner_of_a_stream_that_fails_in_band_gets_it_as_sent(store: TestStore) {
    let gate = Gate::new();
    let overloaded = anthropic("Hel", &[&error_event("overloaded_error")]);
    let upstream = ScriptedSse::start(vec![overloaded.clone()], Some(gate.clone())).await;
    let gateway = gateway(&store, &upstream, CHAT_ROUTE).await;
    let url = gateway.path("/v1/messages");
    let mut first = Reader::post(&url, "joined", "{}").await;
    first.read_until(overloaded[0].len()).await;
    let mut joiner = Reader::post(&url, "joined", "{}").await;
    assert_eq!(joiner.status, 200);
    joiner.read_until(overloaded[0].len()).await;
    gate.open(2);
    assert_eq!(first.finish().await, Finish::Complete);
    assert_eq!(
        joiner.finish().await,
        Finish::Complete,
        "an end, not an error"
    );
    assert_eq!(text(&joiner), overloaded.concat());
    assert_eq!(text(&first), overloaded.concat());
    let job = first.header("idempotency-job").unwrap().to_owned();
    assert_eq!(gateway.job(&job).await["state"], "open");
    assert_eq!(upstream.hits(), 1);
}

async fn a_stream_that_stops_before_its_end_event_is_cut(store: TestStore) {
    let short = anthropic("Hel", &[]);
    let upstream = ScriptedSse::start(vec![short], None).await;
    let gateway = gateway(&store, &upstream, CHAT_ROUTE).await;
    let url = gateway.path("/v1/messages");
    let (first, finish) = read_all(&url, "short").await;
    assert_eq!(first.status, 200);
    assert_eq!(finish, Finish::Aborted, "never passed off as whole");
    let job = first.header("idempotency-job").unwrap().to_owned();
    eventually(
        Duration::from_secs(5),
        "the attempt to be unknown",
        || async { gateway.job(&job).await["attempts"][0]["state"] == "unknown" },
    )
    .await;
    let why = gateway.job(&job).await["attempts"][0]["detail"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(why.contains("stream_end_events"), "{why}");
    let retry = post(&url, "short", "{}").await;
    assert_eq!(retry.status, 409);
    assert_eq!(retry.problem(), "attempt-outcome-unknown");
    assert_eq!(upstream.hits(), 1);
}

async fn a_route_that_turns_stream_errors_off_commits_them(store: TestStore) {
    let overloaded = anthropic("Hel", &[&error_event("overloaded_error")]);
    let upstream = ScriptedSse::start(vec![overloaded.clone()], None).await;
    let route = "[[routes]]\npath_prefix = \"/v1\"\n[routes.stream_errors]\nenabled = false\n";
    let gateway = gateway(&store, &upstream, route).await;
    let url = gateway.path("/v1/messages");
    read_all(&url, "off").await;
    let (again, _) = read_all(&url, "off").await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(upstream.hits(), 1);
}

/// Two replicas of the chat route in front of `upstream`, sharing `store`
/// and `redis`.
async fn two_replicas(
    store: &TestStore,
    upstream: &str,
    redis: &crate::support::ThrowawayRedis,
    schemas: &tempfile::TempDir,
) -> (Gateway, Gateway) {
    let replica = || {
        Gateway::builder(store, upstream)
            .set("upstream_timeout", "\"5s\"")
            .set("redis_url", &format!("{:?}", redis.url()))
            .tables(CHAT_ROUTE)
            .files_from(schemas.path())
            .start()
    };
    (replica().await, replica().await)
}

/// A joiner on another replica, fed through the Redis mirror, ends as the
/// first client does: the events as sent, then a clean end, though nothing
/// was committed; the retry on that replica runs again.
#[tokio::test]
async fn a_joiner_on_another_replica_gets_an_in_band_failure_as_sent() {
    let store = TestStore::postgres().await;
    let redis = crate::support::ThrowawayRedis::start().await;
    let gate = Gate::new();
    let overloaded = anthropic("Hel", &[&error_event("overloaded_error")]);
    let whole = anthropic("Hello", &[MESSAGE_STOP]);
    let upstream =
        ScriptedSse::start(vec![overloaded.clone(), whole.clone()], Some(gate.clone())).await;
    let schemas = schemas();
    let (a, b) = two_replicas(&store, &upstream.url(), &redis, &schemas).await;
    let mut first = Reader::post(&a.path("/v1/chat"), "far", "{}").await;
    first.read_until(overloaded[0].len()).await;
    let mut far = Reader::post(&b.path("/v1/chat"), "far", "{}").await;
    assert_eq!(far.header("idempotent-replayed"), Some("true"));
    far.read_until(overloaded[0].len()).await;
    gate.open(2);
    assert_eq!(first.finish().await, Finish::Complete);
    assert_eq!(far.finish().await, Finish::Complete, "an end, not a cut");
    assert_eq!(text(&far), overloaded.concat());
    gate.open(2);
    let (retry, finish) = read_all(&b.path("/v1/chat"), "far").await;
    assert_eq!((retry.status, finish), (200, Finish::Complete));
    assert_eq!(text(&retry), whole.concat());
    assert_eq!(upstream.hits(), 2);
}

/// A stream that failed in-band leaves its mirror in Redis; the retry's
/// attempt is mirrored on the same job's stream once its head comes. A
/// duplicate meanwhile, on a replica whose own copy of the failed stream has
/// ended, is held, not handed the earlier attempt's failure as if it were
/// the running one's; then it gets the retry's answer, as every client of
/// the job does (`docs/design.md` §10).
#[tokio::test]
async fn a_joiner_never_gets_an_earlier_attempts_mirrored_stream() {
    let store = TestStore::postgres().await;
    let redis = crate::support::ThrowawayRedis::start().await;
    let gate = Gate::new();
    let overloaded = anthropic("Hel", &[&error_event("overloaded_error")]);
    let whole = anthropic("Hello", &[MESSAGE_STOP]);
    let upstream =
        ScriptedSse::head_held(vec![overloaded.clone(), whole.clone()], gate.clone()).await;
    let schemas = schemas();
    let (a, b) = two_replicas(&store, &upstream.url(), &redis, &schemas).await;
    gate.open(overloaded.len());
    let (first, finish) = read_all(&a.path("/v1/chat"), "again").await;
    assert_eq!((first.status, finish), (200, Finish::Complete));
    assert_eq!(text(&first), overloaded.concat());
    let retry = tokio::spawn(read_all(b.path("/v1/chat").leak(), "again"));
    eventually(
        Duration::from_secs(10),
        "the retry's attempt at the upstream",
        || async { upstream.hits() == 2 },
    )
    .await;
    let duplicate = tokio::spawn(read_all(a.path("/v1/chat").leak(), "again"));
    eventually(Duration::from_secs(10), "the duplicate held", || async {
        a.metric("idemgate_held_requests").await == 1.0
    })
    .await;
    gate.open(whole.len());
    let (retry, finish) = retry.await.unwrap();
    assert_eq!((retry.status, finish), (200, Finish::Complete));
    assert_eq!(text(&retry), whole.concat());
    let (duplicate, finish) = duplicate.await.unwrap();
    assert_eq!((duplicate.status, finish), (200, Finish::Complete));
    assert_eq!(
        text(&duplicate),
        whole.concat(),
        "the running attempt's answer"
    );
    assert_eq!(upstream.hits(), 2);
}

/// A whole Anthropic Messages stream of `text`, as the SDK parses it.
fn anthropic_message(text: &str) -> Vec<String> {
    let data = |event: &str, json: serde_json::Value| format!("event: {event}\ndata: {json}\n\n");
    let message = serde_json::json!({
        "id": "msg_fake", "type": "message", "role": "assistant", "content": [],
        "model": "claude-fake", "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": 10, "output_tokens": 1}
    });
    vec![
        data(
            "message_start",
            serde_json::json!({"type": "message_start", "message": message}),
        ),
        data(
            "content_block_start",
            serde_json::json!({"type": "content_block_start", "index": 0,
                               "content_block": {"type": "text", "text": ""}}),
        ),
        data("ping", serde_json::json!({"type": "ping"})),
        data(
            "content_block_delta",
            serde_json::json!({"type": "content_block_delta", "index": 0,
                               "delta": {"type": "text_delta", "text": text}}),
        ),
        data(
            "content_block_stop",
            serde_json::json!({"type": "content_block_stop", "index": 0}),
        ),
        data(
            "message_delta",
            serde_json::json!({"type": "message_delta",
                               "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                               "usage": {"output_tokens": 2}}),
        ),
        MESSAGE_STOP.to_owned(),
    ]
}

/// The official `anthropic` SDK, as an app uses it: the first try's stream
/// ends in an in-band `overloaded_error` and the SDK raises; the app tries
/// again with the same key and gets the whole message (the upstream ran
/// again); a third try replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_anthropic_sdk_retrying_an_overloaded_stream_gets_the_message() {
    let python = tokio::task::spawn_blocking(|| {
        crate::support::python::venv("anthropic-venv", &["anthropic"], "import anthropic")
            .join("python")
    })
    .await
    .unwrap();
    let store = TestStore::postgres().await;
    let mut overloaded = anthropic_message("Hel");
    overloaded.truncate(4);
    overloaded.push(error_event("overloaded_error"));
    let upstream = ScriptedSse::start(vec![overloaded, anthropic_message("Hello!")], None).await;
    let gateway = gateway(&store, &upstream, CHAT_ROUTE).await;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/clients/anthropic_overloaded.py");
    let out = crate::support::python::run_client(
        "SDK script",
        tokio::process::Command::new(&python)
            .arg(&script)
            .arg(gateway.url.clone())
            .arg("sdk-overloaded"),
    )
    .await;
    let seen: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let errors = seen["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 1, "{seen}");
    assert!(errors[0].as_str().unwrap().contains("verloaded"), "{seen}");
    assert_eq!(
        seen["texts"],
        serde_json::json!(["Hello!", "Hello!"]),
        "{seen}"
    );
    assert_eq!(upstream.hits(), 2, "run again once, then replayed");
}

/// A stream whose head comes after `first_byte_timeout` (the attempt
/// already unknown, its client answered `504`) is read whole, and judged
/// as a stream all the same: an in-band error the route retries is no
/// answer (the attempt `failed`, the job open: the retry runs again; the
/// error counted in `idemgate_stream_errors_total`), and
/// a whole valid stream on a route with a contract is checked by the
/// contract's `events`, then committed. Before, the overloaded stream was
/// committed and replayed to every retry, and the valid one broke the
/// contract's JSON schema ("not JSON"): rejected, the job reopened, and a
/// retry ran (and billed) the generation again.
async fn a_late_stream_is_judged_as_a_stream(store: TestStore) {
    let gate = Gate::new();
    let overloaded = anthropic("Hel", &[&error_event("overloaded_error")]);
    let whole = anthropic("Hello", &[MESSAGE_STOP]);
    let scripts = vec![overloaded.clone(), whole.clone(), whole.clone()];
    let upstream = ScriptedSse::head_held(scripts, gate.clone()).await;
    let late = CHAT_ROUTE.replace(
        "stream_end_events",
        "first_byte_timeout = \"300ms\"\nstream_end_events",
    );
    let gateway = gateway(&store, &upstream, &late).await;
    let (chat, messages) = (gateway.path("/v1/chat"), gateway.path("/v1/messages"));

    // A keyed POST answered 504 (no head within 300 ms), then its head and
    // `events` events let through: the job once its late stream is judged.
    let judged_late = |url: &str, key: &'static str, events: usize| {
        let (url, gateway, gate) = (url.to_owned(), &gateway, gate.clone());
        async move {
            let first = post(&url, key, "{}").await;
            assert_eq!(first.status, 504, "{first:?}");
            let job = first.job().unwrap();
            gate.open(events);
            eventually(
                Duration::from_secs(10),
                "the late stream judged",
                || async { gateway.job(&job).await["attempts"][0]["state"] != "unknown" },
            )
            .await;
            gateway.job(&job).await
        }
    };
    let judged = judged_late(&chat, "late", overloaded.len()).await;
    assert_eq!(judged["attempts"][0]["state"], "failed", "{judged}");
    assert_eq!(judged["state"], "open");
    let counted = "idemgate_stream_errors_total{route=\"route-1\",upstream=\"primary\",\
                   type=\"overloaded_error\",retryable=\"true\"}";
    assert_eq!(
        gateway.metric(counted).await,
        1.0,
        "counted as a streamed one's"
    );
    gate.open(whole.len());
    let (retry, finish) = read_all(&chat, "late").await;
    assert_eq!((retry.status, finish), (200, Finish::Complete));
    assert_eq!(text(&retry), whole.concat());

    let judged = judged_late(&messages, "late-valid", whole.len()).await;
    assert_eq!(judged["attempts"][0]["state"], "succeeded", "{judged}");
    let (replay, _) = read_all(&messages, "late-valid").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(text(&replay), whole.concat());
    assert_eq!(upstream.hits(), 3);
}

crate::on_each_deployment!(
    [embedded, postgres]
    an_error_the_stream_went_on_past_is_part_of_the_answer,
    a_late_stream_is_judged_as_a_stream,
    an_overloaded_stream_is_run_again_then_its_whole_answer_replayed,
    an_invalid_request_error_is_the_answer_and_is_replayed,
    a_responses_api_stream_ends_and_fails_as_the_api_says,
    an_error_after_a_tool_the_provider_ran_is_the_answer,
    an_overload_after_an_anthropic_server_tool_is_the_answer,
    an_openai_error_chunk_is_retried,
    a_live_joiner_of_a_stream_that_fails_in_band_gets_it_as_sent,
    a_stream_that_stops_before_its_end_event_is_cut,
    a_route_that_turns_stream_errors_off_commits_them,
);
