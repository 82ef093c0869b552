//! The upstream pool seen from outside: a burst of concurrent requests opens
//! as many upstream connections as it needs, and once it is over the gateway
//! keeps no more of them idle than its cap (design §11).

use std::time::Duration;

use http::Method;

use crate::support::{send, FakeUpstream, Gate, Gateway, TestStore};

/// The pool's cap on idle connections per upstream
/// (`proxy::upstream::pool::MAX_IDLE`).
const IDLE_CAP: usize = 128;

/// `n` pass-through requests held at the upstream together, so each takes
/// a connection of its own, then answered.
async fn burst(gateway: &Gateway, upstream: &FakeUpstream, gate: &Gate, n: usize) {
    let before = upstream.hits();
    let held: Vec<_> = (0..n)
        .map(|_| {
            let url = gateway.path("/v1/models");
            tokio::spawn(async move { send(Method::GET, &url, &[], "").await })
        })
        .collect();
    let arrived = async {
        while upstream.hits() < before + n {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), arrived)
        .await
        .expect("the whole burst reached the upstream");
    gate.open(n);
    for reply in held {
        assert_eq!(reply.await.unwrap().status, 200);
    }
}

/// Two bursts of 200 concurrent requests: the first opens 200 connections,
/// of which the pool keeps 128 and closes 72; the second reuses the 128 and
/// opens 72 again.
#[tokio::test]
async fn a_burst_past_the_idle_cap_leaves_only_the_cap_open() {
    let store = TestStore::embedded();
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let n = IDLE_CAP + 72;
    burst(&gateway, &upstream, &gate, n).await;
    assert_eq!(upstream.connections(), n);
    // A connection whose answer ended before it was ready again is returned
    // by a task of its own, a moment later.
    tokio::time::sleep(Duration::from_millis(200)).await;
    burst(&gateway, &upstream, &gate, n).await;
    assert_eq!(
        upstream.connections(),
        n + (n - IDLE_CAP),
        "the second burst reused the {IDLE_CAP} kept and opened the rest anew"
    );
}
