//! How attempts end: timeouts, late answers, refusals, retryable statuses,
//! a gateway killed mid-attempt, and resolution by an operator.

use std::time::Duration;

use http::Method;
use serde_json::Value;

use crate::support::upstream::{echo_response, json_response};
use crate::support::{eventually, post, send, FakeUpstream, Gate, Gateway, TestStore};

/// An upstream whose first answer waits for `gate`; later ones are immediate.
async fn first_answer_gated(gate: &Gate) -> FakeUpstream {
    FakeUpstream::gated_echo(gate, |r| r.hit == 1).await
}

/// A gateway that calls an attempt unknown after 300 ms of silence, and lets
/// its late answer commit for 30 s.
async fn impatient_gateway(store: &TestStore, upstream: &FakeUpstream) -> Gateway {
    impatient(store, upstream).start().await
}

/// [`impatient_gateway`], to be configured further.
fn impatient(store: &TestStore, upstream: &FakeUpstream) -> crate::support::gateway::Builder {
    Gateway::builder(store, &upstream.url())
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"30s\"")
}

fn attempts(job: &Value) -> &Vec<Value> {
    job["attempts"].as_array().unwrap()
}

async fn timeout_makes_the_job_unknown_until_resolved_then_attempt_two_runs(store: TestStore) {
    let gate = Gate::new();
    let upstream = first_answer_gated(&gate).await;
    let gateway = impatient_gateway(&store, &upstream).await;
    let url = gateway.path("/v1/jobs");

    let first = post(&url, "slow-1", "{}").await;
    assert_eq!(first.status, 504);
    assert_eq!(first.problem(), "attempt-outcome-unknown");
    let job_id = first.job().expect("the 504 names the job");

    let job = gateway.job(&job_id).await;
    assert_eq!(job["state"], "unknown");
    assert_eq!(attempts(&job)[0]["state"], "unknown");

    // Blocked: no new attempt while the outcome is unknown (held while
    // the call is out, for `hold_timeout`, then told so).
    let retry = post(&url, "slow-1", "{}").await;
    assert_eq!(retry.status, 409);
    assert_eq!(retry.problem(), "attempt-outcome-unknown");
    assert!(retry.header("retry-after").is_some());
    assert_eq!(retry.job().as_deref(), Some(job_id.as_str()));
    assert_eq!(upstream.hits(), 1);

    // An operator says attempt 1 had no effect.
    let attempt_1 = attempts(&job)[0]["id"].as_str().unwrap().to_owned();
    let resolved = gateway
        .resolve(&attempt_1, r#"{"outcome": "failed"}"#)
        .await;
    assert_eq!(resolved.status, 200, "{:?}", resolved.body);
    assert_eq!(resolved.json()["state"], "open");

    // The next retry is attempt 2 under the same job, with the same identity upstream.
    let second = post(&url, "slow-1", "{}").await;
    assert_eq!(second.status, 200);
    assert_eq!(second.job().as_deref(), Some(job_id.as_str()));
    let body = second.json();
    assert_eq!(body["attempt"], "2");
    assert_eq!(body["job"], job_id.as_str());
    let recorded = upstream.recorded();
    assert_eq!(recorded.len(), 2);
    assert_eq!(
        recorded[0].header("idempotency-key"),
        recorded[1].header("idempotency-key")
    );

    // Attempt 1's late answer cannot commit any more: the resolution moved the version.
    gate.open(1);
    let replay = post(&url, "slow-1", "{}").await;
    assert_eq!(replay.body, second.body);
    let job = gateway.job(&job_id).await;
    assert_eq!(job["state"], "completed");
    assert_eq!(job["completed_by"], attempts(&job)[1]["id"]);
}

async fn late_answer_before_the_deadline_is_committed_and_replayed(store: TestStore) {
    let gate = Gate::new();
    let upstream = first_answer_gated(&gate).await;
    let gateway = impatient_gateway(&store, &upstream).await;
    let url = gateway.path("/v1/jobs");

    let first = post(&url, "late-1", "{}").await;
    assert_eq!(first.status, 504);
    let job_id = first.job().unwrap();

    // The upstream answers after the client gave up, but before the deadline.
    gate.open(1);
    eventually(
        Duration::from_secs(10),
        "the late answer to be committed",
        || async { gateway.job(&job_id).await["state"] == "completed" },
    )
    .await;

    let replay = post(&url, "late-1", "{}").await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.json()["hit"], 1);
    assert_eq!(upstream.hits(), 1);
    let job = gateway.job(&job_id).await;
    assert_eq!(attempts(&job)[0]["state"], "succeeded");
}

