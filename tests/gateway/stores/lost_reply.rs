//! The network failing between a commit and its reply: the commit is in,
//! the gateway never hears so (docs/design.md §7, "A commit whose reply
//! was lost").

use std::time::Duration;

use crate::support::reply_cutter::ReplyCutter;
use crate::support::sse::{event, Ending, Finish, Reader, SseUpstream};
use crate::support::upstream::{echo_response, json_response};
use crate::support::{eventually, post, FakeUpstream, Gate, Gateway, TestDb, TestStore};

/// The upstream answers, the commit's transaction lands, and its reply is
/// lost with the connection. The commit is retried, finds the job
/// completed by this very attempt, and is told it lost; the request reads
/// the job again and serves the stored answer, its own. The caller and a
/// duplicate held meanwhile on the same replica get that one answer (not
/// an error, not `hold_timeout`'s 409), from one upstream call, and the
/// attempt stands as the job's winner. The lost compare-and-swap rings the
/// job's bell: without that ring the duplicate waited out `hold_timeout`
/// in two runs of three (in the third its first read came after the
/// commit); the ring itself is asserted by the store conformance test
/// `every_change_of_a_jobs_state_rings_once`.
#[tokio::test]
async fn a_commit_whose_reply_was_lost_still_answers_the_caller_and_its_duplicate() {
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |r| r.header("idempotency-key").is_some()).await;
    let Relayed {
        db,
        cutter,
        gateway,
    } = behind_relay(&upstream).await;
    let url = gateway.path("/v1/charges");
    let marker = format!("lose-the-reply-{}", uuid::Uuid::new_v4().simple());
    let body = format!(r#"{{"note":"{marker}"}}"#);

    let first = tokio::spawn({
        let (url, body) = (url.clone(), body.clone());
        async move { post(&url, "lost-reply", &body).await }
    });
    upstream.arrival().await;
    let held = tokio::spawn({
        let (url, body) = (url.clone(), body.clone());
        async move { post(&url, "lost-reply", &body).await }
    });
    eventually(
        Duration::from_secs(10),
        "the duplicate to be held",
        || async { gateway.metric("idemgate_held_requests").await >= 1.0 },
    )
    .await;
    // Only the commit carries the answer, and so the marker.
    cutter.arm(marker.as_bytes());
    gate.open(1);

    let first = first.await.unwrap();
    assert_eq!(first.status, 200, "{first:?}");
    let held = tokio::time::timeout(Duration::from_secs(15), held)
        .await
        .expect("the held duplicate waits out hold_timeout")
        .unwrap();
    assert_eq!(held.status, 200, "{held:?}");
    assert!(
        String::from_utf8_lossy(&held.body).contains(&marker),
        "the upstream's answer: {held:?}"
    );
    assert_eq!(held.body, first.body, "one answer for both");
    assert_eq!(cutter.cuts(), 1, "the commit's reply was lost");
    assert_eq!(upstream.hits(), 1, "one upstream call");
    assert!(
        gateway.metric("idemgate_record_retries_total").await >= 1.0,
        "the commit was retried"
    );
    assert_eq!(
        gateway.metric("idemgate_commits_superseded_total").await,
        0.0,
        "the retry met its own commit: nothing was superseded"
    );

    assert_eq!(
        states(&db).await,
        [("completed".to_owned(), "succeeded".to_owned())],
        "the lost reply's commit is the one committed"
    );
}

