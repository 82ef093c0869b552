//! Streamed answers (server-sent events) through the real binary: streamed
//! through while recorded, duplicates joining live, replays as streams, cut
//! streams failing every reader, and one recorded copy however many read.

use std::time::Duration;

use crate::support::scripted_sse::ScriptedSse;
use crate::support::sse::{event, Ending, Finish, Reader, SseUpstream};
use crate::support::{eventually, post, Gate, Gateway, TestStore};

const EVENT: usize = 128;

fn events(job: &str, from: usize, to: usize, size: usize) -> String {
    (from..=to).map(|n| event(job, n, size)).collect()
}

async fn gateway(store: &TestStore, upstream: &SseUpstream) -> Gateway {
    Gateway::builder(store, &upstream.url())
        .set("upstream_timeout", "\"5s\"")
        .start()
        .await
}

async fn each_event_reaches_the_client_before_the_next_is_sent(store: TestStore) {
    let gate = Gate::new();
    let upstream = SseUpstream::start(3, EVENT, &gate, Ending::Clean).await;
    let gateway = gateway(&store, &upstream).await;
    gate.open(1);
    let mut client = Reader::post(&gateway.path("/v1/chat"), "sse-1", "{}").await;
    assert_eq!(client.status, 200);
    assert_eq!(client.header("content-type"), Some("text/event-stream"));
    assert_eq!(client.header("content-length"), None);
    let job = client.header("idempotency-job").unwrap().to_owned();
    client.read_until(EVENT).await;
    assert_eq!(upstream.sent(), 1, "the second event is not sent yet");
    gate.open(1);
    client.read_until(2 * EVENT).await;
    gate.open(1);
    assert_eq!(client.finish().await, Finish::Complete);
    assert_eq!(
        String::from_utf8(client.read).unwrap(),
        events(&job, 1, 3, EVENT)
    );
}

async fn a_joiner_gets_what_was_sent_so_far_then_the_rest_live(store: TestStore) {
    let gate = Gate::new();
    let upstream = SseUpstream::start(6, EVENT, &gate, Ending::Clean).await;
    let gateway = gateway(&store, &upstream).await;
    let url = gateway.path("/v1/chat");
    gate.open(2);
    let mut first = Reader::post(&url, "sse-join", "{}").await;
    first.read_until(2 * EVENT).await;
    let mut joiner = Reader::post(&url, "sse-join", "{}").await;
    assert_eq!(joiner.status, 200);
    assert_eq!(joiner.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        joiner.header("idempotency-job"),
        first.header("idempotency-job")
    );
    joiner.read_until(2 * EVENT).await;
    // Event 3 reaches the joiner before the upstream sends event 4.
    gate.open(1);
    joiner.read_until(3 * EVENT).await;
    assert_eq!(upstream.sent(), 3);
    gate.open(3);
    assert_eq!(first.finish().await, Finish::Complete);
    assert_eq!(joiner.finish().await, Finish::Complete);
    assert_eq!(joiner.read, first.read, "byte-identical");
    assert_eq!(first.read.len(), 6 * EVENT);
    assert_eq!(upstream.hits(), 1);
}

async fn a_finished_stream_replays_as_an_identical_stream(store: TestStore) {
    let gate = Gate::new();
    gate.open(4);
    let upstream = SseUpstream::start(4, EVENT, &gate, Ending::Clean).await;
    let gateway = gateway(&store, &upstream).await;
    let url = gateway.path("/v1/chat");
    let mut first = Reader::post(&url, "sse-replay", "{}").await;
    assert_eq!(first.finish().await, Finish::Complete);
    let mut replay = Reader::post(&url, "sse-replay", "{}").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("content-type"), Some("text/event-stream"));
    assert_eq!(replay.header("content-length"), None, "sent as a stream");
    assert_eq!(replay.finish().await, Finish::Complete);
    assert_eq!(replay.read, first.read);
    assert_eq!(upstream.hits(), 1);
}

