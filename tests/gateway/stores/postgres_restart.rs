//! PostgreSQL going away under a running gateway, and coming back.

use std::time::Duration;

use http::Method;

use crate::support::postgres::ThrowawayPostgres;
use crate::support::{eventually, post, send, FakeUpstream, Gate, Gateway, TestStore};

#[tokio::test]
async fn postgres_restarted_under_a_running_gateway() {
    let pg = ThrowawayPostgres::start().await;
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |r| {
        r.header("idempotency-key").is_some() && r.hit == 2
    })
    .await;
    let gateway = Gateway::builder(&TestStore::external(pg.url()), &upstream.url())
        .set("database_timeout", "\"500ms\"")
        .set("hold_timeout", "\"30s\"")
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    let committed = post(&url, "before", "{}").await;
    assert_eq!(committed.status, 200);

    // A job in flight, with a duplicate held on it, when the database goes away.
    let first = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "across", "{}").await }
    });
    upstream.arrival().await;
    upstream.arrival().await;
    let held = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "across", "{}").await }
    });
    eventually(
        Duration::from_secs(10),
        "the duplicate to be held",
        || async { gateway.metric("idemgate_held_requests").await >= 1.0 },
    )
    .await;
    pg.stop();

    let refused = post(&url, "during", "{}").await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.problem(), "store-unavailable");
    let passed = send(Method::GET, &gateway.path("/v1/models"), &[], "").await;
    assert_eq!(passed.status, 200, "traffic that does not opt in flows on");
    // The replica stays ready (a shared store down must not empty the
    // Service), and says what is down.
    let readyz = format!("{}/readyz", gateway.admin_url);
    let store_is = |want: &'static str| {
        let readyz = readyz.clone();
        move || {
            let readyz = readyz.clone();
            async move {
                let ready = send(Method::GET, &readyz, &[], "").await;
                assert_eq!(
                    ready.status,
                    200,
                    "{}",
                    String::from_utf8_lossy(&ready.body)
                );
                ready.json()["dependencies"]["store"]["status"] == want
            }
        }
    };
    eventually(
        Duration::from_secs(10),
        "the store reported down",
        store_is("down"),
    )
    .await;
    let hits_while_down = upstream.hits();

    pg.start_again();
    // The in-flight answer commits once the database is back (a commit on
    // a dead pooled connection is retried on a fresh one), and the held
    // duplicate, woken by the reconnected listener, replays it.
    gate.open(1);
    let (first, held) = (first.await.unwrap(), held.await.unwrap());
    assert_eq!(held.status, 200);
    assert_eq!(held.header("idempotent-replayed"), Some("true"));
    // The first client waits at most 2 s for the commit; on a loaded
    // machine the reconnection can take longer, and then it is told its
    // answer is on its way (never the uncommitted bytes): its retry gets it.
    let first = match first.status {
        200 => first,
        _ => {
            assert_eq!(first.problem(), "outcome-not-recorded");
            post(&url, "across", "{}").await
        }
    };
    assert_eq!(first.status, 200);
    assert_eq!(held.body, first.body);

    eventually(
        Duration::from_secs(20),
        "the store reported up",
        store_is("up"),
    )
    .await;
    eventually(
        Duration::from_secs(20),
        "the gateway to use the database again",
        || async { post(&url, "before", "{}").await.status == 200 },
    )
    .await;
    let replay = post(&url, "before", "{}").await;
    assert_eq!(
        replay.body, committed.body,
        "what was committed survives the restart"
    );
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    let after = post(&url, "during", "{}").await;
    assert_eq!(
        after.status, 200,
        "the key refused while the database was down was not burnt"
    );
    assert_eq!(upstream.hits(), hits_while_down + 1);
}
