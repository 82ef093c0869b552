//! MCP tool calls through the real binary (`docs/design.md` §19): a
//! `tools/call` keyed in `params._meta.idempotencyKey` runs once, and every
//! answer is addressed to the request that asked; other messages pass.

use http::Method;
use serde_json::{json, Value};

use crate::support::mcp::{tool_call, Answering, FakeMcp};
use crate::support::{send, Gate, Gateway, Reply, TestStore};

pub(super) const ROUTE: &str = "[[routes]]\npath_prefix = \"/mcp\"\nprotocol = \"mcp\"\n";

async fn gateway(store: &TestStore, server: &FakeMcp) -> Gateway {
    Gateway::builder(store, &server.url())
        .tables(ROUTE)
        .start()
        .await
}

/// POSTs `message` to the MCP endpoint, in session `session`.
pub(super) async fn post(gateway: &Gateway, message: &Value, session: &str) -> Reply {
    let headers = [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("mcp-session-id", session),
    ];
    send(
        Method::POST,
        &gateway.path("/mcp"),
        &headers,
        message.to_string(),
    )
    .await
}

/// The JSON-RPC response an answer carries: its body, or the response
/// event of an event stream.
pub(super) fn response(reply: &Reply) -> Value {
    assert_eq!(
        reply.status,
        200,
        "{:?}",
        String::from_utf8_lossy(&reply.body)
    );
    if reply.header("content-type") == Some("text/event-stream") {
        return messages(reply)
            .into_iter()
            .find(|m| m.get("id").is_some() && m.get("method").is_none())
            .expect("a response event");
    }
    reply.json()
}

/// The JSON-RPC messages of an event stream, each event's `data:` lines
/// joined as a client's parser joins them.
fn messages(reply: &Reply) -> Vec<Value> {
    String::from_utf8_lossy(&reply.body)
        .split("\n\n")
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .collect();
            (!data.is_empty()).then(|| serde_json::from_str(&data.join("\n")).unwrap())
        })
        .collect()
}

async fn a_retried_call_runs_once_and_answers_its_own_id(store: TestStore) {
    let server = FakeMcp::start(Answering::Json, None).await;
    let gateway = gateway(&store, &server).await;
    let args = json!({"amount": 1500, "to": "acct-9"});
    let first = post(
        &gateway,
        &tool_call(json!(1), "charge", args.clone(), Some("pay-1")),
        "s1",
    )
    .await;
    let first = response(&first);
    assert_eq!(first["id"], 1);
    // The agent's harness retries: a new id, the same key, arguments in
    // another order (the same intent).
    let args = json!({"to": "acct-9", "amount": 1500});
    let retry = post(
        &gateway,
        &tool_call(json!("r-2"), "charge", args, Some("pay-1")),
        "s1",
    )
    .await;
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    let retry = response(&retry);
    assert_eq!(retry["id"], "r-2", "addressed to the retry");
    assert_eq!(retry["result"], first["result"]);
    assert_eq!(server.runs("charge"), 1);
}

async fn other_methods_are_never_keyed(store: TestStore) {
    let server = FakeMcp::start(Answering::Json, None).await;
    let gateway = gateway(&store, &server).await;
    let list = json!({"jsonrpc": "2.0", "id": 5, "method": "tools/list"});
    for _ in 0..2 {
        let headers = [
            ("content-type", "application/json"),
            ("idempotency-key", "not-for-lists"),
        ];
        let reply = send(
            Method::POST,
            &gateway.path("/mcp"),
            &headers,
            list.to_string(),
        )
        .await;
        assert_eq!(response(&reply)["id"], 5);
        assert_eq!(reply.header("idempotent-replayed"), None);
    }
    let unkeyed = tool_call(json!(6), "lookup", json!({}), None);
    post(&gateway, &unkeyed, "s").await;
    post(&gateway, &unkeyed, "s").await;
    let posted = server.posts();
    assert_eq!(
        posted.len(),
        4,
        "every message reached the server: {posted:?}"
    );
    assert_eq!(server.runs("lookup"), 2, "a call without a key is not kept");
}

async fn the_same_key_with_other_arguments_is_a_json_rpc_error(store: TestStore) {
    let server = FakeMcp::start(Answering::Json, None).await;
    let gateway = gateway(&store, &server).await;
    post(
        &gateway,
        &tool_call(json!(1), "charge", json!({"amount": 1}), Some("k")),
        "s",
    )
    .await;
    let other = tool_call(json!(2), "charge", json!({"amount": 2}), Some("k"));
    let reply = post(&gateway, &other, "s").await;
    let error = response(&reply);
    assert_eq!(error["id"], 2);
    assert_eq!(error["error"]["code"], -32000);
    let problem = error["error"]["data"]["type"].as_str().unwrap();
    assert!(problem.ends_with("/idempotency-key-mismatch"), "{error}");
    assert_eq!(server.runs("charge"), 1, "nothing ran for the mismatch");
    // Another member of `params` (a task) is part of what the call asks.
    let mut tasked = tool_call(json!(3), "charge", json!({"amount": 1}), Some("k"));
    tasked["params"]["task"] = json!({"ttl": 60000});
    let error = response(&post(&gateway, &tasked, "s").await);
    assert_eq!(error["error"]["code"], -32000, "{error}");
    assert_eq!(server.runs("charge"), 1);
}

/// Three calls with one key at once, each with its own id: the tool runs
/// once, and each gets the answer addressed to it.
async fn concurrent_calls(store: TestStore, answering: Answering) {
    let gate = Gate::new();
    let server = FakeMcp::start(answering, Some(gate.clone())).await;
    let gateway = std::sync::Arc::new(gateway(&store, &server).await);
    let calls: Vec<_> = (1..=3)
        .map(|n| {
            let gateway = gateway.clone();
            let call = tool_call(json!(n), "send_email", json!({"to": "a@b"}), Some("mail-1"));
            tokio::spawn(async move { post(&gateway, &call, &format!("s{n}")).await })
        })
        .collect();
    crate::support::eventually(
        std::time::Duration::from_secs(10),
        "the call in flight",
        || async {
            server.posts().len() == 1 && gateway.metric("idemgate_held_requests").await == 2.0
                || server.posts().len() == 1
                    && gateway.metric("idemgate_stream_joiners_total").await == 2.0
        },
    )
    .await;
    gate.open(1);
    let mut results = Vec::new();
    for (n, call) in calls.into_iter().enumerate() {
        let reply = call.await.unwrap();
        // Its own session, never the one whose call ran the tool: a client
        // adopts the session of any answer it gets.
        let session = format!("s{}", n + 1);
        assert_eq!(reply.header("mcp-session-id"), Some(session.as_str()));
        let answer = response(&reply);
        assert_eq!(answer["id"], n as i64 + 1);
        results.push(answer["result"].clone());
    }
    assert!(results.iter().all(|r| *r == results[0]), "{results:?}");
    assert_eq!(server.runs("send_email"), 1);
}

