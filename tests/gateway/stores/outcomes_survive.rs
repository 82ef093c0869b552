//! Nothing the gateway learned is lost to a transient fault: outcomes seen
//! while the database is down are recorded once it is back, and a client
//! that hangs up early never leaves its key blocked.

use std::time::Duration;

use tokio::io::AsyncWriteExt;

use crate::support::postgres::ThrowawayPostgres;
use crate::support::upstream::{echo_response, json_response};
use crate::support::{eventually, post, FakeUpstream, Gate, Gateway, Reply, TestDb, TestStore};

/// The first keyed request is answered only once `gate` opens, with
/// `first_status`; every later one is echoed at once.
async fn first_answer_gated(gate: &Gate, first_status: u16) -> FakeUpstream {
    let gate = gate.clone();
    FakeUpstream::start(move |r| {
        let gate = gate.clone();
        async move {
            if r.hit == 1 {
                gate.pass().await;
                if first_status != 200 {
                    return json_response(first_status, serde_json::json!({"busy": true}));
                }
            }
            echo_response(&r)
        }
    })
    .await
}

/// Posts `key` (the upstream's first answer gated), and once the upstream
/// has the call, holds its job in an open transaction and lets the answer
/// go: its commit now waits on the holder. Returns the request and the
/// holder (`COMMIT` in it lets go).
async fn answered_while_its_job_is_held(
    db: &TestDb,
    (upstream, gate): (&FakeUpstream, &Gate),
    url: &str,
    key: &'static str,
) -> (tokio::task::JoinHandle<Reply>, tokio_postgres::Client) {
    let held = tokio::spawn({
        let url = url.to_owned();
        async move { post(&url, key, "{}").await }
    });
    upstream.arrival().await;
    let holder = db.connect().await;
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM jobs WHERE key = '{key}' FOR UPDATE"
        ))
        .await
        .unwrap();
    gate.open(1);
    (held, holder)
}

/// Retries the key, as a client would, until it is answered 200 (30 s at most).
async fn retry_until_ok(url: &str, key: &str) -> Reply {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let reply = post(url, key, "{}").await;
        if reply.status == 200 {
            return reply;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still {} after 30 s: {:?}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn gateway_on(pg: &ThrowawayPostgres, upstream: &FakeUpstream) -> Gateway {
    Gateway::builder(&TestStore::external(pg.url()), &upstream.url())
        .set("database_timeout", "\"500ms\"")
        .set("hold_timeout", "\"15s\"")
        .start()
        .await
}

#[tokio::test]
async fn a_safe_failure_seen_while_the_database_is_down_still_reopens_the_job() {
    let pg = ThrowawayPostgres::start().await;
    let gate = Gate::new();
    let upstream = first_answer_gated(&gate, 503).await;
    let gateway = gateway_on(&pg, &upstream).await;
    let url = gateway.path("/v1/charges");

    let first = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "blip", "{}").await }
    });
    upstream.arrival().await;
    // The database goes away while the attempt is upstream; the upstream
    // then says 503: provably no effect, safe to retry.
    pg.stop_fast();
    gate.open(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, 503);
    assert_eq!(first.json()["busy"], true, "the upstream's own answer");
    pg.start_again();

    // The retry finds the failure recorded once the database is back, and
    // makes attempt 2 (it may meet a 503 while the pool reconnects, or be
    // held until the write lands).
    let second = retry_until_ok(&url, "blip").await;
    assert_eq!(second.json()["attempt"], "2");
    let job = gateway.job(&second.job().unwrap()).await;
    let states: Vec<_> = job["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["state"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(states, ["failed", "succeeded"]);
    assert_eq!(upstream.hits(), 2);
}

