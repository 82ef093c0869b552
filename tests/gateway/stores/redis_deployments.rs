//! The fast path on Redis as operators deploy it: one node, a real six-node
//! Redis Cluster (three masters, three replicas) and a master with a
//! replica watched by Sentinel, each started by the test on free loopback
//! ports; masters killed mid-run. Replicas waking each other's held
//! duplicates is one scenario, run on each deployment.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use idemgate_domain::id::JobId;
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_store::fastpath::{self, Binding, Tag};

use crate::support::redis_cluster::{ThrowawayCluster, ThrowawaySentinel};
use crate::support::sse::{Ending, Finish, Reader, SseUpstream};
use crate::support::{
    eventually, held_on_the_other_replica, post, send, FakeUpstream, Gate, Gateway, Reply,
    TestStore, ThrowawayRedis,
};

const WAIT: Duration = Duration::from_secs(20);

fn owner() -> Owner {
    Owner::anonymous()
}

fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::new(k).unwrap()
}

fn redis_key(k: &str) -> String {
    fastpath::redis_key(
        "idemgate:",
        &Binding::of(&owner(), &key(k)),
        &owner(),
        &key(k),
    )
}

fn cached(bytes: Option<Vec<u8>>, k: &str) -> bool {
    let keys = crate::support::entries::suite_keys();
    bytes.is_some_and(|b| crate::support::entries::decode(&b, k, &keys).is_ok())
}

/// A replica whose replays go to Redis (its memory of answers is off).
async fn replica(store: &TestStore, upstream: &str, redis_url: &str) -> Gateway {
    Gateway::builder(store, upstream)
        .replaying_from_redis(redis_url)
        .set("upstream_timeout", "\"5s\"")
        .start()
        .await
}

/// Every key of a job is in one slot: the replay entry and the stream its
/// answer is mirrored on, whatever the key's characters.
#[tokio::test]
async fn a_jobs_keys_share_one_cluster_slot() {
    let cluster = ThrowawayCluster::start().await;
    let job = JobId::new();
    for k in ["a", "{b}", "}{", "with:colons", "{x}{y}", "k-0123456789"] {
        let tag = Tag::of(&owner(), &key(k));
        let entry = cluster.slot(&redis_key(k)).await;
        let stream = cluster
            .slot(&fastpath::stream_key("idemgate:", &tag, job))
            .await;
        assert_eq!(entry, stream, "key {k:?}");
    }
    // And different keys spread over the slots (and so over the masters).
    let mut slots = std::collections::HashSet::new();
    for i in 0..20 {
        slots.insert(cluster.slot(&redis_key(&format!("spread-{i}"))).await);
    }
    assert!(slots.len() >= 18, "{} distinct slots of 20", slots.len());
}

