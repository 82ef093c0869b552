//! MCP tool calls on a route that resends unknown attempts (`reconcile =
//! "resend"`, a server that deduplicates by the forwarded key): a resend is
//! at the server as the call was, and its agent's cancel and session end
//! are held back while it is (`docs/design.md` §19, "An agent's cancel").

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::mcp::{cancel, held_delete_at, post, response, ROUTE};
use crate::support::mcp::tool_call;
use crate::support::upstream::{json_response, FakeUpstream};
use crate::support::{eventually, Gate, Gateway, TestStore};

/// What the server does with the first sending of the call.
#[derive(Clone, Copy, PartialEq)]
enum First {
    /// Its connection breaks: the attempt is `unknown`, its task over.
    Dropped,
    /// Held at the gate: the attempt goes `unknown` at its silence, the
    /// call still out.
    Held,
}

/// What the server was sent.
#[derive(Default)]
struct Seen {
    calls: AtomicUsize,
    cancels: AtomicUsize,
    deletes: AtomicUsize,
}

impl Seen {
    fn of(counter: &AtomicUsize) -> usize {
        counter.load(Ordering::SeqCst)
    }
}

/// A server that deduplicates by key: the call's first sending is
/// `first`; a resend while it is held is answered `409` ("in progress"),
/// and a resend after it broke is held at `gate`, then answered.
async fn server(first: First, gate: &Gate) -> (FakeUpstream, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let upstream = FakeUpstream::start({
        let (gate, seen) = (gate.clone(), seen.clone());
        move |r| {
            let (gate, seen) = (gate.clone(), seen.clone());
            async move {
                let message: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
                if r.method == "DELETE" {
                    seen.deletes.fetch_add(1, Ordering::SeqCst);
                    return json_response(200, json!({}));
                }
                if message["method"] == "notifications/cancelled" {
                    seen.cancels.fetch_add(1, Ordering::SeqCst);
                }
                if message["method"] != "tools/call" {
                    return json_response(202, json!({}));
                }
                let resend = seen.calls.fetch_add(1, Ordering::SeqCst) > 0;
                match (first, resend) {
                    (First::Dropped, false) => panic!("the server drops the call's connection"),
                    (First::Held, true) => return json_response(409, json!({"in": "progress"})),
                    _ => gate.pass().await,
                }
                let result = json!({"content": [{"type": "text", "text": "charged"}]});
                json_response(
                    200,
                    json!({"jsonrpc": "2.0", "id": message["id"], "result": result}),
                )
            }
        }
    })
    .await;
    (upstream, seen)
}

/// Two replicas on `store` whose route resends, silent-timeout `silence`.
async fn replicas(store: &TestStore, upstream: &FakeUpstream, silence: &str) -> [Arc<Gateway>; 2] {
    let start = || {
        Gateway::builder(store, &upstream.url())
            .tables(&format!("{ROUTE}reconcile = \"resend\"\n"))
            .set("upstream_timeout", &format!("\"{silence}\""))
            .set("attempt_deadline", "\"30s\"")
            .start()
    };
    [Arc::new(start().await), Arc::new(start().await)]
}

fn call(id: u32) -> Value {
    tool_call(json!(id), "charge", json!({"amount": 5}), Some("k"))
}

