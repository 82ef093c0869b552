//! The embedded store end to end: restarts keep their promises, and one
//! file serves one gateway.

use crate::support::{post, FakeUpstream, Gate, Gateway, TestStore};

#[tokio::test]
async fn a_gateway_killed_and_restarted_on_its_file_replays_and_reports_unfinished_as_unknown() {
    let store = TestStore::embedded();
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |r| r.hit == 2).await;
    let mut first = Gateway::start(&store, &upstream.url()).await;
    let done = post(&first.path("/v1/jobs"), "finished", "{}").await;
    assert_eq!(done.status, 200);

    let in_flight = crate::support::post_detached(first.path("/v1/jobs"), "unfinished");
    upstream.arrival().await;
    let unfinished_job = upstream
        .arrival()
        .await
        .header("idempotency-key")
        .unwrap()
        .to_owned();
    first.kill().await;
    assert!(in_flight.await.unwrap().is_err());

    let second = Gateway::start(&store, &upstream.url()).await;
    let replay = post(&second.path("/v1/jobs"), "finished", "{}").await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        replay.body, done.body,
        "what was committed before the crash is replayed"
    );

    let blocked = post(&second.path("/v1/jobs"), "unfinished", "{}").await;
    assert_eq!(blocked.status, 409);
    assert_eq!(blocked.problem(), "attempt-outcome-unknown");
    let job = second.job(&unfinished_job).await;
    assert_eq!(job["state"], "unknown");
    assert_eq!(job["attempts"][0]["state"], "unknown");
    assert!(job["attempts"][0]["detail"]
        .as_str()
        .unwrap()
        .contains("stopped"));
    assert_eq!(upstream.hits(), 2);
    gate.open(1);
}

#[tokio::test]
async fn one_embedded_file_serves_one_gateway() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let _running = Gateway::start(&store, &upstream.url()).await;
    let err = Gateway::builder(&store, &upstream.url())
        .start_and_fail()
        .await;
    assert!(err.contains("another idemgate"), "{err}");
    assert!(err.contains("PostgreSQL"), "{err}");
}
