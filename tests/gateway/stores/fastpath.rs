//! The Redis fast path against real Redis servers that the tests start,
//! kill, restart and flush: replays without the database, and correctness
//! that never depends on Redis being up, empty, stale or restarted.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::future::join_all;
use idemgate_domain::fingerprint::Fingerprint;
use idemgate_domain::id::JobId;
use idemgate_store::fastpath::Entry;

use crate::support::entries::{self, redis_key, suite_keys};
use crate::support::{eventually, post, FakeUpstream, Gateway, TestStore, ThrowawayRedis};

const WAIT: Duration = Duration::from_secs(10);

fn decode(bytes: &[u8], key: &str) -> Option<Entry> {
    entries::decode(bytes, key, &suite_keys()).ok()
}

async fn cached(redis: &ThrowawayRedis, key: &str) -> Entry {
    let rkey = redis_key(key);
    eventually(WAIT, "the committed response to reach Redis", || async {
        redis
            .get(&rkey)
            .await
            .is_some_and(|b| decode(&b, key).is_some())
    })
    .await;
    decode(&redis.get(&rkey).await.unwrap(), key).unwrap()
}

/// A gateway whose replays go to Redis: its own memory of answers is off,
/// so what is tested here is the fast path (the memory is tested in
/// `core_answers`).
async fn gateway(store: &TestStore, upstream: &FakeUpstream, redis_url: &str) -> Gateway {
    Gateway::builder(store, &upstream.url())
        .replaying_from_redis(redis_url)
        .start()
        .await
}

#[tokio::test]
async fn replays_are_served_from_redis_without_the_database() {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, &upstream, &redis.url()).await;
    let url = gateway.path("/v1/charges");
    let first = post(&url, "fast-1", "{}").await;
    let entry = cached(&redis, "fast-1").await;
    assert_eq!(Some(entry.job.to_string()), first.job());
    assert!(entry.response.is_some(), "small responses are inline");

    // Take the job out of the database: only Redis can answer now.
    let TestStore::Postgres(db) = &store else {
        unreachable!()
    };
    db.connect()
        .await
        .execute("DELETE FROM jobs", &[])
        .await
        .unwrap();
    let replay = post(&url, "fast-1", "{}").await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.job(), first.job());
    assert_eq!(upstream.hits(), 1);
    assert!(
        gateway
            .metric("idemgate_fastpath_lookups_total{result=\"hit\"}")
            .await
            >= 1.0
    );
}

/// Most keyed requests are first tries: while they run, Redis is not asked
/// (its lookup could not hit), and a run of replays brings the lookups back
/// (docs/design.md §2, "Redis only while replays are common"). Every answer
/// stays the committed one either way.
#[tokio::test]
async fn new_keys_stop_the_redis_lookups_and_replays_bring_them_back() {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, &upstream, &redis.url()).await;
    let url = gateway.path("/v1/charges");
    let lookups = |result: &'static str| {
        let gateway = &gateway;
        async move {
            gateway
                .metric(&format!(
                    "idemgate_fastpath_lookups_total{{result=\"{result}\"}}"
                ))
                .await
        }
    };
    let mut firsts = Vec::new();
    for n in 0..80 {
        let first = post(&url, &format!("first-try-{n}"), &format!("{{\"n\": {n}}}")).await;
        assert_eq!(first.status, 200);
        firsts.push(first);
    }
    // A lookup that outlasts `redis_timeout` on a loaded machine counts as
    // an error, not a miss; it moves the share as a miss does.
    let asked = || async {
        lookups("hit").await
            + lookups("miss").await
            + lookups("error").await
            + lookups("invalid").await
    };
    let (missed, skipped) = (asked().await, lookups("skipped").await);
    assert_eq!(missed + skipped, 80.0, "every new key counted once");
    assert!(
        (30.0..=60.0).contains(&missed),
        "Redis asked for the first new keys only: {missed} asked, {skipped} skipped"
    );

    // Replays of those keys: the first few from the store (which answers
    // them exactly as Redis would), then from Redis again.
    for n in 0..30 {
        cached(&redis, &format!("first-try-{n}")).await;
    }
    for (n, first) in firsts.iter().enumerate().take(30) {
        let replay = post(&url, &format!("first-try-{n}"), &format!("{{\"n\": {n}}}")).await;
        assert_eq!(replay.status, 200);
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(replay.body, first.body);
        assert_eq!(replay.job(), first.job());
    }
    let skipped_on_replays = lookups("skipped").await - skipped;
    let asked_on_replays = asked().await - missed;
    assert!(
        (3.0..=12.0).contains(&skipped_on_replays),
        "{skipped_on_replays} replays went to the store before Redis was asked again"
    );
    assert_eq!(
        asked_on_replays + skipped_on_replays,
        30.0,
        "the rest asked Redis"
    );
    assert!(lookups("hit").await >= 10.0, "and were answered from it");
    assert_eq!(upstream.hits(), 80, "one upstream call per key");
}