/// A call that does not stream has its head only when its answer is
/// done, so a slow one goes unknown at `first_byte_timeout` while its
/// call goes on. A retry that comes while the call is still out from this
/// replica is held for it, as for a running attempt, and gets its late
/// answer (docs/design.md §11, "Silence, not total time"). Before, it was
/// told `409` at once, and an SDK's own retries spent themselves on that
/// while the answer was on its way.
async fn a_retry_while_the_late_call_is_out_is_held_for_its_answer(store: TestStore) {
    let gate = Gate::new();
    let upstream = first_answer_gated(&gate).await;
    let gateway = impatient_gateway(&store, &upstream).await;
    let url = gateway.path("/v1/jobs");
    let first = post(&url, "late-2", "{}").await;
    assert_eq!(first.status, 504);

    let retry = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "late-2", "{}").await }
    });
    eventually(Duration::from_secs(10), "the retry to be held", || async {
        gateway.metric("idemgate_held_requests").await >= 1.0
    })
    .await;
    gate.open(1);
    let retry = retry.await.unwrap();
    assert_eq!(retry.status, 200, "{retry:?}");
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.json()["hit"], 1);
    assert_eq!(upstream.hits(), 1);
}

/// On a route that answers duplicates at once (`in_progress =
/// "conflict"`), a retry while the late call is out is not held: `409` at
/// once, as for a running attempt.
async fn a_conflict_route_is_not_held_on_a_late_call(store: TestStore) {
    let gate = Gate::new();
    let upstream = first_answer_gated(&gate).await;
    let gateway = impatient(&store, &upstream)
        .set("hold_timeout", "\"20s\"")
        .tables("[[routes]]\npath_prefix = \"/v1\"\nin_progress = \"conflict\"\n")
        .start()
        .await;
    let url = gateway.path("/v1/jobs");
    assert_eq!(post(&url, "late-3", "{}").await.status, 504);
    let retry = tokio::time::timeout(Duration::from_secs(10), post(&url, "late-3", "{}"))
        .await
        .expect("answered at once, not held for hold_timeout");
    assert_eq!(retry.status, 409);
    assert_eq!(retry.problem(), "attempt-outcome-unknown");
    gate.open(1);
}

async fn refused_connection_fails_the_attempt_and_the_retry_makes_attempt_two(store: TestStore) {
    // Reserve a port, then free it: nothing listens there yet.
    let reserved = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = reserved.local_addr().unwrap();
    drop(reserved);
    let gateway = Gateway::start(&store, &format!("http://{addr}")).await;
    let url = gateway.path("/v1/jobs");

    let first = post(&url, "refused-1", "{}").await;
    assert_eq!(first.status, 502);
    assert_eq!(first.problem(), "upstream-unreachable");
    let job_id = first.job().unwrap();
    let job = gateway.job(&job_id).await;
    assert_eq!(job["state"], "open");
    assert_eq!(attempts(&job)[0]["state"], "failed");

    // The upstream comes up; the client's retry is attempt 2 of the same job.
    let upstream = FakeUpstream::serve(
        tokio::net::TcpListener::bind(addr).await.unwrap(),
        |r| async move { echo_response(&r) },
    );
    let retry = post(&url, "refused-1", "{}").await;
    assert_eq!(retry.status, 200);
    assert_eq!(retry.job().as_deref(), Some(job_id.as_str()));
    assert_eq!(retry.json()["attempt"], "2");
    assert_eq!(upstream.hits(), 1);
}

