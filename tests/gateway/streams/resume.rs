//! Resuming a stream where its client lost it, through the real binary
//! (`docs/design.md` §10, "Resume"): a retry naming a resume point gets only
//! what follows it, live while the stream runs (on this replica, or on
//! another through the Redis mirror) and from the stored answer once it
//! ended; a point the answer never reaches is refused, nothing replayed or
//! run. Heartbeats reach live readers but are not part of the answer.

use std::time::Duration;

use http::Method;

use crate::support::sse::{event, event_with_id, Ending, Finish, Reader, SseUpstream, HEARTBEAT};
use crate::support::{send, FakeUpstream, Gate, Gateway, TestStore};

const EVENT: usize = 128;
const EVENTS: usize = 8;

fn events(job: &str, from: usize, to: usize) -> String {
    (from..=to).map(|n| event(job, n, EVENT)).collect()
}

async fn gateway(store: &TestStore, upstream: &SseUpstream) -> Gateway {
    Gateway::builder(store, &upstream.url())
        .set("upstream_timeout", "\"5s\"")
        .start()
        .await
}

fn received(n: usize) -> [(&'static str, String); 1] {
    [("idempotency-events-received", n.to_string())]
}

async fn resume(url: &str, key: &str, header: (&str, &str)) -> Reader {
    Reader::post_with(url, key, "{}", &[header]).await
}

/// The first client reads 3 of 8 events and drops; a retry saying so gets
/// events 4 to 8 only, live, then again once the stream ended; the whole
/// answer is still there for a retry without a resume point.
async fn a_retry_with_its_count_gets_only_what_follows_live_and_after_the_end(store: TestStore) {
    let gate = Gate::new();
    let upstream = SseUpstream::start(EVENTS, EVENT, &gate, Ending::Clean).await;
    let gateway = gateway(&store, &upstream).await;
    let url = gateway.path("/v1/chat");
    gate.open(3);
    let mut first = Reader::post(&url, "resume-count", "{}").await;
    first.read_until(3 * EVENT).await;
    let job = first.header("idempotency-job").unwrap().to_owned();
    drop(first);
    let [(name, three)] = received(3);
    let mut live = resume(&url, "resume-count", (name, &three)).await;
    assert_eq!(live.status, 200);
    assert_eq!(live.header("idempotent-replayed"), Some("true"));
    assert_eq!(live.header("idempotency-events-skipped"), Some("3"));
    assert_eq!(live.header("content-type"), Some("text/event-stream"));
    // Live: event 4 arrives before the upstream sends event 5.
    gate.open(1);
    live.read_until(EVENT).await;
    assert_eq!(upstream.sent(), 4);
    gate.open(EVENTS - 4);
    assert_eq!(live.finish().await, Finish::Complete);
    assert_eq!(
        String::from_utf8(live.read).unwrap(),
        events(&job, 4, EVENTS)
    );
    let mut whole = Reader::post(&url, "resume-count", "{}").await;
    assert_eq!(whole.finish().await, Finish::Complete);
    assert_eq!(
        String::from_utf8(whole.read.clone()).unwrap(),
        events(&job, 1, EVENTS)
    );
    let mut stored = resume(&url, "resume-count", (name, &three)).await;
    assert_eq!(stored.finish().await, Finish::Complete);
    assert_eq!(
        stored.read,
        whole.read[3 * EVENT..],
        "the original's tail, byte for byte"
    );
    let [(_, all)] = received(EVENTS);
    let mut nothing_left = resume(&url, "resume-count", (name, &all)).await;
    assert_eq!(nothing_left.finish().await, Finish::Complete);
    assert!(
        nothing_left.read.is_empty(),
        "every event was received: only the end"
    );
    assert_eq!(upstream.hits(), 1);
    assert_eq!(
        gateway
            .metric("idemgate_stream_resumes_total{result=\"resumed\"}")
            .await,
        3.0
    );
}

/// `Last-Event-ID` resumes after the event that carried the id.
async fn a_retry_with_last_event_id_gets_what_follows_that_event(store: TestStore) {
    let gate = Gate::new();
    let upstream = SseUpstream::with_ids(EVENTS, EVENT, &gate).await;
    let gateway = gateway(&store, &upstream).await;
    let url = gateway.path("/v1/chat");
    gate.open(3);
    let mut first = Reader::post(&url, "resume-id", "{}").await;
    first.read_until(3 * EVENT).await;
    let job = first.header("idempotency-job").unwrap().to_owned();
    drop(first);
    let mut live = resume(&url, "resume-id", ("last-event-id", "e3")).await;
    assert_eq!(live.header("idempotency-events-skipped"), Some("3"));
    gate.open(EVENTS - 3);
    assert_eq!(live.finish().await, Finish::Complete);
    let tail: String = (4..=EVENTS)
        .map(|n| event_with_id(&job, n, EVENT))
        .collect();
    assert_eq!(String::from_utf8(live.read).unwrap(), tail);
    let mut after_end = resume(&url, "resume-id", ("last-event-id", "e7")).await;
    assert_eq!(after_end.finish().await, Finish::Complete);
    assert_eq!(
        String::from_utf8(after_end.read).unwrap(),
        event_with_id(&job, 8, EVENT)
    );
    let unknown = send(
        Method::POST,
        &url,
        &[
            ("idempotency-key", "resume-id"),
            ("content-type", "application/json"),
            ("last-event-id", "e99"),
        ],
        "{}",
    )
    .await;
    assert_eq!(unknown.status, 416);
    assert_eq!(unknown.problem(), "resume-point-not-satisfiable");
    assert_eq!(unknown.json()["events"], EVENTS);
    assert_eq!(upstream.hits(), 1);
}

/// Points that cannot be read are `400`; points past the end, keys with no
/// job and answers that are not event streams are `416`; none runs or
/// replays anything, and none spends the key.
async fn a_bad_resume_point_is_refused_and_nothing_is_run_or_replayed(store: TestStore) {
    let gate = Gate::new();
    gate.open(EVENTS);
    let upstream = SseUpstream::start(EVENTS, EVENT, &gate, Ending::Clean).await;
    let gateway = gateway(&store, &upstream).await;
    let url = gateway.path("/v1/chat");
    let refused = |headers: Vec<(&'static str, &'static str)>, key: &'static str| {
        let url = url.clone();
        async move {
            let mut all = vec![
                ("idempotency-key", key),
                ("content-type", "application/json"),
            ];
            all.extend(headers);
            send(Method::POST, &url, &all, "{}").await
        }
    };
    // No job has this key: nothing to resume, and nothing is started.
    let none = refused(vec![("idempotency-events-received", "3")], "resume-new").await;
    assert_eq!(none.status, 416, "{}", none.problem_detail());
    assert_eq!(
        none.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(upstream.hits(), 0);
    let mut first = Reader::post(&url, "resume-new", "{}").await;
    assert_eq!(first.finish().await, Finish::Complete);
    assert_eq!(
        first.header("idempotent-replayed"),
        None,
        "the key was not spent"
    );
    for (headers, why) in [
        (
            vec![("idempotency-events-received", "three")],
            "not a number",
        ),
        (vec![("idempotency-events-received", "-1")], "negative"),
        (
            vec![
                ("idempotency-events-received", "1"),
                ("last-event-id", "e1"),
            ],
            "two points",
        ),
    ] {
        let bad = refused(headers, "resume-new").await;
        assert_eq!(bad.status, 400, "{why}");
        assert_eq!(bad.problem(), "invalid-resume-point", "{why}");
    }
    // Another owner's key of the same name is not this job: nothing of it.
    let stranger = vec![
        ("idempotency-events-received", "1"),
        ("authorization", "Bearer mallory"),
    ];
    let stranger = refused(stranger, "resume-new").await;
    assert_eq!(stranger.status, 416);
    assert!(!String::from_utf8_lossy(&stranger.body).contains("data:"));
    let past = refused(vec![("idempotency-events-received", "9")], "resume-new").await;
    assert_eq!(past.status, 416);
    assert_eq!(past.json()["events"], EVENTS);
    assert!(
        past.problem_detail().contains("0 to 8"),
        "{}",
        past.problem_detail()
    );
    assert_eq!(upstream.hits(), 1);
    let refusals = gateway.metric("idemgate_stream_resumes_total{result=\"refused\"}");
    assert_eq!(refusals.await, 3.0, "no job, another owner's, past the end");
}

/// A resume point on an answer that is not an event stream is refused.
async fn an_answer_that_is_not_an_event_stream_cannot_be_resumed(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let url = gateway.path("/v1/charges");
    // A count of 0 is no resume point: the request runs, and the gateway's
    // header stays the gateway's.
    let first = send(
        Method::POST,
        &url,
        &[
            ("idempotency-key", "resume-json"),
            ("content-type", "application/json"),
            ("idempotency-events-received", "0"),
        ],
        "{}",
    )
    .await;
    assert_eq!(first.status, 200);
    assert_eq!(first.header("idempotent-replayed"), None);
    let sent = &upstream.recorded()[0];
    assert_eq!(sent.header("idempotency-events-received"), None);
    let refused = send(
        Method::POST,
        &url,
        &[
            ("idempotency-key", "resume-json"),
            ("content-type", "application/json"),
            ("idempotency-events-received", "1"),
        ],
        "{}",
    )
    .await;
    assert_eq!(refused.status, 416);
    assert!(refused.problem_detail().contains("not an event stream"));
    assert_eq!(upstream.hits(), 1);
}

/// Heartbeats reach the client reading live and keep a quiet stream alive
/// past the silence timeout, but a replay, and a resume, count and carry
/// events only.
async fn heartbeats_pass_live_but_are_not_part_of_the_answer(store: TestStore) {
    let gate = Gate::new();
    let beat = Duration::from_millis(100);
    let upstream = SseUpstream::with_heartbeats(4, EVENT, &gate, beat).await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"1s\"")
        .start()
        .await;
    let url = gateway.path("/v1/chat");
    gate.open(1);
    let mut first = Reader::post(&url, "beats", "{}").await;
    first.read_until(EVENT + 3 * HEARTBEAT.len()).await;
    // Quiet for three times the timeout but for heartbeats: not cut.
    let quiet = first.read.len();
    tokio::time::sleep(Duration::from_secs(3)).await;
    gate.open(3);
    assert_eq!(first.finish().await, Finish::Complete);
    let job = first.header("idempotency-job").unwrap().to_owned();
    let sent = String::from_utf8(first.read).unwrap();
    assert!(
        sent[quiet..].starts_with(HEARTBEAT),
        "heartbeats while quiet"
    );
    assert_eq!(
        sent.replace(HEARTBEAT, ""),
        events(&job, 1, 4),
        "heartbeats came between whole events"
    );
    let mut replay = Reader::post(&url, "beats", "{}").await;
    assert_eq!(replay.finish().await, Finish::Complete);
    assert_eq!(String::from_utf8(replay.read).unwrap(), events(&job, 1, 4));
    let [(name, two)] = received(2);
    let mut resumed = resume(&url, "beats", (name, &two)).await;
    assert_eq!(resumed.finish().await, Finish::Complete);
    assert_eq!(String::from_utf8(resumed.read).unwrap(), events(&job, 3, 4));
    assert_eq!(upstream.hits(), 1);
}

