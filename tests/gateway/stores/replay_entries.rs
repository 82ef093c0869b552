//! Replay entries in Redis cannot be forged (`docs/design.md` §17): the
//! test writes to Redis as anyone able to reach it could (a forged answer
//! with the victim's fingerprint, today's format with a good checksum, a
//! sealed answer moved to another key, a well-tagged entry in the clear
//! while sealing is on, a mirrored stream cut short or spliced) and the
//! real binary never serves it: the store answers with the true answer,
//! and `idemgate_replay_entries_rejected_total` counts it. Keys rotate.
//! Every Redis here is a throwaway one of the test's.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use idemgate_domain::id::JobId;
use idemgate_domain::response::StoredResponse;
use idemgate_store::fastpath::keys::HEAD_LEN;
use idemgate_store::fastpath::stream::{record, Part};
use idemgate_store::fastpath::{stream_key, Entry, EntryKeys, Tag};
use sha2::{Digest, Sha256};

use crate::support::entries::{
    self, derived_keys, forger_keys, key, owner, redis_key, suite_keys, Raw,
};
use crate::support::sse::{Ending, Finish, Reader, SseUpstream};
use crate::support::{
    eventually, post, FakeUpstream, Gate, Gateway, Reply, TestStore, ThrowawayRedis,
};

// A deadline, not a delay: generous for a loaded machine.
const WAIT: Duration = Duration::from_secs(30);
const FORGED: &[u8] = b"{\"forged\":true}";
const ENCRYPTION_KEY: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

fn rejected(reason: &str) -> String {
    format!("idemgate_replay_entries_rejected_total{{reason=\"{reason}\"}}")
}

/// The entry the gateway wrote for `k`, once it is there (read with `keys`).
async fn written(redis: &ThrowawayRedis, k: &str, keys: &EntryKeys) -> (Vec<u8>, Entry) {
    eventually(WAIT, "the replay entry to reach Redis", || async {
        let bytes = redis.get(&redis_key(k)).await;
        bytes.is_some_and(|b| entries::decode(&b, k, keys).is_ok())
    })
    .await;
    let bytes = redis.get(&redis_key(k)).await.unwrap();
    let entry = entries::decode(&bytes, k, keys).unwrap();
    (bytes, entry)
}

/// `genuine` with a forged answer: same job, fingerprint and expiry.
fn forged_answer(genuine: &Entry) -> Entry {
    Entry {
        response: Some(StoredResponse {
            status: 200,
            headers: vec![(
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            )],
            body: Bytes::from_static(FORGED),
        }),
        ..genuine.clone()
    }
}

/// What a forger writes: an entry under its own key, given the gateway's
/// key id (readable in any genuine entry), so only the tag can refuse it.
fn forge(entry: &Entry, k: &str, gateway: &EntryKeys) -> Vec<u8> {
    let mut bytes = entries::encode(entry, k, &forger_keys(gateway.sealed()));
    bytes[4..4 + HEAD_LEN].copy_from_slice(&gateway.head());
    bytes
}

/// The format before this one, which anyone can compute: a SHA-256 of
/// `(owner, key)` for a binding and a truncated SHA-256 as its checksum.
fn igr1(entry: &Entry, k: &str) -> Vec<u8> {
    let r = entry.response.as_ref().unwrap();
    let mut out = b"IGR1".to_vec();
    let mut h = Sha256::new();
    h.update(owner().as_str().as_bytes());
    h.update([0]);
    h.update(k.as_bytes());
    out.extend_from_slice(&h.finalize());
    out.extend_from_slice(entry.job.0.as_bytes());
    out.extend_from_slice(&entry.fingerprint.0);
    let ms = entry
        .expires_at
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    out.extend_from_slice(&ms.to_be_bytes());
    out.push(1);
    out.extend_from_slice(&r.status.to_be_bytes());
    out.extend_from_slice(&0u32.to_be_bytes());
    out.extend_from_slice(&r.body);
    let checksum = Sha256::digest(&out);
    out.extend_from_slice(&checksum[..8]);
    out
}

