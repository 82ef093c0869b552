//! A duplicate of a running job, as each route chooses (issue 22): held
//! until the job's answer (`in_progress = "hold"`, the default), or
//! answered `409 …/request-in-progress` with `Retry-After` at once
//! (`"conflict"`, the IETF draft's SHOULD), streamed jobs included.

use std::time::Duration;

use tokio::time::Instant;

use crate::support::deployment::Deployment;
use crate::support::sse::{Ending, Finish, Reader, SseUpstream};
use crate::support::{eventually, post, FakeUpstream, Gate};

fn route(in_progress: &str) -> String {
    format!(
        "[[routes]]\nname = \"charges\"\npath_prefix = \"/v1\"\nin_progress = \"{in_progress}\"\n"
    )
}

async fn hold_waits_for_the_running_job_and_replays_its_answer(env: Deployment) {
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    let gateway = env
        .gateway(&upstream.url())
        .tables(&route("hold"))
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    let first = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "held", "{}").await }
    });
    upstream.arrival().await;
    let duplicate = tokio::spawn(async move { post(&url, "held", "{}").await });
    eventually(
        Duration::from_secs(20),
        "the duplicate to be held",
        || async { gateway.metric("idemgate_held_requests").await == 1.0 },
    )
    .await;
    assert!(!duplicate.is_finished(), "held while the job runs");
    gate.open(1);
    let (first, duplicate) = (first.await.unwrap(), duplicate.await.unwrap());
    assert_eq!((first.status, duplicate.status), (200, 200));
    assert_eq!(duplicate.header("idempotent-replayed"), Some("true"));
    assert_eq!(duplicate.body, first.body);
    assert_eq!(upstream.hits(), 1);
}

async fn conflict_answers_409_at_once_and_the_retry_replays(env: Deployment) {
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    let gateway = env
        .gateway(&upstream.url())
        .set("retry_after", "\"2s\"")
        .tables(&route("conflict"))
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    let first = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "busy", "{}").await }
    });
    upstream.arrival().await;
    let started = Instant::now();
    let duplicate = post(&url, "busy", "{}").await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "at once, not held"
    );
    assert_eq!(duplicate.status, 409);
    assert_eq!(duplicate.problem(), "request-in-progress");
    assert_eq!(duplicate.header("retry-after"), Some("2"));
    assert_eq!(
        duplicate.header("x-should-retry"),
        None,
        "a retry later wins"
    );
    assert!(duplicate.job().is_some(), "names the running job");
    assert_eq!(gateway.metric("idemgate_requests_held_total").await, 0.0);
    gate.open(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, 200);
    assert_eq!(duplicate.job(), first.job());
    // Once it has finished, the retry the 409 asked for gets its answer.
    let retry = post(&url, "busy", "{}").await;
    assert_eq!(retry.status, 200);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.hits(), 1);
}

async fn conflict_does_not_join_a_running_stream(env: Deployment) {
    let gate = Gate::new();
    let upstream = SseUpstream::start(3, 64, &gate, Ending::Clean).await;
    let gateway = env
        .gateway(&upstream.url())
        .set("upstream_timeout", "\"5s\"")
        .tables(&route("conflict"))
        .start()
        .await;
    let url = gateway.path("/v1/chat");
    gate.open(1);
    let mut first = Reader::post(&url, "streaming", "{}").await;
    first.read_until(64).await;
    let duplicate = post(&url, "streaming", "{}").await;
    assert_eq!(duplicate.status, 409);
    assert_eq!(duplicate.problem(), "request-in-progress");
    assert!(duplicate.header("retry-after").is_some());
    gate.open(2);
    assert_eq!(first.finish().await, Finish::Complete);
    let mut replay = Reader::post(&url, "streaming", "{}").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.finish().await, Finish::Complete);
    assert_eq!(replay.read, first.read);
    assert_eq!(upstream.hits(), 1);
}

crate::on_each_deployment!(
    [embedded, postgres_redis]
    hold_waits_for_the_running_job_and_replays_its_answer,
    conflict_answers_409_at_once_and_the_retry_replays,
    conflict_does_not_join_a_running_stream,
);

#[tokio::test]
async fn an_unknown_in_progress_setting_stops_start_up_naming_the_key() {
    let env = Deployment::embedded().await;
    let err = env
        .gateway("http://127.0.0.1:1")
        .tables(&route("wait"))
        .start_and_fail()
        .await;
    assert!(err.contains("routes[0].in_progress"), "{err}");
    assert!(
        err.contains("\"hold\"") && err.contains("\"conflict\""),
        "{err}"
    );
}