async fn concurrent_calls_with_one_key_run_the_tool_once(store: TestStore) {
    concurrent_calls(store, Answering::Json).await;
}

async fn concurrent_calls_answered_as_a_stream_run_the_tool_once(store: TestStore) {
    concurrent_calls(store, Answering::Stream).await;
}

async fn a_new_session_gets_the_answer_of_the_old_one(store: TestStore) {
    let server = FakeMcp::start(Answering::Stream, None).await;
    let gateway = gateway(&store, &server).await;
    let call = |id| {
        tool_call(
            json!(id),
            "create_ticket",
            json!({"title": "x"}),
            Some("t-1"),
        )
    };
    let first = post(&gateway, &call(1), "session-before-crash").await;
    let again = post(&gateway, &call(1001), "session-after-reconnect").await;
    assert_eq!(again.header("content-type"), Some("text/event-stream"));
    // The replay is in the session that asked: a client adopts the
    // session of any answer, and the old one may be gone.
    assert_eq!(
        again.header("mcp-session-id"),
        Some("session-after-reconnect")
    );
    let (first, again) = (response(&first), response(&again));
    assert_eq!(again["id"], 1001);
    assert_eq!(again["result"], first["result"]);
    // A call that names no session is told none.
    let headers = [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
    ];
    let sessionless = send(
        Method::POST,
        &gateway.path("/mcp"),
        &headers,
        call(1002).to_string(),
    )
    .await;
    assert_eq!(sessionless.header("idempotent-replayed"), Some("true"));
    assert_eq!(sessionless.header("mcp-session-id"), None);
    assert_eq!(response(&sessionless)["id"], 1002);
    assert_eq!(server.runs("create_ticket"), 1);
}

/// A gateway with the MCP route in front of `upstream`, a server scripted
/// by the test.
async fn gateway_on(store: &TestStore, upstream: &crate::support::FakeUpstream) -> Gateway {
    Gateway::builder(store, &upstream.url())
        .tables(ROUTE)
        .start()
        .await
}

/// An event stream of `body`, an MCP server's answer in session `s1`.
fn events_in_s1(body: String) -> http::Response<http_body_util::Full<bytes::Bytes>> {
    http::Response::builder()
        .header("content-type", "text/event-stream")
        .header("mcp-session-id", "s1")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap()
}

/// A tool that asks its user (`elicitation/create`) before it acts sends
/// the request inside its call's stream; the first caller answers it. A
/// retry in another session is answered the stored stream without that
/// request (its user is not asked again to consent to what is done), its
/// notifications and its response, readdressed, kept; a retry in the
/// session the call ran in is answered it whole.
async fn a_replay_never_asks_the_first_callers_questions(store: TestStore) {
    asks_once(store, Lines::One).await
}

/// The same, from a server that writes each message's JSON over several
/// `data:` lines (as a pretty-printing one does), the question and the
/// response each over 64 KiB, so the replay's frames cut them: each event
/// is held whole and read as its client's parser joins it, so the
/// question is still left out and the response still readdressed (before,
/// both were passed as they came: the question asked again, the response
/// under the first call's id).
async fn a_replay_of_messages_written_over_several_lines_asks_nothing(store: TestStore) {
    asks_once(store, Lines::Several).await
}

/// The same, from a server that names the session only where it sets one
/// up, as the transport allows: the answer is stored with the session the
/// call asked in, so a retry in that session is still asked (before, it
/// was taken for another session's, and its client never saw the question
/// its server waited on).
async fn a_retry_in_the_calls_session_is_asked_though_its_server_named_none(store: TestStore) {
    asks_once(store, Lines::Unnamed).await
}

/// How a scripted server writes its answer.
#[derive(Clone, Copy)]
enum Lines {
    One,
    Several,
    /// On one line, the answer naming no session.
    Unnamed,
}

async fn asks_once(store: TestStore, lines: Lines) {
    let upstream = crate::support::FakeUpstream::start(move |r| async move {
        let call: Value = serde_json::from_slice(&r.body).unwrap();
        let messages = [
            json!({"jsonrpc": "2.0", "method": "notifications/progress",
                   "params": {"progressToken": call["id"], "progress": 1}}),
            json!({"jsonrpc": "2.0", "id": 7, "method": "elicitation/create",
                   "params": {"message": "Really charge 5000?", "requestedSchema": {},
                              "_meta": {"lines": long()}}}),
            json!({"jsonrpc": "2.0", "id": call["id"], "result": charged()}),
        ];
        let json = |m: &Value| match lines {
            Lines::One | Lines::Unnamed => m.to_string(),
            Lines::Several => serde_json::to_string_pretty(m).unwrap(),
        };
        let event = |m: &Value| {
            let data: Vec<String> = json(m).lines().map(|l| format!("data: {l}\n")).collect();
            format!("{}\n", data.concat())
        };
        let mut answer = events_in_s1(messages.iter().map(event).collect());
        if let Lines::Unnamed = lines {
            answer.headers_mut().remove("mcp-session-id");
        }
        answer
    })
    .await;
    let gateway = gateway_on(&store, &upstream).await;
    let call = |id| tool_call(json!(id), "charge", json!({"amount": 5000}), Some("ask-1"));
    let methods = |reply: &Reply| -> Vec<String> {
        messages(reply)
            .iter()
            .map(|m| m["method"].as_str().unwrap_or("(response)").to_owned())
            .collect()
    };
    let first = post(&gateway, &call(1), "s1").await;
    assert_eq!(
        methods(&first),
        ["notifications/progress", "elicitation/create", "(response)"]
    );
    let again = post(&gateway, &call(2), "s2").await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(methods(&again), ["notifications/progress", "(response)"]);
    assert_eq!(again.header("mcp-session-id"), Some("s2"));
    assert_eq!(response(&again)["id"], 2);
    assert_eq!(response(&again)["result"], charged());
    // A retry in the session the call ran in (its first connection lost)
    // may still have to answer.
    let same = post(&gateway, &call(3), "s1").await;
    assert_eq!(same.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        methods(&same),
        ["notifications/progress", "elicitation/create", "(response)"]
    );
    assert_eq!(same.header("mcp-session-id"), Some("s1"));
    assert_eq!(response(&same)["id"], 3);
    assert_eq!(upstream.hits(), 1);
}