async fn retryable_status_is_passed_on_uncommitted_and_the_retry_runs_again(store: TestStore) {
    let upstream = FakeUpstream::overloaded_once().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let url = gateway.path("/v1/jobs");

    let first = post(&url, "busy-1", "{}").await;
    assert_eq!(
        first.status, 503,
        "the upstream's own answer reaches the client"
    );
    assert_eq!(first.json()["error"], "overloaded");
    let job_id = first.job().unwrap();
    assert_eq!(gateway.job(&job_id).await["state"], "open");

    let retry = post(&url, "busy-1", "{}").await;
    assert_eq!(retry.status, 200);
    assert_eq!(retry.json()["attempt"], "2");
    // A non-retryable error status is terminal: committed and replayed.
    let job = gateway.job(&job_id).await;
    assert_eq!(job["state"], "completed");
    assert_eq!(attempts(&job)[0]["upstream_status"], 503);
}

async fn error_answers_that_are_not_retryable_are_committed(store: TestStore) {
    let upstream = FakeUpstream::start(|_| async move {
        json_response(400, serde_json::json!({"error": "card declined"}))
    })
    .await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let url = gateway.path("/v1/charges");
    let first = post(&url, "declined", "{}").await;
    assert_eq!(first.status, 400);
    let again = post(&url, "declined", "{}").await;
    assert_eq!(again.status, 400);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    assert_eq!(upstream.hits(), 1);
}

async fn a_held_duplicate_past_the_hold_timeout_gets_409_in_progress(store: TestStore) {
    let gate = Gate::new();
    let upstream = first_answer_gated(&gate).await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("hold_timeout", "\"300ms\"")
        .start()
        .await;
    let url = gateway.path("/v1/jobs");
    let first = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "held-1", "{}").await }
    });
    upstream.arrival().await;
    let duplicate = post(&url, "held-1", "{}").await;
    assert_eq!(duplicate.status, 409);
    assert_eq!(duplicate.problem(), "request-in-progress");
    assert!(duplicate.header("retry-after").is_some());
    gate.open(1);
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(upstream.hits(), 1);
}