/// The true answer again, never the forged one.
fn assert_true_answer(reply: &Reply, first: &Reply) {
    assert_eq!(reply.status, 200);
    assert_ne!(reply.body, FORGED, "the forged answer was served");
    assert_eq!(reply.body, first.body);
    assert_eq!(reply.job(), first.job());
    assert_eq!(reply.header("idempotent-replayed"), Some("true"));
}

#[tokio::test]
async fn a_forged_answer_with_the_victims_fingerprint_is_never_served() {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .replaying_from_redis(&redis.url())
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    let first = post(&url, "victim", "{\"amount\":5}").await;
    let (_, genuine) = written(&redis, "victim", &suite_keys()).await;

    // Tagged under another key, passing as the gateway's.
    let forged = forge(&forged_answer(&genuine), "victim", &suite_keys());
    redis.set(&redis_key("victim"), &forged).await;
    let reply = post(&url, "victim", "{\"amount\":5}").await;
    assert_true_answer(&reply, &first);
    assert_eq!(gateway.metric(&rejected("forged")).await, 1.0);

    // Today's format, whose checksum anyone can compute.
    redis
        .set(
            &redis_key("victim"),
            &igr1(&forged_answer(&genuine), "victim"),
        )
        .await;
    let reply = post(&url, "victim", "{\"amount\":5}").await;
    assert_true_answer(&reply, &first);
    assert_eq!(gateway.metric(&rejected("version")).await, 1.0);
    assert_eq!(
        gateway
            .metric("idemgate_replays_total{source=\"redis\"}")
            .await,
        0.0,
        "nothing was replayed from Redis"
    );
    assert_eq!(
        gateway
            .metric("idemgate_replays_total{source=\"store\"}")
            .await,
        2.0
    );
    // The store's replay wrote the genuine entry back.
    let (_, repaired) = written(&redis, "victim", &suite_keys()).await;
    assert_eq!(repaired.job, genuine.job);
    assert_eq!(upstream.hits(), 1);
}

/// A gateway sealing with `[encryption]`, its replay key derived from the
/// encryption key (the suite's own replay key unset).
fn sealing(builder: crate::support::gateway::Builder) -> crate::support::gateway::Builder {
    builder
        .tables("[encryption]\nactive = \"a\"\n[[encryption.keys]]\nid = \"a\"\nenv = \"TEST_ENCRYPTION_KEY\"\n")
        .env("TEST_ENCRYPTION_KEY", ENCRYPTION_KEY)
        .env("IDEMGATE_REPLAY_KEY", "")
}

#[tokio::test]
async fn a_sealed_answer_moved_to_another_key_does_not_open() {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway =
        sealing(Gateway::builder(&store, &upstream.url()).replaying_from_redis(&redis.url()))
            .start()
            .await;
    let url = gateway.path("/v1/charges");
    let keys = derived_keys(ENCRYPTION_KEY);
    let alice = post(&url, "alice", "{}").await;
    let bob = post(&url, "bob", "{}").await;
    let (alices, _) = written(&redis, "alice", &keys).await;
    written(&redis, "bob", &keys).await;
    assert!(
        !alices.windows(4).any(|w| w == b"\"job"),
        "sealed: no body in the clear"
    );

    // The same request under two keys: one fingerprint, so only the
    // entry's binding to its key tells them apart.
    redis.set(&redis_key("bob"), &alices).await;
    let reply = post(&url, "bob", "{}").await;
    assert_eq!(reply.body, bob.body, "alice's answer served for bob");
    assert_ne!(reply.body, alice.body);
    assert_eq!(reply.job(), bob.job());
    assert_eq!(gateway.metric(&rejected("forged")).await, 1.0);
    assert_eq!(upstream.hits(), 2);
}