/// The caller whose call ran (it was sent the server's question) lost
/// its stream after two events, the question among them, and resumes
/// from another session (the server restarted): it is sent what follows
/// those two in the stored stream, nothing it never got skipped. A resume
/// point is of the stored stream; cut after readdressing (the question
/// left out for another session), the second notification was lost.
async fn a_resumed_tool_call_loses_no_event(store: TestStore) {
    let upstream = crate::support::FakeUpstream::start(|r| async move {
        let call: Value = serde_json::from_slice(&r.body).unwrap();
        let progress = |n: u32| {
            json!({"jsonrpc": "2.0", "method": "notifications/progress",
                   "params": {"progressToken": call["id"], "progress": n}})
        };
        let messages = [
            progress(1),
            json!({"jsonrpc": "2.0", "id": 7, "method": "elicitation/create",
                   "params": {"message": "Really charge 5000?", "requestedSchema": {}}}),
            progress(2),
            json!({"jsonrpc": "2.0", "id": call["id"], "result": charged()}),
        ];
        events_in_s1(messages.iter().map(|m| format!("data: {m}\n\n")).collect())
    })
    .await;
    let gateway = gateway_on(&store, &upstream).await;
    let call = |id| {
        tool_call(
            json!(id),
            "charge",
            json!({"amount": 5000}),
            Some("resume-1"),
        )
    };
    let first = post(&gateway, &call(1), "s1").await;
    assert_eq!(messages(&first).len(), 4);
    let headers = [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("mcp-session-id", "s2"),
        ("idempotency-events-received", "2"),
    ];
    let url = gateway.path("/mcp");
    let resumed = send(Method::POST, &url, &headers, call(1).to_string()).await;
    assert_eq!(resumed.header("idempotent-replayed"), Some("true"));
    assert_eq!(resumed.header("idempotency-events-skipped"), Some("2"));
    let got = messages(&resumed);
    assert_eq!(
        got.len(),
        2,
        "the second notification, then the response: {got:?}"
    );
    assert_eq!(got[0]["params"]["progress"], 2);
    assert_eq!(response(&resumed)["id"], 1);
    assert_eq!(upstream.hits(), 1);
}

/// Twenty thousand values: a message over 64 KiB on one line (given out
/// in parts as it comes, as any line that long), and of thousands of
/// lines pretty-printed; either way a replay's 16 KiB frames cut its
/// event (`replay/mod.rs`).
fn long() -> Value {
    json!((0..20_000).collect::<Vec<u32>>())
}

/// The tool's result.
fn charged() -> Value {
    json!({"content": [{"type": "text", "text": "charged"}],
           "structuredContent": {"receipt": long()}})
}

/// A server that ends a long call's stream before its response, on
/// purpose (an event id first, a `retry:` pause, then the connection
/// closed: the 2025-11-25 transport's polling, the official SDK's
/// `close_sse_stream`), and sends the response to whoever reconnects with
/// `GET` and `Last-Event-ID`. The attempt reconnects as the client would:
/// the caller reads the response in the stream it was reading, it is
/// committed, and a retry in another session replays it. Before, the
/// stream's clean end without a response left the call unknown, and every
/// retry was told so, though the tool ran once.
async fn a_stream_closed_before_its_response_is_taken_up_again(store: TestStore) {
    let asked = std::sync::Arc::new(std::sync::Mutex::new(Value::Null));
    let upstream = crate::support::FakeUpstream::start({
        let asked = asked.clone();
        move |r| {
            let asked = asked.clone();
            async move {
                let body = if r.method == "POST" {
                    let call: Value = serde_json::from_slice(&r.body).unwrap();
                    *asked.lock().unwrap() = call["id"].clone();
                    "id: e1\nretry: 20\ndata:\n\n".to_owned()
                } else {
                    let id = asked.lock().unwrap().clone();
                    let done = json!({"jsonrpc": "2.0", "id": id,
                                      "result": {"content": [{"type": "text", "text": "charged"}]}});
                    format!("id: e2\ndata: {done}\n\n")
                };
                events_in_s1(body)
            }
        }
    })
    .await;
    let gateway = gateway_on(&store, &upstream).await;
    let call = |id| tool_call(json!(id), "charge", json!({"amount": 5000}), Some("polled"));
    let first = post(&gateway, &call(1), "s1").await;
    assert_eq!(response(&first)["id"], 1);
    assert_eq!(response(&first)["result"]["content"][0]["text"], "charged");
    let again = post(&gateway, &call(2), "s2").await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(response(&again)["id"], 2);
    let sent = upstream.recorded();
    let methods: Vec<_> = sent.iter().map(|r| r.method.as_str()).collect();
    assert_eq!(methods, ["POST", "GET"], "one run, one reconnect");
    assert_eq!(sent[1].header("last-event-id"), Some("e1"));
    assert_eq!(sent[1].header("mcp-session-id"), Some("s1"));
    assert_eq!(sent[1].header("accept"), Some("text/event-stream"));
}

/// A call the server refused before dispatching it (`404` "Session not
/// found" with `"id": null` after a restart; a bare `400`) had no effect:
/// the refusal is the caller's, nothing is kept, and the retry in a new
/// session runs the tool.
async fn a_call_the_server_refused_runs_in_the_next_session(store: TestStore) {
    let server = FakeMcp::start(Answering::Json, None).await;
    let gateway = gateway(&store, &server).await;
    for (session, status, key) in [("gone", 404, "k-404"), ("refused", 400, "k-400")] {
        let call = |id| tool_call(json!(id), "charge", json!({"amount": 5}), Some(key));
        let refused = post(&gateway, &call(1), session).await;
        assert_eq!(refused.status, status, "{session}");
        assert_eq!(refused.header("idempotent-replayed"), None);
        let runs = server.runs("charge");
        let retry = post(&gateway, &call(2), "s2").await;
        assert_eq!(retry.header("idempotent-replayed"), None, "{session}");
        let retry = response(&retry);
        assert_eq!(retry["id"], 2, "{retry}");
        assert!(retry["result"].is_object(), "{session}: {retry}");
        assert_eq!(server.runs("charge"), runs + 1, "{session}");
    }
    assert_eq!(server.runs("charge"), 2, "once for each key");
}

/// How an agent abandons a call in flight.
#[derive(Debug, Clone, Copy)]
enum Abandon {
    /// `notifications/cancelled`: the server answers `-32800`.
    Cancel,
    /// The session's `DELETE`: `500` with `"id": null`, or a stream that
    /// ends before the response.
    Delete,
}

/// A call its agent abandoned mid-run, the server cut short: its answer
/// carries no response to the call (or `-32800`), yet the tool may have
/// acted. Nothing is kept, and the retry in a new session meets an
/// unknown outcome, never that answer, nor a second run. `-32603` is
/// listed retryable: the session's `id: null` error is still not the
/// call's.
async fn abandoned(store: TestStore, answering: Answering, how: Abandon) {
    let gate = Gate::new();
    let server = FakeMcp::start(answering, Some(gate.clone())).await;
    let gateway = std::sync::Arc::new(
        Gateway::builder(&store, &server.url())
            .tables(&format!("{ROUTE}retryable_rpc_codes = [-32603]\n"))
            .start()
            .await,
    );
    let call = |id| tool_call(json!(id), "charge", json!({"amount": 5}), Some("k"));
    let first = held_at_server(&gateway, &server, call(1)).await;
    match how {
        // Sent to the server itself, as through another replica: a
        // replica holds back only the cancels, and the session ends, of
        // calls it has in flight.
        Abandon::Cancel => {
            let cancel = json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                "params": {"requestId": 1, "reason": "timed out"}});
            let headers = [
                ("content-type", "application/json"),
                ("mcp-session-id", "s1"),
            ];
            let sent = send(Method::POST, &server.url(), &headers, cancel.to_string()).await;
            assert_eq!(sent.status, 202);
        }
        Abandon::Delete => {
            let headers = [("mcp-session-id", "s1")];
            let deleted = send(Method::DELETE, &server.url(), &headers, "").await;
            assert_eq!(deleted.status, 200);
        }
    }
    // A JSON answer is the first caller's; a stream it read is cut.
    let first = first.await;
    if answering == Answering::Json {
        let first = response(&first.unwrap());
        let kind = first["error"]["data"]["type"].as_str().unwrap_or_default();
        assert!(kind.ends_with("/attempt-outcome-unknown"), "{first}");
    }
    let retry = post(&gateway, &call(2), "s2").await;
    let retry = response(&retry);
    assert_eq!(retry["id"], 2, "{retry}");
    let kind = retry["error"]["data"]["type"].as_str().unwrap_or_default();
    assert!(
        kind.ends_with("/attempt-outcome-unknown"),
        "{answering:?} {how:?}: {retry}"
    );
    assert_eq!(server.runs("charge"), 1, "never a second run");
}