async fn a_stream_cut_midway_aborts_every_reader_and_blocks_the_key(store: TestStore) {
    let gate = Gate::new();
    let upstream = SseUpstream::start(6, EVENT, &gate, Ending::ResetAfter(3)).await;
    let gateway = gateway(&store, &upstream).await;
    let url = gateway.path("/v1/chat");
    gate.open(2);
    let mut first = Reader::post(&url, "sse-cut", "{}").await;
    first.read_until(2 * EVENT).await;
    let mut joiner = Reader::post(&url, "sse-cut", "{}").await;
    joiner.read_until(2 * EVENT).await;
    gate.open(4);
    assert_eq!(
        first.finish().await,
        Finish::Aborted,
        "no clean end for a partial stream"
    );
    assert_eq!(joiner.finish().await, Finish::Aborted);
    assert!(first.read.len() >= 2 * EVENT && first.read.len() < 6 * EVENT);
    assert_eq!(joiner.read, first.read, "both saw the same part");
    let job = first.header("idempotency-job").unwrap().to_owned();
    eventually(
        Duration::from_secs(5),
        "the attempt to be unknown",
        || async { gateway.job(&job).await["attempts"][0]["state"] == "unknown" },
    )
    .await;
    let retry = post(&url, "sse-cut", "{}").await;
    assert_eq!(retry.status, 409);
    assert_eq!(retry.problem(), "attempt-outcome-unknown");
    assert_eq!(upstream.hits(), 1);
}

async fn a_client_hanging_up_mid_stream_does_not_cancel_it(store: TestStore) {
    let gate = Gate::new();
    let upstream = SseUpstream::start(5, EVENT, &gate, Ending::Clean).await;
    let gateway = gateway(&store, &upstream).await;
    let url = gateway.path("/v1/chat");
    gate.open(1);
    let mut first = Reader::post(&url, "sse-gone", "{}").await;
    first.read_until(EVENT).await;
    let job = first.header("idempotency-job").unwrap().to_owned();
    drop(first);
    gate.open(4);
    // Counted once the commit's task has kept the answer for replays (the
    // job reads completed a moment before).
    eventually(
        Duration::from_secs(10),
        "the stream to be committed",
        || async { gateway.metric_sum("idemgate_commits_total").await == 1.0 },
    )
    .await;
    assert_eq!(gateway.job(&job).await["state"], "completed");
    let mut retry = Reader::post(&url, "sse-gone", "{}").await;
    assert_eq!(retry.finish().await, Finish::Complete);
    assert_eq!(
        String::from_utf8(retry.read).unwrap(),
        events(&job, 1, 5, EVENT)
    );
    assert_eq!(upstream.hits(), 1);
    // The attempt that committed the stream kept it for replays, though
    // nobody was reading any more: the retry is served from memory.
    assert_eq!(
        gateway
            .metric("idemgate_replays_total{source=\"memory\"}")
            .await,
        1.0
    );
    assert_eq!(
        gateway
            .metric("idemgate_replays_total{source=\"store\"}")
            .await,
        0.0
    );
}

/// Memory of the gateway process, from the kernel.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[tokio::test]
async fn a_hundred_joiners_share_one_recorded_copy() {
    const BIG: usize = 256 * 1024;
    let store = TestStore::postgres().await;
    let gate = Gate::new();
    let upstream = SseUpstream::start(6, BIG, &gate, Ending::Clean).await;
    // The upstream stays silent while a hundred joiners connect; on a loaded
    // machine that can take longer than the suite's usual 5 s silence.
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"30s\"")
        .start()
        .await;
    let url = gateway.path("/v1/chat");
    gate.open(5);
    let mut first = Reader::post(&url, "sse-many", "{}").await;
    first.read_until(5 * BIG).await;
    let before = rss_kib(gateway.pid());
    let mut joiners = Vec::new();
    for _ in 0..100 {
        let mut joiner = Reader::post(&url, "sse-many", "{}").await;
        joiner.read_until(5 * BIG).await;
        joiners.push(joiner);
    }
    let grown = rss_kib(gateway.pid()).saturating_sub(before);
    // 100 copies of the 1.25 MiB recorded so far would be 125 MiB; a
    // joiner costs its connection, not a copy.
    assert!(
        grown < 100 * 160,
        "RSS grew {grown} KiB for 100 joiners of a 1.25 MiB stream"
    );
    gate.open(1);
    for joiner in &mut joiners {
        assert_eq!(joiner.finish().await, Finish::Complete);
        assert_eq!(joiner.read.len(), 6 * BIG);
    }
    assert_eq!(first.finish().await, Finish::Complete);
    assert_eq!(upstream.hits(), 1);
    assert_eq!(gateway.metric("idemgate_stream_joiners_total").await, 100.0);
}