/// The begin of a new key lands (its job and first attempt made) but its
/// reply is lost with the connection. The begin is asked again with the
/// same ids and finds its own job, so the request calls the upstream, once,
/// and answers. Before, a lone begin's lost reply was the client's 503,
/// leaving a started attempt nobody ran: the client's retry was held on it
/// until its lease lapsed, and was then told the outcome was unknown.
#[tokio::test]
async fn a_begin_whose_reply_was_lost_still_calls_the_upstream_once() {
    let upstream = FakeUpstream::echo().await;
    let Relayed {
        db,
        cutter,
        gateway,
    } = behind_relay(&upstream).await;
    let url = gateway.path("/v1/charges");
    let key = format!("lose-the-begin-{}", uuid::Uuid::new_v4().simple());
    // Only the begin carries the key before the upstream is called.
    cutter.arm(key.as_bytes());

    let reply = tokio::time::timeout(Duration::from_secs(15), post(&url, &key, "{}"))
        .await
        .expect("the request waits on its own job");
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(cutter.cuts(), 1, "the begin's reply was lost");
    assert_eq!(upstream.hits(), 1, "one upstream call");
    let again = post(&url, &key, "{}").await;
    assert_eq!(again.status, 200);
    assert_eq!(again.body, reply.body, "replayed");
    assert_eq!(upstream.hits(), 1);

    assert_eq!(
        states(&db).await,
        [("completed".to_owned(), "succeeded".to_owned())]
    );
}

