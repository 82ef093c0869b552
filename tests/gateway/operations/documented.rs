//! The operator's commands the guides give, run as written against a
//! running gateway with jobs gone unknown: `docs/operations.md`'s admin API
//! calls (and `docs/runbook.md`'s, below), with only the example's address,
//! job and attempt ids swapped for the test's.

use std::time::Duration;

use http::Method;
use serde_json::Value;

use crate::support::{docs, send, FakeUpstream, Gate, Gateway, TestStore};

/// The guides' example ids, swapped for real ones.
const EXAMPLE_JOB: &str = "01a22beb-fef0-7411-87aa-ba1b1ac0e8b7";
const EXAMPLE_ATTEMPT: &str = "01a22beb-fef0-7411-87aa-ba1b1ac0e8b8";

/// A gateway with the guides' admin token in front of an upstream whose
/// first `silent` calls never answer in time.
async fn with_unknown_jobs(store: &TestStore, silent: usize) -> (Gateway, FakeUpstream, Gate) {
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, move |r| r.hit <= silent).await;
    let gateway = Gateway::builder(store, &upstream.url())
        .set("admin_token", "\"change-me-to-a-long-secret\"")
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"60s\"")
        .start()
        .await;
    (gateway, upstream, gate)
}

/// Sends `key` as Alice; the answer's job id.
async fn charge(gateway: &Gateway, key: &str) -> (u16, String) {
    let headers = [("idempotency-key", key), ("authorization", "Bearer alice")];
    let reply = send(Method::POST, &gateway.path("/charges"), &headers, "{}").await;
    (reply.status, reply.job().unwrap_or_default())
}