/// A compressed event stream is recorded exactly as sent, whatever its
/// bytes look like (a "heartbeat" inside gzip output is not one), and is
/// not resumable.
async fn a_compressed_event_stream_is_kept_as_sent_and_not_cut(store: TestStore) {
    const BODY: &[u8] = b"\x1f\x8b\x08\0junk\n\n: not a heartbeat\n\nmore\r\rdata: x\n\n\xff";
    let upstream = FakeUpstream::start(|_| async {
        http::Response::builder()
            .header("content-type", "text/event-stream")
            .header("content-encoding", "gzip")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(BODY)))
            .unwrap()
    })
    .await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let url = gateway.path("/v1/chat");
    let mut first = Reader::post(&url, "gzip", "{}").await;
    assert_eq!(first.finish().await, Finish::Complete);
    assert_eq!(first.read, BODY);
    let mut replay = Reader::post(&url, "gzip", "{}").await;
    assert_eq!(replay.finish().await, Finish::Complete);
    assert_eq!(
        replay.read, BODY,
        "byte for byte, nothing taken for a heartbeat"
    );
    let resumed =
        Reader::post_with(&url, "gzip", "{}", &[("idempotency-events-received", "1")]).await;
    assert_eq!(resumed.status, 416);
    assert_eq!(upstream.hits(), 1);
}