/// The begin of a new key lands, its reply is lost, and the begin asked
/// again loses its reply too, so the client is told 503: a job with a
/// started attempt that nobody runs. The gateway knows the attempt was
/// never sent upstream and records it `failed` once the store answers, so
/// the job reopens and the client's retry runs, once. Before, the retry
/// was held until `hold_timeout` (or the lease lapsed into `unknown`).
#[tokio::test]
async fn a_begin_lost_twice_is_answered_503_and_its_retry_still_runs() {
    let upstream = FakeUpstream::echo().await;
    let Relayed {
        db: _db,
        cutter,
        gateway,
    } = behind_relay(&upstream).await;
    let url = gateway.path("/v1/charges");
    let key = format!("lose-the-begin-twice-{}", uuid::Uuid::new_v4().simple());
    cutter.arm_times(key.as_bytes(), 2);

    let refused = post(&url, &key, "{}").await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.problem(), "store-unavailable");
    assert_eq!(cutter.cuts(), 2, "both begins' replies were lost");
    assert_eq!(upstream.hits(), 0, "nothing was proxied");

    let retry = tokio::time::timeout(Duration::from_secs(15), post(&url, &key, "{}"))
        .await
        .expect("the retry is held on an attempt nobody runs");
    assert_eq!(retry.status, 200, "{retry:?}");
    assert_eq!(upstream.hits(), 1, "run once, by the retry");
    let detail = gateway.job(&retry.job().unwrap()).await;
    let attempts: Vec<(&str, &str)> = detail["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["state"].as_str().unwrap(),
                a["detail"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert_eq!(attempts[0].0, "failed");
    assert!(
        attempts[0].1.starts_with("never sent upstream"),
        "{attempts:?}"
    );
    assert_eq!(attempts[1].0, "succeeded");
}

/// The same lost begins, with the store refusing the never-sent record
/// (its connection closed before the write reaches the server), and the
/// gateway asked to stop meanwhile: the drain waits for the record, still
/// retried, and the process exits once it landed. The attempt ends
/// `failed`, never sent, and its job open for the client's retry. Before,
/// the gateway exited at once (no attempt was running) and left the
/// attempt `started`, to lapse into `unknown` with no one to run it.
#[tokio::test]
async fn the_drain_waits_for_a_never_sent_record_the_store_still_refuses() {
    let upstream = FakeUpstream::echo().await;
    let Relayed {
        db,
        cutter,
        mut gateway,
    } = a_never_sent_record_refused(&upstream, &[]).await;
    // The drain has begun once the listener is gone; only a try refused
    // after that shows the drain waiting.
    gateway.stop_listening().await;
    let asked = cutter.refused();
    eventually(
        Duration::from_secs(10),
        "the record to be tried again after SIGTERM",
        || async { cutter.refused() > asked },
    )
    .await;
    assert!(gateway.running(), "the drain waits for the record");
    cutter.refuse(None);
    assert!(gateway.exited().await.success(), "a clean exit");
    assert_eq!(
        states(&db).await,
        [("open".to_owned(), "failed".to_owned())],
        "recorded never sent before the process exited"
    );
}

/// The same, with the store refusing the record for good: the drain
/// waits for it at most `lease_ttl` past the attempts, not the whole
/// `shutdown_grace` (300 s here), and the attempt is left to lapse into
/// `unknown`. A store down that long does not hold a rollout.
#[tokio::test]
async fn the_drain_gives_up_on_a_refused_record_after_the_lease() {
    let upstream = FakeUpstream::echo().await;
    let Relayed {
        db,
        cutter: _cutter,
        mut gateway,
    } = a_never_sent_record_refused(&upstream, &[("lease_ttl", "\"1s\"")]).await;
    // `exited` allows 30 s: a drain waiting out shutdown_grace fails it.
    assert!(gateway.terminate().await.success(), "a clean exit");
    // Never recorded failed: the attempt is still started, or already
    // lapsed into unknown if a sweep came after its 1 s lease.
    let states = states(&db).await;
    assert_eq!(states.len(), 1, "{states:?}");
    assert!(
        ["started", "unknown"].contains(&states[0].1.as_str()),
        "the record never landed: {states:?}"
    );
}

/// A begin still on its way when the gateway is asked to stop (its client
/// gone: a begin runs in a task of its own) lands during the drain and
/// starts its attempt: the drain waits for that attempt too, and the
/// process exits once its answer is committed. Before, the drain had seen
/// no attempt running before it waited for the begin, and the attempt
/// was abandoned as `unknown` with its upstream call just sent.
#[tokio::test]
async fn the_drain_waits_for_an_attempt_a_late_begin_started() {
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    // The begin is held for as long as the test takes, not the 2 s default.
    let settings = [("database_timeout", "\"60s\"")];
    let Relayed {
        db,
        cutter,
        mut gateway,
    } = behind_relay_with(&upstream, &settings).await;
    let key = format!("late-begin-{}", uuid::Uuid::new_v4().simple());
    cutter.hold(key.as_bytes());
    let client = tokio::spawn({
        let (url, key) = (gateway.path("/v1/charges"), key.clone());
        async move { post(&url, &key, "{}").await }
    });
    eventually(Duration::from_secs(10), "the begin to be held", || async {
        cutter.held() >= 1
    })
    .await;
    client.abort();
    gateway.stop_listening().await;

    cutter.let_through();
    upstream.arrival().await;
    // Its call held by the upstream: a drain that left the attempt
    // exits now.
    let early = tokio::time::timeout(Duration::from_secs(2), gateway.exited()).await;
    assert!(early.is_err(), "the drain waits for the attempt");
    gate.open(1);
    assert!(gateway.exited().await.success(), "a clean exit");
    assert_eq!(
        states(&db).await,
        [("completed".to_owned(), "succeeded".to_owned())],
        "its answer committed before the process exited"
    );
}

/// A gateway (with `settings`) behind a relay that lost both begins'
/// replies of a new key, so the client was answered 503, and that now
/// refuses the never-sent record the gateway retries in the background;
/// returned once a first try was refused.
async fn a_never_sent_record_refused(
    upstream: &FakeUpstream,
    settings: &[(&str, &str)],
) -> Relayed {
    let relayed = behind_relay_with(upstream, settings).await;
    let key = format!("lose-then-stop-{}", uuid::Uuid::new_v4().simple());
    relayed.cutter.arm_times(key.as_bytes(), 2);
    relayed.cutter.refuse(Some(b"never sent upstream"));
    let refused = post(&relayed.gateway.path("/v1/charges"), &key, "{}").await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(upstream.hits(), 0, "nothing was proxied");
    eventually(
        Duration::from_secs(10),
        "the never-sent record to be refused",
        || async { relayed.cutter.refused() >= 1 },
    )
    .await;
    relayed
}

/// A key's first attempt fails with a retryable status, so its job is
/// open; the client's retry claims the next attempt, and the claim's
/// transaction commits but its reply is lost. The claim reads the job back,
/// finds its attempt started, and runs it: the retry is answered by the
/// upstream, once. Before, it was answered 503, and the next retry was held
/// on an attempt nobody ran until its lease lapsed into `unknown`.
#[tokio::test]
async fn a_claim_whose_reply_was_lost_still_runs_its_attempt() {
    let upstream = FakeUpstream::overloaded_once().await;
    let Relayed {
        db: _db,
        cutter,
        gateway,
    } = behind_relay(&upstream).await;
    let url = gateway.path("/v1/jobs");
    let first = post(&url, "lost-claim", "{}").await;
    assert_eq!(first.status, 503);
    let job = first.job().unwrap();
    assert_eq!(gateway.job(&job).await["state"], "open");

    // Only a claim inserts an attempt inside a locked transaction, and the
    // statement's text goes on the wire when a connection first prepares
    // it: here, for the claim (the first attempt's failure inserted none).
    cutter.arm(b"INSERT INTO attempts AS a");
    let retry = tokio::time::timeout(Duration::from_secs(15), post(&url, "lost-claim", "{}"))
        .await
        .expect("the retry waits on an attempt nobody runs");
    assert_eq!(retry.status, 200, "{retry:?}");
    assert_eq!(retry.json()["attempt"], "2");
    assert_eq!(cutter.cuts(), 1, "the claim's reply was lost");
    assert_eq!(upstream.hits(), 2, "the first attempt and the claimed one");

    let detail = gateway.job(&job).await;
    assert_eq!(detail["state"], "completed");
    let states: Vec<&str> = detail["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["failed", "succeeded"]);
}

/// A key's first attempt fails with a retryable status while a duplicate
/// of it is held on the same replica; the settle's transaction commits
/// (the job open again) but its reply is lost. The settle is retried,
/// finds the attempt already failed as it would write it, and rings the
/// job's bell here: the duplicate reads the job open, claims attempt 2 and
/// is answered by the upstream at once. Before, the retry's refusal rang
/// nothing, the trigger's announcement carried this replica's own id (so
/// its listener ignored it), and the duplicate waited out `hold_timeout`
/// (20 s) to be told `409` (docs/design.md §7, "A settle whose reply was
/// lost").
#[tokio::test]
async fn a_settle_whose_reply_was_lost_still_wakes_the_duplicate_held_here() {
    let gate = Gate::new();
    let upstream = FakeUpstream::start({
        let gate = gate.clone();
        move |r| {
            let gate = gate.clone();
            async move {
                if r.hit == 1 {
                    gate.pass().await;
                    return json_response(503, serde_json::json!({"error": "overloaded"}));
                }
                echo_response(&r)
            }
        }
    })
    .await;
    let Relayed {
        db,
        cutter,
        gateway,
    } = behind_relay(&upstream).await;
    let url = gateway.path("/v1/jobs");
    let first = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "lost-settle", "{}").await }
    });
    upstream.arrival().await;
    let held = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "lost-settle", "{}").await }
    });
    eventually(
        Duration::from_secs(10),
        "the duplicate to be held",
        || async { gateway.metric("idemgate_held_requests").await >= 1.0 },
    )
    .await;
    // Only a settle updates an attempt inside a locked transaction, and
    // the statement's text goes on the wire when a connection first
    // prepares it: here, for this first settle.
    cutter.arm(b"finished_at = CASE WHEN");
    gate.open(1);

    let first = first.await.unwrap();
    assert_eq!(first.status, 503, "the upstream's own answer: {first:?}");
    let held = tokio::time::timeout(Duration::from_secs(10), held)
        .await
        .expect("the held duplicate waits out hold_timeout")
        .unwrap();
    assert_eq!(held.status, 200, "{held:?}");
    assert_eq!(held.json()["attempt"], "2");
    assert_eq!(cutter.cuts(), 1, "the settle's reply was lost");
    assert!(
        gateway.metric("idemgate_record_retries_total").await >= 1.0,
        "the settle was retried"
    );
    assert_eq!(upstream.hits(), 2, "the first attempt and the claimed one");
    let mut states = states(&db).await;
    states.sort();
    assert_eq!(
        states,
        [
            ("completed".to_owned(), "failed".to_owned()),
            ("completed".to_owned(), "succeeded".to_owned())
        ]
    );
}

