//! Issue 38: `idemgate jobs` and the job API cannot mislead. An outcome is
//! never implied (the error names both and what each does to the next
//! retry); `resolve` takes a job id or an attempt id; `list` shows the
//! attempt; `find` by owner (`hmac:<hex>` or the raw value) and key;
//! `resolve-many` refuses an upstream that does not exist; an operator's
//! answer is stored and shown as the operator's (who, when), never as an
//! upstream status; where lookups stand is shown.

use std::time::Duration;

use http::Method;
use serde_json::Value;

use crate::support::gateway::ADMIN_TOKEN;
use crate::support::{post, send, FakeUpstream, Gate, Gateway, TestStore};

/// Runs `idemgate jobs ARGS` against `gateway`, with the admin token, as
/// `operator` when given (no `$USER` either way, so that what is recorded
/// is only what the test says).
async fn jobs(gateway: &Gateway, operator: Option<&str>, args: &[&str]) -> std::process::Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemgate"));
    command
        .arg("jobs")
        .args(args)
        .env("IDEMGATE_ADMIN_URL", &gateway.admin_url)
        .env("IDEMGATE_ADMIN_TOKEN", ADMIN_TOKEN)
        .env_remove("IDEMGATE_ADMIN_TOKEN_FILE")
        .env_remove("IDEMGATE_OPERATOR")
        .env_remove("USER")
        .kill_on_drop(true);
    if let Some(name) = operator {
        command.env("IDEMGATE_OPERATOR", name);
    }
    tokio::time::timeout(Duration::from_secs(20), command.output())
        .await
        .expect("idemgate jobs finished")
        .unwrap()
}

fn stdout(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The command failed with exit code 1; what it said.
fn refused(out: &std::process::Output) -> String {
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(out.stdout.is_empty(), "{:?}", out.stdout);
    said
}

/// A gateway whose upstream never answers the first `held` calls in time:
/// each of them leaves its job unknown (the gate released at the end).
async fn with_unknown_jobs(store: &TestStore, gate: &Gate, held: usize) -> (Gateway, FakeUpstream) {
    let upstream = FakeUpstream::gated_echo(gate, move |r| r.hit <= held).await;
    let gateway = Gateway::builder(store, &upstream.url())
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"60s\"")
        .start()
        .await;
    (gateway, upstream)
}

async fn unknown_job(gateway: &Gateway, key: &str) -> String {
    let reply = post(&gateway.path("/v1/charges"), key, "{}").await;
    assert_eq!(reply.status, 504);
    reply.job().unwrap()
}

#[tokio::test]
async fn resolving_without_an_outcome_names_both_and_what_each_does_and_changes_nothing() {
    let store = TestStore::embedded();
    let gate = Gate::new();
    let (gateway, _upstream) = with_unknown_jobs(&store, &gate, 1).await;
    let job = unknown_job(&gateway, "no-outcome").await;

    let said = refused(&jobs(&gateway, None, &["resolve", &job]).await);
    for needed in [
        "nothing is assumed",
        "--succeeded --status N",
        "the client's next retry gets it replayed",
        "--no-effect",
        "the client's next retry runs a new attempt",
    ] {
        assert!(said.contains(needed), "{needed:?} not in:\n{said}");
    }
    assert!(!said.contains("required"), "{said}");
    let said = refused(&jobs(&gateway, None, &["resolve", &job, "--succeeded"]).await);
    assert!(said.contains("--succeeded needs --status"), "{said}");

    let since = humantime::format_rfc3339(std::time::SystemTime::now() - Duration::from_secs(60))
        .to_string();
    let many = ["resolve-many", "--upstream", "primary", "--since", &since];
    let said = refused(&jobs(&gateway, None, &many).await);
    for needed in [
        "nothing is assumed",
        "--no-effect",
        "--cancelled",
        "next retry",
    ] {
        assert!(said.contains(needed), "{needed:?} not in:\n{said}");
    }
    assert_eq!(gateway.job(&job).await["state"], "unknown");
    gate.open(1);
}

#[tokio::test]
async fn resolve_many_refuses_an_upstream_that_does_not_exist_and_lists_those_that_do() {
    let store = TestStore::embedded();
    let gate = Gate::new();
    let (gateway, _upstream) = with_unknown_jobs(&store, &gate, 1).await;
    let job = unknown_job(&gateway, "misspelled").await;
    let since = humantime::format_rfc3339(std::time::SystemTime::now() - Duration::from_secs(60))
        .to_string();

    for dry in [true, false] {
        let mut args = vec![
            "resolve-many",
            "--upstream",
            "primray",
            "--since",
            &since,
            "--no-effect",
        ];
        if dry {
            args.push("--dry-run");
        }
        let said = refused(&jobs(&gateway, None, &args).await);
        assert!(said.contains("400"), "{said}");
        assert!(
            said.contains("no upstream is named \"primray\"; the upstreams are: primary"),
            "{said}"
        );
    }
    assert_eq!(gateway.job(&job).await["state"], "unknown");
    gate.open(1);
}