#[tokio::test]
async fn without_redis_a_duplicate_on_another_replica_is_held_then_replayed() {
    let store = TestStore::postgres().await;
    let gate = Gate::new();
    let upstream = SseUpstream::start(3, EVENT, &gate, Ending::Clean).await;
    let a = gateway(&store, &upstream).await;
    let b = gateway(&store, &upstream).await;
    gate.open(1);
    let mut first = Reader::post(&a.path("/v1/chat"), "sse-far", "{}").await;
    first.read_until(EVENT).await;
    let held = tokio::spawn({
        let url = b.path("/v1/chat");
        async move {
            let mut other = Reader::post(&url, "sse-far", "{}").await;
            let finish = other.finish().await;
            (other, finish)
        }
    });
    eventually(
        Duration::from_secs(5),
        "the duplicate to be held",
        || async { b.metric("idemgate_held_requests").await >= 1.0 },
    )
    .await;
    gate.open(2);
    assert_eq!(first.finish().await, Finish::Complete);
    let (other, finish) = held.await.unwrap();
    assert_eq!(finish, Finish::Complete);
    assert_eq!(other.header("idempotent-replayed"), Some("true"));
    assert_eq!(other.read, first.read);
    assert_eq!(upstream.hits(), 1);
}

crate::on_each_deployment!(
    [embedded, postgres]
    each_event_reaches_the_client_before_the_next_is_sent,
    a_joiner_gets_what_was_sent_so_far_then_the_rest_live,
    a_finished_stream_replays_as_an_identical_stream,
    a_stream_cut_midway_aborts_every_reader_and_blocks_the_key,
    a_client_hanging_up_mid_stream_does_not_cancel_it,
);

/// A side-effect-free route over `a` (primary) and `b`, hedging after 300 ms.
async fn hedging_gateway(store: &TestStore, a: &str, b: &str) -> Gateway {
    Gateway::builder(store, a)
        .set("upstreams", &format!("[{a:?}, {b:?}]"))
        .set("upstream_timeout", "\"5s\"")
        .tables(
            "[[routes]]\npath_prefix = \"/v1\"\nside_effect_free = true\nhedge_after = \"300ms\"\n",
        )
        .start()
        .await
}

/// Two side-effect-free routes hedging to `fallback` after 300 ms:
/// `/v1/chat` first tries `streams`, `/v1/slow` first tries `slow`.
async fn two_hedging_routes(
    store: &TestStore,
    streams: &str,
    slow: &str,
    fallback: &str,
) -> Gateway {
    let mut builder = Gateway::builder(store, "http://unused")
        .unset("upstreams")
        .set("upstream_timeout", "\"5s\"");
    for (name, url) in [("streams", streams), ("slow", slow), ("fallback", fallback)] {
        builder = builder.tables(&format!("[[upstreams]]\nname = {name:?}\nurl = {url:?}\n"));
    }
    for (prefix, primary) in [("/v1/chat", "streams"), ("/v1/slow", "slow")] {
        builder = builder.tables(&format!(
            "[[routes]]\npath_prefix = {prefix:?}\nupstreams = [{primary:?}, \"fallback\"]\n\
             side_effect_free = true\nhedge_after = \"300ms\"\n"
        ));
    }
    builder.start().await
}