/// A duplicate held on replica b while a runs the job is answered with a's
/// commit, and a's announcement through Redis reaches b: one scenario for
/// every deployment of Redis, which the caller starts and keeps up.
async fn a_duplicate_held_on_one_replica_is_woken_by_the_other(redis_url: &str) {
    let store = TestStore::postgres().await;
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    let a = replica(&store, &upstream.url(), redis_url).await;
    let b = replica(&store, &upstream.url(), redis_url).await;
    let (first, held) = held_on_the_other_replica(&a, &b, &upstream, "/v1/x", "wake").await;
    gate.open(1);
    let (first, held) = (first.await.unwrap(), held.await.unwrap());
    assert_eq!(held.body, first.body);
    assert_eq!(held.header("idempotent-replayed"), Some("true"));
    // PostgreSQL's NOTIFY may ring first; Redis's announcement still reaches b.
    eventually(WAIT, "a's commit announced to b through Redis", || async {
        b.metric("idemgate_wakeups_total{source=\"redis\"}").await >= 1.0
    })
    .await;
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn on_one_node_a_duplicate_held_on_one_replica_is_woken_by_the_other() {
    let redis = ThrowawayRedis::start().await;
    a_duplicate_held_on_one_replica_is_woken_by_the_other(&redis.url()).await;
}

#[tokio::test]
async fn on_a_cluster_a_duplicate_held_on_one_replica_is_woken_by_the_other() {
    let redis = ThrowawayCluster::start().await;
    a_duplicate_held_on_one_replica_is_woken_by_the_other(&redis.url()).await;
}

#[tokio::test]
async fn with_sentinel_a_duplicate_held_on_one_replica_is_woken_by_the_other() {
    let redis = ThrowawaySentinel::start().await;
    a_duplicate_held_on_one_replica_is_woken_by_the_other(&redis.url()).await;
}

#[tokio::test]
async fn on_a_cluster_replays_come_from_redis_alone_for_keys_on_every_master() {
    let store = TestStore::postgres().await;
    let cluster = ThrowawayCluster::start().await;
    let upstream = FakeUpstream::echo().await;
    let a = replica(&store, &upstream.url(), &cluster.url()).await;
    let b = replica(&store, &upstream.url(), &cluster.url()).await;

    // Keys on every master: written by a, replayed by b from the cluster
    // alone once the database has forgotten them.
    let keys: Vec<String> = (0..24).map(|i| format!("cluster-{i}")).collect();
    let mut firsts = HashMap::new();
    for k in &keys {
        firsts.insert(k.clone(), post(&a.path("/v1/x"), k, "{}").await.body);
    }
    for k in &keys {
        eventually(WAIT, "the entry to reach the cluster", || async {
            cached(cluster.get(&redis_key(k)).await, k)
        })
        .await;
    }
    let mut masters = std::collections::HashSet::new();
    for k in &keys {
        masters.insert(cluster.master_of(cluster.slot(&redis_key(k)).await).await);
    }
    assert_eq!(masters.len(), 3, "the keys spread over the three masters");
    let TestStore::Postgres(db) = &store else {
        unreachable!()
    };
    db.connect()
        .await
        .execute("DELETE FROM jobs", &[])
        .await
        .unwrap();
    for k in &keys {
        let replay = post(&b.path("/v1/x"), k, "{}").await;
        assert_eq!(replay.status, 200, "{k}");
        assert_eq!(replay.body, firsts[k], "{k}");
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    }
    assert_eq!(upstream.hits(), keys.len());
    assert!(
        b.metric("idemgate_fastpath_lookups_total{result=\"hit\"}")
            .await
            >= keys.len() as f64
    );
}

#[tokio::test]
async fn on_a_cluster_a_stream_is_joined_live_from_another_replica() {
    let store = TestStore::postgres().await;
    let cluster = ThrowawayCluster::start().await;
    let gate = Gate::new();
    let upstream = SseUpstream::start(5, 128, &gate, Ending::Clean).await;
    let a = replica(&store, &upstream.url(), &cluster.url()).await;
    let b = replica(&store, &upstream.url(), &cluster.url()).await;
    gate.open(2);
    let mut first = Reader::post(&a.path("/v1/chat"), "cluster-sse", "{}").await;
    first.read_until(2 * 128).await;
    let mut far = Reader::post(&b.path("/v1/chat"), "cluster-sse", "{}").await;
    assert_eq!(far.status, 200);
    far.read_until(2 * 128).await;
    gate.open(1);
    far.read_until(3 * 128).await;
    assert_eq!(upstream.sent(), 3, "event 3 reached b before 4 was sent");
    gate.open(2);
    assert_eq!(first.finish().await, Finish::Complete);
    assert_eq!(far.finish().await, Finish::Complete);
    assert_eq!(far.read, first.read);
    assert_eq!(upstream.hits(), 1);
    assert_eq!(b.metric("idemgate_stream_joiners_total").await, 1.0);
}

/// Two replicas under load: each client makes new keys and retries them,
/// on either replica. Returns every answer by key.
async fn load(
    replicas: [&Gateway; 2],
    clients: usize,
    rounds: usize,
    prefix: &'static str,
    done: Arc<AtomicUsize>,
) -> Vec<tokio::task::JoinHandle<Vec<(String, Reply)>>> {
    (0..clients)
        .map(|c| {
            let urls = [replicas[0].path("/v1/x"), replicas[1].path("/v1/x")];
            let done = done.clone();
            tokio::spawn(async move {
                let mut answers = Vec::new();
                for r in 0..rounds {
                    let k = format!("{prefix}-{c}-{r}");
                    for url in [&urls[r % 2], &urls[(r + 1) % 2]] {
                        let reply =
                            send(http::Method::POST, url, &[("idempotency-key", &k)], "{}").await;
                        answers.push((k.clone(), reply));
                    }
                    done.fetch_add(1, Ordering::SeqCst);
                }
                answers
            })
        })
        .collect()
}

/// Every answer a 200, one body per key, one upstream call per key (beyond
/// the `before` made earlier).
async fn check(
    workers: Vec<tokio::task::JoinHandle<Vec<(String, Reply)>>>,
    upstream: &FakeUpstream,
    before: usize,
) -> usize {
    let mut bodies: HashMap<String, bytes::Bytes> = HashMap::new();
    for worker in join_all(workers).await {
        for (k, reply) in worker.unwrap() {
            assert_eq!(reply.status, 200, "{k}: {:?}", reply.body);
            let first = bodies.entry(k.clone()).or_insert(reply.body.clone());
            assert_eq!(*first, reply.body, "{k}: every answer is the one commit");
        }
    }
    assert_eq!(
        upstream.hits(),
        before + bodies.len(),
        "one upstream call per key"
    );
    bodies.len()
}

#[tokio::test]
async fn a_cluster_master_killed_mid_run_loses_nothing_and_its_replica_takes_over() {
    let store = TestStore::postgres().await;
    let mut cluster = ThrowawayCluster::start().await;
    let upstream = FakeUpstream::echo().await;
    let a = replica(&store, &upstream.url(), &cluster.url()).await;
    let b = replica(&store, &upstream.url(), &cluster.url()).await;
    let done = Arc::new(AtomicUsize::new(0));
    let (clients, rounds) = (6, 30);
    let workers = load([&a, &b], clients, rounds, "kill", done.clone()).await;
    eventually(WAIT, "a third of the load to be done", || async {
        done.load(Ordering::SeqCst) >= clients * rounds / 3
    })
    .await;
    let victim = cluster
        .master_of(cluster.slot(&redis_key("kill-0-0")).await)
        .await;
    let victim_port = cluster.nodes[victim].port;
    cluster.nodes[victim].kill().await;
    let keys = check(workers, &upstream, 0).await;
    assert_eq!(keys, clients * rounds);

    // The replica is promoted; the gateway follows it: a key on the slots
    // the dead master served is cached again and replayed from the cluster.
    cluster.wait_ok().await;
    let promoted = cluster
        .master_of(cluster.slot(&redis_key("kill-0-0")).await)
        .await;
    assert_ne!(cluster.nodes[promoted].port, victim_port);
    // An entry is written once, best effort: one whose write met the
    // client still finding its way to the promoted master is lost (its
    // replays come from PostgreSQL). So a new key on those slots is tried
    // until one is cached: the client has followed the promotion.
    let deadline = tokio::time::Instant::now() + WAIT;
    let (mut i, mut posted) = (0, 0);
    let (k, first) = loop {
        let k = loop {
            i += 1;
            let k = format!("after-{i}");
            if cluster.master_of(cluster.slot(&redis_key(&k)).await).await == promoted {
                break k;
            }
        };
        let first = post(&a.path("/v1/x"), &k, "{}").await;
        posted += 1;
        let written = tokio::time::Instant::now() + Duration::from_secs(2);
        while tokio::time::Instant::now() < written {
            if cached(cluster.get(&redis_key(&k)).await, &k) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if cached(cluster.get(&redis_key(&k)).await, &k) {
            break (k, first);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the promoted master took no entry within {WAIT:?}"
        );
    };
    // The other replica follows too: its client may first meet the dead
    // master's address (a miss, replayed from PostgreSQL), then drops it
    // and reads the slot map again. Every replay has the one answer.
    let hit = || b.metric("idemgate_fastpath_lookups_total{result=\"hit\"}");
    let (before, deadline) = (hit().await, tokio::time::Instant::now() + WAIT);
    loop {
        let replay = post(&b.path("/v1/x"), &k, "{}").await;
        assert_eq!(replay.body, first.body);
        if hit().await > before {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the other replica never replayed from the promoted master within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(upstream.hits(), keys + posted, "one call per key posted");
}

#[tokio::test]
async fn with_sentinel_the_gateway_follows_the_master_through_a_failover() {
    let store = TestStore::postgres().await;
    let mut redis = ThrowawaySentinel::start().await;
    let upstream = FakeUpstream::echo().await;
    let a = replica(&store, &upstream.url(), &redis.url()).await;
    let b = replica(&store, &upstream.url(), &redis.url()).await;

    // Entries go to the master Sentinel names, and b replays from there.
    eventually(WAIT, "an entry on the master", || async {
        post(&a.path("/v1/x"), "sentinel-0", "{}").await;
        cached(
            redis
                .master
                .query(&["GET", &redis_key("sentinel-0")])
                .await
                .ok(),
            "sentinel-0",
        )
    })
    .await;
    // b's client may still be finding the master through Sentinel when
    // its first replay comes (then it is replayed from PostgreSQL).
    eventually(WAIT, "b to replay from the master", || async {
        let replay = post(&b.path("/v1/x"), "sentinel-0", "{}").await;
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        b.metric("idemgate_fastpath_lookups_total{result=\"hit\"}")
            .await
            >= 1.0
    })
    .await;

    let done = Arc::new(AtomicUsize::new(0));
    let (clients, rounds) = (4, 40);
    let workers = load([&a, &b], clients, rounds, "sentinel", done.clone()).await;
    eventually(WAIT, "a quarter of the load to be done", || async {
        done.load(Ordering::SeqCst) >= clients * rounds / 4
    })
    .await;
    let old = redis.master.port;
    redis.master.kill().await;
    eventually(WAIT, "Sentinel to promote the replica", || async {
        redis.master_port().await == redis.replica.port
    })
    .await;
    let keys = check(workers, &upstream, 1).await;
    assert_eq!(keys, clients * rounds);
    assert_ne!(redis.master_port().await, old);

    // The gateway writes to the promoted replica now.
    eventually(WAIT, "an entry on the promoted master", || async {
        post(&a.path("/v1/x"), "sentinel-after", "{}").await;
        cached(
            redis
                .replica
                .query(&["GET", &redis_key("sentinel-after")])
                .await
                .ok(),
            "sentinel-after",
        )
    })
    .await;
}

/// A cluster that is down when the gateway starts only means misses until
/// it is up: then entries are written and replays come from it.
#[tokio::test]
async fn a_cluster_down_at_start_up_is_used_once_it_is_up() {
    let store = TestStore::postgres().await;
    let upstream = FakeUpstream::echo().await;
    let ports = ThrowawayCluster::ports().await;
    let url = ThrowawayCluster::url_of(&ports);
    let gateway = replica(&store, &upstream.url(), &url).await;
    let first = post(&gateway.path("/v1/x"), "before-the-cluster", "{}").await;
    assert_eq!(first.status, 200, "served without Redis");
    let cluster = ThrowawayCluster::start_on(ports).await;
    eventually(WAIT, "entries in the cluster once it is up", || async {
        post(&gateway.path("/v1/x"), "after-the-cluster", "{}").await;
        cached(
            cluster.get(&redis_key("after-the-cluster")).await,
            "after-the-cluster",
        )
    })
    .await;
}