/// Entries of answers committed together go to Redis together (one
/// pipeline, `FastPath::write_entries`), each under its own key: every one
/// is there, verifies for its own key, and holds its own job and answer.
#[tokio::test]
async fn entries_of_answers_committed_together_are_each_written_under_their_key() {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, &upstream, &redis.url()).await;
    let url = gateway.path("/v1/charges");
    let keys: Vec<String> = (0..64).map(|n| format!("together-{n}")).collect();
    let bodies: Vec<String> = (0..64).map(|n| format!("{{\"n\": {n}}}")).collect();
    let firsts = join_all(keys.iter().zip(&bodies).map(|(k, b)| post(&url, k, b))).await;
    for (k, first) in keys.iter().zip(&firsts) {
        assert_eq!(first.status, 200, "{k}");
        let entry = cached(&redis, k).await;
        assert_eq!(Some(entry.job.to_string()), first.job(), "{k}");
        let kept = entry.response.expect("small answers are kept inline");
        assert_eq!(kept.body, first.body, "{k}: its own answer");
    }
    assert!(
        gateway.metric("idemgate_fastpath_writes_total").await >= 64.0,
        "each entry counted as written"
    );
    assert_eq!(upstream.hits(), 64);
}

#[tokio::test]
async fn a_hit_with_another_fingerprint_is_a_409_confirmed_by_the_store() {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, &upstream, &redis.url()).await;
    let url = gateway.path("/v1/charges");
    post(&url, "fp", r#"{"amount": 1}"#).await;
    cached(&redis, "fp").await;
    let other = post(&url, "fp", r#"{"amount": 2}"#).await;
    assert_eq!(other.status, 409);
    assert_eq!(other.problem(), "idempotency-key-mismatch");
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn large_responses_are_cached_by_reference() {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("replay_cache_size", "0")
        .set("redis_url", &format!("{:?}", redis.url()))
        .set("redis_inline_max", "\"16B\"")
        .start()
        .await;
    let url = gateway.path("/v1/big");
    let first = post(&url, "big", "a body long enough to be stored by reference").await;
    let entry = cached(&redis, "big").await;
    assert!(entry.response.is_none(), "kept by reference");
    let replay = post(&url, "big", "a body long enough to be stored by reference").await;
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert!(
        gateway
            .metric("idemgate_replays_total{source=\"redis\"}")
            .await
            >= 1.0
    );
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn redis_down_at_start_up_means_the_database_alone_until_it_comes_up() {
    let store = TestStore::postgres().await;
    let port = crate::support::redis::free_port().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, &upstream, &format!("redis://127.0.0.1:{port}")).await;
    let url = gateway.path("/v1/charges");
    let first = post(&url, "no-redis", "{}").await;
    let replay = post(&url, "no-redis", "{}").await;
    assert_eq!((first.status, replay.status), (200, 200));
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(upstream.hits(), 1);
    assert!(gateway.metric("idemgate_fastpath_errors_total").await >= 1.0);

    // Redis comes up on its port: the next replays repopulate it.
    let mut late = ThrowawayRedis::start_on(port).await;
    eventually(
        WAIT,
        "the fast path to reconnect and cache the job",
        || async {
            post(&url, "no-redis", "{}").await;
            late.get(&redis_key("no-redis")).await.is_some()
        },
    )
    .await;
    late.kill().await;
}

#[tokio::test]
async fn redis_killed_under_load_costs_no_errors_and_no_duplicate_calls() {
    let store = TestStore::postgres().await;
    let mut redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, &upstream, &redis.url()).await;
    let url = gateway.path("/v1/charges");
    let done = Arc::new(AtomicUsize::new(0));
    let (clients, rounds) = (8, 12);
    let workers = (0..clients).map(|c| {
        let url = url.clone();
        let done = done.clone();
        tokio::spawn(async move {
            for r in 0..rounds {
                let key = format!("load-{c}-{r}");
                let first = crate::support::send(
                    http::Method::POST,
                    &url,
                    &[("idempotency-key", &key)],
                    "{}",
                )
                .await;
                let again = crate::support::send(
                    http::Method::POST,
                    &url,
                    &[("idempotency-key", &key)],
                    "{}",
                )
                .await;
                assert_eq!(first.status, 200, "{key}");
                assert_eq!(again.status, 200, "{key}");
                assert_eq!(again.body, first.body, "{key}");
                assert_eq!(again.header("idempotent-replayed"), Some("true"));
                done.fetch_add(1, Ordering::SeqCst);
            }
        })
    });
    let workers: Vec<_> = workers.collect();
    eventually(WAIT, "half the load to be done", || async {
        done.load(Ordering::SeqCst) >= clients * rounds / 2
    })
    .await;
    redis.kill().await;
    for w in join_all(workers).await {
        w.unwrap();
    }
    assert_eq!(
        upstream.hits(),
        clients * rounds,
        "one upstream call per key, Redis or not"
    );

    // And it recovers when Redis is back.
    redis.restart().await;
    eventually(WAIT, "the fast path to recover", || async {
        post(&url, "after-restart", "{}").await;
        redis.get(&redis_key("after-restart")).await.is_some()
    })
    .await;
}

#[tokio::test]
async fn a_flushed_redis_falls_back_and_is_repopulated() {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, &upstream, &redis.url()).await;
    let url = gateway.path("/v1/charges");
    let first = post(&url, "flushed", "{}").await;
    cached(&redis, "flushed").await;
    redis.flush().await;
    let replay = post(&url, "flushed", "{}").await;
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    cached(&redis, "flushed").await;
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn corrupt_and_stale_entries_are_ignored_and_repaired() {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, &upstream, &redis.url()).await;
    let url = gateway.path("/v1/charges");

    // Corrupt: garbage under the key.
    let first = post(&url, "corrupt", "{}").await;
    cached(&redis, "corrupt").await;
    redis.set(&redis_key("corrupt"), b"\x00not an entry").await;
    let replay = post(&url, "corrupt", "{}").await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.body, first.body);
    let repaired = cached(&redis, "corrupt").await;
    assert_eq!(Some(repaired.job.to_string()), first.job());

    // Stale: a well-formed entry naming another job and fingerprint must not
    // turn the real request into a 409; the store answers and it is rewritten.
    let real = post(&url, "stale", "{}").await;
    cached(&redis, "stale").await;
    let stale = Entry {
        job: JobId::new(),
        fingerprint: Fingerprint([1; 32]),
        expires_at: SystemTime::now() + Duration::from_secs(3600),
        response: Some(idemgate_domain::response::StoredResponse {
            status: 200,
            headers: vec![],
            body: bytes::Bytes::from_static(b"stale"),
        }),
    };
    let bytes = entries::encode(&stale, "stale", &suite_keys());
    redis.set(&redis_key("stale"), &bytes).await;
    let replay = post(&url, "stale", "{}").await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.body, real.body);
    eventually(WAIT, "the stale entry to be repaired", || async {
        let entry = redis
            .get(&redis_key("stale"))
            .await
            .and_then(|b| decode(&b, "stale"));
        entry.is_some_and(|e| Some(e.job.to_string()) == real.job())
    })
    .await;
    assert_eq!(upstream.hits(), 2);
}