/// An agent's `notifications/cancelled` of a keyed call in flight here is
/// held back (`202`, never forwarded): the call goes on at the server, and
/// its answer is the first caller's and the retry's, the tool run once.
/// A cancel of another call passes.
async fn cancel_held_back(store: TestStore, answering: Answering) {
    let gate = Gate::new();
    let server = FakeMcp::start(answering, Some(gate.clone())).await;
    let gateway = std::sync::Arc::new(gateway(&store, &server).await);
    let call = |id| tool_call(json!(id), "charge", json!({"amount": 5}), Some("k"));
    let first = held_at_server(&gateway, &server, call(1)).await;
    let posts = server.posts().len();
    assert_eq!(post(&gateway, &cancel(1), "s1").await.status, 202);
    assert_eq!(server.posts().len(), posts, "{answering:?}: held back");
    assert_eq!(server.pending(), 1, "the call goes on");
    // Another call's, or this id in another session: passed.
    assert_eq!(post(&gateway, &cancel(9), "s1").await.status, 202);
    assert_eq!(post(&gateway, &cancel(1), "s2").await.status, 202);
    assert_eq!(server.posts().len(), posts + 2, "{answering:?}");
    gate.open(1);
    let first = response(&first.await.unwrap());
    assert_eq!(first["id"], 1, "{first}");
    assert!(first["result"].is_object(), "{answering:?}: {first}");
    let retry = response(&post(&gateway, &call(2), "s2").await);
    assert_eq!(retry["id"], 2);
    assert_eq!(retry["result"], first["result"]);
    assert_eq!(server.runs("charge"), 1, "{answering:?}");
}

/// Two replicas on one PostgreSQL: a keyed call runs at the server from
/// one, and the agent's cancel of it, then the end of its session, reach
/// the other. Both are held back there (the cancel answered `202`, the
/// `DELETE` sent on once the call has ended): the call's attempt marked it
/// in the store. A cancel of another call passes; the mark is taken off as
/// the call ends. Before, only the replica the call ran from knew it: the
/// cancel and the `DELETE` passed, and the call was cut.
#[tokio::test]
async fn an_agents_cancel_and_session_end_at_another_replica_are_held_back() {
    let store = TestStore::postgres().await;
    let gate = Gate::new();
    let server = FakeMcp::start(Answering::Json, Some(gate.clone())).await;
    let running = std::sync::Arc::new(gateway(&store, &server).await);
    let other = std::sync::Arc::new(gateway(&store, &server).await);
    let call = |id| tool_call(json!(id), "charge", json!({"amount": 5}), Some("k"));
    let first = held_at_server(&running, &server, call(1)).await;
    let posts = server.posts().len();
    assert_eq!(post(&other, &cancel(1), "s1").await.status, 202);
    assert_eq!(
        server.posts().len(),
        posts,
        "held back at the other replica"
    );
    assert_eq!(post(&other, &cancel(9), "s1").await.status, 202);
    assert_eq!(server.posts().len(), posts + 1, "another call's passes");
    let deleted = held_delete_at(&other, || !server.deletes().is_empty()).await;
    assert_eq!(server.pending(), 1, "the call goes on");
    gate.open(1);
    let first = response(&first.await.unwrap());
    assert!(first["result"].is_object(), "{first}");
    assert_eq!(deleted.await.unwrap().status, 200);
    assert_eq!(server.deletes(), ["s1"], "then the session ends");
    assert_eq!(server.runs("charge"), 1);
    crate::support::eventually(
        std::time::Duration::from_secs(10),
        "the call's mark taken off",
        || async {
            let marks = store
                .column("SELECT count(*) FROM mcp_calls_at_server")
                .await;
            marks == ["0"]
        },
    )
    .await;
}

/// The call's mark is tried again when the store refuses it for a
/// transient fault, while the call is out: a lock on the marks' table,
/// held past `database_lock_timeout`, fails the first insert (`55P03`);
/// once it is let go, a later try lands, and the agent's cancel at the
/// other replica is held back. Before, the one failed insert was logged
/// and the call stayed unmarked: the cancel passed and cut it.
#[tokio::test]
async fn a_calls_mark_refused_for_a_moment_is_written_while_the_call_is_out() {
    let store = TestStore::postgres().await;
    let TestStore::Postgres(db) = &store else {
        unreachable!()
    };
    let gate = Gate::new();
    let server = FakeMcp::start(Answering::Json, Some(gate.clone())).await;
    let start = || {
        Gateway::builder(&store, &server.url())
            .tables(ROUTE)
            .set("database_lock_timeout", "\"300ms\"")
            .start()
    };
    let running = std::sync::Arc::new(start().await);
    let other = std::sync::Arc::new(start().await);
    let holder = db.connect().await;
    holder
        .batch_execute("BEGIN; LOCK TABLE mcp_calls_at_server IN SHARE MODE")
        .await
        .unwrap();
    let call = tool_call(json!(1), "charge", json!({"amount": 5}), Some("k"));
    let first = held_at_server(&running, &server, call).await;
    // The first try failed before the call was sent (it is waited for);
    // two more seen waiting on the lock are its retries.
    let watcher = db.connect().await;
    let tries = std::sync::Mutex::new(std::collections::BTreeSet::new());
    crate::support::eventually(
        std::time::Duration::from_secs(10),
        "the mark's insert tried again",
        || async {
            let waiting = watcher
                .query(
                    "SELECT query_start::text FROM pg_stat_activity \
                     WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO mcp_calls_at_server%'",
                    &[],
                )
                .await
                .unwrap();
            let mut tries = tries.lock().unwrap();
            tries.extend(waiting.iter().map(|r| r.get::<_, String>(0)));
            tries.len() >= 2
        },
    )
    .await;
    holder.batch_execute("ROLLBACK").await.unwrap();
    crate::support::eventually(
        std::time::Duration::from_secs(10),
        "the call's mark written",
        || async {
            store
                .column("SELECT count(*) FROM mcp_calls_at_server")
                .await
                == ["1"]
        },
    )
    .await;
    let posts = server.posts().len();
    assert_eq!(post(&other, &cancel(1), "s1").await.status, 202);
    assert_eq!(
        server.posts().len(),
        posts,
        "held back at the other replica"
    );
    gate.open(1);
    let first = response(&first.await.unwrap());
    assert!(first["result"].is_object(), "{first}");
    assert_eq!(server.runs("charge"), 1);
}

