//! Proven providers: a fallback is a failover target only while its probes
//! prove it answers *right* (golden values by JSON pointer), the same way
//! every run, with the prompt rendered as intended (the provider's own
//! token count in a window), and after a failure only once it has passed
//! `recover_after` verifications in a row. The primary is always tried; it
//! is unreachable here, so whether the fallback is used is all there is to
//! see.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http::Method;
use serde_json::Value;

use crate::support::chat::{Drift, Provider, Timing};
use crate::support::gateway::Builder;
use crate::support::{eventually, post, send, Gateway, Reply, TestStore};

const WAIT: Duration = Duration::from_secs(15);
const CHAT_BODY: &str = r#"{"model": "default", "temperature": 0, "messages": [{"role": "user", "content": "Capital of France?"}]}"#;

/// The chat contract with a probe that checks what the answer says: the
/// embedded answer names Paris, the envelope says the answer stopped of
/// itself, the prompt counts 10 to 40 tokens, and three runs agree.
const CONTRACT: &str = r#"
[contracts.chat-json]
schema = "response.schema.json"
recover_after = 3
[contracts.chat-json.embedded]
pointer = "/choices/0/message/content"
schema = "answer.schema.json"
[[contracts.chat-json.probes]]
name = "capital-of-france"
path = "/v1/chat/completions"
body = "probe-capital.json"
runs = 3
expect = { "/answer" = { matches = "^Paris, says " }, "body:/choices/0/finish_reason" = "stop" }
prompt_tokens = { pointer = "/usage/prompt_tokens", min = 10, max = 40 }
"#;

fn chat_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("config/chat")
}

/// A route whose primary `a` is unreachable and whose fallback is `b`,
/// under `contract`, probed every `interval`.
async fn behind_a_dead_primary(
    store: &TestStore,
    b: &Provider,
    contract: &str,
    interval: &str,
) -> Builder {
    let closed = crate::support::redis::free_port().await;
    Gateway::builder(store, "http://unused")
        .unset("upstreams")
        .set("probe_interval", &format!("{interval:?}"))
        .files_from(&chat_dir())
        .tables(&format!(
            "[[upstreams]]\nname = \"a\"\nurl = \"http://127.0.0.1:{closed}\"\n\
             [[upstreams]]\nname = \"b\"\nurl = {:?}\n",
            b.url()
        ))
        .tables(contract)
        .tables(
            "[[routes]]\nname = \"chat\"\npath_prefix = \"/v1/chat\"\nupstreams = [\"a\", \"b\"]\ncontract = \"chat-json\"\n",
        )
}

async fn chat(gateway: &Gateway, key: &str) -> Reply {
    post(&gateway.path("/v1/chat/completions"), key, CHAT_BODY).await
}

