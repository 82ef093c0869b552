//! Failover and hedging across upstreams, gated by proven contracts: every
//! new attempt stays under the same job, and exactly one result commits.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use serde_json::Value;
use tokio::sync::Barrier;

use crate::support::chat::{Drift, Provider, Timing};
use crate::support::gateway::Builder;
use crate::support::upstream::{echo_response, json_response};
use crate::support::{
    eventually, post, send, sha256_hex, FakeUpstream, Gate, Gateway, Reply, TestStore,
};

const WAIT: Duration = Duration::from_secs(10);
const CHAT_BODY: &str = r#"{"model": "default", "temperature": 0, "messages": [{"role": "user", "content": "Capital of France?"}]}"#;
const CONTRACT: &str = r#"
[contracts.chat-json]
schema = "response.schema.json"
[contracts.chat-json.embedded]
pointer = "/choices/0/message/content"
schema = "answer.schema.json"
[[contracts.chat-json.probes]]
name = "capital-of-france"
path = "/v1/chat/completions"
body = "probe-capital.json"
"#;

fn chat_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("config/chat")
}

fn upstream_table(name: &str, url: &str) -> String {
    format!("[[upstreams]]\nname = {name:?}\nurl = {url:?}\n")
}

/// Two named upstreams `a` and `b`, the chat contract, and a route using
/// both with `route_extra` added.
pub(crate) fn chat_gateway(store: &TestStore, a: &str, b: &str, route_extra: &str) -> Builder {
    Gateway::builder(store, "http://unused")
        .unset("upstreams")
        .set("probe_interval", "\"200ms\"")
        .files_from(&chat_dir())
        .tables(&upstream_table("a", a))
        .tables(&upstream_table("b", b))
        .tables(CONTRACT)
        .tables(&format!(
            "[[routes]]\nname = \"chat\"\npath_prefix = \"/v1/chat\"\nupstreams = [\"a\", \"b\"]\ncontract = \"chat-json\"\n{route_extra}"
        ))
}

async fn chat(gateway: &Gateway, key: &str) -> Reply {
    post(&gateway.path("/v1/chat/completions"), key, CHAT_BODY).await
}

/// Waits until the admin listener reports `upstream` as eligible (proven by
/// its probes) or not.
async fn probed(gateway: &Gateway, upstream: &str, passed: bool) {
    eventually(
        WAIT,
        &format!("{upstream} to be probed as eligible={passed}"),
        || async {
            let status = gateway
                .admin(Method::GET, "/admin/v1/upstreams", "")
                .await
                .json();
            status["upstreams"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|u| u["name"] == upstream)
                .flat_map(|u| u["contracts"].as_array().cloned().unwrap_or_default())
                .any(|c| c["eligible"] == passed)
        },
    )
    .await;
}

fn attempts(job: &Value) -> Vec<Value> {
    job["attempts"].as_array().unwrap().clone()
}