#[tokio::test]
async fn an_answer_whose_commit_waits_for_the_database_is_replayed_once_it_lands() {
    let pg = ThrowawayPostgres::start().await;
    let gate = Gate::new();
    let upstream = first_answer_gated(&gate, 200).await;
    let gateway = gateway_on(&pg, &upstream).await;
    let url = gateway.path("/v1/charges");

    let first = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "held-answer", "{}").await }
    });
    upstream.arrival().await;
    pg.stop_fast();
    gate.open(1);
    // Not committed, so not sent: the client hears its answer is on its way.
    let first = first.await.unwrap();
    assert_eq!(first.status, 503);
    assert_eq!(first.problem(), "outcome-not-recorded");
    assert_eq!(first.header("retry-after"), Some("1"));
    // Longer than any quick retry: the gateway still holds the answer.
    tokio::time::sleep(Duration::from_secs(3)).await;
    pg.start_again();

    let replay = retry_until_ok(&url, "held-answer").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.json()["hit"], 1, "the one execution's answer");
    assert_eq!(upstream.hits(), 1, "never executed twice");
}

#[tokio::test]
async fn clients_that_hang_up_right_after_sending_never_block_their_keys() {
    let store = TestStore::postgres().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url()).start().await;
    let authority = gateway.url.trim_start_matches("http://").to_owned();
    for i in 0..200 {
        let mut stream = tokio::net::TcpStream::connect(&authority).await.unwrap();
        let request = format!(
            "POST /v1/charges HTTP/1.1\r\nhost: {authority}\r\nidempotency-key: gone-{i}\r\n\
             content-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}"
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        // Gone a fraction of a millisecond after the request is written,
        // with a reset: the gateway may be anywhere between reading the
        // request and starting its attempt when it notices.
        stream.set_zero_linger().unwrap();
        tokio::time::sleep(Duration::from_micros(300 + (i % 5) * 200)).await;
        drop(stream);
    }
    // Settled: every job that was begun finished, every attempt succeeded,
    // and the upstream ran exactly those jobs; and it stays so (requests
    // whose clients left may still be on their way through the gateway).
    let settled = || async {
        let jobs = store.job_count().await as usize;
        let open = store
            .column("SELECT count(*) FROM jobs WHERE state <> 'completed'")
            .await;
        let unsettled = store
            .column("SELECT count(*) FROM attempts WHERE state <> 'succeeded'")
            .await;
        (open[0] == "0" && unsettled[0] == "0" && upstream.hits() == jobs).then_some(jobs)
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut last = None;
    loop {
        let now = settled().await;
        if now.is_some() && now == last {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "jobs begun by clients that hung up did not all finish within 20 s"
        );
        last = now;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let stuck = store
        .column("SELECT state FROM attempts WHERE state <> 'succeeded'")
        .await;
    assert_eq!(
        stuck,
        Vec::<String>::new(),
        "no attempt left started or unknown"
    );
    // A retry of any of them replays; none is blocked.
    let retry = post(&gateway.path("/v1/charges"), "gone-7", "{}").await;
    assert_eq!(retry.status, 200);
}

/// The attempt that commits an answer keeps it for replays itself: its
/// client hung up before the upstream answered, yet the retry is served
/// from memory, not read back from the store.
async fn an_answer_whose_client_hung_up_is_kept_for_replays(store: TestStore) {
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    let gateway = Gateway::builder(&store, &upstream.url()).start().await;
    let authority = gateway.url.trim_start_matches("http://").to_owned();
    let mut client = tokio::net::TcpStream::connect(&authority).await.unwrap();
    let request = format!(
        "POST /v1/charges HTTP/1.1\r\nhost: {authority}\r\nidempotency-key: left\r\n\
         content-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}"
    );
    client.write_all(request.as_bytes()).await.unwrap();
    upstream.arrival().await;
    drop(client);
    gate.open(1);
    // Counted once the commit's task has kept the answer for replays (the
    // job reads completed a moment before).
    crate::support::eventually(Duration::from_secs(10), "the commit", || async {
        gateway.metric_sum("idemgate_commits_total").await == 1.0
    })
    .await;
    assert_eq!(store.column("SELECT state FROM jobs").await, ["completed"]);
    let retry = post(&gateway.path("/v1/charges"), "left", "{}").await;
    assert_eq!(retry.status, 200);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
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
    assert_eq!(upstream.hits(), 1);
}

crate::on_each_deployment!([embedded, postgres] an_answer_whose_client_hung_up_is_kept_for_replays);

/// An operator's transaction left open on a job (here `SELECT … FOR
/// UPDATE` from psql) holds up that job's commit and nothing else: its
/// commit waits `database_lock_timeout`, gives its connection back and is
/// tried again, so a replica whose pool is a single connection still
/// answers other keys meanwhile. Once the holder lets go, the held answer
/// lands and is replayed; the upstream ran each key once. A duplicate of
/// the held job is answered 503 meanwhile. Waiting without
/// a timeout, the commit kept the one connection until the holder let go,
/// and every other request was answered 503 after `database_timeout`.
#[tokio::test]
async fn a_job_held_by_an_open_transaction_holds_up_only_its_own_answer() {
    let store = TestStore::postgres().await;
    let TestStore::Postgres(db) = &store else {
        unreachable!()
    };
    let gate = Gate::new();
    let upstream = first_answer_gated(&gate, 200).await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("database_pool_size", "1")
        .set("database_timeout", "\"2s\"")
        .set("database_lock_timeout", "\"300ms\"")
        .set("hold_timeout", "\"15s\"")
        .start()
        .await;
    let url = gateway.path("/v1/charges");

    let (held, holder) = answered_while_its_job_is_held(db, (&upstream, &gate), &url, "held").await;
    // The held commit now waits on the holder, time and again.
    let watcher = db.connect().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = watcher
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if waiting > 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no commit waited");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    for n in 0..3 {
        let other = post(&url, &format!("other-{n}"), "{}").await;
        assert_eq!(
            other.status,
            200,
            "another key, while the held one waits: {}",
            String::from_utf8_lossy(&other.body)
        );
    }
    assert!(!held.is_finished() || held.await.unwrap().status == 503);
    // A duplicate of the held job is answered 503 rather than kept waiting
    // on a connection: the mark it sets on the job waits on the holder too.
    let duplicate = tokio::time::timeout(Duration::from_secs(10), post(&url, "held", "{}"))
        .await
        .expect("a duplicate of the held job is answered within the lock timeout");
    assert_eq!(duplicate.status, 503, "{duplicate:?}");
    assert_eq!(duplicate.problem(), "store-unavailable");
    // An operator's resolution of the held job's attempt waits on the
    // holder as long, and is told the job is busy, not that the store is
    // down: 409 job-busy, with Retry-After and the runbook to find it.
    let attempt: uuid::Uuid = watcher
        .query_one(
            "SELECT a.id FROM attempts a JOIN jobs j ON j.id = a.job_id WHERE j.key = 'held'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let resolved = gateway
        .resolve(&attempt.to_string(), r#"{"outcome": "failed"}"#)
        .await;
    assert_eq!(resolved.status, 409, "{resolved:?}");
    assert_eq!(resolved.problem(), "job-busy");
    assert_eq!(resolved.header("retry-after"), Some("1"));
    assert!(resolved.problem_detail().contains("database_lock_timeout"));

    // The runbook's query finds the holder (docs/runbook.md,
    // IdemgateOutcomeWritesRetried).
    let holder_pid: i32 = holder
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let query = crate::support::docs::block("runbook-lock-holders");
    tokio::time::timeout(Duration::from_secs(10), async {
        // Other tests' holders may show too: the server is shared.
        while !watcher
            .query(&query, &[])
            .await
            .unwrap()
            .iter()
            .any(|row| row.get::<_, i32>("pid") == holder_pid)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the runbook's query finds the holder while a commit waits on it");

    holder.batch_execute("COMMIT").await.unwrap();
    let replay = retry_until_ok(&url, "held").await;
    assert_eq!(replay.json()["hit"], 1, "the held execution's own answer");
    assert_eq!(upstream.hits(), 4, "every key ran once");
}

/// An answer held up past its attempt's deadline (a transaction holds its
/// job from just after the call until 2 s past the deadline): its commit
/// is tried for a minute at least after the answer, not only until the
/// deadline, so it lands once the holder lets go and the retry replays
/// the one charge. Its request, which waited 2 s, is told the answer is
/// being recorded. Before, the commit gave up at the deadline and the
/// answer was lost: the attempt lapsed into `unknown` for an operator.
#[tokio::test]
async fn an_answer_held_up_past_its_attempts_deadline_still_commits() {
    let store = TestStore::postgres().await;
    let TestStore::Postgres(db) = &store else {
        unreachable!()
    };
    let gate = Gate::new();
    let upstream = first_answer_gated(&gate, 200).await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"3s\"")
        .set("attempt_deadline", "\"3s\"")
        .set("database_lock_timeout", "\"300ms\"")
        .start()
        .await;
    let url = gateway.path("/v1/charges");

    let (held, holder) = answered_while_its_job_is_held(db, (&upstream, &gate), &url, "late").await;
    let held = held.await.unwrap();
    assert_eq!(held.status, 503, "{held:?}");
    assert_eq!(held.problem(), "outcome-not-recorded");
    // The deadline is 3 s after the start; held 2 s past it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    holder.batch_execute("COMMIT").await.unwrap();

    let replay = retry_until_ok(&url, "late").await;
    assert_eq!(replay.json()["hit"], 1, "the held execution's own answer");
    assert_eq!(upstream.hits(), 1, "never executed twice");
}

/// The same held job, where the database gives up on a statement before
/// the lock timeout does: the gateway's sessions run with a
/// `statement_timeout` (500 ms, from the URL's `options`, as a DBA's
/// OLTP policy would set it) shorter than `database_lock_timeout` (5 s).
/// The held commit's wait is cancelled (SQLSTATE 57014), which rolls it
/// back, and it is tried again until the holder lets go: the answer
/// commits and is replayed, and the upstream ran once. Before, a cancelled
/// statement was a permanent error: the commit was given up at once, the
/// attempt left `started` to lapse into `unknown`, and the client's retry
/// was told its outcome was unknown (docs/design.md §13, "A lock waited
/// for").
#[tokio::test]
async fn an_answer_whose_commit_the_database_cancelled_still_commits() {
    let db = TestDb::new().await;
    // The gateway's sessions only: set on the role or the database, the
    // timeout would reach other tests, or this test's own holder.
    let store = TestStore::external(format!("{}?options=-c%20statement_timeout%3D500ms", db.url));
    let logs = tempfile::NamedTempFile::new().unwrap();
    let gate = Gate::new();
    let upstream = first_answer_gated(&gate, 200).await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("database_lock_timeout", "\"5s\"")
        .set("hold_timeout", "\"15s\"")
        .stderr_to(logs.path())
        .start()
        .await;
    let url = gateway.path("/v1/charges");

    let (held, holder) =
        answered_while_its_job_is_held(&db, (&upstream, &gate), &url, "cancelled").await;
    // Each wait on the holder is cancelled after 500 ms; two retries mean
    // the commit outlived two cancellations.
    eventually(
        Duration::from_secs(10),
        "the cancelled commit to be tried again",
        || async { gateway.metric("idemgate_record_retries_total").await >= 2.0 },
    )
    .await;
    let attempt = db
        .connect()
        .await
        .query_one("SELECT state FROM attempts", &[])
        .await
        .unwrap()
        .get::<_, String>(0);
    assert_eq!(attempt, "started", "still the gateway's to record");
    holder.batch_execute("COMMIT").await.unwrap();

    let held = held.await.unwrap();
    assert!(
        held.status == 200 || held.problem() == "outcome-not-recorded",
        "{held:?}"
    );
    let replay = retry_until_ok(&url, "cancelled").await;
    assert_eq!(replay.json()["hit"], 1, "the held execution's own answer");
    assert_eq!(upstream.hits(), 1, "never executed twice");
    let states = db
        .connect()
        .await
        .query_one(
            "SELECT j.state, a.state FROM jobs j JOIN attempts a ON a.job_id = j.id",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (states.get::<_, String>(0), states.get::<_, String>(1)),
        ("completed".to_owned(), "succeeded".to_owned())
    );
    let logs = std::fs::read_to_string(logs.path()).unwrap();
    assert!(
        logs.contains("canceling statement due to statement timeout"),
        "the database cancelled the commit's wait: {logs}"
    );
}