/// A resume only ever continues an answer: a job whose attempt failed (it
/// is open), or whose stream was cut where the route would move on, is
/// `416` with no new attempt; a cut stream on a route that blocks is `409`
/// like any retry; a resume with another body is a key mismatch.
async fn a_resume_never_starts_an_attempt(store: TestStore) {
    let busy = FakeUpstream::start(|_| async {
        crate::support::upstream::json_response(503, serde_json::json!({"busy": true}))
    })
    .await;
    let gate = Gate::new();
    gate.open(10);
    let cut = SseUpstream::start(6, EVENT, &gate, Ending::ResetAfter(3)).await;
    let routes = format!(
        r#"
[[upstreams]]
name = "busy"
url = "{}"

[[upstreams]]
name = "cut"
url = "{}"

[[routes]]
path_prefix = "/v1/busy"
upstreams = ["busy"]

[[routes]]
path_prefix = "/v1/cut"
upstreams = ["cut"]

[[routes]]
path_prefix = "/v1/cut-moving-on"
upstreams = ["cut"]
side_effect_free = true
on_unknown = "new_attempt"
"#,
        busy.url(),
        cut.url()
    );
    let gateway = Gateway::builder(&store, &busy.url())
        .unset("upstreams")
        .tables(&routes)
        .set("upstream_timeout", "\"5s\"")
        .start()
        .await;
    let count = [("idempotency-events-received", "2")];
    let open = Reader::post(&gateway.path("/v1/busy"), "open", "{}").await;
    assert_eq!(open.status, 503, "passed on, the job open");
    let refused = Reader::post_with(&gateway.path("/v1/busy"), "open", "{}", &count).await;
    assert_eq!(refused.status, 416);
    assert_eq!(busy.hits(), 1, "no attempt for a resume");
    for (path, key, status) in [
        ("/v1/cut", "blocked", 409),
        ("/v1/cut-moving-on", "moving", 416),
    ] {
        let url = gateway.path(path);
        let mut first = Reader::post(&url, key, "{}").await;
        // Cut before or after its head: either way its outcome is unknown.
        let _ = first.finish().await;
        let job = first.header("idempotency-job").unwrap().to_owned();
        let unknown = || async { gateway.job(&job).await["state"] == "unknown" };
        crate::support::eventually(Duration::from_secs(10), "the job to be unknown", unknown).await;
        let hits = cut.hits();
        let resumed = Reader::post_with(&url, key, "{}", &count).await;
        assert_eq!(resumed.status, status, "{path}");
        assert_eq!(cut.hits(), hits, "{path}: no attempt for a resume");
    }
    let other_body =
        Reader::post_with(&gateway.path("/v1/busy"), "open", "{\"x\":1}", &count).await;
    assert_eq!(other_body.status, 409, "another request under the key");
    assert_eq!(busy.hits(), 1);
}