fn model(reply: &Reply) -> String {
    reply.json()["model"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn reverse_order_finish_the_hedge_commits_and_the_primary_is_superseded() {
    let store = TestStore::postgres().await;
    let slow = Gate::new();
    let a = Provider::start("a", Drift::None, Timing::Gate(slow.clone())).await;
    let b = Provider::start("b", Drift::None, Timing::Now).await;
    let gateway = chat_gateway(
        &store,
        &a.url(),
        &b.url(),
        "side_effect_free = true\nhedge_after = \"500ms\"\n",
    )
    .start()
    .await;
    probed(&gateway, "b", true).await;

    // A (primary) leaves first and stays silent; B is hedged at 500 ms and answers.
    let reply = chat(&gateway, "reverse-1").await;
    assert_eq!(reply.status, 200);
    assert_eq!(model(&reply), "b", "the hedge's answer is returned");
    let job_id = reply.job().unwrap();
    eventually(WAIT, "the primary to be superseded", || async {
        let job = gateway.job(&job_id).await;
        attempts(&job)[0]["state"] == "superseded"
    })
    .await;
    let job = gateway.job(&job_id).await;
    let list = attempts(&job);
    assert_eq!(
        (list[0]["upstream"].as_str(), list[1]["upstream"].as_str()),
        (Some("a"), Some("b"))
    );
    assert_eq!(list[1]["state"], "succeeded");
    assert_eq!(job["completed_by"], list[1]["id"]);
    assert_eq!(gateway.metric("idemgate_hedges_total").await, 1.0);
    assert_eq!(
        list[0]["job_version"], list[1]["job_version"],
        "a hedge races under the same version"
    );

    // A's late answer touches nothing.
    slow.open(1);
    let replay = chat(&gateway, "reverse-1").await;
    assert_eq!(replay.body, reply.body);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!((a.calls().len(), b.calls().len()), (1, 1));
    assert_eq!(
        gateway.job(&job_id).await["attempts"][0]["state"],
        "superseded"
    );
}

#[tokio::test]
async fn answers_a_millisecond_apart_always_make_exactly_one_winner() {
    let store = TestStore::postgres().await;
    let together = Arc::new(Barrier::new(2));
    let a = Provider::start("a", Drift::None, Timing::Barrier(together.clone())).await;
    let b = Provider::start("b", Drift::None, Timing::Barrier(together)).await;
    let gateway = chat_gateway(
        &store,
        &a.url(),
        &b.url(),
        "side_effect_free = true\nhedge_after = \"20ms\"\n",
    )
    .start()
    .await;
    probed(&gateway, "b", true).await;
    for round in 0..12 {
        let key = format!("photo-finish-{round}");
        let reply = chat(&gateway, &key).await;
        assert_eq!(reply.status, 200, "round {round}");
        let job_id = reply.job().unwrap();
        eventually(WAIT, "both attempts to be settled", || async {
            let job = gateway.job(&job_id).await;
            attempts(&job).iter().all(|a| a["state"] != "started")
        })
        .await;
        let job = gateway.job(&job_id).await;
        let states: Vec<_> = attempts(&job)
            .iter()
            .map(|a| a["state"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(
            states.iter().filter(|s| *s == "succeeded").count(),
            1,
            "round {round}: {states:?}"
        );
        assert_eq!(
            states.iter().filter(|s| *s == "superseded").count(),
            1,
            "round {round}: {states:?}"
        );
        assert_eq!(
            job["response"]["body"].as_str().unwrap().as_bytes(),
            reply.body.as_ref(),
            "round {round}"
        );
        let replay = chat(&gateway, &key).await;
        assert_eq!(
            replay.body, reply.body,
            "round {round}: the replay equals what the first client got"
        );
    }
}

#[tokio::test]
async fn a_fallback_failing_its_probes_is_never_used_until_they_pass() {
    let store = TestStore::postgres().await;
    let closed = crate::support::redis::free_port().await;
    let b = Provider::start("b", Drift::Prose, Timing::Now).await;
    let gateway = chat_gateway(&store, &format!("http://127.0.0.1:{closed}"), &b.url(), "")
        .start()
        .await;
    probed(&gateway, "b", false).await;

    let refused = chat(&gateway, "gated-1").await;
    assert_eq!(refused.status, 502);
    assert_eq!(refused.problem(), "upstream-unreachable");
    assert!(
        b.calls().is_empty(),
        "a fallback that fails its probes is never a failover target"
    );

    b.set(Drift::None);
    probed(&gateway, "b", true).await;
    let served = chat(&gateway, "gated-2").await;
    assert_eq!(served.status, 200);
    assert_eq!(model(&served), "b");
    let job = gateway.job(&served.job().unwrap()).await;
    let list = attempts(&job);
    assert_eq!(list.len(), 2);
    assert_eq!(
        (list[0]["state"].as_str(), list[0]["upstream"].as_str()),
        (Some("failed"), Some("a"))
    );
    assert_eq!(
        (list[1]["state"].as_str(), list[1]["upstream"].as_str()),
        (Some("succeeded"), Some("b"))
    );
    assert_eq!(b.calls()[0].header("idempotency-attempt"), Some("2"));
    assert_eq!(
        b.calls()[0].header("idempotency-key"),
        served.job().as_deref(),
        "one identity across attempts"
    );
}

#[tokio::test]
async fn a_response_breaking_the_contract_is_rejected_and_the_next_upstream_tried() {
    let store = TestStore::postgres().await;
    let a = Provider::start("a", Drift::None, Timing::Now).await;
    let b = Provider::start("b", Drift::None, Timing::Now).await;
    let free = "side_effect_free = true\n";
    let gateway = chat_gateway(&store, &a.url(), &b.url(), free).start().await;
    probed(&gateway, "b", true).await;
    for (drift, why) in [
        (Drift::WrongType, "/created"),
        (Drift::MissingField, "choices"),
        (Drift::Prose, "not JSON"),
    ] {
        a.set(drift);
        let key = format!("drift-{drift:?}");
        let reply = chat(&gateway, &key).await;
        assert_eq!(reply.status, 200, "{drift:?}");
        assert_eq!(model(&reply), "b", "{drift:?}: the next upstream answered");
        let job = gateway.job(&reply.job().unwrap()).await;
        let list = attempts(&job);
        assert_eq!(list[0]["state"], "rejected", "{drift:?}");
        assert_eq!(list[0]["upstream"], "a");
        let detail = list[0]["detail"].as_str().unwrap();
        assert!(detail.contains(why), "{drift:?}: {detail}");
        assert_eq!(list[1]["state"], "succeeded");
        let replay = chat(&gateway, &key).await;
        assert_eq!(
            replay.body, reply.body,
            "{drift:?}: a rejected answer is never replayed"
        );
    }
}

#[tokio::test]
async fn with_every_upstream_breaking_the_contract_the_client_gets_502() {
    let store = TestStore::postgres().await;
    let a = Provider::start("a", Drift::Prose, Timing::Now).await;
    let gateway = Gateway::builder(&store, "http://unused")
        .unset("upstreams")
        .files_from(&chat_dir())
        .tables(&upstream_table("a", &a.url()))
        .tables(CONTRACT)
        .tables("[[routes]]\npath_prefix = \"/v1/chat\"\ncontract = \"chat-json\"\nside_effect_free = true\n")
        .start()
        .await;
    let reply = chat(&gateway, "all-bad").await;
    assert_eq!(reply.status, 502);
    assert_eq!(reply.problem(), "upstream-contract-violation");
    let job = gateway.job(&reply.job().unwrap()).await;
    assert_eq!(job["state"], "open", "a rejected attempt is a safe failure");
}

/// On a route not declared `side_effect_free`, a `2xx` that breaks the
/// contract says the upstream acted: the attempt is `unknown`, nothing
/// fails over to the next upstream (eligible as it is), and the retry is
/// told the outcome is unknown, not run again. Before, the breach was a
/// safe failure on every route: `b` ran the request too, and on a route
/// with effects (a charge) that was a second charge.
#[tokio::test]
async fn a_breach_on_a_route_with_effects_is_unknown_and_never_failed_over() {
    let store = TestStore::postgres().await;
    let a = Provider::start("a", Drift::Prose, Timing::Now).await;
    let b = Provider::start("b", Drift::None, Timing::Now).await;
    let gateway = chat_gateway(&store, &a.url(), &b.url(), "").start().await;
    probed(&gateway, "b", true).await;
    let before = b.calls().len();
    let reply = chat(&gateway, "acted").await;
    assert_eq!(reply.status, 502, "{reply:?}");
    assert_eq!(reply.problem(), "upstream-contract-violation");
    let job = gateway.job(&reply.job().unwrap()).await;
    assert_eq!(job["state"], "unknown", "{job}");
    assert_eq!(attempts(&job).len(), 1, "{job}");
    let retry = chat(&gateway, "acted").await;
    assert_eq!(retry.status, 409);
    assert_eq!(retry.problem(), "attempt-outcome-unknown");
    assert_eq!(b.calls().len(), before, "nothing sent to b");
}

#[tokio::test]
async fn no_hedging_on_a_route_not_declared_side_effect_free() {
    let store = TestStore::postgres().await;
    let err = chat_gateway(
        &store,
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
        "hedge_after = \"100ms\"\n",
    )
    .start_and_fail()
    .await;
    assert!(
        err.contains("routes[0].hedge_after") && err.contains("side_effect_free"),
        "{err}"
    );

    // Without hedging, an unknown outcome blocks as in the core: no failover.
    let silent = Gate::new();
    let a = Provider::start("a", Drift::None, Timing::Gate(silent.clone())).await;
    let b = Provider::start("b", Drift::None, Timing::Now).await;
    let gateway = chat_gateway(&store, &a.url(), &b.url(), "")
        .set("upstream_timeout", "\"300ms\"")
        .start()
        .await;
    probed(&gateway, "b", true).await;
    let reply = chat(&gateway, "no-hedge").await;
    assert_eq!(reply.status, 504);
    assert_eq!(reply.problem(), "attempt-outcome-unknown");
    let retry = chat(&gateway, "no-hedge").await;
    assert_eq!(retry.status, 409);
    assert!(b.calls().is_empty(), "an unknown outcome never fails over");
    silent.open(1);
}

#[tokio::test]
async fn on_a_side_effect_free_route_an_unknown_attempt_may_be_followed_by_another() {
    let store = TestStore::postgres().await;
    let silent = Gate::new();
    let a = Provider::start("a", Drift::None, Timing::Gate(silent.clone())).await;
    let b = Provider::start("b", Drift::None, Timing::Now).await;
    // The hedge timer is far off: what moves on to b is a's timeout.
    let gateway = chat_gateway(
        &store,
        &a.url(),
        &b.url(),
        "side_effect_free = true\nhedge_after = \"30s\"\n",
    )
    .set("upstream_timeout", "\"300ms\"")
    .start()
    .await;
    probed(&gateway, "b", true).await;
    let reply = chat(&gateway, "unknown-then-b").await;
    assert_eq!(reply.status, 200);
    assert_eq!(model(&reply), "b");
    let job = gateway.job(&reply.job().unwrap()).await;
    assert_eq!(job["state"], "completed");
    let list = attempts(&job);
    assert_eq!(list[1]["state"], "succeeded");
    assert_eq!(job["completed_by"], list[1]["id"]);
    eventually(WAIT, "the silent primary to be superseded", || async {
        let job = gateway.job(&reply.job().unwrap()).await;
        attempts(&job)[0]["state"] == "superseded"
    })
    .await;
    silent.open(1);
}

#[tokio::test]
async fn failover_within_one_request_on_refusal_and_retryable_status() {
    let store = TestStore::embedded();
    let closed = crate::support::redis::free_port().await;
    let fallback = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, "http://unused")
        .set(
            "upstreams",
            &format!("[\"http://127.0.0.1:{closed}\", {:?}]", fallback.url()),
        )
        .start()
        .await;
    let reply = post(&gateway.path("/v1/charges"), "failover-1", "{}").await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["attempt"], "2");
    let job = gateway.job(&reply.job().unwrap()).await;
    let list = attempts(&job);
    assert_eq!(
        (list[0]["upstream"].as_str(), list[0]["state"].as_str()),
        (Some("primary"), Some("failed"))
    );
    assert_eq!(
        (list[1]["upstream"].as_str(), list[1]["state"].as_str()),
        (Some("fallback-1"), Some("succeeded"))
    );
    assert_eq!(gateway.metric("idemgate_failovers_total").await, 1.0);

    let busy =
        FakeUpstream::start(
            |_| async move { json_response(503, serde_json::json!({"busy": true})) },
        )
        .await;
    let other_store = TestStore::embedded();
    let gateway = Gateway::builder(&other_store, "http://unused")
        .set(
            "upstreams",
            &format!("[{:?}, {:?}]", busy.url(), fallback.url()),
        )
        .start()
        .await;
    let reply = post(&gateway.path("/v1/charges"), "failover-2", "{}").await;
    assert_eq!(reply.status, 200);
    assert_eq!((busy.hits(), fallback.hits()), (1, 2));
    let _ = echo_response;
}

#[tokio::test]
async fn provider_credentials_come_from_the_environment_not_the_client() {
    let store = TestStore::embedded();
    let provider = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, "http://unused")
        .unset("upstreams")
        .env("TEST_PROVIDER_KEY", "sk-provider-secret")
        .tables(&format!(
            "[[upstreams]]\nname = \"provider\"\nurl = {:?}\n[upstreams.headers]\nauthorization = {{ env = \"TEST_PROVIDER_KEY\", prefix = \"Bearer \" }}\n\
             [[clients]]\nname = \"app\"\nkey_sha256 = {{ value = {:?} }}\n\
             [[routes]]\npath_prefix = \"/v1\"\nrequire_client = true\n",
            provider.url(),
            sha256_hex("client-token"),
        ))
        .start()
        .await;
    let reply = send(
        Method::POST,
        &gateway.path("/v1/x"),
        &[
            ("idempotency-key", "creds"),
            ("authorization", "Bearer client-token"),
        ],
        "{}",
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        provider.recorded()[0].header("authorization"),
        Some("Bearer sk-provider-secret")
    );
    // A caller without the client key gets 401, and the provider nothing;
    // a request on no route goes to the first upstream without the key.
    for (path, key) in [("/v1/x", Some("creds-2")), ("/v1/y", None)] {
        let headers: Vec<(&str, &str)> = key.map(|k| ("idempotency-key", k)).into_iter().collect();
        let refused = send(Method::POST, &gateway.path(path), &headers, "{}").await;
        assert_eq!(
            (refused.status, refused.problem().as_str()),
            (401, "client-unauthenticated")
        );
    }
    assert_eq!(provider.recorded().len(), 1);
    let elsewhere = send(
        Method::GET,
        &gateway.path("/health"),
        &[("authorization", "Bearer client-token")],
        "",
    )
    .await;
    assert_eq!(elsewhere.status, 200);
    let seen = provider.recorded();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen[1].header("authorization"),
        None,
        "neither the provider's key nor the client's own (the gateway's) on no route"
    );

    let missing = Gateway::builder(&store, "http://unused")
        .unset("upstreams")
        .tables("[[upstreams]]\nurl = \"http://127.0.0.1:1\"\n[upstreams.headers]\nauthorization = { env = \"IDEMGATE_TEST_UNSET_KEY\" }\n")
        .start_and_fail()
        .await;
    assert!(missing.contains("IDEMGATE_TEST_UNSET_KEY"), "{missing}");
}

