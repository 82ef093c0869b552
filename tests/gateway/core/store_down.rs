//! A store that cannot be reached: 503 and nothing proxied, except
//! repeats this replica remembers, and never near their expiry.

use std::time::Duration;

use http::Method;

use crate::support::{eventually, post, send, FakeUpstream, Gateway, TestStore};

#[tokio::test]
async fn store_unreachable_means_503_and_nothing_proxied() {
    let upstream = FakeUpstream::echo().await;
    let closed = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let nowhere = TestStore::external(format!("postgres://postgres@{closed}/nowhere"));
    let gateway = Gateway::builder(&nowhere, &upstream.url())
        .set("database_timeout", "\"500ms\"")
        .start()
        .await;
    let reply = post(&gateway.path("/v1/charges"), "no-store", "{}").await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.problem(), "store-unavailable");
    assert_eq!(
        upstream.hits(),
        0,
        "an opted-in request that cannot be recorded is never proxied"
    );

    // Ready all the same: the store is shared by every replica, and a
    // failing readiness would take all of them out of the Service at once
    // (docs/design.md §8). The body says what is down.
    let readyz = format!("{}/readyz", gateway.admin_url);
    eventually(
        Duration::from_secs(10),
        "the store reported down",
        || async {
            let ready = send(Method::GET, &readyz, &[], "").await;
            assert_eq!(
                ready.status,
                200,
                "{:?}",
                String::from_utf8_lossy(&ready.body)
            );
            ready.json()["dependencies"]["store"]["status"] == "down"
        },
    )
    .await;
    let ready = send(Method::GET, &readyz, &[], "").await.json();
    assert_eq!(ready["status"], "degraded");
    assert!(
        ready["dependencies"]["store"]["error"]
            .as_str()
            .is_some_and(|e| !e.is_empty()),
        "{ready}"
    );
    assert_eq!(
        gateway
            .metric("idemgate_dependency_up{dependency=\"store\"}")
            .await,
        0.0
    );
    // Traffic that does not opt in does not need the store.
    let get = send(Method::GET, &gateway.path("/v1/models"), &[], "").await;
    assert_eq!(get.status, 200);
    assert_eq!(upstream.hits(), 1);
}

/// A repeat of a request whose answer this replica has seen is replayed
/// from its memory, so it keeps working with the database stopped; with
/// `replay_cache_size = 0` the same repeat needs the database. A request
/// with another fingerprint is never answered from memory: the store
/// decides, and it is down.
#[tokio::test]
async fn a_repeat_is_replayed_from_memory_with_the_database_down() {
    let pg = crate::support::postgres::ThrowawayPostgres::start().await;
    let upstream = FakeUpstream::echo().await;
    let store = TestStore::external(pg.url());
    let remembering = Gateway::builder(&store, &upstream.url())
        .set("database_timeout", "\"500ms\"")
        .start()
        .await;
    let forgetting = Gateway::builder(&store, &upstream.url())
        .set("database_timeout", "\"500ms\"")
        .set("replay_cache_size", "0")
        .start()
        .await;
    let (on, off) = (
        remembering.path("/v1/charges"),
        forgetting.path("/v1/charges"),
    );
    let first = post(&on, "remembered", r#"{"amount": 1}"#).await;
    assert_eq!(first.status, 200);
    assert_eq!(post(&off, "forgotten", "{}").await.status, 200);
    assert_eq!(upstream.hits(), 2);

    pg.stop();
    let replay = post(&on, "remembered", r#"{"amount": 1}"#).await;
    assert_eq!(replay.status, 200, "{:?}", replay.body);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.job(), first.job());
    assert_eq!(
        remembering
            .metric("idemgate_replays_total{source=\"memory\"}")
            .await,
        1.0
    );
    let other = post(&on, "remembered", r#"{"amount": 2}"#).await;
    assert_eq!(other.status, 503);
    assert_eq!(other.problem(), "store-unavailable");
    let without = post(&off, "forgotten", "{}").await;
    assert_eq!(without.status, 503);
    assert_eq!(without.problem(), "store-unavailable");
    assert_eq!(upstream.hits(), 2, "nothing proxied again");
}

/// An answer is not replayed from memory near its job's expiry (another
/// replica's clock may already have let the key go): with keys kept for
/// less than that margin, every replay comes from the store.
#[tokio::test]
async fn answers_near_their_expiry_are_replayed_from_the_store() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("key_ttl", "\"3s\"")
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    let first = post(&url, "brief", "{}").await;
    for _ in 0..3 {
        let replay = post(&url, "brief", "{}").await;
        assert_eq!(replay.status, 200);
        assert_eq!(replay.job(), first.job());
    }
    assert_eq!(upstream.hits(), 1);
    assert_eq!(
        gateway
            .metric("idemgate_replays_total{source=\"store\"}")
            .await,
        3.0
    );
    assert_eq!(
        gateway
            .metric("idemgate_replays_total{source=\"memory\"}")
            .await,
        0.0
    );
}