/// A streamed answer larger than the job's row holds (about 300 KiB of
/// server-sent events, over `INLINE_ANSWER`) whose commit lands but
/// whose reply is lost. The commit is retried, its compare-and-swap
/// fails, and the store reads the answer kept out of the row to compare
/// it: its own, so it is told it committed. The client's stream ends
/// cleanly, byte for byte the upstream's, and the attempt is the job's
/// winner. Before, an answer held out of the row was never compared: the
/// commit was told it lost, and the stream was cut at its end for the
/// client (and any joiner) though it had committed (docs/design.md §7, "A
/// commit whose reply was lost").
#[tokio::test]
async fn a_large_stream_whose_commit_reply_was_lost_still_ends_cleanly() {
    const EVENTS: usize = 75;
    const SIZE: usize = 4096;
    let gate = Gate::new();
    let upstream = SseUpstream::start(EVENTS, SIZE, &gate, Ending::Clean).await;
    let Relayed {
        db,
        cutter,
        gateway,
    } = behind_relay_to(&upstream.url(), &[("upstream_timeout", "\"5s\"")]).await;
    let key = format!("lose-the-large-commit-{}", uuid::Uuid::new_v4().simple());
    gate.open(1);
    let mut client = Reader::post(&gateway.path("/v1/chat"), &key, "{}").await;
    assert_eq!(client.status, 200);
    assert_eq!(client.header("content-type"), Some("text/event-stream"));
    let job = client.header("idempotency-job").unwrap().to_owned();
    client.read_until(SIZE).await;
    // The upstream is sent the job's id as its key, and puts it in every
    // event: in text, only the commit carries it.
    cutter.arm(job.as_bytes());
    gate.open(EVENTS - 1);

    assert_eq!(client.finish().await, Finish::Complete, "ended cleanly");
    let sent: String = (1..=EVENTS).map(|n| event(&job, n, SIZE)).collect();
    assert!(sent.len() > idemgate_domain::job::INLINE_ANSWER);
    let tail = |bytes: &[u8]| {
        String::from_utf8_lossy(&bytes[bytes.len().saturating_sub(160)..]).into_owned()
    };
    assert!(
        client.read == sent.as_bytes(),
        "the upstream's stream: {} bytes read, ending {:?}; {} sent, ending {:?}",
        client.read.len(),
        tail(&client.read),
        sent.len(),
        tail(sent.as_bytes())
    );
    assert_eq!(cutter.cuts(), 1, "the commit's reply was lost");
    assert_eq!(upstream.hits(), 1);
    assert_eq!(
        gateway.metric("idemgate_commits_superseded_total").await,
        0.0,
        "the retry met its own commit: nothing was superseded"
    );
    assert_eq!(
        states(&db).await,
        [("completed".to_owned(), "succeeded".to_owned())]
    );
    let detail = gateway.job(&job).await;
    assert_eq!(detail["completed_by"], detail["attempts"][0]["id"]);
}