#[tokio::test]
async fn with_encryption_on_a_well_tagged_entry_in_the_clear_is_refused() {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway =
        sealing(Gateway::builder(&store, &upstream.url()).replaying_from_redis(&redis.url()))
            .start()
            .await;
    let url = gateway.path("/v1/charges");
    let sealed = derived_keys(ENCRYPTION_KEY);
    let first = post(&url, "clear", "{}").await;
    let (_, genuine) = written(&redis, "clear", &sealed).await;

    // Tagged with the gateway's very key, but not sealed.
    let secret = idemgate_store::fastpath::keys::derive_from_encryption_key(
        &entries::bytes_of(ENCRYPTION_KEY).try_into().unwrap(),
    );
    let in_the_clear = EntryKeys::new(&secret, [], false);
    assert_eq!(in_the_clear.head()[1..], sealed.head()[1..], "the same key");
    let planted = entries::encode(&forged_answer(&genuine), "clear", &in_the_clear);
    redis.set(&redis_key("clear"), &planted).await;
    let reply = post(&url, "clear", "{}").await;
    assert_true_answer(&reply, &first);
    assert_eq!(gateway.metric(&rejected("plaintext")).await, 1.0);
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn a_rejected_entry_is_never_kept_in_memory() {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    // Both replicas keep the answers they see in memory (the default).
    let replica = || {
        Gateway::builder(&store, &upstream.url())
            .set("redis_url", &format!("{:?}", redis.url()))
            // These tests are about what is read back, not how fast: a
            // loaded machine must not turn a mirror write into a miss.
            .set("redis_timeout", "\"1s\"")
            .start()
    };
    let (a, b) = (replica().await, replica().await);
    let first = post(&a.path("/v1/charges"), "kept", "{}").await;
    let (_, genuine) = written(&redis, "kept", &suite_keys()).await;
    redis
        .set(
            &redis_key("kept"),
            &forge(&forged_answer(&genuine), "kept", &suite_keys()),
        )
        .await;

    // The forged entry names the genuine job: had it been kept, memory
    // would have served it from then on (a job's answer is kept once).
    for _ in 0..3 {
        let reply = post(&b.path("/v1/charges"), "kept", "{}").await;
        assert_true_answer(&reply, &first);
    }
    assert_eq!(
        b.metric(&rejected("forged")).await,
        1.0,
        "read from Redis once"
    );
    assert_eq!(
        b.metric("idemgate_replays_total{source=\"store\"}").await,
        1.0
    );
    assert_eq!(
        b.metric("idemgate_replays_total{source=\"memory\"}").await,
        2.0
    );
    assert_eq!(upstream.hits(), 1);
}

const KEY_1: &str = "b2xkIHJlcGxheSBrZXksIHRoaXJ0eS10d28gYnl0ZXMgb3IgbW9yZQ==";
const KEY_2: &str = "bmV3IHJlcGxheSBrZXksIHRoaXJ0eS10d28gYnl0ZXMgb3IgbW9yZQ==";

#[tokio::test]
async fn entries_of_a_previous_key_replay_until_that_key_is_dropped() {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = |current: &str, previous: &str| {
        Gateway::builder(&store, &upstream.url())
            .replaying_from_redis(&redis.url())
            .env("IDEMGATE_REPLAY_KEY", current)
            .env("IDEMGATE_REPLAY_PREVIOUS_KEYS", previous)
            .start()
    };
    let old = |k: &[u8]| EntryKeys::new(k, [], false);
    let (key_1, key_2) = (entries::bytes_of(KEY_1), entries::bytes_of(KEY_2));

    let mut before = gateway(KEY_1, "").await;
    let first = post(&before.path("/v1/charges"), "rotating", "{}").await;
    written(&redis, "rotating", &old(&key_1)).await;
    before.kill().await;

    // The new key writes; the old one, listed as previous, still verifies.
    // Configured as the example file shows it (its lines uncommented).
    let example = include_str!("../../../config/idemgate.example.toml");
    let mut during = Gateway::builder(&store, &upstream.url()).replaying_from_redis(&redis.url());
    for line in example.lines().filter_map(|l| l.strip_prefix("# replay_")) {
        let (name, value) = line.split_once(" = ").unwrap();
        during = during.set(&format!("replay_{name}"), value);
    }
    let mut during = during
        .env("IDEMGATE_REPLAY_KEY", KEY_2)
        .env("IDEMGATE_REPLAY_KEY_OLD", KEY_1)
        .start()
        .await;
    let reply = post(&during.path("/v1/charges"), "rotating", "{}").await;
    assert_true_answer(&reply, &first);
    assert_eq!(
        during
            .metric("idemgate_replays_total{source=\"redis\"}")
            .await,
        1.0
    );
    let fresh = post(&during.path("/v1/charges"), "fresh", "{}").await;
    assert_eq!(fresh.status, 200);
    written(&redis, "fresh", &old(&key_2)).await;
    during.kill().await;

    // Dropped: its entries are refused, the store answers and rewrites them.
    let after = gateway(KEY_2, "").await;
    let reply = post(&after.path("/v1/charges"), "rotating", "{}").await;
    assert_true_answer(&reply, &first);
    assert_eq!(after.metric(&rejected("unknown_key")).await, 1.0);
    assert_eq!(
        after
            .metric("idemgate_replays_total{source=\"store\"}")
            .await,
        1.0
    );
    written(&redis, "rotating", &old(&key_2)).await;
    let fresh_again = post(&after.path("/v1/charges"), "fresh", "{}").await;
    assert_eq!(fresh_again.body, fresh.body);
    assert_eq!(
        after
            .metric("idemgate_replays_total{source=\"redis\"}")
            .await,
        1.0
    );
    assert_eq!(upstream.hits(), 2);
}

#[tokio::test]
async fn with_postgres_and_redis_a_replay_key_is_required() {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let refused = Gateway::builder(&store, "http://127.0.0.1:9")
        .set("redis_url", &format!("{:?}", redis.url()))
        // These tests are about what is read back, not how fast: a
        // loaded machine must not turn a mirror write into a miss.
        .set("redis_timeout", "\"1s\"")
        .env("IDEMGATE_REPLAY_KEY", "")
        .start_and_fail()
        .await;
    assert!(
        refused.contains("`replay_key`") && refused.contains("openssl rand -base64 32"),
        "{refused}"
    );
    let short = Gateway::builder(&store, "http://127.0.0.1:9")
        .set("redis_url", &format!("{:?}", redis.url()))
        // These tests are about what is read back, not how fast: a
        // loaded machine must not turn a mirror write into a miss.
        .set("redis_timeout", "\"1s\"")
        .env("IDEMGATE_REPLAY_KEY", "dG9vIHNob3J0")
        .start_and_fail()
        .await;
    assert!(short.contains("`replay_key`: not 32 bytes"), "{short}");
}

#[tokio::test]
async fn the_embedded_store_keeps_its_replay_key_beside_its_file() {
    let store = TestStore::embedded();
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = || {
        Gateway::builder(&store, &upstream.url())
            .replaying_from_redis(&redis.url())
            .env("IDEMGATE_REPLAY_KEY", "")
            .start()
    };
    let mut first_run = gateway().await;
    let first = post(&first_run.path("/v1/charges"), "beside", "{}").await;
    let TestStore::Embedded(dir) = &store else {
        unreachable!()
    };
    let beside = dir.path().join("idemgate.db.replay-key");
    let secret = std::fs::read_to_string(&beside).expect("the replay key beside the store");
    let keys = EntryKeys::new(&entries::bytes_of(secret.trim()), [], false);
    // The entry is written to Redis after the answer is sent: wait for it
    // before stopping the gateway, or a kill can come first.
    written(&redis, "beside", &keys).await;
    first_run.kill().await;

    // Started again, it finds its key and its entries.
    let second_run = gateway().await;
    let reply = post(&second_run.path("/v1/charges"), "beside", "{}").await;
    assert_true_answer(&reply, &first);
    assert_eq!(
        second_run
            .metric("idemgate_replays_total{source=\"redis\"}")
            .await,
        1.0
    );
}

/// Two replicas on PostgreSQL and Redis, streaming from `upstream`.
async fn replicas(
    store: &TestStore,
    upstream: &SseUpstream,
    redis: &ThrowawayRedis,
) -> (Gateway, Gateway) {
    let replica = || {
        Gateway::builder(store, &upstream.url())
            .set("upstream_timeout", "\"5s\"")
            .set("redis_url", &format!("{:?}", redis.url()))
            // These tests are about what is read back, not how fast: a
            // loaded machine must not turn a mirror write into a miss.
            .set("redis_timeout", "\"1s\"")
            .start()
    };
    (replica().await, replica().await)
}

fn job_of(reader: &Reader) -> JobId {
    JobId(uuid::Uuid::parse_str(reader.header("idempotency-job").unwrap()).unwrap())
}

const EVENT: usize = 128;
const EVENTS: usize = 5;

/// How a test spoils the Redis Stream of a running answer after its head
/// and first two chunks were mirrored.
enum Spoil {
    /// A forged end, counting the two chunks, as if committed.
    ForgedEnd,
    /// The genuine end of another job's stream.
    AnotherJobsEnd,
    /// The second chunk removed.
    ChunkRemoved,
}

/// A duplicate on another replica joins a stream whose mirror was spoiled:
/// it must not end before the true end, and its bytes are the true ones.
async fn a_spoiled_stream_is_never_served_as_complete(spoil: Spoil) -> Gateway {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let gate = Gate::new();
    let upstream = SseUpstream::start(EVENTS, EVENT, &gate, Ending::Clean).await;
    let (a, b) = replicas(&store, &upstream, &redis).await;
    let mut raw = Raw::connect(&redis.url()).await;
    let mut another_end = None;
    if let Spoil::AnotherJobsEnd = spoil {
        gate.open(EVENTS);
        let mut other = Reader::post(&a.path("/v1/chat"), "another", "{}").await;
        assert_eq!(other.finish().await, Finish::Complete);
        let job = job_of(&other);
        let stream = stream_key("idemgate:", &Tag::of(&owner(), &key("another")), job);
        eventually(WAIT, "another job's end to be mirrored", || async {
            Raw::connect(&redis.url())
                .await
                .entries(&stream)
                .await
                .len()
                == EVENTS + 2
        })
        .await;
        another_end = raw.entries(&stream).await.pop().map(|(_, _, end)| end);
    }
    gate.open(2);
    let mut first = Reader::post(&a.path("/v1/chat"), "spoiled", "{}").await;
    first.read_until(2 * EVENT).await;
    let job = job_of(&first);
    let stream = stream_key("idemgate:", &Tag::of(&owner(), &key("spoiled")), job);
    eventually(WAIT, "the head and two chunks to be mirrored", || async {
        Raw::connect(&redis.url())
            .await
            .entries(&stream)
            .await
            .len()
            == 3
    })
    .await;
    let mirrored = raw.entries(&stream).await;
    match spoil {
        Spoil::ForgedEnd => {
            let mut end = record(&forger_keys(false), (job, 1), Part::End, 2, &[1]);
            end[4..4 + HEAD_LEN].copy_from_slice(&suite_keys().head());
            raw.append(&stream, Part::End.field(), &end).await;
        }
        Spoil::AnotherJobsEnd => {
            raw.append(&stream, Part::End.field(), &another_end.unwrap())
                .await;
        }
        Spoil::ChunkRemoved => raw.remove(&stream, &mirrored[2].0).await,
    }

    let mut far = Reader::post(&b.path("/v1/chat"), "spoiled", "{}").await;
    assert_eq!(far.status, 200);
    far.read_until(EVENT).await;
    gate.open(EVENTS - 2);
    assert_eq!(first.finish().await, Finish::Complete);
    assert_eq!(
        far.finish().await,
        Finish::Complete,
        "completed from the store"
    );
    assert_eq!(
        String::from_utf8_lossy(&far.read),
        String::from_utf8_lossy(&first.read),
        "the joiner's copy is the whole answer"
    );
    assert_eq!(
        upstream.hits(),
        1 + matches!(spoil, Spoil::AnotherJobsEnd) as usize
    );
    b
}

#[tokio::test]
async fn a_stream_with_a_forged_end_is_completed_from_the_store() {
    let b = a_spoiled_stream_is_never_served_as_complete(Spoil::ForgedEnd).await;
    assert_eq!(b.metric(&rejected("forged")).await, 1.0);
}

#[tokio::test]
async fn a_stream_ended_by_another_jobs_end_is_completed_from_the_store() {
    let b = a_spoiled_stream_is_never_served_as_complete(Spoil::AnotherJobsEnd).await;
    assert_eq!(b.metric(&rejected("forged")).await, 1.0);
}

#[tokio::test]
async fn a_stream_missing_a_chunk_is_completed_from_the_store() {
    let b = a_spoiled_stream_is_never_served_as_complete(Spoil::ChunkRemoved).await;
    assert_eq!(b.metric(&rejected("truncated")).await, 1.0);
}