async fn a_running_attempt_keeps_renewing_its_lease(store: TestStore) {
    let gate = Gate::new();
    let upstream = first_answer_gated(&gate).await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("lease_ttl", "\"600ms\"")
        .start()
        .await;
    let first = tokio::spawn({
        let url = gateway.path("/v1/jobs");
        async move { post(&url, "long-1", "{}").await }
    });
    let job_id = upstream
        .arrival()
        .await
        .header("idempotency-key")
        .unwrap()
        .to_owned();
    let lease = |job: &Value| {
        attempts(job)[0]["lease_expires_at"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let initial = lease(&gateway.job(&job_id).await);
    // Several lease lengths pass with the sweeper running every 200 ms: the
    // lease moves forward and the attempt stays started.
    for _ in 0..3 {
        let before = lease(&gateway.job(&job_id).await);
        eventually(
            Duration::from_secs(10),
            "the lease to be renewed",
            || async { lease(&gateway.job(&job_id).await) > before },
        )
        .await;
    }
    let job = gateway.job(&job_id).await;
    assert!(lease(&job) > initial);
    assert_eq!(attempts(&job)[0]["state"], "started");
    assert_eq!(job["state"], "running");
    gate.open(1);
    assert_eq!(first.await.unwrap().status, 200);
}

async fn expired_jobs_are_purged_in_the_background(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("key_ttl", "\"1s\"")
        .set("sweep_interval", "\"200ms\"")
        .start()
        .await;
    let url = gateway.path("/v1/jobs");
    let first = post(&url, "short-lived", "{}").await;
    let job_id = first.job().unwrap();
    eventually(
        Duration::from_secs(10),
        "the expired job to be purged",
        || async {
            gateway
                .admin(Method::GET, &format!("/admin/v1/jobs/{job_id}"), "")
                .await
                .status
                == 404
        },
    )
    .await;
    // The key is free again: a new job, a new upstream call.
    let again = post(&url, "short-lived", "{}").await;
    assert_ne!(again.job(), first.job());
    assert_eq!(upstream.hits(), 2);
}

/// A call that outlasts its key's lifetime keeps its job: the sweeps past
/// `key_ttl` leave it, a retry of the key is held on it instead of calling
/// the upstream a second time, and the call's answer commits and is
/// replayed to the held retry (`docs/design.md` §11, "not forgotten").
async fn a_call_longer_than_its_keys_lifetime_keeps_its_job(store: TestStore) {
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("key_ttl", "\"1s\"")
        .set("sweep_interval", "\"100ms\"")
        .start()
        .await;
    let url = gateway.path("/v1/jobs");
    let first = {
        let url = url.clone();
        tokio::spawn(async move { post(&url, "slow-1", "{}").await })
    };
    upstream.arrival().await;
    // Past the key's lifetime, with a sweep every 100 ms meanwhile.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let kept = gateway
        .admin(Method::GET, "/admin/v1/jobs?owner=anonymous&key=slow-1", "")
        .await;
    assert_eq!(kept.status, 200, "the job was forgotten: {kept:?}");
    assert_eq!(kept.json()["state"], "running");
    let retry = {
        let url = url.clone();
        tokio::spawn(async move { post(&url, "slow-1", "{}").await })
    };
    eventually(
        Duration::from_secs(10),
        "the retry held on the job",
        || async { gateway.metric("idemgate_held_requests").await == 1.0 },
    )
    .await;
    gate.open(1);
    let (first, retry) = (first.await.unwrap(), retry.await.unwrap());
    assert_eq!(first.status, 200);
    assert_eq!((retry.status, retry.job()), (200, first.job()));
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.hits(), 1, "one upstream call");
}

async fn a_gateway_stopped_mid_attempt_records_it_unknown_at_once(store: TestStore) {
    let gate = Gate::new();
    let upstream = first_answer_gated(&gate).await;
    // A lease far longer than the test: only the shutdown can explain `unknown`.
    let builder = || {
        Gateway::builder(&store, &upstream.url())
            .set("lease_ttl", "\"10m\"")
            .set("shutdown_grace", "\"300ms\"")
    };
    let mut stopping = builder().start().await;
    let in_flight = crate::support::post_detached(stopping.path("/v1/jobs"), "stopped-1");
    let job_id = upstream
        .arrival()
        .await
        .header("idempotency-key")
        .unwrap()
        .to_owned();
    assert!(
        stopping.terminate().await.success(),
        "a clean exit on SIGTERM"
    );
    let _ = in_flight.await;

    let next = builder().start().await;
    let job = next.job(&job_id).await;
    assert_eq!(job["state"], "unknown");
    let detail = attempts(&job)[0]["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("shut down"), "{detail}");
    let retry = post(&next.path("/v1/jobs"), "stopped-1", "{}").await;
    assert_eq!(retry.status, 409);
    assert_eq!(upstream.hits(), 1);
    gate.open(1);
}

#[tokio::test]
async fn a_gateway_killed_mid_attempt_leaves_the_attempt_unknown_once_its_lease_lapses() {
    let store = TestStore::postgres().await;
    let gate = Gate::new();
    let upstream = first_answer_gated(&gate).await;
    let mut doomed = Gateway::builder(&store, &upstream.url())
        .set("lease_ttl", "\"600ms\"")
        .start()
        .await;
    let survivor = Gateway::builder(&store, &upstream.url())
        .set("lease_ttl", "\"600ms\"")
        .set("hold_timeout", "\"20s\"")
        .start()
        .await;

    let in_flight = crate::support::post_detached(doomed.path("/v1/jobs"), "killed-1");
    let arrived = upstream.arrival().await;
    let job_id = arrived.header("idempotency-key").unwrap().to_owned();
    doomed.kill().await;
    assert!(
        in_flight.await.unwrap().is_err(),
        "the client lost its connection"
    );

    // A duplicate on the survivor is held while the job runs, and released
    // with 409 when the survivor's sweeper finds the lapsed lease.
    let duplicate = post(&survivor.path("/v1/jobs"), "killed-1", "{}").await;
    assert_eq!(duplicate.status, 409);
    assert_eq!(duplicate.problem(), "attempt-outcome-unknown");
    assert_eq!(duplicate.job().as_deref(), Some(job_id.as_str()));

    let job = survivor.job(&job_id).await;
    assert_eq!(job["state"], "unknown");
    assert_eq!(
        job["response"],
        Value::Null,
        "nothing that never finished is stored"
    );
    let attempt = &attempts(&job)[0];
    assert_eq!(attempt["state"], "unknown");
    assert!(attempt["detail"].as_str().unwrap().contains("lease"));

    // The upstream finishing into the void changes nothing.
    gate.open(1);
    let again = post(&survivor.path("/v1/jobs"), "killed-1", "{}").await;
    assert_eq!(again.status, 409);
    assert_eq!(upstream.hits(), 1);
}

async fn resolving_an_unknown_attempt_as_succeeded_commits_the_given_response(store: TestStore) {
    let gate = Gate::new();
    let upstream = first_answer_gated(&gate).await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"300ms\"")
        .start()
        .await;
    let url = gateway.path("/v1/jobs");
    let first = post(&url, "manual-1", "{}").await;
    assert_eq!(first.status, 504);
    let job = gateway.job(&first.job().unwrap()).await;
    let attempt = attempts(&job)[0]["id"].as_str().unwrap().to_owned();

    // A length of its own would frame every replay's connection wrongly
    // (stray bytes ahead of the next answer): refused, nothing written.
    let framed = gateway
        .resolve(
            &attempt,
            r#"{"outcome": "succeeded", "response": {"status": 200, "headers": [["content-length", "2"]], "body": "hello world"}}"#,
        )
        .await;
    assert_eq!(framed.status, 400, "{:?}", framed.body);
    assert!(
        framed.problem_detail().contains("content-length"),
        "{framed:?}"
    );
    assert_eq!(gateway.job(&first.job().unwrap()).await["state"], "unknown");

    let resolved = gateway
        .resolve(
            &attempt,
            r#"{"outcome": "succeeded", "response": {"status": 201, "headers": [["content-type", "application/json"]], "body": "{\"settled\": true}"}}"#,
        )
        .await;
    assert_eq!(resolved.status, 200, "{:?}", resolved.body);
    assert_eq!(resolved.json()["state"], "completed");

    let replay = post(&url, "manual-1", "{}").await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("content-type"), Some("application/json"));
    assert_eq!(replay.body.as_ref(), br#"{"settled": true}"#);

    // A settled attempt cannot be resolved again.
    let again = gateway.resolve(&attempt, r#"{"outcome": "failed"}"#).await;
    assert_eq!(again.status, 409);
    gate.open(1);
}

async fn admin_rejects_malformed_resolutions(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let missing = gateway
        .resolve(
            &uuid::Uuid::new_v4().to_string(),
            r#"{"outcome": "failed"}"#,
        )
        .await;
    assert_eq!(missing.status, 404);
    let bad = gateway
        .resolve(&uuid::Uuid::new_v4().to_string(), r#"{"outcome": "maybe"}"#)
        .await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.problem(), "invalid-admin-request");
    let no_response = gateway
        .resolve(
            &uuid::Uuid::new_v4().to_string(),
            r#"{"outcome": "succeeded"}"#,
        )
        .await;
    assert_eq!(no_response.status, 400);
    let not_json = send(
        Method::POST,
        &format!("{}/admin/v1/attempts/x/resolve", gateway.admin_url),
        &[],
        "{",
    )
    .await;
    assert_eq!(not_json.status, 401, "auth is checked before anything else");
}

/// An upstream that answers `101 Switching Protocols` (the gateway asked
/// for no upgrade), typed as an event stream, on a raw socket: the 101 is
/// no final answer, streamed or not. The attempt is `unknown`, nothing is
/// committed, and the client is never switched: its retry is told the
/// outcome is unknown. Before, the typed 101 went down the streaming path
/// and was committed, and every replay switched its client's connection.
async fn an_upstreams_101_typed_as_a_stream_is_no_answer(store: TestStore) {
    let (upstream, hits) = raw_upstream(|_| {
        "HTTP/1.1 101 Switching Protocols\r\n\
         connection: upgrade\r\nupgrade: sse\r\n\
         content-type: text/event-stream\r\n\r\n\
         data: switched\n\n"
    })
    .await;
    let gateway = Gateway::start(&store, &upstream).await;
    let url = gateway.path("/v1/chat/completions");
    let first = post(&url, "switched", "{}").await;
    assert!(first.status >= 500, "{first:?}");
    let retry = post(&url, "switched", "{}").await;
    assert_eq!(retry.status, 409, "{retry:?}");
    assert_eq!(retry.problem(), "attempt-outcome-unknown");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 1);
    let committed = store
        .column("SELECT count(*) FROM jobs WHERE response_status IS NOT NULL")
        .await;
    assert_eq!(committed, ["0"]);
}

/// An answer framed two ways (a `Transfer-Encoding` other than `chunked`
/// alone, or one beside a `Content-Length`) is no answer to record: its
/// bytes may be a cut (`identity` beside a length of 50, 4 bytes sent) or
/// still encoded (`gzip, chunked`). Before, each was committed and
/// replayed as whole; now the attempt is unknown, as any broken answer.
async fn an_answer_framed_two_ways_is_never_committed(store: TestStore) {
    let (upstream, hits) = raw_upstream(|head| {
        if head.contains("/identity") {
            "HTTP/1.1 200 OK\r\ntransfer-encoding: identity\r\ncontent-length: 50\r\n\
             content-type: application/json\r\n\r\n{\"a\""
        } else if head.contains("/both") {
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\
             content-type: application/json\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
        } else {
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\
             content-type: application/json\r\n\r\n2\r\n\x1f\x7f\r\n0\r\n\r\n"
        }
    })
    .await;
    let gateway = Gateway::start(&store, &upstream).await;
    for path in ["/v1/identity", "/v1/both", "/v1/gzip"] {
        let url = gateway.path(path);
        let first = post(&url, path, "{}").await;
        assert_eq!(first.status, 502, "{path}: {first:?}");
        let retry = post(&url, path, "{}").await;
        assert_eq!(retry.status, 409, "{path}: {retry:?}");
        assert_eq!(retry.problem(), "attempt-outcome-unknown");
    }
    assert_eq!(
        hits.load(std::sync::atomic::Ordering::SeqCst),
        3,
        "each sent once"
    );
    let committed = store
        .column("SELECT count(*) FROM jobs WHERE response_status IS NOT NULL")
        .await;
    assert_eq!(committed, ["0"]);
}

/// An upstream on a socket of its own that answers each request's head
/// with `answer(head)`, written raw, then closes; and how many
/// connections it took.
async fn raw_upstream(
    answer: fn(&str) -> &'static str,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let hits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = hits.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let Some(head) = crate::support::upstream::read_head(&mut socket).await else {
                    return;
                };
                let reply = answer(&String::from_utf8_lossy(&head));
                let _ = socket.write_all(reply.as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    (url, hits)
}

crate::on_each_deployment!(
    [embedded, postgres]
    an_answer_framed_two_ways_is_never_committed,
    an_upstreams_101_typed_as_a_stream_is_no_answer,
    a_retry_while_the_late_call_is_out_is_held_for_its_answer,
    a_conflict_route_is_not_held_on_a_late_call,
    a_gateway_stopped_mid_attempt_records_it_unknown_at_once,
    a_running_attempt_keeps_renewing_its_lease,
    expired_jobs_are_purged_in_the_background,
    a_call_longer_than_its_keys_lifetime_keeps_its_job,
    timeout_makes_the_job_unknown_until_resolved_then_attempt_two_runs,
    late_answer_before_the_deadline_is_committed_and_replayed,
    refused_connection_fails_the_attempt_and_the_retry_makes_attempt_two,
    retryable_status_is_passed_on_uncommitted_and_the_retry_runs_again,
    error_answers_that_are_not_retryable_are_committed,
    a_held_duplicate_past_the_hold_timeout_gets_409_in_progress,
    resolving_an_unknown_attempt_as_succeeded_commits_the_given_response,
    admin_rejects_malformed_resolutions,
);