/// A replica dies mid-attempt; another's sweep makes the attempt
/// `unknown` when its lease lapses, and that sweep's commit lands but its
/// reply is lost with the connection. The sweeper reads the attempt again,
/// finds it `unknown`, and reports it as after any sweep: counted ended
/// `unknown` by its deadline, its job's bell rung, and looked up at once;
/// the job completes with the looked-up answer, and nothing ran twice.
/// Before, the lost reply made the sweep an error: the attempt was never
/// counted, and looked up only once the scan for orphaned lookups adopted
/// it (docs/design.md §7, "A sweep whose reply was lost").
#[tokio::test]
async fn a_sweep_whose_reply_was_lost_still_looks_its_attempts_up() {
    let silent = Gate::new();
    let upstream = FakeUpstream::start({
        let silent = silent.clone();
        move |r| {
            let silent = silent.clone();
            async move {
                if r.method == "GET" {
                    return json_response(200, serde_json::json!({"charge": "ch_9"}));
                }
                silent.pass().await;
                echo_response(&r)
            }
        }
    })
    .await;
    let db = TestDb::new().await;
    let (cutter, relayed) = ReplyCutter::relay(&db).await;
    let replica = |store: &TestStore| {
        Gateway::builder(store, &upstream.url())
            .set("lease_ttl", "\"600ms\"")
            .set("upstream_timeout", "\"30s\"")
            .set("attempt_deadline", "\"60s\"")
            .tables(
                "[[routes]]\npath_prefix = \"/v1/charges\"\n\
                 [routes.reconcile]\npath = \"/v1/charges/lookup/{job}\"\n",
            )
    };
    let mut doomed = replica(&TestStore::external(db.url.clone())).start().await;
    let survivor = replica(&relayed).start().await;
    // Only the sweep's write of the lapsed attempt carries its detail.
    cutter.arm(b"stopped renewing it");
    let in_flight = crate::support::post_detached(doomed.path("/v1/charges"), "charge-9");
    let job = upstream.arrival().await;
    let job = job.header("idempotency-key").unwrap().to_owned();
    doomed.kill().await;
    let _ = in_flight.await;

    eventually(
        Duration::from_secs(20),
        "the lapsed attempt to be looked up and its answer committed",
        || async { survivor.job(&job).await["state"] == "completed" },
    )
    .await;
    assert_eq!(cutter.cuts(), 1, "the sweep's reply was lost");
    let lapsed = survivor
        .metric_labelled(
            "idemgate_attempts_ended_total",
            &[r#"state="unknown""#, r#"by="deadline""#],
        )
        .await;
    assert_eq!(
        lapsed, 1.0,
        "the sweep's expiry is reported though its reply was lost"
    );
    let detail = survivor.job(&job).await;
    assert_eq!(detail["attempts"][0]["state"], "succeeded");
    assert_eq!(detail["attempts"][0]["lookups"]["count"], 1);
    let retry = post(&survivor.path("/v1/charges"), "charge-9", "{}").await;
    assert_eq!(retry.json()["charge"], "ch_9");
    let posts = upstream
        .recorded()
        .iter()
        .filter(|r| r.method == "POST")
        .count();
    assert_eq!(posts, 1, "the charge ran once");
    silent.open(1);
}

/// A sweep's commit never reaches the server (the network fails as it is
/// sent, and stays down a while): the transaction is rolled back, and the
/// lapsed attempt is left to the next sweep, another replica's, which makes
/// it `unknown` (and reports it). When the first replica can ask again, it
/// asks what became of its own transaction, learns it was rolled back, and
/// reports nothing. Before, it read the attempt's state, found it
/// `unknown` by the other's sweep, and reported it too: ended twice in the
/// metrics, its job's bell rung and, on a route that reconciles, looked up
/// twice (docs/design.md §7, "A sweep whose reply was lost"). The test
/// writes the other replica's sweep itself, while the network is down: so
/// the first replica's asking again comes well within the 10 s it asks for.
#[tokio::test]
async fn a_sweep_whose_commit_never_landed_reports_nothing_another_sweep_expired() {
    let silent = Gate::new();
    let upstream = FakeUpstream::start({
        let silent = silent.clone();
        move |r| {
            let silent = silent.clone();
            async move {
                silent.pass().await;
                echo_response(&r)
            }
        }
    })
    .await;
    let db = TestDb::new().await;
    let (cutter, relayed) = ReplyCutter::relay(&db).await;
    let replica = |store: &TestStore, sweeps_every: &str| {
        Gateway::builder(store, &upstream.url())
            .set("lease_ttl", "\"600ms\"")
            .set("sweep_interval", sweeps_every)
            .set("upstream_timeout", "\"30s\"")
            .set("attempt_deadline", "\"60s\"")
    };
    let direct = TestStore::external(db.url.clone());
    let mut doomed = replica(&direct, "\"1h\"").start().await;
    let first = replica(&relayed, "\"200ms\"").start().await;
    // Only the sweep's write of the lapsed attempt carries its detail; the
    // next write on its connection is the sweep's COMMIT.
    cutter.fail_after(b"stopped renewing it");
    let in_flight = crate::support::post_detached(doomed.path("/v1/charges"), "charge-10");
    upstream.arrival().await;
    doomed.kill().await;
    let _ = in_flight.await;
    eventually(
        Duration::from_secs(20),
        "the first replica's sweep to fail at its commit",
        || async { cutter.is_down() },
    )
    .await;
    assert!(cutter.refused_a_commit(), "the write refused is the COMMIT");
    // What another replica's sweep writes: the lapsed attempt and its job
    // unknown (no other replica is running: it cannot take the attempt
    // first).
    let client = db.connect().await;
    let swept = "UPDATE attempts SET state = 'unknown', finished_at = now(), \
                 detail = 'another replica stopped renewing it' WHERE state = 'started'";
    assert_eq!(client.execute(swept, &[]).await.unwrap(), 1);
    let job = "UPDATE jobs SET state = 'unknown', version = version + 1 WHERE state = 'running'";
    assert_eq!(client.execute(job, &[]).await.unwrap(), 1);
    cutter.heal();
    // A sweep that counts the unknown jobs follows the failed one.
    eventually(
        Duration::from_secs(20),
        "the first replica to sweep again",
        || async { first.metric("idemgate_jobs_unknown").await == 1.0 },
    )
    .await;
    assert_eq!(
        ended(&first).await,
        0.0,
        "the failed sweep reports nothing: its transaction was rolled back"
    );
    assert_eq!(states(&db).await, [("unknown".into(), "unknown".into())]);
    assert_eq!(upstream.hits(), 1);
    silent.open(1);
}

/// Attempts `gateway` reported ended `unknown` by their deadline (a
/// sweep's).
async fn ended(gateway: &Gateway) -> f64 {
    let labels = [r#"state="unknown""#, r#"by="deadline""#];
    gateway
        .metric_labelled("idemgate_attempts_ended_total", &labels)
        .await
}

/// A fresh database, a relay in front of its server, and a gateway on
/// `upstream` that reaches the database through the relay, holding
/// duplicates for up to 20 s.
struct Relayed {
    db: TestDb,
    cutter: ReplyCutter,
    gateway: Gateway,
}

async fn behind_relay(upstream: &FakeUpstream) -> Relayed {
    behind_relay_with(upstream, &[]).await
}

/// [`behind_relay`], with more of the gateway's `settings`.
async fn behind_relay_with(upstream: &FakeUpstream, settings: &[(&str, &str)]) -> Relayed {
    behind_relay_to(&upstream.url(), settings).await
}

/// [`behind_relay_with`], for the upstream at `upstream`.
async fn behind_relay_to(upstream: &str, settings: &[(&str, &str)]) -> Relayed {
    let db = TestDb::new().await;
    let (cutter, relayed) = ReplyCutter::relay(&db).await;
    let mut builder = Gateway::builder(&relayed, upstream).set("hold_timeout", "\"20s\"");
    for (key, value) in settings {
        builder = builder.set(key, value);
    }
    let gateway = builder.start().await;
    Relayed {
        db,
        cutter,
        gateway,
    }
}

/// Every job's state beside each of its attempts', as stored.
async fn states(db: &TestDb) -> Vec<(String, String)> {
    let rows = db
        .connect()
        .await
        .query(
            "SELECT j.state, a.state FROM jobs j JOIN attempts a ON a.job_id = j.id",
            &[],
        )
        .await
        .unwrap();
    rows.iter().map(|r| (r.get(0), r.get(1))).collect()
}