/// Runs `script` with bash, the example's `localhost:9090` being `gateway`'s
/// admin listener; its standard output.
async fn run(script: &str, gateway: &Gateway) -> String {
    let admin = gateway.admin_url.trim_start_matches("http://");
    let script = script.replace("localhost:9090", admin);
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new("bash")
            .args(["-euo", "pipefail", "-c", &script])
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the commands ended within 30 s")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script}\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The unknown attempt of `job`.
async fn unknown_attempt(gateway: &Gateway, job: &str) -> String {
    let url = format!("{}/admin/v1/jobs/{job}", gateway.admin_url);
    let auth = [("authorization", "Bearer change-me-to-a-long-secret")];
    let job = send(Method::GET, &url, &auth, "").await.json();
    assert_eq!(job["state"], "unknown", "{job}");
    let attempt = job["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["state"] == "unknown");
    attempt.unwrap()["id"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn the_admin_api_calls_of_the_operations_guide_run_as_written() {
    let store = TestStore::embedded();
    let (gateway, upstream, _gate) = with_unknown_jobs(&store, 2).await;
    let (status, reopened) = charge(&gateway, "order-42").await;
    assert_eq!(status, 504);
    let (_, answered) = charge(&gateway, "order-43").await;

    let read = docs::block("operations-admin-api-read").replace(EXAMPLE_JOB, &reopened);
    let out = run(&read, &gateway).await;
    let answers: Vec<Value> = serde_json::Deserializer::from_str(&out)
        .into_iter::<Value>()
        .map(Result::unwrap)
        .collect();
    assert_eq!(answers.len(), 4, "four answers: {out}");
    assert_eq!(answers[0]["id"], reopened.as_str(), "the job by id: {out}");
    assert!(
        answers[1].to_string().contains(&reopened),
        "by owner and key: {out}"
    );
    let inbox = answers[2].to_string();
    assert!(
        inbox.contains(&reopened) && inbox.contains(&answered),
        "the inbox: {out}"
    );

    // "had no effect": the job reopens and the retry runs again.
    let attempt = unknown_attempt(&gateway, &reopened).await;
    let no_effect = format!(
        "{}\n{}",
        read.lines().next().unwrap(),
        docs::block("operations-admin-api-no-effect").replace(EXAMPLE_ATTEMPT, &attempt)
    );
    run(&no_effect, &gateway).await;
    assert_eq!(charge(&gateway, "order-42").await.0, 200, "the retry ran");
    assert_eq!(upstream.hits(), 3);

    // "it did, with this response": the retry gets the operator's answer.
    let attempt = unknown_attempt(&gateway, &answered).await;
    let succeeded = format!(
        "{}\nATTEMPT={attempt}\n{}",
        read.lines().next().unwrap(),
        docs::block("operations-admin-api-succeeded")
    );
    run(&succeeded, &gateway).await;
    let headers = [
        ("idempotency-key", "order-43"),
        ("authorization", "Bearer alice"),
    ];
    let replay = send(Method::POST, &gateway.path("/charges"), &headers, "{}").await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.body.as_ref(), br#"{"ok": true}"#);
    assert_eq!(upstream.hits(), 3, "nothing sent upstream for it");
}

/// `docs/runbook.md`'s commands for unknown jobs, as an on-call engineer
/// runs them after the port-forward (`IDEMGATE_ADMIN_URL` standing for it,
/// the token in `IDEMGATE_ADMIN_TOKEN`), with the job and attempt ids they
/// name: the jobs listed, one shown, one resolved with an answer every
/// retry then gets, one reopened so that its retry runs again.
#[tokio::test]
async fn the_runbooks_commands_for_unknown_jobs_run_as_written() {
    let store = TestStore::embedded();
    let (gateway, upstream, _gate) = with_unknown_jobs(&store, 2).await;
    let (_, took) = charge(&gateway, "runbook-took-effect").await;
    let (_, none) = charge(&gateway, "runbook-no-effect").await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("answer.json"), r#"{"charged": true}"#).unwrap();
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_idemgate"));
    let on_call = |script: String| {
        let mut command = tokio::process::Command::new("bash");
        command
            .args(["-euo", "pipefail", "-c", &script])
            .current_dir(dir.path())
            .env(
                "PATH",
                format!(
                    "{}:{}",
                    bin.parent().unwrap().display(),
                    std::env::var("PATH").unwrap()
                ),
            )
            .env("IDEMGATE_ADMIN_URL", &gateway.admin_url)
            .env("IDEMGATE_ADMIN_TOKEN", "change-me-to-a-long-secret")
            .env_remove("IDEMGATE_ADMIN_TOKEN_FILE")
            .kill_on_drop(true);
        async move {
            let out = tokio::time::timeout(Duration::from_secs(30), command.output())
                .await
                .expect("the command ended within 30 s")
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{script}\n{stdout}\n{stderr}");
            stdout
        }
    };

    let listed = on_call(docs::block("runbook-jobs-list")).await;
    assert!(listed.contains(&took) && listed.contains(&none), "{listed}");
    let shown = on_call(docs::block("runbook-jobs-show").replace("<job>", &took)).await;
    assert!(
        shown.contains(&took) && shown.contains("unknown"),
        "{shown}"
    );

    on_call(docs::block("runbook-resolve-succeeded").replace("<job>", &took)).await;
    on_call(docs::block("runbook-resolve-no-effect").replace("<job>", &none)).await;
    let url = format!("{}/admin/v1/jobs/{took}", gateway.admin_url);
    let auth = [("authorization", "Bearer change-me-to-a-long-secret")];
    let job = send(Method::GET, &url, &auth, "").await.json();
    let by = job["attempts"][0]["resolved_by"]["operator"]
        .as_str()
        .unwrap_or_default();
    assert!(
        by.contains("admin token"),
        "recorded as the operator's: {job}"
    );

    let headers = [
        ("idempotency-key", "runbook-took-effect"),
        ("authorization", "Bearer alice"),
    ];
    let replay = send(Method::POST, &gateway.path("/charges"), &headers, "{}").await;
    assert_eq!(
        (replay.status, replay.body.as_ref()),
        (200, br#"{"charged": true}"#.as_slice())
    );
    assert_eq!(
        charge(&gateway, "runbook-no-effect").await.0,
        200,
        "the retry ran"
    );
    assert_eq!(upstream.hits(), 3, "one new call: the reopened job's retry");
}