/// On a route that does not stream event streams, an answer is buffered and
/// replayed whole, with its length: a resume of it is still cut at its
/// events, and sent without that length.
async fn an_event_stream_kept_whole_resumes_too(store: TestStore) {
    let gate = Gate::new();
    gate.open(4);
    let upstream = SseUpstream::start(4, EVENT, &gate, Ending::Clean).await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .tables("[[routes]]\npath_prefix = \"/\"\nstream_types = [\"application/x-ndjson\"]\n")
        .start()
        .await;
    let url = gateway.path("/v1/chat");
    let whole = send(
        Method::POST,
        &url,
        &[
            ("idempotency-key", "whole"),
            ("content-type", "application/json"),
        ],
        "{}",
    )
    .await;
    assert_eq!(
        whole.header("content-length"),
        Some(&*(4 * EVENT).to_string())
    );
    let job = whole.job().unwrap();
    let mut resumed = resume(&url, "whole", ("idempotency-events-received", "2")).await;
    assert_eq!(resumed.header("content-length"), None);
    assert_eq!(resumed.finish().await, Finish::Complete);
    assert_eq!(String::from_utf8(resumed.read).unwrap(), events(&job, 3, 4));
    assert_eq!(upstream.hits(), 1);
}

crate::on_each_deployment!(
    [embedded, postgres]
    a_retry_with_its_count_gets_only_what_follows_live_and_after_the_end,
    a_retry_with_last_event_id_gets_what_follows_that_event,
    a_bad_resume_point_is_refused_and_nothing_is_run_or_replayed,
    an_answer_that_is_not_an_event_stream_cannot_be_resumed,
    heartbeats_pass_live_but_are_not_part_of_the_answer,
    a_compressed_event_stream_is_kept_as_sent_and_not_cut,
    a_resume_never_starts_an_attempt,
    an_event_stream_kept_whole_resumes_too,
);