/// A call at its server longer than several leases, gone `unknown` at its
/// first-byte timeout, still holds its session's `DELETE` back at another
/// replica: its replica renews the call's mark with its leases, though
/// the attempt is no longer `started`. A mark good for a lease and not
/// renewed lapses after 3 s here, and the `DELETE` would pass and cut the
/// call.
#[tokio::test]
async fn a_long_call_gone_unknown_is_held_at_other_replicas_past_its_lease() {
    let store = TestStore::postgres().await;
    let gate = Gate::new();
    let server = FakeMcp::start(Answering::Json, Some(gate.clone())).await;
    let start = || {
        Gateway::builder(&store, &server.url())
            .tables(ROUTE)
            .set("lease_ttl", "\"3s\"")
            .set("upstream_timeout", "\"1s\"")
            .set("attempt_deadline", "\"60s\"")
            .start()
    };
    let running = std::sync::Arc::new(start().await);
    let other = std::sync::Arc::new(start().await);
    let call = tool_call(json!(1), "charge", json!({"amount": 5}), Some("k"));
    let first = held_at_server(&running, &server, call).await;
    let first = response(&first.await.unwrap());
    let kind = first["error"]["data"]["type"].as_str().unwrap_or_default();
    assert!(kind.ends_with("/attempt-outcome-unknown"), "{first}");
    // Past two leases of the mark's first: only renewals keep it.
    tokio::time::sleep(std::time::Duration::from_secs(7)).await;
    assert_eq!(server.pending(), 1, "the call is still at its server");
    let deleted = held_delete_at(&other, || !server.deletes().is_empty()).await;
    gate.open(1);
    assert_eq!(deleted.await.unwrap().status, 200);
    assert_eq!(server.deletes(), ["s1"], "then the session ends");
    assert_eq!(server.runs("charge"), 1);
}

/// A keyed call answered `202` (`Prefer: respond-async`) and polled: the
/// answer is the call's, and names no session (a poll is in none; the
/// stored answer names the session of the connection the call ran in).
#[tokio::test]
async fn a_polled_call_names_no_session() {
    let store = TestStore::embedded();
    let gate = Gate::new();
    let server = FakeMcp::start(Answering::Json, Some(gate.clone())).await;
    let gateway = gateway(&store, &server).await;
    let location = polled_at(&gateway).await;
    gate.open(1);
    let poll = || send(Method::GET, &location, &[AGENT], "");
    crate::support::eventually(
        std::time::Duration::from_secs(10),
        "the polled answer",
        || async { poll().await.status == 200 },
    )
    .await;
    let polled = poll().await;
    assert_eq!(response(&polled)["id"], 1);
    assert!(response(&polled)["result"].is_object(), "{polled:?}");
    assert_eq!(polled.header("mcp-session-id"), None);
    assert_eq!(server.runs("charge"), 1);
}