#[tokio::test]
async fn verify_providers_prints_a_table_and_fails_on_drift() {
    let store = TestStore::embedded();
    let a = Provider::start("a", Drift::None, Timing::Now).await;
    let b = Provider::start("b", Drift::WrongType, Timing::Now).await;
    let out = chat_gateway(&store, &a.url(), &b.url(), "")
        .run("verify-providers")
        .await;
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{table}");
    let row = |name: &str| {
        table
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_default()
            .to_owned()
    };
    assert!(row("a ").contains("pass"), "{table}");
    assert!(
        row("b ").contains("FAIL") && row("b ").contains("/created"),
        "{table}"
    );

    b.set(Drift::None);
    let out = chat_gateway(&store, &a.url(), &b.url(), "")
        .run("verify-providers")
        .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[tokio::test]
async fn the_worked_chat_example_runs_against_local_providers() {
    let store = TestStore::postgres().await;
    let a = Provider::start("provider-a", Drift::None, Timing::Now).await;
    let b = Provider::start("provider-b", Drift::MissingField, Timing::Now).await;
    let example = std::fs::read_to_string(chat_dir().join("idemgate.toml"))
        .unwrap()
        .replace("http://127.0.0.1:8001", &a.url())
        .replace("http://127.0.0.1:8002", &b.url())
        .replace("listen = \"127.0.0.1:8080\"", "listen = \"127.0.0.1:0\"")
        .replace(
            "admin_listen = \"127.0.0.1:9090\"",
            "admin_listen = \"127.0.0.1:0\"",
        )
        .replace("probe_interval = \"60s\"", "probe_interval = \"200ms\"");
    let builder = || {
        Gateway::builder(&store, "http://unused")
            .unset("upstreams")
            .unset("listen")
            .unset("admin_listen")
            .files_from(&chat_dir())
            .env("PROVIDER_A_API_KEY", "sk-a")
            .env("PROVIDER_B_API_KEY", "sk-b")
            .env("CHAT_APP_KEY_SHA256", &sha256_hex(CHAT_APP_KEY))
            .tables(&example)
    };
    let out = builder().run("verify-providers").await;
    assert!(
        !out.status.success(),
        "provider-b drifts: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    // The same, for a pipeline: provider-a passes with the prompt counts
    // it reported; provider-b fails, saying why.
    let out = builder().run_with("verify-providers", &["--json"]).await;
    assert!(!out.status.success());
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let of = |upstream: &str| -> Vec<serde_json::Value> {
        rows.as_array()
            .unwrap()
            .iter()
            .filter(|r| r["upstream"] == upstream)
            .cloned()
            .collect()
    };
    // The golden probe and the real case from config/chat/cases/.
    let probes: Vec<&str> = rows
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["upstream"] == "provider-a")
        .filter_map(|r| r["probe"].as_str())
        .collect();
    assert_eq!(
        probes,
        ["capital-of-france", "real/capital-one-word"],
        "{rows:#}"
    );
    for row in of("provider-a") {
        assert_eq!(row["result"], "pass", "{rows:#}");
        let seen = row["prompt_tokens"].as_array().unwrap();
        assert!(!seen.is_empty(), "{rows:#}");
    }
    assert!(
        of("provider-b")
            .iter()
            .any(|r| r["result"] == "fail" && r["why"].is_string()),
        "{rows:#}"
    );

    let gateway = builder().start().await;
    probed(&gateway, "provider-a", true).await;
    probed(&gateway, "provider-b", false).await;
    let url = gateway.path("/v1/chat/completions");
    let as_app = format!("Bearer {CHAT_APP_KEY}");
    let reply = send(
        Method::POST,
        &url,
        &[("idempotency-key", "example-1"), ("authorization", &as_app)],
        CHAT_BODY,
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(model(&reply), "provider-a");
    assert_eq!(a.calls()[0].header("authorization"), Some("Bearer sk-a"));
    let calls = a.calls().len();
    // Only the gateway's clients may spend the providers' keys.
    for who in [None, Some("Bearer someone-else")] {
        let headers: Vec<(&str, &str)> = [("idempotency-key", "example-2")]
            .into_iter()
            .chain(who.map(|w| ("authorization", w)))
            .collect();
        let refused = send(Method::POST, &url, &headers, CHAT_BODY).await;
        assert_eq!(refused.status, 401);
        assert_eq!(refused.problem(), "client-unauthenticated");
    }
    assert_eq!(
        a.calls().len(),
        calls,
        "no provider call for an unproven caller"
    );
    let missing_key = send(Method::POST, &url, &[("authorization", &as_app)], CHAT_BODY).await;
    assert_eq!(missing_key.problem(), "idempotency-key-missing");
}

/// The worked example's client key; its digest is what the gateway holds.
const CHAT_APP_KEY: &str = "chat-app-key-for-tests";