/// Two replicas on PostgreSQL and Redis: the client drops on one and
/// resumes on the other while the stream runs (through the Redis mirror),
/// then again once it ended.
#[tokio::test]
async fn a_resume_on_another_replica_follows_the_mirror_live() {
    let store = TestStore::postgres().await;
    let redis = crate::support::ThrowawayRedis::start().await;
    let gate = Gate::new();
    let upstream = SseUpstream::start(EVENTS, EVENT, &gate, Ending::Clean).await;
    let a = upstream.replica(&store, &redis).await;
    let b = upstream.replica(&store, &redis).await;
    gate.open(3);
    let mut first = Reader::post(&a.path("/v1/chat"), "resume-far", "{}").await;
    first.read_until(3 * EVENT).await;
    let job = first.header("idempotency-job").unwrap().to_owned();
    drop(first);
    let [(name, three)] = received(3);
    let mut far = resume(&b.path("/v1/chat"), "resume-far", (name, &three)).await;
    assert_eq!(far.status, 200);
    assert_eq!(far.header("idempotency-events-skipped"), Some("3"));
    gate.open(1);
    far.read_until(EVENT).await;
    assert_eq!(upstream.sent(), 4, "live: event 4 before event 5 is sent");
    gate.open(EVENTS - 4);
    assert_eq!(far.finish().await, Finish::Complete);
    assert_eq!(
        String::from_utf8(far.read).unwrap(),
        events(&job, 4, EVENTS)
    );
    let mut ended = resume(&b.path("/v1/chat"), "resume-far", (name, &three)).await;
    assert_eq!(ended.finish().await, Finish::Complete);
    assert_eq!(
        String::from_utf8(ended.read).unwrap(),
        events(&job, 4, EVENTS)
    );
    assert_eq!(upstream.hits(), 1);
    assert_eq!(b.metric("idemgate_stream_joiners_total").await, 1.0);
}