/// `b`'s standing under the chat contract, as the admin API shows it.
async fn standing(gateway: &Gateway) -> Value {
    let status = gateway
        .admin(Method::GET, "/admin/v1/upstreams", "")
        .await
        .json();
    status["upstreams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == "b")
        .and_then(|u| u["contracts"].as_array()?.first().cloned())
        .unwrap_or(Value::Null)
}

/// Waits until `b` has `n` verdicts, all of them `result`.
async fn verdicts(gateway: &Gateway, n: usize, result: &str) -> Value {
    eventually(WAIT, &format!("{n} verdicts of {result} on b"), || async {
        let history = standing(gateway).await["history"].clone();
        history.as_array().is_some_and(|h| h.len() >= n)
    })
    .await;
    let now = standing(gateway).await;
    let history = now["history"].as_array().unwrap();
    assert!(
        history.iter().all(|v| v["result"] == result),
        "every verdict is {result}: {now}"
    );
    now
}

/// A series' value on the gateway's `/metrics`, by name and labels.
async fn series(gateway: &Gateway, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = send(
        Method::GET,
        &format!("{}/metrics", gateway.admin_url),
        &[],
        "",
    )
    .await;
    String::from_utf8_lossy(&text.body)
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The client gets the primary's failure, and the fallback nothing but
/// probes.
async fn not_a_target(gateway: &Gateway, b: &Provider, key: &str) {
    let refused = chat(gateway, key).await;
    assert_eq!(refused.status, 502, "{:?}", refused.body);
    assert_eq!(refused.problem(), "upstream-unreachable");
    assert!(b.calls().is_empty(), "the fallback got a client's request");
    assert!(b.probes() >= 3, "the fallback was probed");
    let eligible = [("upstream", "b"), ("contract", "chat-json")];
    assert_eq!(
        series(gateway, "idemgate_upstream_eligible", &eligible).await,
        0.0
    );
}

/// The main scenario: valid JSON in the contract's shape, saying the wrong
/// thing. Every schema passes; the golden value does not.
async fn a_fallback_answering_the_wrong_value_is_never_a_target(store: TestStore) {
    let b = Provider::start("b", Drift::WrongAnswer, Timing::Now).await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let gateway = behind_a_dead_primary(&store, &b, CONTRACT, "200ms")
        .await
        .stderr_to(log.path())
        .start()
        .await;
    let now = verdicts(&gateway, 2, "fail").await;
    assert_eq!(now["eligible"], false);
    let why = now["failures"][0]["why"].as_str().unwrap();
    assert!(
        why.contains(r#"/answer: expected a string matching /^Paris, says /, got "Lyon, says b""#),
        "the failure says what differed: {why}"
    );
    assert_eq!(now["failures"][0]["probe"], "capital-of-france");
    not_a_target(&gateway, &b, "wrong-value").await;
    let failed = [
        ("upstream", "b"),
        ("probe", "capital-of-france"),
        ("result", "fail"),
    ];
    assert!(series(&gateway, "idemgate_probe_runs_total", &failed).await >= 2.0);
    let log = std::fs::read_to_string(log.path()).unwrap();
    assert!(
        !log.contains("only prove the shape"),
        "a contract with `expect` proves more than the shape: {log}"
    );
}

/// The control case: right, alike in every run, in the window: used.
async fn the_control_fallback_right_stable_and_in_the_window_is_used(store: TestStore) {
    let b = Provider::start("b", Drift::None, Timing::Now).await;
    let gateway = behind_a_dead_primary(&store, &b, CONTRACT, "200ms")
        .await
        .start()
        .await;
    eventually(WAIT, "b to be eligible", || async {
        standing(&gateway).await["eligible"] == true
    })
    .await;
    let now = standing(&gateway).await;
    assert_eq!(now["history"][0]["result"], "pass", "{now}");
    let verifications = now["history"].as_array().unwrap().len();
    assert!(
        b.probes() >= 3 * verifications,
        "every verification sends the probe 3 times"
    );
    let served = chat(&gateway, "control").await;
    assert_eq!(served.status, 200, "{:?}", served.body);
    assert_eq!(served.json()["model"], "b");
    assert_eq!(b.calls().len(), 1);
    let eligible = [("upstream", "b"), ("contract", "chat-json")];
    assert_eq!(
        series(&gateway, "idemgate_upstream_eligible", &eligible).await,
        1.0
    );
    let passed = [("upstream", "b"), ("result", "pass")];
    assert!(series(&gateway, "idemgate_probe_runs_total", &passed).await >= 1.0);
}

crate::on_each_deployment!(
    [embedded, postgres]
    a_fallback_right_only_some_of_the_time_is_unstable_and_never_a_target,
    a_fallback_whose_prompt_renders_out_of_the_window_is_never_a_target,
    a_recovering_fallback_is_a_target_only_after_recover_after_passes,
    a_fallback_answering_the_wrong_value_is_never_a_target,
    the_control_fallback_right_stable_and_in_the_window_is_used,
);

async fn a_fallback_right_only_some_of_the_time_is_unstable_and_never_a_target(store: TestStore) {
    let b = Provider::start("b", Drift::Flapping, Timing::Now).await;
    let gateway = behind_a_dead_primary(&store, &b, CONTRACT, "200ms")
        .await
        .start()
        .await;
    let now = verdicts(&gateway, 3, "unstable").await;
    assert_eq!(now["eligible"], false);
    assert_eq!(now["failures"][0]["result"], "unstable");
    let why = now["failures"][0]["why"].as_str().unwrap();
    assert!(
        why.contains("of 3 runs failed") && why.contains("Lyon"),
        "{why}"
    );
    not_a_target(&gateway, &b, "flapping").await;
    let unstable = [("upstream", "b"), ("result", "unstable")];
    assert!(series(&gateway, "idemgate_probe_runs_total", &unstable).await >= 3.0);
}

async fn a_fallback_whose_prompt_renders_out_of_the_window_is_never_a_target(store: TestStore) {
    let b = Provider::start("b", Drift::LongPrompt, Timing::Now).await;
    let gateway = behind_a_dead_primary(&store, &b, CONTRACT, "200ms")
        .await
        .start()
        .await;
    let now = verdicts(&gateway, 2, "fail").await;
    let why = now["failures"][0]["why"].as_str().unwrap();
    assert!(
        why.contains(
            "prompt_tokens: /usage/prompt_tokens is 400, expected a count between 10 and 40"
        ),
        "{why}"
    );
    not_a_target(&gateway, &b, "long-prompt").await;
}

async fn a_recovering_fallback_is_a_target_only_after_recover_after_passes(store: TestStore) {
    let b = Provider::start("b", Drift::WrongAnswer, Timing::Now).await;
    // A verification a second: the test acts between two of them.
    let gateway = behind_a_dead_primary(&store, &b, CONTRACT, "1s")
        .await
        .start()
        .await;
    verdicts(&gateway, 1, "fail").await;
    b.set(Drift::None);

    // One pass after the failure: not yet (recover_after = 3).
    eventually(WAIT, "b to pass once after failing", || async {
        standing(&gateway).await["passes_in_a_row"] == 1
    })
    .await;
    let now = standing(&gateway).await;
    assert_eq!(
        (now["eligible"].clone(), now["needed"].clone()),
        (Value::from(false), Value::from(2)),
        "{now}"
    );
    let refused = chat(&gateway, "recovering").await;
    assert_eq!(
        refused.status, 502,
        "a fallback still recovering is not a target"
    );
    assert!(b.calls().is_empty());

    // Eligible exactly at the third pass in a row, never before.
    eventually(WAIT, "b to be eligible again", || async {
        let now = standing(&gateway).await;
        assert!(
            now["eligible"] == false || now["passes_in_a_row"].as_u64() >= Some(3),
            "eligible before recover_after passes: {now}"
        );
        now["eligible"] == true
    })
    .await;
    let now = standing(&gateway).await;
    let results: Vec<&str> = now["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["result"].as_str().unwrap())
        .collect();
    assert_eq!(results[..3], ["pass", "pass", "pass"], "{now}");
    assert_ne!(
        results[3], "pass",
        "three passes since the last failure: {now}"
    );
    let served = chat(&gateway, "recovered").await;
    assert_eq!(served.status, 200, "{:?}", served.body);
    assert_eq!(served.json()["model"], "b");
}

#[tokio::test]
async fn a_contract_whose_probes_only_check_the_shape_says_so_at_start_up() {
    let store = TestStore::embedded();
    let b = Provider::start("b", Drift::None, Timing::Now).await;
    let shape_only: String = CONTRACT
        .lines()
        .filter(|l| !l.starts_with("expect") && !l.starts_with("prompt_tokens"))
        .map(|l| format!("{l}\n"))
        .collect();
    let log = tempfile::NamedTempFile::new().unwrap();
    let _gateway = behind_a_dead_primary(&store, &b, &shape_only, "200ms")
        .await
        .stderr_to(log.path())
        .start()
        .await;
    eventually(WAIT, "the start-up warning", || async {
        let log = std::fs::read_to_string(log.path()).unwrap();
        log.contains("only prove the shape") && log.contains("chat-json")
    })
    .await;
}
