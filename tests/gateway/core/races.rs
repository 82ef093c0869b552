//! Duplicates racing each other: one job, one upstream call, one result.

use std::time::Duration;

use futures_util::future::join_all;

use crate::support::{eventually, post, FakeUpstream, Gate, Gateway, Reply, TestStore};

/// Sends `n` duplicates at once, holds the upstream until all the rest are
/// held by the gateways, then lets it answer.
async fn double_click(
    n: usize,
    gateways: &[&Gateway],
    upstream: &FakeUpstream,
    gate: &Gate,
) -> Vec<Reply> {
    let body = r#"{"amount": 42}"#;
    // The first request reaches the upstream and is held there…
    let first = tokio::spawn(post_owned(gateways[0].path("/v1/charges"), body));
    let arrived = upstream.arrival().await;
    assert_eq!(arrived.hit, 1);
    // …while the duplicates arrive, spread across the gateways.
    let rest: Vec<_> = (1..n)
        .map(|i| {
            tokio::spawn(post_owned(
                gateways[i % gateways.len()].path("/v1/charges"),
                body,
            ))
        })
        .collect();
    let expected = (n - 1) as f64;
    eventually(
        Duration::from_secs(10),
        "every duplicate to be held",
        || async {
            let mut held = 0.0;
            for g in gateways {
                held += g.metric("idemgate_held_requests").await;
            }
            held == expected
        },
    )
    .await;
    gate.open(1);
    let mut replies = vec![first.await.unwrap()];
    replies.extend(join_all(rest).await.into_iter().map(Result::unwrap));
    replies
}

async fn post_owned(url: String, body: &'static str) -> Reply {
    post(&url, "double-click", body).await
}

fn assert_one_result(replies: &[Reply], upstream: &FakeUpstream) {
    assert_eq!(upstream.hits(), 1, "exactly one upstream call");
    let job = replies[0].job().expect("job header");
    for reply in replies {
        assert_eq!(
            reply.status,
            200,
            "{:?}",
            String::from_utf8_lossy(&reply.body)
        );
        assert_eq!(
            reply.job().as_deref(),
            Some(job.as_str()),
            "one job id on every answer"
        );
        assert_eq!(reply.body, replies[0].body, "identical bodies");
    }
    assert_eq!(
        replies[0].header("idempotent-replayed"),
        None,
        "the first answer is not a replay"
    );
    assert!(replies[1..]
        .iter()
        .all(|r| r.header("idempotent-replayed") == Some("true")));
    assert_eq!(
        replies[0].json()["job"],
        job.as_str(),
        "upstream saw the job id as its key"
    );
}

async fn two_simultaneous_duplicates_make_one_upstream_call(store: TestStore) {
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let replies = double_click(2, &[&gateway], &upstream, &gate).await;
    assert_one_result(&replies, &upstream);
}

async fn fifty_simultaneous_duplicates_make_one_upstream_call(store: TestStore) {
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let replies = double_click(50, &[&gateway], &upstream, &gate).await;
    assert_one_result(&replies, &upstream);
}

#[tokio::test]
async fn duplicates_across_two_processes_on_one_database() {
    let store = TestStore::postgres().await;
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    let a = Gateway::start(&store, &upstream.url()).await;
    let b = Gateway::start(&store, &upstream.url()).await;
    // Duplicates held on b are released by a's commit: the wake-up crosses processes.
    let replies = double_click(20, &[&a, &b], &upstream, &gate).await;
    assert_one_result(&replies, &upstream);
}

/// `worker_threads = 1` runs a gateway on Tokio's current-thread runtime
/// (its start-up line says so), and the race still comes out right with
/// everything on that one thread: it owns the job, duplicates are held on
/// it and on a multi-threaded replica, and its commit releases both. Its
/// log, written to a file, carries no terminal colour codes.
#[tokio::test]
async fn one_worker_thread_serves_the_race_on_the_current_thread_runtime() {
    let store = TestStore::postgres().await;
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let one = Gateway::builder(&store, &upstream.url())
        .set("worker_threads", "1")
        .env("RUST_LOG", "info")
        .stderr_to(log.path())
        .start()
        .await;
    let many = Gateway::builder(&store, &upstream.url())
        .set("worker_threads", "3")
        .start()
        .await;
    let replies = double_click(20, &[&one, &many], &upstream, &gate).await;
    assert_one_result(&replies, &upstream);
    let started = std::fs::read_to_string(log.path()).unwrap();
    assert!(
        started.contains("runtime=CurrentThread") && started.contains("worker_threads=1"),
        "{started}"
    );
    // Logs going to a file carry no terminal colour codes.
    assert!(!started.contains('\u{1b}'), "{started:?}");
}