#[tokio::test]
async fn a_redis_that_never_answers_cannot_stall_requests() {
    // Accepts connections and never says a word.
    let blackhole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = blackhole.local_addr().unwrap();
    let _hold = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = blackhole.accept().await {
            open.push(socket);
        }
    });
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("redis_url", &format!("\"redis://{addr}\""))
        .set("redis_timeout", "\"50ms\"")
        .start()
        .await;
    let url = gateway.path("/v1/x");
    let both = async {
        let first = post(&url, "silent-redis", "{}").await;
        let replay = post(&url, "silent-redis", "{}").await;
        (first, replay)
    };
    // Far beyond 50 ms, far below a hang.
    let (first, replay) = tokio::time::timeout(Duration::from_secs(5), both)
        .await
        .expect("requests stalled behind a silent Redis");
    assert_eq!(first.status, 200);
    assert_eq!(replay.body, first.body);
}

/// Two deployments on one Redis, each with its own `redis_key_prefix`
/// (design §13): the same owner and key in both are two entries, neither
/// deployment replays the other's answer, and nothing is written under the
/// default prefix.
#[tokio::test]
async fn deployments_sharing_a_redis_keep_apart_under_their_own_prefixes() {
    let redis = ThrowawayRedis::start().await;
    let mut deployments = Vec::new();
    for name in ["tenant-a", "tenant-b"] {
        let store = TestStore::postgres().await;
        let answer = serde_json::json!({ "from": name });
        let upstream = FakeUpstream::start(move |_| {
            let answer = answer.clone();
            async move { crate::support::upstream::json_response(200, answer) }
        })
        .await;
        let gateway = Gateway::builder(&store, &upstream.url())
            .replaying_from_redis(&redis.url())
            .set("redis_key_prefix", &format!("\"{name}:\""))
            .start()
            .await;
        deployments.push((name, store, upstream, gateway));
    }
    for (name, _, upstream, gateway) in &deployments {
        let first = post(&gateway.path("/v1/charges"), "shared", "{}").await;
        assert_eq!(first.json()["from"], *name, "its own upstream answered");
        assert_eq!(upstream.hits(), 1);
        let prefixed = redis_key("shared").replacen("idemgate:", &format!("{name}:"), 1);
        eventually(
            WAIT,
            "the answer to reach Redis under its prefix",
            || async { redis.get(&prefixed).await.is_some() },
        )
        .await;
    }
    assert!(
        redis.get(&redis_key("shared")).await.is_none(),
        "nothing under the default prefix"
    );
    for (name, _, upstream, gateway) in &deployments {
        let again = post(&gateway.path("/v1/charges"), "shared", "{}").await;
        assert_eq!(again.json()["from"], *name, "its own answer, replayed");
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        let from_redis = gateway
            .metric("idemgate_replays_total{source=\"redis\"}")
            .await;
        assert_eq!(from_redis, 1.0, "{name} replayed from its own entry");
        assert_eq!(upstream.hits(), 1);
    }
    // One's entry copied under the other's prefix (one replay key and
    // owner salt for both, as when a Secret is shared) is not believed:
    // each deployment's keys are scoped to its prefix.
    let (a, b) = (&deployments[0], &deployments[1]);
    assert_eq!(
        post(&a.3.path("/v1/charges"), "only-a", "{}").await.status,
        200
    );
    let at = |name: &str| redis_key("only-a").replacen("idemgate:", &format!("{name}:"), 1);
    eventually(WAIT, "a's entry to reach Redis", || async {
        redis.get(&at("tenant-a")).await.is_some()
    })
    .await;
    let entry = redis.get(&at("tenant-a")).await.unwrap();
    redis.set(&at("tenant-b"), &entry).await;
    let copied = post(&b.3.path("/v1/charges"), "only-a", "{}").await;
    assert_eq!(copied.json()["from"], "tenant-b", "b ran its own call");
    assert_eq!(copied.header("idempotent-replayed"), None);
    assert_eq!(b.2.hits(), 2);
    let rejected =
        b.3.metric_sum("idemgate_replay_entries_rejected_total")
            .await;
    assert!(rejected >= 1.0, "counted as rejected: {rejected}");
}