/// Heartbeats are mirrored with the stream: a joiner on another replica
/// gets them while it waits, and its replay afterwards has none.
#[tokio::test]
async fn heartbeats_reach_a_joiner_on_another_replica_but_not_the_answer() {
    let store = TestStore::postgres().await;
    let redis = crate::support::ThrowawayRedis::start().await;
    let gate = Gate::new();
    let upstream = SseUpstream::with_heartbeats(2, EVENT, &gate, Duration::from_millis(100)).await;
    let a = upstream.replica(&store, &redis).await;
    let b = upstream.replica(&store, &redis).await;
    gate.open(1);
    let mut first = Reader::post(&a.path("/v1/chat"), "beats-far", "{}").await;
    first.read_until(EVENT).await;
    let mut far = Reader::post(&b.path("/v1/chat"), "beats-far", "{}").await;
    assert_eq!(far.header("idempotent-replayed"), Some("true"));
    far.read_until(EVENT + 2 * HEARTBEAT.len()).await;
    gate.open(1);
    assert_eq!(first.finish().await, Finish::Complete);
    assert_eq!(far.finish().await, Finish::Complete);
    let job = first.header("idempotency-job").unwrap().to_owned();
    let far_read = String::from_utf8(far.read).unwrap();
    assert!(far_read.contains(HEARTBEAT), "heartbeats crossed replicas");
    assert_eq!(far_read.replace(HEARTBEAT, ""), events(&job, 1, 2));
    let mut replay = Reader::post(&b.path("/v1/chat"), "beats-far", "{}").await;
    assert_eq!(replay.finish().await, Finish::Complete);
    assert_eq!(String::from_utf8(replay.read).unwrap(), events(&job, 1, 2));
}

/// Without Redis, a resume on another replica while the stream runs is held
/// until the answer is committed, then cut from the store's copy; a replica
/// that never saw the stream resumes from the store alone.
#[tokio::test]
async fn without_redis_a_resume_elsewhere_is_cut_from_the_store() {
    let store = TestStore::postgres().await;
    let gate = Gate::new();
    let upstream = SseUpstream::start(EVENTS, EVENT, &gate, Ending::Clean).await;
    let a = gateway(&store, &upstream).await;
    let b = gateway(&store, &upstream).await;
    gate.open(3);
    let mut first = Reader::post(&a.path("/v1/chat"), "resume-store", "{}").await;
    first.read_until(3 * EVENT).await;
    let job = first.header("idempotency-job").unwrap().to_owned();
    drop(first);
    let far_url = b.path("/v1/chat");
    let held = tokio::spawn(async move {
        let mut far = resume(
            &far_url,
            "resume-store",
            ("idempotency-events-received", "3"),
        )
        .await;
        let finish = far.finish().await;
        (far, finish)
    });
    let gauge = || async { b.metric("idemgate_held_requests").await == 1.0 };
    crate::support::eventually(Duration::from_secs(20), "the resume to be held on b", gauge).await;
    gate.open(EVENTS - 3);
    let (far, finish) = held.await.unwrap();
    assert_eq!(finish, Finish::Complete);
    assert_eq!(far.header("idempotency-events-skipped"), Some("3"));
    assert_eq!(
        String::from_utf8(far.read).unwrap(),
        events(&job, 4, EVENTS)
    );
    let c = gateway(&store, &upstream).await;
    let mut fresh = resume(&c.path("/v1/chat"), "resume-store", ("last-event-id", "x")).await;
    assert_eq!(fresh.status, 416, "no event has that id");
    let mut late = resume(
        &c.path("/v1/chat"),
        "resume-store",
        ("idempotency-events-received", "6"),
    )
    .await;
    assert_eq!(late.finish().await, Finish::Complete);
    assert_eq!(
        String::from_utf8(late.read).unwrap(),
        events(&job, 7, EVENTS)
    );
    fresh.finish().await;
    assert_eq!(upstream.hits(), 1);
}