/// Resolving by job id, as one operator, on `store`: what is stored and
/// shown is the operator's answer, never an upstream status.
async fn a_job_id_resolves_its_unknown_attempt_as_the_operators(store: TestStore) {
    let gate = Gate::new();
    let (gateway, upstream) = with_unknown_jobs(&store, &gate, 2).await;
    let job = unknown_job(&gateway, "by-job-id").await;
    let other = unknown_job(&gateway, "by-attempt-hint").await;
    let attempt = gateway.job(&job).await["attempts"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();

    // The listing shows the attempt to resolve and its upstream.
    let listed = stdout(&jobs(&gateway, None, &["list"]).await);
    let line = listed
        .lines()
        .find(|l| l.starts_with(&job))
        .unwrap_or_else(|| panic!("{listed}"));
    assert!(
        line.contains(&attempt) && line.contains("primary"),
        "{listed}"
    );
    // Nothing looks it up on this route, and the job API says so.
    let shown = gateway.job(&job).await;
    let stopped = shown["attempts"][0]["lookups"]["stopped"].as_str().unwrap();
    assert!(stopped.contains("does not look attempts up"), "{stopped}");
    assert_eq!(shown["attempts"][0]["lookups"]["next_at"], Value::Null);

    let args = [
        "resolve",
        &job,
        "--succeeded",
        "--status",
        "201",
        "--body",
        "charged",
    ];
    let said = stdout(&jobs(&gateway, Some("alice"), &args).await);
    assert!(
        said.contains(&format!(
            "attempt {attempt} resolved by alice (admin token)"
        )),
        "{said}"
    );
    assert!(
        said.contains(&format!("job {job} is now completed")),
        "{said}"
    );

    let shown = gateway.job(&job).await;
    let settled = &shown["attempts"][0];
    assert_eq!(settled["state"], "succeeded");
    assert_eq!(
        settled["upstream_status"],
        Value::Null,
        "the upstream never answered: {settled}"
    );
    assert_eq!(settled["resolved_by"]["operator"], "alice (admin token)");
    let at = settled["resolved_by"]["at"].as_str().unwrap();
    let at = humantime::parse_rfc3339(at).unwrap();
    let age = std::time::SystemTime::now().duration_since(at).unwrap();
    assert!(age < Duration::from_secs(30), "resolved just now: {at:?}");
    assert_eq!(shown["response"]["status"], 201);
    let replay = post(&gateway.path("/v1/charges"), "by-job-id", "{}").await;
    assert_eq!((replay.status, &replay.body[..]), (201, &b"charged"[..]));

    // Nothing left to resolve on it; an id nothing has.
    let said = refused(&jobs(&gateway, None, &["resolve", &job, "--no-effect"]).await);
    assert!(said.contains("has no attempt of unknown outcome"), "{said}");
    let nobody = uuid::Uuid::new_v4().to_string();
    let said = refused(&jobs(&gateway, None, &["resolve", &nobody, "--no-effect"]).await);
    assert!(
        said.contains(&format!("no job or attempt has id {nobody}")),
        "{said}"
    );

    // The API, given a job id for an attempt's, names the attempt.
    let other_attempt = gateway.job(&other).await["attempts"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let reply = gateway.resolve(&other, r#"{"outcome": "failed"}"#).await;
    assert_eq!(reply.status, 404);
    let detail = reply.problem_detail();
    assert!(
        detail.contains("is a job's id, not an attempt's")
            && detail.contains(&format!("#1 {other_attempt}")),
        "{detail}"
    );
    // Through the API without a name: the admin token decided, and a
    // failed resolution is no upstream status either.
    assert_eq!(
        gateway
            .resolve(&other_attempt, r#"{"outcome": "failed"}"#)
            .await
            .status,
        200
    );
    let settled = &gateway.job(&other).await["attempts"][0];
    assert_eq!(settled["resolved_by"]["operator"], "admin token");
    assert_eq!(settled["upstream_status"], Value::Null);
    assert_eq!(upstream.hits(), 2, "no call was made to resolve");
    gate.open(2);
}

#[tokio::test]
async fn a_job_id_resolves_its_unknown_attempt_as_the_operators_embedded() {
    a_job_id_resolves_its_unknown_attempt_as_the_operators(TestStore::embedded()).await;
}

#[tokio::test]
async fn a_job_id_resolves_its_unknown_attempt_as_the_operators_postgres() {
    a_job_id_resolves_its_unknown_attempt_as_the_operators(TestStore::postgres().await).await;
}

#[tokio::test]
async fn find_takes_the_stored_hmac_owner_or_the_raw_value_and_refuses_sha256() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let reply = send(
        Method::POST,
        &gateway.path("/v1/charges"),
        &[
            ("idempotency-key", "owned-key"),
            ("authorization", "Bearer sk-owner-1"),
            ("content-type", "application/json"),
        ],
        "{}",
    )
    .await;
    assert_eq!(reply.status, 200);
    let job = reply.job().unwrap();
    let owner = gateway.job(&job).await["owner"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(owner.starts_with("hmac:"), "{owner}");

    for given in [owner.as_str(), "Bearer sk-owner-1"] {
        let args = ["find", "--owner", given, "--key", "owned-key"];
        let found: Value =
            serde_json::from_str(&stdout(&jobs(&gateway, None, &args).await)).unwrap();
        assert_eq!(found["id"], job.as_str(), "found by {given}");
    }
    // Another owner's raw value finds nothing, and says so.
    let args = ["find", "--owner", "Bearer sk-other", "--key", "owned-key"];
    let said = refused(&jobs(&gateway, None, &args).await);
    assert!(said.contains("no job for this owner and key"), "{said}");
    // What the docs once said: refused, not taken for a raw value.
    let sha = format!("sha256:{}", &owner["hmac:".len()..]);
    let args = ["find", "--owner", &sha, "--key", "owned-key"];
    let said = refused(&jobs(&gateway, None, &args).await);
    assert!(
        said.contains("stored owners are hmac: and 64 hex digits"),
        "{said}"
    );
}

/// A route that looks its unknown attempts up; its upstream never answers
/// the first POST in time and answers every lookup `503` (not yet known).
#[tokio::test]
async fn the_job_api_says_how_many_lookups_their_last_result_the_next_and_when_they_stopped() {
    use crate::support::eventually;
    use crate::support::upstream::json_response;
    let store = TestStore::embedded();
    let gate = Gate::new();
    let silent = gate.clone();
    let upstream = FakeUpstream::start(move |r| {
        let silent = silent.clone();
        async move {
            if r.method == "GET" {
                return json_response(503, serde_json::json!({"error": "not yet"}));
            }
            silent.pass().await;
            crate::support::upstream::echo_response(&r)
        }
    })
    .await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"4s\"")
        .tables(
            r#"
[[routes]]
name = "charges"
path_prefix = "/v1/charges"
[routes.reconcile]
path = "/v1/charges/lookup/{job}"
"#,
        )
        .start()
        .await;
    let job = unknown_job(&gateway, "looked-up").await;

    // Asked, answered 503: counted, the last kept, the next one scheduled.
    let lookups = || async { gateway.job(&job).await["attempts"][0]["lookups"].clone() };
    eventually(Duration::from_secs(10), "a lookup recorded", || async {
        lookups().await["count"].as_u64() >= Some(1)
    })
    .await;
    let seen = lookups().await;
    assert_eq!(seen["last"]["status"], 503, "{seen}");
    assert_eq!(seen["last"]["result"], "still_unknown", "{seen}");
    let started = gateway.job(&job).await["attempts"][0]["started_at"]
        .as_str()
        .unwrap()
        .to_owned();
    let started = humantime::parse_rfc3339(&started).unwrap();
    if seen["stopped"].is_null() {
        let next = humantime::parse_rfc3339(seen["next_at"].as_str().unwrap()).unwrap();
        let last = humantime::parse_rfc3339(seen["last"]["at"].as_str().unwrap()).unwrap();
        assert!(
            next > last && next < started + Duration::from_secs(4),
            "{seen}"
        );
    }

    // Past the deadline: stopped, and why; the count stays what was made.
    eventually(Duration::from_secs(15), "the lookups to stop", || async {
        lookups().await["stopped"].is_string()
    })
    .await;
    let seen = lookups().await;
    assert_eq!(seen["next_at"], Value::Null, "{seen}");
    let why = seen["stopped"].as_str().unwrap();
    assert!(
        why.contains("deadline passed") && why.contains("only an operator settles it now"),
        "{why}"
    );
    assert!(seen["count"].as_u64().unwrap() >= 2, "{seen}");
    assert_eq!(gateway.job(&job).await["state"], "unknown");
    gate.open(1);
}