/// A streamed call answered `202` and polled, live and then once
/// answered: neither poll names the session the call ran in, nor relays
/// the question its server asked there (`elicitation/create`: the client
/// whose call ran answered it); the progress and the response, under the
/// call's own id, do reach the poller.
#[tokio::test]
async fn a_polled_stream_neither_names_the_session_nor_asks_its_questions() {
    let store = TestStore::embedded();
    let gate = Gate::new();
    let event = |message: Value| format!("event: message\ndata: {message}\n\n");
    let script = vec![
        event(
            json!({"jsonrpc": "2.0", "id": 7, "method": "elicitation/create",
                     "params": {"message": "Really charge 5000?", "requestedSchema": {}}}),
        ),
        event(json!({"jsonrpc": "2.0", "method": "notifications/progress",
                     "params": {"progressToken": 1, "progress": 1}})),
        event(json!({"jsonrpc": "2.0", "id": 1,
                     "result": {"content": [{"type": "text", "text": "charged"}]}})),
    ];
    let server =
        crate::support::scripted_sse::ScriptedSse::head_held(vec![script], gate.clone()).await;
    let gateway = std::sync::Arc::new(
        Gateway::builder(&store, &server.url())
            .tables(ROUTE)
            .start()
            .await,
    );
    let location = polled_at(&gateway).await;
    gate.open(1);
    let live = {
        let location = location.clone();
        tokio::spawn(async move {
            let accept = [("accept", "text/event-stream"), AGENT];
            loop {
                let polled = send(Method::GET, &location, &accept, "").await;
                if polled.status != 202 {
                    return polled;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        })
    };
    crate::support::eventually(
        std::time::Duration::from_secs(10),
        "the poll joined the stream",
        || async { gateway.metric("idemgate_stream_joiners_total").await >= 1.0 },
    )
    .await;
    gate.open(2);
    let live = live.await.unwrap();
    let answered = send(Method::GET, &location, &[AGENT], "").await;
    for (polled, how) in [(live, "live"), (answered, "answered")] {
        assert_eq!(polled.status, 200, "{how}: {polled:?}");
        assert_eq!(polled.header("mcp-session-id"), None, "{how}");
        let body = String::from_utf8_lossy(&polled.body).into_owned();
        assert!(!body.contains("elicitation/create"), "{how}: {body}");
        assert!(body.contains("notifications/progress"), "{how}: {body}");
        assert_eq!(response(&polled)["id"], 1, "{how}: {body}");
    }
}

/// The agent's credential, which owns its calls: an anonymous call is
/// never answered later (its poll would be anyone's).
const AGENT: (&str, &str) = ("authorization", "Bearer agent");

/// Posts a keyed tool call (`id` 1) in session `s1`, preferring
/// `respond-async`, and returns where its `202` says to poll its job.
async fn polled_at(gateway: &Gateway) -> String {
    let call = tool_call(json!(1), "charge", json!({"amount": 5}), Some("k"));
    let headers = [
        AGENT,
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("mcp-session-id", "s1"),
        ("prefer", "respond-async"),
    ];
    let url = gateway.path("/mcp");
    let accepted = send(Method::POST, &url, &headers, call.to_string()).await;
    assert_eq!(accepted.status, 202, "{accepted:?}");
    gateway.path(accepted.header("location").unwrap())
}

/// A held session `DELETE` whose client leaves still counts against
/// `max_in_flight` until it is sent on: with the call and the `DELETE` in
/// flight, a third request is shed. Before, the `DELETE`'s task went on
/// uncounted once its client left, so clients leaving held `DELETE`s could
/// pile up tasks without bound. The session still ends after the call.
#[tokio::test]
async fn a_held_session_end_whose_client_left_still_counts_in_flight() {
    let store = TestStore::embedded();
    let gate = Gate::new();
    let server = FakeMcp::start(Answering::Json, Some(gate.clone())).await;
    let gateway = std::sync::Arc::new(
        Gateway::builder(&store, &server.url())
            .tables(ROUTE)
            .set("max_in_flight", "2")
            .start()
            .await,
    );
    let in_flight = || gateway.metric("idemgate_requests_in_flight");
    let call = tool_call(json!(1), "charge", json!({"amount": 5}), Some("k"));
    let first = held_at_server(&gateway, &server, call).await;
    let deleted = {
        let gateway = gateway.clone();
        tokio::spawn(async move {
            let headers = [("mcp-session-id", "s1")];
            send(Method::DELETE, &gateway.path("/mcp"), &headers, "").await
        })
    };
    let held = std::time::Duration::from_secs(10);
    crate::support::eventually(held, "the DELETE held", || async {
        in_flight().await >= 2.0
    })
    .await;
    deleted.abort();
    let _ = deleted.await;
    // Uncounted, the gauge falls to 1 as soon as the gateway sees the
    // client gone (milliseconds); counted, it stays at 2 all along.
    let leaving = std::time::Duration::from_secs(3);
    let _ = tokio::time::timeout(leaving, async {
        while in_flight().await >= 2.0 {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(in_flight().await, 2.0, "the held DELETE still counted");
    let shed = post(&gateway, &cancel(9), "s2").await;
    assert_eq!(shed.status, 503, "shed: the call and the held DELETE");
    assert!(server.deletes().is_empty());
    gate.open(1);
    assert!(response(&first.await.unwrap())["result"].is_object());
    crate::support::eventually(held, "the session ended after its call", || async {
        server.deletes() == ["s1"]
    })
    .await;
    crate::support::eventually(held, "nothing in flight", || async {
        in_flight().await == 0.0
    })
    .await;
}

/// A session's `DELETE` whose server never answers is answered `504` once
/// the attempt deadline has passed, and stops counting in flight: its
/// task keeps its client's place (above), so without a bound one
/// server that never answers a `DELETE` would keep places until every
/// request was shed.
#[tokio::test]
async fn a_session_end_the_server_never_answers_is_given_up_at_the_deadline() {
    let store = TestStore::embedded();
    let upstream = crate::support::FakeUpstream::start(|r| async move {
        if r.method == "DELETE" {
            std::future::pending::<()>().await;
        }
        crate::support::upstream::json_response(200, json!({}))
    })
    .await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .tables(ROUTE)
        .set("upstream_timeout", "\"1s\"")
        .set("attempt_deadline", "\"2s\"")
        .start()
        .await;
    let headers = [("mcp-session-id", "s1")];
    let url = gateway.path("/mcp");
    let deleting = send(Method::DELETE, &url, &headers, "");
    let deleted = tokio::time::timeout(std::time::Duration::from_secs(15), deleting)
        .await
        .expect("given up at the attempt deadline");
    assert_eq!(deleted.status, 504);
    assert_eq!(upstream.hits(), 1);
    crate::support::eventually(
        std::time::Duration::from_secs(10),
        "nothing in flight",
        || async { gateway.metric("idemgate_requests_in_flight").await == 0.0 },
    )
    .await;
}

/// Sends session `s1`'s `DELETE` to `other`, a replica that does not run
/// the session's call, and waits until it is held there: `other` asks the
/// store whether a call of the session is at its server, and asks again
/// only while one is (the asks tell it held, not merely slow). `deleted`
/// says whether the server has seen a `DELETE`.
pub(super) async fn held_delete_at(
    other: &std::sync::Arc<Gateway>,
    deleted: impl Fn() -> bool,
) -> tokio::task::JoinHandle<Reply> {
    let asks = || async {
        let asked = [r#"operation="call_at_server""#];
        other
            .metric_labelled("idemgate_store_seconds_count", &asked)
            .await
    };
    let asked = asks().await;
    let sent = {
        let other = other.clone();
        tokio::spawn(async move {
            let headers = [("mcp-session-id", "s1")];
            send(Method::DELETE, &other.path("/mcp"), &headers, "").await
        })
    };
    crate::support::eventually(
        std::time::Duration::from_secs(10),
        "the DELETE held at the other replica, asking again",
        || async { deleted() || asks().await >= asked + 2.0 },
    )
    .await;
    assert!(!deleted(), "the session's end held back");
    sent
}

/// Posts `call` through `gateway` in session `s1`, and waits until it is
/// held at `server` (gated).
async fn held_at_server(
    gateway: &std::sync::Arc<Gateway>,
    server: &FakeMcp,
    call: Value,
) -> tokio::task::JoinHandle<Reply> {
    let gateway = gateway.clone();
    let first = tokio::spawn(async move { post(&gateway, &call, "s1").await });
    crate::support::eventually(
        std::time::Duration::from_secs(10),
        "the call held at the server",
        || async { server.pending() == 1 },
    )
    .await;
    first
}

/// An agent's `notifications/cancelled` of the request `id`.
pub(super) fn cancel(id: u32) -> Value {
    json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
           "params": {"requestId": id, "reason": "timed out"}})
}

async fn an_agents_cancel_of_a_call_in_flight_is_held_back(store: TestStore) {
    cancel_held_back(store, Answering::Json).await;
}

async fn an_agents_cancel_of_a_streamed_call_in_flight_is_held_back(store: TestStore) {
    cancel_held_back(store, Answering::Stream).await;
}

/// An agent's `DELETE` of its session while a keyed call of it is in
/// flight here waits for the call: the call goes on at the server, and its
/// answer is the first caller's and the retry's, the tool run once; then
/// the session ends.
async fn session_end_held_back(store: TestStore, answering: Answering) {
    let gate = Gate::new();
    let server = FakeMcp::start(answering, Some(gate.clone())).await;
    let gateway = std::sync::Arc::new(gateway(&store, &server).await);
    let call = |id| tool_call(json!(id), "charge", json!({"amount": 5}), Some("k"));
    let first = held_at_server(&gateway, &server, call(1)).await;
    let deleted = {
        let gateway = gateway.clone();
        tokio::spawn(async move {
            let headers = [("mcp-session-id", "s1")];
            send(Method::DELETE, &gateway.path("/mcp"), &headers, "").await
        })
    };
    // The DELETE is served (held, or sent on: then the server has it).
    crate::support::eventually(
        std::time::Duration::from_secs(10),
        "the DELETE at the gateway",
        || async {
            !server.deletes().is_empty()
                || gateway.metric("idemgate_requests_in_flight").await >= 2.0
        },
    )
    .await;
    assert!(server.deletes().is_empty(), "{answering:?}: held back");
    assert_eq!(server.pending(), 1, "the call goes on");
    // Another session's end is not held.
    let headers = [("mcp-session-id", "s2")];
    let other = send(Method::DELETE, &gateway.path("/mcp"), &headers, "").await;
    assert_eq!(other.status, 200);
    assert_eq!(server.deletes(), ["s2"]);
    gate.open(1);
    let first = response(&first.await.unwrap());
    assert_eq!(first["id"], 1, "{first}");
    assert!(first["result"].is_object(), "{answering:?}: {first}");
    assert_eq!(deleted.await.unwrap().status, 200);
    assert_eq!(server.deletes(), ["s2", "s1"], "then the session ends");
    let retry = response(&post(&gateway, &call(2), "s3").await);
    assert_eq!(retry["id"], 2);
    assert_eq!(retry["result"], first["result"]);
    assert_eq!(server.runs("charge"), 1, "{answering:?}");
}

async fn an_agents_session_end_waits_for_its_call_in_flight(store: TestStore) {
    session_end_held_back(store, Answering::Json).await;
}

async fn an_agents_session_end_waits_for_its_streamed_call_in_flight(store: TestStore) {
    session_end_held_back(store, Answering::Stream).await;
}

async fn a_cancelled_call_is_unknown_not_its_cancellation(store: TestStore) {
    abandoned(store, Answering::Json, Abandon::Cancel).await;
}

async fn a_cancelled_streamed_call_is_unknown_not_its_cancellation(store: TestStore) {
    abandoned(store, Answering::Stream, Abandon::Cancel).await;
}

async fn a_call_whose_session_ended_is_unknown(store: TestStore) {
    abandoned(store, Answering::Json, Abandon::Delete).await;
}

async fn a_streamed_call_whose_session_ended_is_unknown(store: TestStore) {
    abandoned(store, Answering::Stream, Abandon::Delete).await;
}

async fn a_keyed_batch_is_refused_and_an_error_answer_is_the_tools(store: TestStore) {
    let server = FakeMcp::start(Answering::Json, None).await;
    let gateway = gateway(&store, &server).await;
    let batch = json!([tool_call(json!(1), "charge", json!({}), Some("b"))]);
    let reply = post(&gateway, &batch, "s").await;
    assert_eq!(reply.status, 400);
    assert_eq!(reply.problem(), "keyed-batch");
    assert_eq!(server.runs("charge"), 0);
    // The server's JSON-RPC error, its code not retryable: the call's answer.
    let flaky = tool_call(json!(2), "flaky", json!({}), Some("f"));
    let first = response(&post(&gateway, &flaky, "s").await);
    assert_eq!(first["error"]["code"], -32603);
    let again = response(
        &post(
            &gateway,
            &tool_call(json!(3), "flaky", json!({}), Some("f")),
            "s",
        )
        .await,
    );
    assert_eq!(again["id"], 3);
    assert_eq!(again["error"], first["error"]);
    assert_eq!(server.runs("flaky"), 1);
}

/// What a call's key meets, told as a JSON-RPC error of that call: its key
/// missing on a route that requires one, a call in progress past
/// `hold_timeout`, an outcome unknown.
async fn refusals_are_json_rpc_errors_of_the_call(store: TestStore) {
    let gate = Gate::new();
    let server = FakeMcp::start(Answering::Json, Some(gate.clone())).await;
    let gateway = std::sync::Arc::new(
        Gateway::builder(&store, &server.url())
            .set("hold_timeout", "\"300ms\"")
            .set("upstream_timeout", "\"2s\"")
            .tables(&format!("{ROUTE}require_key = true\n"))
            .start()
            .await,
    );
    let problem = |reply: &Reply, id: i64, slug: &str| {
        let error = response(reply);
        assert_eq!(error["id"], id, "{error}");
        let kind = error["error"]["data"]["type"].as_str().unwrap_or_default();
        assert!(kind.ends_with(slug), "{slug}: {error}");
    };
    let unkeyed = post(
        &gateway,
        &tool_call(json!(1), "charge", json!({}), None),
        "s",
    )
    .await;
    problem(&unkeyed, 1, "/idempotency-key-missing");
    let first = {
        let gateway = gateway.clone();
        tokio::spawn(async move {
            post(
                &gateway,
                &tool_call(json!(2), "charge", json!({}), Some("k")),
                "s",
            )
            .await
        })
    };
    crate::support::eventually(
        std::time::Duration::from_secs(10),
        "the call in flight",
        || async { server.posts().len() == 1 },
    )
    .await;
    let held = post(
        &gateway,
        &tool_call(json!(3), "charge", json!({}), Some("k")),
        "s",
    )
    .await;
    problem(&held, 3, "/request-in-progress");
    // The first call falls silent past upstream_timeout: its outcome unknown.
    problem(&first.await.unwrap(), 2, "/attempt-outcome-unknown");
    let unknown = post(
        &gateway,
        &tool_call(json!(4), "charge", json!({}), Some("k")),
        "s",
    )
    .await;
    problem(&unknown, 4, "/attempt-outcome-unknown");
    gate.open(1);
    assert_eq!(server.posts().len(), 1, "nothing ran but the first call");
}

/// A server's error answer with one of the route's retryable codes had no
/// effect: passed on uncommitted, and the retry calls the tool again. A
/// batch without a keyed call passes through.
async fn a_retryable_error_code_runs_again_and_an_unkeyed_batch_passes(store: TestStore) {
    let server = FakeMcp::start(Answering::Json, None).await;
    let gateway = Gateway::builder(&store, &server.url())
        .tables(&format!("{ROUTE}retryable_rpc_codes = [-32603]\n"))
        .start()
        .await;
    for id in [1, 2] {
        let call = tool_call(json!(id), "flaky", json!({}), Some("again"));
        let error = response(&post(&gateway, &call, "s").await);
        assert_eq!(
            (error["id"].clone(), error["error"]["code"].clone()),
            (json!(id), json!(-32603))
        );
    }
    assert_eq!(
        server.runs("flaky"),
        2,
        "not kept: the retry ran the tool again"
    );
    let batch = json!([
        {"jsonrpc": "2.0", "id": 7, "method": "tools/list"},
        tool_call(json!(8), "lookup", json!({}), None)
    ]);
    let reply = post(&gateway, &batch, "s").await;
    assert_eq!(reply.status, 202, "the fake server's own answer to a batch");
    assert_eq!(reply.header("idempotency-job"), None, "never a job");
    assert_eq!(
        server.posts().last().unwrap(),
        &batch,
        "the batch reached the server"
    );
}

/// A message whose parse would hold more than the whole memory budget (a
/// tool call whose arguments are 40 Ki small values, in a 4 MiB budget) is
/// refused before the server sees it: `413`, a problem rather than a
/// JSON-RPC error, the message not having been parsed (docs/design.md §18).
async fn a_message_whose_parse_outgrows_the_budget_is_refused(store: TestStore) {
    let server = FakeMcp::start(Answering::Json, None).await;
    let gateway = Gateway::builder(&store, &server.url())
        .set("memory_budget", "\"4MiB\"")
        .tables(&format!("{ROUTE}body_limit = \"1MiB\"\n"))
        .start()
        .await;
    let zeros = vec![0; 40 * 1024];
    let call = tool_call(json!(1), "charge", json!({ "items": zeros }), Some("big"));
    let reply = post(&gateway, &call, "s-1").await;
    assert_eq!(reply.status, 413, "{reply:?}");
    assert_eq!(reply.problem(), "request-too-large");
    assert!(server.posts().is_empty(), "nothing reached the server");
}

crate::on_each_deployment!(
    [embedded, postgres]
    a_retryable_error_code_runs_again_and_an_unkeyed_batch_passes,
    refusals_are_json_rpc_errors_of_the_call,
    a_retried_call_runs_once_and_answers_its_own_id,
    other_methods_are_never_keyed,
    the_same_key_with_other_arguments_is_a_json_rpc_error,
    concurrent_calls_with_one_key_run_the_tool_once,
    concurrent_calls_answered_as_a_stream_run_the_tool_once,
    a_new_session_gets_the_answer_of_the_old_one,
    a_replay_never_asks_the_first_callers_questions,
    a_replay_of_messages_written_over_several_lines_asks_nothing,
    a_retry_in_the_calls_session_is_asked_though_its_server_named_none,
    a_resumed_tool_call_loses_no_event,
    a_stream_closed_before_its_response_is_taken_up_again,
    a_keyed_batch_is_refused_and_an_error_answer_is_the_tools,
    a_message_whose_parse_outgrows_the_budget_is_refused,
    a_call_the_server_refused_runs_in_the_next_session,
    a_cancelled_call_is_unknown_not_its_cancellation,
    an_agents_cancel_of_a_call_in_flight_is_held_back,
    an_agents_cancel_of_a_streamed_call_in_flight_is_held_back,
    an_agents_session_end_waits_for_its_call_in_flight,
    an_agents_session_end_waits_for_its_streamed_call_in_flight,
    a_cancelled_streamed_call_is_unknown_not_its_cancellation,
    a_call_whose_session_ended_is_unknown,
    a_streamed_call_whose_session_ended_is_unknown,
);

/// The official `mcp` Python SDK's server (`tests/clients/mcp_server.py`,
/// with `args` after its port and runs file) behind the gateway started
/// with the worked configuration (`config/mcp/idemgate.toml`) as written,
/// on the embedded store.
struct OfficialSdk {
    python: std::path::PathBuf,
    /// The gateway's MCP endpoint.
    url: String,
    runs: std::path::PathBuf,
    _dir: tempfile::TempDir,
    /// The server's process group, and the server (killed when dropped).
    _server: (crate::support::process::ProcessGroup, tokio::process::Child),
    _gateway: tokio::process::Child,
    /// The gateway's standard output, kept open: it writes there.
    _stdout: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl OfficialSdk {
    async fn start(args: &[&str]) -> OfficialSdk {
        use tokio::io::AsyncBufReadExt;
        let python = tokio::task::spawn_blocking(|| {
            crate::support::python::venv("mcp-venv", &["mcp>=2,<3"], "import mcp.server.mcpserver")
                .join("python")
        })
        .await
        .unwrap();
        let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let dir = tempfile::tempdir().unwrap();
        let runs = dir.path().join("runs.txt");
        let port = crate::support::redis::free_port().await;
        let server = tokio::process::Command::new(&python)
            .arg(repo.join("tests/clients/mcp_server.py"))
            .arg(port.to_string())
            .arg(&runs)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let server = (crate::support::process::ProcessGroup::of(&server), server);
        let mut gateway = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args(["--config", "config/mcp/idemgate.toml", "serve"])
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .arg("--upstream")
            .arg(format!("http://127.0.0.1:{port}"))
            .arg("--embedded-path")
            .arg(dir.path().join("idemgate.db"))
            .current_dir(repo)
            .env_remove("IDEMGATE_CONFIG")
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(gateway.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(std::time::Duration::from_secs(30), lines.next_line())
            .await
            .expect("the gateway did not start within 30 s")
            .unwrap()
            .unwrap();
        let url = line
            .strip_prefix("idemgate listening on ")
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("{line}"))
            .to_owned();
        crate::support::eventually(
            std::time::Duration::from_secs(20),
            "the MCP server",
            || async {
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_ok()
            },
        )
        .await;
        OfficialSdk {
            python,
            url: format!("{url}/mcp"),
            runs,
            _dir: dir,
            _server: server,
            _gateway: gateway,
            _stdout: lines,
        }
    }

    /// Runs the agent `script` (Python source) as the agent holding
    /// `token`: what it printed.
    async fn agent(&self, script: &str, token: &str) -> String {
        let out = crate::support::python::run_client(
            "agent",
            tokio::process::Command::new(&self.python)
                .args(["-c", script])
                .env("MCP_URL", &self.url)
                .env("MCP_TOKEN", token),
        )
        .await;
        String::from_utf8(out).unwrap().trim_end().to_owned()
    }

    /// How many times the server's tools ran.
    fn ran(&self) -> usize {
        std::fs::read_to_string(&self.runs).unwrap().lines().count()
    }
}

/// The official `mcp` Python SDK (2.x), client and server over Streamable
/// HTTP, the gateway between them started with the worked configuration
/// (`config/mcp/idemgate.toml`) as written: `docs/agents.md`'s agent, run twice
/// (two sessions, as an agent that crashed and reconnected), runs the tool
/// once and both print its result; another agent's token is another owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_mcp_sdk_calls_a_tool_once_across_sessions() {
    let sdk = OfficialSdk::start(&[]).await;
    let agent = crate::support::docs::block("agents-mcp");
    let first = sdk.agent(&agent, "agent-7").await;
    assert_eq!(first, "charged 5000 to acct-9 (run 1)");
    assert_eq!(
        sdk.agent(&agent, "agent-7").await,
        first,
        "the reconnected agent's call replayed"
    );
    assert_eq!(sdk.ran(), 1, "the tool ran once");
    // Another agent's key of the same name is its own: its call runs.
    assert_eq!(
        sdk.agent(&agent, "agent-8").await,
        "charged 5000 to acct-9 (run 2)"
    );
    assert_eq!(sdk.ran(), 2);
}

/// The official SDK's server with an event store, whose long tool closes
/// its call's stream before it answers (`close_sse_stream`, the 2025-11-25
/// transport's polling), and the official client: the gateway's attempt
/// takes the stream up again (docs/design.md §19, "A stream its server
/// closes before the response"), the agent gets its result, and its retry
/// in a new session replays it, the tool having run once. Before, the
/// attempt was left unknown and the retry was told so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_mcp_sdk_polling_a_long_call_runs_it_once() {
    let sdk = OfficialSdk::start(&["polling"]).await;
    let agent = crate::support::docs::block("agents-mcp")
        .replace("\"charge\"", "\"long_charge\"")
        .replace("order-42-charge", "order-43-long-charge");
    let first = sdk.agent(&agent, "agent-7").await;
    assert_eq!(first, "charged 5000 to acct-9 (run 1)");
    assert_eq!(sdk.agent(&agent, "agent-7").await, first, "replayed");
    assert_eq!(sdk.ran(), 1, "the tool ran once");
}