/// `worker_runtime = "per_thread"`: each of two worker threads runs a
/// runtime of its own, accepts its own connections on the one listener
/// and sends their statements through its own lane of the pool. The race
/// still comes out right when the owner and its duplicates sit on
/// different threads (and on a replica with a shared runtime), both
/// workers accept (`idemgate_connections_accepted_total` by worker), new
/// keys commit from each lane, and SIGTERM drains a request in flight.
/// Connections `gateway`'s proxy listener accepted on `worker`.
async fn accepted(gateway: &Gateway, worker: usize) -> f64 {
    let worker = format!("worker=\"{worker}\"");
    gateway
        .metric_labelled("idemgate_connections_accepted_total", &[&worker])
        .await
}

#[tokio::test]
async fn a_runtime_per_worker_thread_serves_the_race_from_both_threads() {
    let store = TestStore::postgres().await;
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |r| r.body.starts_with(b"{\"amount\"")).await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut per_thread = Gateway::builder(&store, &upstream.url())
        .set("worker_threads", "2")
        .set("worker_runtime", "\"per_thread\"")
        // Split 5 + 4 between the lanes: the odd one must still work.
        .set("database_pool_size", "9")
        .env("RUST_LOG", "info")
        .stderr_to(log.path())
        .start()
        .await;
    let shared = Gateway::builder(&store, &upstream.url())
        .set("worker_threads", "2")
        .start()
        .await;
    let replies = double_click(40, &[&per_thread, &shared], &upstream, &gate).await;
    assert_one_result(&replies, &upstream);

    // New keys, each on a connection of its own, until both workers have
    // accepted some (a handful is enough; 200 bounds it).
    let mut sent = 0;
    loop {
        for n in 0..10 {
            let reply = post(
                &per_thread.path("/v1/new"),
                &format!("new-{sent}-{n}"),
                "{}",
            )
            .await;
            assert_eq!(
                reply.status,
                200,
                "{:?}",
                String::from_utf8_lossy(&reply.body)
            );
            assert!(reply.header("idempotent-replayed").is_none());
        }
        sent += 10;
        let both = accepted(&per_thread, 0).await > 0.0 && accepted(&per_thread, 1).await > 0.0;
        if both || sent == 200 {
            break;
        }
    }
    let (zero, one) = (
        accepted(&per_thread, 0).await,
        accepted(&per_thread, 1).await,
    );
    assert!(
        zero > 0.0 && one > 0.0,
        "accepted by worker 0: {zero}, by worker 1: {one}"
    );
    // Each of those keys committed once: replayed, whichever worker asks.
    for n in 0..10 {
        let again = post(&per_thread.path("/v1/new"), &format!("new-0-{n}"), "{}").await;
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
    }
    // A shared runtime counts every connection as worker 0's.
    assert!(accepted(&shared, 0).await > 0.0);
    assert_eq!(accepted(&shared, 1).await, 0.0);
    let started = std::fs::read_to_string(log.path()).unwrap();
    assert!(
        started.contains("worker_threads=2") && started.contains("worker_runtime=\"per_thread\""),
        "{started}"
    );

    // SIGTERM while a request is held upstream: it is answered, then the
    // process exits cleanly.
    let url = per_thread.path("/v1/charges");
    let held = tokio::spawn(async move { post(&url, "in-flight", r#"{"amount": 7}"#).await });
    // (The new keys' arrivals are queued before it.)
    while !upstream
        .arrival()
        .await
        .body
        .starts_with(br#"{"amount": 7"#)
    {}
    per_thread.ask_to_stop().await;
    gate.open(1);
    assert_eq!(held.await.unwrap().status, 200);
    assert!(per_thread.exited().await.success());
}

#[tokio::test]
async fn simultaneous_first_requests_race_to_the_arbiter() {
    // No head start: all requests leave together and the database's unique
    // constraint alone decides which one owns the job.
    let store = TestStore::postgres().await;
    let upstream = FakeUpstream::echo().await;
    let a = Gateway::start(&store, &upstream.url()).await;
    let b = Gateway::start(&store, &upstream.url()).await;
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(30));
    let tasks: Vec<_> = (0..30)
        .map(|i| {
            let url = if i % 2 == 0 {
                a.path("/v1/x")
            } else {
                b.path("/v1/x")
            };
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                post(&url, "same-instant", "{}").await
            })
        })
        .collect();
    let replies: Vec<Reply> = join_all(tasks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(upstream.hits(), 1);
    let first = &replies[0];
    for r in &replies {
        assert_eq!(r.status, 200);
        assert_eq!(r.job(), first.job());
        assert_eq!(r.body, first.body);
    }
    assert_eq!(
        replies
            .iter()
            .filter(|r| r.header("idempotent-replayed").is_none())
            .count(),
        1,
        "exactly one request ran the job"
    );
}

crate::on_each_deployment!(
    [embedded, postgres]
    two_simultaneous_duplicates_make_one_upstream_call,
    fifty_simultaneous_duplicates_make_one_upstream_call,
);