/// The call's connection breaks after it was sent (its attempt `unknown`,
/// its task over), and the resend is held at the server. While it is, the
/// agent's cancel of the call is held back at the replica that resent it
/// and at another one (the resend marks the call in the store), and so is
/// the session's end; the resend's answer settles the job, the retry gets
/// it, the tool run once, and the mark is taken off. Before, a resend was
/// known nowhere: the cancels and the `DELETE` reached the server and cut
/// it. Its stored answer names the session; an operator's view of the job
/// shows that it does, not the session.
#[tokio::test]
async fn a_resent_call_holds_its_agents_cancel_back_at_every_replica() {
    let store = TestStore::postgres().await;
    let gate = Gate::new();
    let (upstream, seen) = server(First::Dropped, &gate).await;
    let [running, other] = replicas(&store, &upstream, "30s").await;
    let first = response(&post(&running, &call(1), "s1").await);
    let kind = first["error"]["data"]["type"].as_str().unwrap_or_default();
    assert!(kind.ends_with("/attempt-outcome-unknown"), "{first}");
    eventually(
        Duration::from_secs(10),
        "the call resent, held at the server",
        || async { Seen::of(&seen.calls) == 2 },
    )
    .await;
    assert_eq!(post(&running, &cancel(1), "s1").await.status, 202);
    assert_eq!(post(&other, &cancel(1), "s1").await.status, 202);
    assert_eq!(Seen::of(&seen.cancels), 0, "both cancels held back");
    assert_eq!(post(&other, &cancel(9), "s1").await.status, 202);
    assert_eq!(Seen::of(&seen.cancels), 1, "another call's passes");
    let deleted = held_delete_at(&other, || Seen::of(&seen.deletes) > 0).await;
    gate.open(1);
    assert_eq!(deleted.await.unwrap().status, 200, "then the session ends");
    eventually(
        Duration::from_secs(10),
        "the resend's answer committed, its mark taken off",
        || async {
            let settled = "SELECT a.state || '/' || \
                           (SELECT count(*) FROM mcp_calls_at_server) FROM attempts a";
            store.column(settled).await == ["succeeded/0"]
        },
    )
    .await;
    let retry = response(&post(&other, &call(2), "s2").await);
    assert_eq!(retry["id"], 2);
    assert_eq!(retry["result"]["content"][0]["text"], "charged", "{retry}");
    assert_eq!(Seen::of(&seen.calls), 2, "the call and its resend");
    let job = store.column("SELECT id::text FROM jobs").await;
    let shown = running.job(&job[0]).await;
    let headers = shown["response"]["headers"].as_array().unwrap();
    let session = headers.iter().find(|h| h[0] == "mcp-session-id");
    let redacted = json!(["mcp-session-id", "[redacted]"]);
    assert_eq!(session, Some(&redacted), "{shown}");
}

/// The call goes `unknown` at its silence while still at its server, and
/// is resent at once: the resend, answered `409` ("in progress"), ends and
/// takes its own mark off, not the call's. So the agent's cancel at another
/// replica is still held back until the call answers. A resend marked
/// under the attempt's own id would have taken the call's mark off.
#[tokio::test]
async fn a_resend_ending_leaves_the_mark_of_the_call_still_out() {
    let store = TestStore::postgres().await;
    let gate = Gate::new();
    let (upstream, seen) = server(First::Held, &gate).await;
    let [running, other] = replicas(&store, &upstream, "300ms").await;
    let first = response(&post(&running, &call(1), "s1").await);
    let kind = first["error"]["data"]["type"].as_str().unwrap_or_default();
    assert!(kind.ends_with("/attempt-outcome-unknown"), "{first}");
    eventually(
        Duration::from_secs(10),
        "a resend answered, and only the call's mark left",
        || async {
            let asked = "SELECT lookups || '/' || \
                         (SELECT count(*) FROM mcp_calls_at_server) FROM attempts";
            let asked = store.column(asked).await;
            asked.len() == 1 && !asked[0].starts_with("0/") && asked[0].ends_with("/1")
        },
    )
    .await;
    assert_eq!(post(&other, &cancel(1), "s1").await.status, 202);
    assert_eq!(Seen::of(&seen.cancels), 0, "held back: the call is out");
    gate.open(1);
    eventually(
        Duration::from_secs(10),
        "the call's late answer committed",
        || async { store.column("SELECT state FROM jobs").await == ["completed"] },
    )
    .await;
    let retry = response(&post(&other, &call(2), "s2").await);
    assert_eq!(retry["result"]["content"][0]["text"], "charged", "{retry}");
}