#[tokio::test]
async fn once_a_stream_has_started_no_other_upstream_is_tried() {
    let store = TestStore::postgres().await;
    let gate = Gate::new();
    let primary = SseUpstream::start(3, EVENT, &gate, Ending::Clean).await;
    let never = Gate::new();
    let slow = crate::support::FakeUpstream::gated_echo(&never, |_| true).await;
    let fallback = crate::support::FakeUpstream::echo().await;
    let gateway = two_hedging_routes(&store, &primary.url(), &slow.url(), &fallback.url()).await;
    gate.open(1);
    let mut client = Reader::post(&gateway.path("/v1/chat"), "sse-hedge-1", "{}").await;
    client.read_until(EVENT).await;
    // Then the stream falls silent. The control: a request begun after it,
    // on a route hedging after the same 300 ms to the same fallback, whose
    // primary never answers. Answered within 3 s (before the 5 s upstream
    // timeout), it was answered by its hedge; by then the stream's hedge
    // timer, armed earlier, has run out too, and had it still counted once
    // the bytes were out, its hedge would have reached the fallback first.
    let slow_url = gateway.path("/v1/slow");
    let control = post(&slow_url, "hedge-control", "{}");
    let control = tokio::time::timeout(Duration::from_secs(3), control)
        .await
        .expect("the control was not hedged within 3 s: the stream's silence proves nothing");
    assert_eq!(control.status, 200, "{:?}", control.body);
    let hedged: Vec<String> = fallback.recorded().into_iter().map(|r| r.path).collect();
    assert_eq!(hedged, ["/v1/slow"], "no hedge once the stream started");
    assert_eq!(gateway.metric("idemgate_hedges_total").await, 1.0);
    gate.open(2);
    assert_eq!(client.finish().await, Finish::Complete);
    let job = gateway.job(client.header("idempotency-job").unwrap()).await;
    assert_eq!(job["attempts"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn a_hedge_that_streams_first_wins_and_the_silent_primary_is_superseded() {
    let store = TestStore::postgres().await;
    let silent = Gate::new();
    let primary = crate::support::FakeUpstream::gated_echo(&silent, |_| true).await;
    let gate = Gate::new();
    gate.open(3);
    let hedge = SseUpstream::start(3, EVENT, &gate, Ending::Clean).await;
    let gateway = hedging_gateway(&store, &primary.url(), &hedge.url()).await;
    let mut client = Reader::post(&gateway.path("/v1/chat"), "sse-hedge-2", "{}").await;
    assert_eq!(client.header("content-type"), Some("text/event-stream"));
    assert_eq!(client.finish().await, Finish::Complete);
    assert_eq!(client.read.len(), 3 * EVENT);
    let id = client.header("idempotency-job").unwrap().to_owned();
    eventually(
        Duration::from_secs(5),
        "the primary to be superseded",
        || async { gateway.job(&id).await["attempts"][0]["state"] == "superseded" },
    )
    .await;
    let job = gateway.job(&id).await;
    assert_eq!(job["attempts"][1]["state"], "succeeded");
    assert_eq!(job["completed_by"], job["attempts"][1]["id"]);
    // The primary's late answer changes nothing.
    silent.open(1);
    let mut replay = Reader::post(&gateway.path("/v1/chat"), "sse-hedge-2", "{}").await;
    assert_eq!(replay.finish().await, Finish::Complete);
    assert_eq!(replay.read, client.read);
}

#[tokio::test]
async fn with_redis_a_duplicate_on_another_replica_joins_live() {
    let store = TestStore::postgres().await;
    let redis = crate::support::ThrowawayRedis::start().await;
    let gate = Gate::new();
    let upstream = SseUpstream::start(6, EVENT, &gate, Ending::Clean).await;
    let a = upstream.replica(&store, &redis).await;
    let b = upstream.replica(&store, &redis).await;
    gate.open(2);
    let mut first = Reader::post(&a.path("/v1/chat"), "sse-redis", "{}").await;
    first.read_until(2 * EVENT).await;
    let mut far = Reader::post(&b.path("/v1/chat"), "sse-redis", "{}").await;
    assert_eq!(far.status, 200);
    assert_eq!(far.header("idempotent-replayed"), Some("true"));
    far.read_until(2 * EVENT).await;
    // Live: event 3 reaches the other replica's client before event 4 is sent.
    gate.open(1);
    far.read_until(3 * EVENT).await;
    assert_eq!(upstream.sent(), 3);
    gate.open(3);
    assert_eq!(first.finish().await, Finish::Complete);
    assert_eq!(far.finish().await, Finish::Complete);
    assert_eq!(far.read, first.read);
    assert_eq!(upstream.hits(), 1);
    assert_eq!(b.metric("idemgate_stream_joiners_total").await, 1.0);
}

/// A replica of a side-effect-free `/v1` route trying `primary`, hedged to
/// `fallback` after 300 ms, mirroring streams on `redis`.
async fn hedging_replica(
    store: &TestStore,
    (primary, fallback): (&str, &str),
    redis: &crate::support::ThrowawayRedis,
) -> Gateway {
    Gateway::builder(store, "http://unused")
        .unset("upstreams")
        .set("upstream_timeout", "\"5s\"")
        .set("redis_url", &format!("{:?}", redis.url()))
        .tables(&format!(
            "[[upstreams]]\nname = \"primary\"\nurl = {primary:?}\n\
             [[upstreams]]\nname = \"fallback\"\nurl = {fallback:?}\n\
             [[routes]]\npath_prefix = \"/v1\"\nupstreams = [\"primary\", \"fallback\"]\n\
             side_effect_free = true\nhedge_after = \"300ms\"\n"
        ))
        .start()
        .await
}

/// The job's latest attempt is a hedge, started while the primary was
/// silent; then the primary's head comes, its stream supersedes the hedge,
/// and the stream is the job's answer though its attempt is not the
/// latest. A duplicate on another replica joins it live through the Redis
/// mirror, as it would a stream of the latest attempt, rather than being
/// held to the end (`docs/design.md` §10). Before, it was held: its head
/// came only once the stream had ended.
#[tokio::test]
async fn with_redis_a_duplicate_on_another_replica_joins_a_stream_its_hedge_gave_way_to() {
    let store = TestStore::postgres().await;
    let redis = crate::support::ThrowawayRedis::start().await;
    let gate = Gate::new();
    let events: Vec<String> = (1..=3).map(|n| event("hedged", n, EVENT)).collect();
    let primary = ScriptedSse::head_held(vec![events.clone()], gate.clone()).await;
    let never = Gate::new();
    let fallback = crate::support::FakeUpstream::gated_echo(&never, |_| true).await;
    let urls = (primary.url(), fallback.url());
    let a = hedging_replica(&store, (&urls.0, &urls.1), &redis).await;
    let b = hedging_replica(&store, (&urls.0, &urls.1), &redis).await;
    let first = tokio::spawn(Reader::post(a.path("/v1/chat").leak(), "hedged", "{}"));
    eventually(
        Duration::from_secs(10),
        "the hedge at the fallback",
        || async { fallback.hits() == 1 },
    )
    .await;
    gate.open(1);
    let mut first = first.await.unwrap();
    assert_eq!(first.status, 200);
    first.read_until(EVENT).await;
    let id = first.header("idempotency-job").unwrap().to_owned();
    // A bound, not a pace: polled, it passes in about a second; a CI
    // machine loaded by the other tests' databases once took over 5 s to
    // record the hedge's end.
    eventually(
        Duration::from_secs(30),
        "the hedge to be superseded",
        || async { a.job(&id).await["attempts"][1]["state"] == "superseded" },
    )
    .await;
    assert_eq!(a.job(&id).await["attempts"][0]["state"], "started");
    let far_url = b.path("/v1/chat");
    let far = Reader::post(&far_url, "hedged", "{}");
    let mut far = tokio::time::timeout(Duration::from_secs(5), far)
        .await
        .expect("the duplicate was held, not joined to the stream");
    assert_eq!(far.status, 200);
    assert_eq!(far.header("idempotent-replayed"), Some("true"));
    far.read_until(EVENT).await;
    // Live: event 2 reaches the other replica's client before event 3 is sent.
    gate.open(1);
    far.read_until(2 * EVENT).await;
    gate.open(1);
    assert_eq!(first.finish().await, Finish::Complete);
    assert_eq!(far.finish().await, Finish::Complete);
    assert_eq!(far.read, first.read);
    assert_eq!(String::from_utf8(far.read).unwrap(), events.concat());
    assert_eq!(primary.hits(), 1);
    assert_eq!(b.metric("idemgate_stream_joiners_total").await, 1.0);
}

#[tokio::test]
async fn a_joiner_across_replicas_completes_from_the_store_when_redis_dies() {
    let store = TestStore::postgres().await;
    let mut redis = crate::support::ThrowawayRedis::start().await;
    let gate = Gate::new();
    let upstream = SseUpstream::start(4, EVENT, &gate, Ending::Clean).await;
    let a = upstream.replica(&store, &redis).await;
    let b = upstream.replica(&store, &redis).await;
    gate.open(1);
    let mut first = Reader::post(&a.path("/v1/chat"), "sse-redis-gone", "{}").await;
    first.read_until(EVENT).await;
    let mut far = Reader::post(&b.path("/v1/chat"), "sse-redis-gone", "{}").await;
    far.read_until(EVENT).await;
    redis.kill().await;
    gate.open(3);
    assert_eq!(first.finish().await, Finish::Complete);
    assert_eq!(
        far.finish().await,
        Finish::Complete,
        "completed from the committed answer"
    );
    assert_eq!(far.read, first.read);
    assert_eq!(upstream.hits(), 1);
}

/// A route whose contract checks each event of a streamed answer, its
/// requests declared free of side effects (`side_effect_free`) or not.
async fn contract_gateway_with(store: &TestStore, upstream: &SseUpstream, free: bool) -> Gateway {
    let chat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/chat");
    Gateway::builder(store, &upstream.url())
        .files_from(&chat)
        .tables(&format!(
            "[contracts.chunks]\nschema = \"response.schema.json\"\nevents = \"chunk.schema.json\"\n\
             [[routes]]\npath_prefix = \"/v1\"\ncontract = \"chunks\"\nside_effect_free = {free}\n",
        ))
        .start()
        .await
}

async fn contract_gateway(store: &TestStore, upstream: &SseUpstream) -> Gateway {
    contract_gateway_with(store, upstream, true).await
}

#[tokio::test]
async fn a_stream_that_breaks_the_contract_is_cut_and_rejected() {
    let store = TestStore::postgres().await;
    let gate = Gate::new();
    gate.open(3);
    let upstream = SseUpstream::start(3, EVENT, &gate, Ending::Clean).await;
    let gateway = contract_gateway(&store, &upstream).await;
    let mut client = Reader::post(&gateway.path("/v1/chat"), "sse-breach", "{}").await;
    assert_eq!(client.finish().await, Finish::Aborted, "no clean end");
    let job = gateway.job(client.header("idempotency-job").unwrap()).await;
    assert_eq!(job["state"], "open", "a breach is a safe failure");
    assert_eq!(job["attempts"][0]["state"], "rejected");
    assert!(job["attempts"][0]["detail"]
        .as_str()
        .unwrap()
        .contains("broke contract chunks"));
}

/// The same breach on a route not declared `side_effect_free`: the
/// stream's `200` says the upstream acted, so the attempt is `unknown`,
/// not a safe failure, and the retry is told so rather than run again.
#[tokio::test]
async fn a_stream_that_breaks_the_contract_of_a_route_with_effects_is_unknown() {
    let store = TestStore::postgres().await;
    let gate = Gate::new();
    gate.open(3);
    let upstream = SseUpstream::start(3, EVENT, &gate, Ending::Clean).await;
    let gateway = contract_gateway_with(&store, &upstream, false).await;
    let mut client = Reader::post(&gateway.path("/v1/chat"), "sse-breach-2", "{}").await;
    assert_eq!(client.finish().await, Finish::Aborted, "no clean end");
    let job = gateway.job(client.header("idempotency-job").unwrap()).await;
    assert_eq!(job["state"], "unknown", "{job}");
    assert_eq!(job["attempts"][0]["state"], "unknown");
    let retry = crate::support::post(&gateway.path("/v1/chat"), "sse-breach-2", "{}").await;
    assert_eq!(retry.status, 409);
    assert_eq!(retry.problem(), "attempt-outcome-unknown");
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn a_stream_that_honours_the_contract_is_committed() {
    const TOKENS: &[&str] = &["a", "b"];
    let store = TestStore::postgres().await;
    let upstream = SseUpstream::openai(TOKENS, Duration::from_millis(1)).await;
    let gateway = contract_gateway(&store, &upstream).await;
    let mut client = Reader::post(&gateway.path("/v1/chat"), "sse-honest", "{}").await;
    assert_eq!(client.finish().await, Finish::Complete);
    let job = gateway.job(client.header("idempotency-job").unwrap()).await;
    assert_eq!(job["state"], "completed");
}
