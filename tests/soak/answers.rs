//! Answers and replays within the memory budget (`docs/design.md` §18):
//! a 128 MiB budget against 40 parallel keyed calls whose answers are
//! 10 MiB (400 MiB of answers), 40 parallel cold replays of one stored
//! 10 MiB answer, and 40 parallel retries of its key with another body.
//!
//! What must hold, on each store set-up: every client is answered `200` or
//! `503 …/overloaded` with `Retry-After`; every `200` is the answer byte
//! for byte and replays so; and the gateway's peak resident memory during
//! each burst stays within 1.5 times the budget over its idle resident
//! memory before it.

use std::sync::Arc;

use bytes::Bytes;
use futures_util::future::join_all;
use http::{Method, Response};
use http_body_util::Full;

use crate::support::deployment::Deployment;
use crate::support::process::{peak_rss, rss};
use crate::support::{send, FakeUpstream, Gateway, Reply};

const BUDGET: u64 = 128 << 20;
const ANSWER: usize = 10 << 20;
const CALLS: usize = 40;

/// An upstream whose answer to a body is that body repeated to 10 MiB,
/// sent once `together` requests have arrived: the answers all come at
/// once, more than the budget holds.
async fn big_answers(together: usize) -> FakeUpstream {
    let barrier = Arc::new(tokio::sync::Barrier::new(together));
    FakeUpstream::start(move |r| {
        let barrier = barrier.clone();
        async move {
            barrier.wait().await;
            Response::builder()
                .header("content-type", "application/octet-stream")
                .body(Full::new(answer_to(&r.body)))
                .unwrap()
        }
    })
    .await
}

/// `body` (of a length that divides 10 MiB) repeated to 10 MiB.
fn answer_to(body: &[u8]) -> Bytes {
    Bytes::from(body.repeat(ANSWER / body.len()))
}

/// Two bytes of its own for each call.
fn body_of(i: usize) -> String {
    let letter = |n: usize| char::from(b'a' + (n % 26) as u8);
    format!("{}{}", letter(i / 26), letter(i))
}

async fn gateway(deployment: &Deployment, upstream: &FakeUpstream) -> Gateway {
    deployment
        .gateway(&upstream.url())
        .set("memory_budget", "\"128MiB\"")
        // Cold replays: none is kept in this replica's memory.
        .set("replay_cache_size", "\"1KiB\"")
        .start()
        .await
}

async fn call(gateway: &Gateway, key: impl AsRef<str>, body: impl Into<String>) -> Reply {
    let headers = [
        ("idempotency-key", key.as_ref()),
        ("content-type", "application/octet-stream"),
    ];
    send(
        Method::POST,
        &gateway.path("/v1/renders"),
        &headers,
        body.into(),
    )
    .await
}

/// Forgets the process's peak so far (`clear_refs` 5 resets VmHWM), and
/// gives its resident memory now.
fn idle_baseline(pid: u32) -> u64 {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("VmHWM reset");
    rss(pid)
}

/// Asserts the burst's peak stayed within 1.5 budgets over `baseline`.
fn assert_within_budget(what: &str, pid: u32, baseline: u64) {
    let peak = peak_rss(pid);
    let over = peak.saturating_sub(baseline);
    eprintln!(
        "{what}: idle {} MiB, peak {} MiB (+{} MiB), after {} MiB",
        baseline >> 20,
        peak >> 20,
        over >> 20,
        rss(pid) >> 20
    );
    assert!(
        over <= BUDGET * 3 / 2,
        "{what}: peak {} MiB is {} MiB over the idle {} MiB, past 1.5 × the {} MiB budget",
        peak >> 20,
        over >> 20,
        baseline >> 20,
        BUDGET >> 20
    );
}

/// `200` with `expected`, or `503 …/overloaded` with `Retry-After`; true
/// for a `200`.
fn served_or_refused(reply: &Reply, expected: &[u8]) -> bool {
    match reply.status {
        200 => {
            assert!(reply.body == expected, "a 200 that is not the answer");
            true
        }
        503 => {
            assert_eq!(reply.problem(), "overloaded");
            assert!(
                reply.header("retry-after").is_some(),
                "503 without Retry-After"
            );
            false
        }
        other => panic!("{other}: {:?}", String::from_utf8_lossy(&reply.body)),
    }
}

async fn ten_mib_answers_stay_within_the_budget(deployment: Deployment) {
    let _alone = crate::ALONE.lock().await;
    let upstream = big_answers(CALLS).await;
    let gateway = gateway(&deployment, &upstream).await;
    let baseline = idle_baseline(gateway.pid());
    let replies = join_all((0..CALLS).map(|i| call(&gateway, format!("k{i}"), body_of(i)))).await;
    assert_within_budget("40 answers of 10 MiB", gateway.pid(), baseline);
    let served: Vec<usize> = (0..CALLS)
        .filter(|&i| served_or_refused(&replies[i], &answer_to(body_of(i).as_bytes())))
        .collect();
    assert!(!served.is_empty(), "some answers were served");
    assert!(
        served.len() < CALLS,
        "400 MiB of answers did not all fit 128 MiB"
    );
    for i in served {
        let again = call(&gateway, format!("k{i}"), body_of(i)).await;
        assert_eq!(again.status, 200, "a served answer replays");
        assert!(
            again.body == answer_to(body_of(i).as_bytes()),
            "byte for byte"
        );
    }
}

async fn cold_replays_and_mismatches_stay_within_the_budget(deployment: Deployment) {
    let _alone = crate::ALONE.lock().await;
    let upstream = big_answers(1).await;
    let gateway = gateway(&deployment, &upstream).await;
    let first = call(&gateway, "stored", "st").await;
    assert_eq!(first.status, 200);
    let expected = answer_to(b"st");
    assert!(first.body == expected);

    let baseline = idle_baseline(gateway.pid());
    let replays = join_all((0..CALLS).map(|_| call(&gateway, "stored", "st"))).await;
    assert_within_budget("40 cold replays of 10 MiB", gateway.pid(), baseline);
    let served = replays
        .iter()
        .filter(|r| served_or_refused(r, &expected))
        .count();
    assert!(served > 0, "some replays were served");

    let baseline = idle_baseline(gateway.pid());
    let mismatches = join_all((0..CALLS).map(|_| call(&gateway, "stored", "other"))).await;
    assert_within_budget("40 mismatched retries", gateway.pid(), baseline);
    for reply in &mismatches {
        assert_eq!(reply.problem(), "idempotency-key-mismatch");
    }
    assert_eq!(upstream.hits(), 1, "the stored answer ran once");
}

crate::on_each_deployment!(
    [embedded, postgres, postgres_redis]
    ten_mib_answers_stay_within_the_budget,
    cold_replays_and_mismatches_stay_within_the_budget,
);
