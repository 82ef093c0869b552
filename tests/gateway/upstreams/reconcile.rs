//! Reconciling an attempt of unknown outcome by asking the upstream
//! (`[routes.reconcile]`, `docs/design.md` §5): a `2xx` lookup commits its
//! answer, a `404` reopens the job, anything else asks again.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use http::Method;
use serde_json::{json, Value};

use crate::support::upstream::{echo_response, json_response, Recorded};
use crate::support::{eventually, post, send, FakeUpstream, Gate, Gateway, TestStore};

const ROUTE: &str = r#"
[[routes]]
name = "charges"
path_prefix = "/v1/charges"
[routes.reconcile]
path = "/v1/charges/lookup/{job}"
"#;

fn is_lookup(r: &Recorded) -> bool {
    r.method == "GET" && r.path.starts_with("/v1/charges/lookup/")
}

type Answer = http::Response<http_body_util::Full<bytes::Bytes>>;

/// An upstream that never answers the first POST (the attempt goes
/// unknown) until `silent` opens, echoes later POSTs, and answers lookups
/// with `lookup`.
async fn upstream_with_lookups<F>(silent: &Gate, lookup: F) -> FakeUpstream
where
    F: Fn(&Recorded) -> Answer + Send + Sync + 'static,
{
    let (silent, lookup) = (silent.clone(), Arc::new(lookup));
    let posts = Arc::new(AtomicUsize::new(0));
    FakeUpstream::start(move |r| {
        let (silent, lookup) = (silent.clone(), lookup.clone());
        let posts = posts.clone();
        async move {
            if is_lookup(&r) {
                return lookup(&r);
            }
            if posts.fetch_add(1, Ordering::SeqCst) == 0 {
                silent.pass().await;
            }
            echo_response(&r)
        }
    })
    .await
}

/// A gateway that calls an attempt unknown after 300 ms of silence and lets
/// it be reconciled for 30 s.
async fn gateway(store: &TestStore, upstream: &FakeUpstream) -> Gateway {
    Gateway::builder(store, &upstream.url())
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"30s\"")
        .tables(ROUTE)
        .start()
        .await
}

fn first_attempt(job: &Value) -> &Value {
    &job["attempts"][0]
}

fn posts(upstream: &FakeUpstream) -> usize {
    upstream
        .recorded()
        .iter()
        .filter(|r| r.method == "POST")
        .count()
}

/// The value of `idemgate_reconcile_lookups_total` for `result` on the
/// route `charges` (0 when not yet counted), lookups and resends together.
async fn lookups_counted(gateway: &Gateway, result: &str) -> f64 {
    counted_by(gateway, "", result).await
}

/// The same, only for asks `by` (`lookup`, `resend`; empty: any).
async fn counted_by(gateway: &Gateway, by: &str, result: &str) -> f64 {
    let reply = send(
        Method::GET,
        &format!("{}/metrics", gateway.admin_url),
        &[],
        "",
    )
    .await;
    let text = String::from_utf8_lossy(&reply.body).into_owned();
    text.lines()
        .filter(|l| l.starts_with("idemgate_reconcile_lookups_total{"))
        .filter(|l| l.contains("route=\"charges\"") && l.contains(&format!("result=\"{result}\"")))
        .filter(|l| by.is_empty() || l.contains(&format!("by=\"{by}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn a_lookup_answering_200_commits_its_answer_for_every_retry(store: TestStore) {
    let silent = Gate::new();
    let upstream = upstream_with_lookups(&silent, |r| {
        let mut response = json_response(
            200,
            json!({"charge": "ch_1", "looked_up": r.path, "job": r.header("idempotency-key")}),
        );
        response
            .headers_mut()
            .insert("x-charge", "ch_1".parse().unwrap());
        response
    })
    .await;
    let gateway = gateway(&store, &upstream).await;
    let url = gateway.path("/v1/charges");

    let first = post(&url, "charge-1", r#"{"amount": 5}"#).await;
    assert_eq!(first.status, 504);
    assert_eq!(first.problem(), "attempt-outcome-unknown");
    let job_id = first.job().unwrap();

    // The gateway asks at once, on the attempt's upstream.
    let lookup = upstream.arrival().await;
    let lookup = if is_lookup(&lookup) {
        lookup
    } else {
        upstream.arrival().await
    };
    assert!(is_lookup(&lookup), "{lookup:?}");
    assert_eq!(lookup.path, format!("/v1/charges/lookup/{job_id}"));
    assert_eq!(lookup.header("idempotency-key"), Some(job_id.as_str()));
    eventually(
        Duration::from_secs(10),
        "the lookup's answer to be committed",
        || async { gateway.job(&job_id).await["state"] == "completed" },
    )
    .await;

    let retry = post(&url, "charge-1", r#"{"amount": 5}"#).await;
    assert_eq!(retry.status, 200);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.header("x-charge"), Some("ch_1"));
    let body = retry.json();
    assert_eq!(body["charge"], "ch_1");
    assert_eq!(body["job"], job_id.as_str());
    let again = post(&url, "charge-1", r#"{"amount": 5}"#).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.body, retry.body);
    assert_eq!(posts(&upstream), 1, "the charge reached the upstream once");

    let job = gateway.job(&job_id).await;
    let attempt = first_attempt(&job);
    assert_eq!(attempt["state"], "succeeded");
    assert_eq!(job["completed_by"], attempt["id"]);
    assert_eq!(attempt["lookups"]["count"], 1);
    assert_eq!(attempt["lookups"]["last"]["status"], 200);
    assert_eq!(attempt["lookups"]["last"]["result"], "settled_succeeded");
    assert!(attempt["lookups"]["last"]["at"].is_string());
    assert!(attempt["detail"]
        .as_str()
        .unwrap()
        .starts_with("reconciled"));
    assert_eq!(lookups_counted(&gateway, "settled_succeeded").await, 1.0);

    // The attempt's own late answer can no longer commit.
    silent.open(1);
    let replay = post(&url, "charge-1", r#"{"amount": 5}"#).await;
    assert_eq!(replay.body, retry.body);
}

/// An upstream whose POSTs never answer, and whose lookups wait for
/// `asked`, then find the charge `charge`.
async fn lookups_waiting_for(asked: &Gate, charge: &'static str) -> FakeUpstream {
    let (silent, asked) = (Gate::new(), asked.clone());
    FakeUpstream::start(move |r| {
        let (silent, asked) = (silent.clone(), asked.clone());
        async move {
            if is_lookup(&r) {
                asked.pass().await;
                return json_response(200, json!({"charge": charge}));
            }
            silent.pass().await;
            echo_response(&r)
        }
    })
    .await
}

/// Waits until `upstream` has been sent a lookup (the first POST may come
/// first).
async fn lookup_arrival(upstream: &FakeUpstream) {
    let arrived = upstream.arrival().await;
    let lookup = if is_lookup(&arrived) {
        arrived
    } else {
        upstream.arrival().await
    };
    assert!(is_lookup(&lookup));
}

/// A duplicate that arrives while a lookup is under way is held for it,
/// as for a running attempt, and gets the looked-up answer.
async fn a_duplicate_held_meanwhile_gets_the_looked_up_answer(store: TestStore) {
    let asked = Gate::new();
    let upstream = lookups_waiting_for(&asked, "ch_held").await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"2s\"")
        .set("attempt_deadline", "\"30s\"")
        .tables(ROUTE)
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    let first = post(&url, "charge-held", "{}").await;
    assert_eq!(first.status, 504);
    // The lookup has arrived and waits at the upstream.
    lookup_arrival(&upstream).await;
    let duplicate = {
        let url = url.clone();
        tokio::spawn(async move { post(&url, "charge-held", "{}").await })
    };
    eventually(
        Duration::from_secs(1),
        "the duplicate to be held for the lookup",
        || async { gateway.metric("idemgate_held_requests").await == 1.0 },
    )
    .await;
    asked.open(1);
    let duplicate = duplicate.await.unwrap();
    assert_eq!(duplicate.status, 200, "{:?}", duplicate.json());
    assert_eq!(duplicate.json()["charge"], "ch_held");
    let later = post(&url, "charge-held", "{}").await;
    assert_eq!(later.header("idempotent-replayed"), Some("true"));
    assert_eq!(later.json()["charge"], "ch_held");
    assert_eq!(posts(&upstream), 1, "the POST ran once");
}

/// An upstream whose first POST's connection drops once the POST is in
/// (the attempt unknown, its call over); it echoes later POSTs and answers
/// lookups with `lookup`.
async fn upstream_dropping_the_first<F>(lookup: F) -> FakeUpstream
where
    F: Fn(&Recorded) -> Answer + Send + Sync + 'static,
{
    let lookup = Arc::new(lookup);
    let posts = Arc::new(AtomicUsize::new(0));
    FakeUpstream::start(move |r| {
        let (lookup, posts) = (lookup.clone(), posts.clone());
        async move {
            if is_lookup(&r) {
                return lookup(&r);
            }
            if posts.fetch_add(1, Ordering::SeqCst) == 0 {
                panic!("the upstream drops the first call's connection");
            }
            echo_response(&r)
        }
    })
    .await
}

/// Once the attempt's call is over (its connection broke after the POST
/// went out), a lookup's `404` proves it had no effect: the job reopens
/// and the retry runs attempt 2.
async fn a_lookup_answering_404_reopens_the_job_for_attempt_two(store: TestStore) {
    let upstream =
        upstream_dropping_the_first(|_| json_response(404, json!({"error": "no such charge"})))
            .await;
    let gateway = gateway(&store, &upstream).await;
    let url = gateway.path("/v1/charges");

    let first = post(&url, "charge-2", "{}").await;
    assert_eq!(first.status, 502, "{first:?}");
    let job_id = first.job().unwrap();
    eventually(
        Duration::from_secs(10),
        "the lookup to reopen the job",
        || async { gateway.job(&job_id).await["state"] == "open" },
    )
    .await;
    let job = gateway.job(&job_id).await;
    assert_eq!(first_attempt(&job)["state"], "failed");
    assert_eq!(first_attempt(&job)["lookups"]["count"], 1);
    assert_eq!(
        first_attempt(&job)["lookups"]["last"]["result"],
        "settled_no_effect"
    );
    assert_eq!(first_attempt(&job)["lookups"]["last"]["status"], 404);

    let second = post(&url, "charge-2", "{}").await;
    assert_eq!(second.status, 200);
    assert_eq!(second.job().as_deref(), Some(job_id.as_str()));
    assert_eq!(second.json()["attempt"], "2");
    assert_eq!(posts(&upstream), 2);
    assert_eq!(lookups_counted(&gateway, "settled_no_effect").await, 1.0);
}

/// Posts `key` to an upstream silent past `upstream_timeout` whose lookups
/// answer `404`: its attempt goes unknown, and the first lookup's "no
/// record" is held back while the call is out. Returns the job's id.
async fn unknown_with_a_404_held_back(gateway: &Gateway, url: &str, key: &str) -> String {
    unknown_and_asked(gateway, url, key, r#"{"n": 1}"#).await
}

/// Posts `key` with `body` to an upstream silent past `upstream_timeout`:
/// its attempt goes unknown, and the first ask about it (a lookup, a
/// resend) leaves it so. Returns the job's id.
async fn unknown_and_asked(gateway: &Gateway, url: &str, key: &str, body: &str) -> String {
    let first = post(url, key, body).await;
    assert_eq!(first.status, 504);
    let job_id = first.job().unwrap();
    // Waited for in the attempt's record, which is written after the
    // lookup is counted.
    eventually(
        Duration::from_secs(10),
        "a first ask recorded, the attempt still unknown",
        || async {
            first_attempt(&gateway.job(&job_id).await)["lookups"]["last"]["result"]
                == "still_unknown"
        },
    )
    .await;
    job_id
}

/// While the attempt's call is still out (the upstream silent past
/// `upstream_timeout`, the attempt unknown, the call going on), a
/// lookup's `404` says only that the upstream has no record *yet*: the
/// charge may be in progress. The job stays unknown (the lookup recorded
/// `still_unknown`), no retry runs a second charge, and the call's late
/// answer commits. Before, the `404` reopened the job and the retry
/// charged again beside the first charge.
async fn a_lookup_404_while_the_call_is_out_keeps_the_job_unknown(store: TestStore) {
    let silent = Gate::new();
    let upstream = upstream_with_lookups(&silent, |_| {
        json_response(404, json!({"error": "no such charge"}))
    })
    .await;
    let gateway = gateway(&store, &upstream).await;
    let url = gateway.path("/v1/charges");

    let job_id = unknown_with_a_404_held_back(&gateway, &url, "charge-3").await;
    let job = gateway.job(&job_id).await;
    assert_eq!(job["state"], "unknown");
    assert_eq!(first_attempt(&job)["state"], "unknown");
    assert_eq!(first_attempt(&job)["lookups"]["last"]["status"], 404);
    assert_eq!(
        first_attempt(&job)["lookups"]["last"]["result"],
        "still_unknown"
    );
    let retry = post(&url, "charge-3", r#"{"n": 1}"#).await;
    assert_eq!(retry.status, 409, "{retry:?}");
    assert_eq!(retry.problem(), "attempt-outcome-unknown");

    silent.open(1);
    eventually(
        Duration::from_secs(10),
        "the late answer to commit",
        || async { gateway.job(&job_id).await["state"] == "completed" },
    )
    .await;
    let replayed = post(&url, "charge-3", r#"{"n": 1}"#).await;
    assert_eq!(replayed.status, 200);
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    assert_eq!(posts(&upstream), 1, "one charge");
    assert_eq!(lookups_counted(&gateway, "settled_no_effect").await, 0.0);
}

/// A call silent until the attempt's deadline ends there, and so does the
/// lookups' schedule: a "no record" held back while the call was out is
/// asked again once the call has ended, and a `404` then reopens the job.
/// Before, every `404` had been held back and none was left to ask: the
/// job waited for an operator.
async fn a_404_held_back_is_asked_again_when_the_call_ends_at_its_deadline(store: TestStore) {
    let silent = Gate::new();
    let upstream = upstream_with_lookups(&silent, |_| {
        json_response(404, json!({"error": "no such charge"}))
    })
    .await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"2s\"")
        .tables(ROUTE)
        .start()
        .await;
    let first = post(&gateway.path("/v1/charges"), "charge-5", "{}").await;
    assert_eq!(first.status, 504);
    let job_id = first.job().unwrap();
    eventually(Duration::from_secs(10), "the job reopened", || async {
        gateway.job(&job_id).await["state"] == "open"
    })
    .await;
    let attempt = first_attempt(&gateway.job(&job_id).await).clone();
    assert_eq!(attempt["state"], "failed", "{attempt}");
    assert_eq!(attempt["lookups"]["last"]["result"], "settled_no_effect");
    assert_eq!(posts(&upstream), 1);
    silent.open(1);
}

/// As above, but the ask made as the call ends errs (the lookup answers
/// `500`): it is owed again, after the lookups' backoff, and the `404`
/// then reopens the job. Before, that one last ask was not repeated, and
/// the job waited for an operator.
async fn a_last_ask_that_errs_is_asked_again(store: TestStore) {
    let silent = Gate::new();
    let posted = Arc::new(std::sync::Mutex::new(None::<std::time::Instant>));
    let (seen, erred) = (posted.clone(), Arc::new(AtomicBool::new(false)));
    let errs = erred.clone();
    let upstream = upstream_with_lookups(&silent, move |_| {
        // The schedule's lookups come at 0.3 and 1.3 s (the next would be
        // past the 3 s deadline); the first after 2.8 s is the one made as
        // the call ends, cut at the deadline: it errs, once.
        let since = seen.lock().unwrap().map(|at| at.elapsed());
        let late = since.is_some_and(|t| t >= Duration::from_millis(2800));
        match late && !errs.swap(true, Ordering::SeqCst) {
            true => json_response(500, json!({"error": "lookups are down"})),
            false => json_response(404, json!({"error": "no such charge"})),
        }
    })
    .await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"3s\"")
        .tables(ROUTE)
        .start()
        .await;
    let first = tokio::spawn({
        let url = gateway.path("/v1/charges");
        async move { post(&url, "charge-8", "{}").await }
    });
    upstream.arrival().await;
    *posted.lock().unwrap() = Some(std::time::Instant::now());
    reopened_past_an_erring_ask(&gateway, &first.await.unwrap(), &erred).await;
    assert_eq!(posts(&upstream), 1);
    silent.open(1);
}

/// `first`, answered `504` (its attempt unknown), has its job reopened
/// (30 s at most) by a lookup's `404`, after `erred`, the ask made as the
/// call ended, had erred.
async fn reopened_past_an_erring_ask(
    gateway: &Gateway,
    first: &crate::support::Reply,
    erred: &AtomicBool,
) {
    assert_eq!(first.status, 504, "{first:?}");
    let job_id = first.job().unwrap();
    eventually(Duration::from_secs(30), "the job reopened", || async {
        gateway.job(&job_id).await["state"] == "open"
    })
    .await;
    assert!(
        erred.load(Ordering::SeqCst),
        "the ask as the call ended erred"
    );
    let attempt = first_attempt(&gateway.job(&job_id).await).clone();
    assert_eq!(attempt["lookups"]["last"]["result"], "settled_no_effect");
}

/// The call ends (its connection closed) at 2.5 s, before the 5 s
/// deadline, while the lookups' schedule still has an ask at 3.3 s; the
/// ask made as it ends errs, and the backoff after it would put the
/// schedule's next past the deadline. That ask is owed all the same: made
/// after the backoff, its `404` reopens the job. Before, the schedule
/// counted as not over when the ask was made, and nothing asked again.
async fn a_last_ask_that_errs_before_the_deadline_is_asked_again(store: TestStore) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (posted, erred) = (
        Arc::new(std::sync::Mutex::new(None)),
        Arc::new(AtomicBool::new(false)),
    );
    let (seen, errs) = (posted.clone(), erred.clone());
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let (seen, errs) = (seen.clone(), errs.clone());
            tokio::spawn(async move {
                let Some(head) = crate::support::upstream::read_head(&mut socket).await else {
                    return;
                };
                if head.starts_with(b"POST") {
                    *seen.lock().unwrap() = Some(std::time::Instant::now());
                    // Silent, then gone: the call ends without an answer.
                    tokio::time::sleep(Duration::from_millis(2500)).await;
                    return;
                }
                let since = seen
                    .lock()
                    .unwrap()
                    .map(|at: std::time::Instant| at.elapsed());
                let late = since.is_some_and(|t| t >= Duration::from_millis(2400));
                let (status, body) = match late && !errs.swap(true, Ordering::SeqCst) {
                    true => ("500 Internal Server Error", r#"{"error":"down"}"#),
                    false => ("404 Not Found", r#"{"error":"no such charge"}"#),
                };
                let answer = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(answer.as_bytes()).await;
            });
        }
    });
    let gateway = Gateway::builder(&store, &url)
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"5s\"")
        .tables(ROUTE)
        .start()
        .await;
    let first = post(&gateway.path("/v1/charges"), "charge-9", "{}").await;
    reopened_past_an_erring_ask(&gateway, &first, &erred).await;
}

/// A late answer whose commit is held up (a transaction holds its job)
/// past the 2 s its request waits for it: the call is not over while its
/// answer may still commit, so a lookup's `404` meanwhile is held back,
/// and the answer commits once the holder lets go. Before, the call was
/// taken as over once the request stopped waiting: the next lookup's
/// `404` settled the attempt "no effect" while its answer was being
/// committed, and whichever write landed first won (a reopened job, and a
/// second charge on the client's retry).
#[tokio::test]
async fn a_404_while_the_late_answer_is_being_committed_proves_nothing() {
    let store = TestStore::postgres().await;
    let TestStore::Postgres(db) = &store else {
        unreachable!()
    };
    let silent = Gate::new();
    let upstream = upstream_with_lookups(&silent, |_| {
        json_response(404, json!({"error": "no such charge"}))
    })
    .await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"30s\"")
        .set("database_lock_timeout", "\"300ms\"")
        .tables(ROUTE)
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    let job_id = unknown_with_a_404_held_back(&gateway, &url, "charge-11").await;

    let holder = db.connect().await;
    holder
        .batch_execute("BEGIN; SELECT 1 FROM jobs WHERE key = 'charge-11' FOR UPDATE")
        .await
        .unwrap();
    silent.open(1);
    eventually(
        Duration::from_secs(10),
        "the late answer's commit to wait on the holder",
        || async { gateway.metric("idemgate_record_retries_total").await >= 1.0 },
    )
    .await;
    // Twice the 2 s its request waited: the call taken as over then would
    // have been looked up again at once.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        lookups_counted(&gateway, "settled_no_effect").await,
        0.0,
        "a 404 settled the attempt while its answer was being committed"
    );
    assert_eq!(gateway.job(&job_id).await["state"], "unknown");

    holder.batch_execute("COMMIT").await.unwrap();
    eventually(
        Duration::from_secs(10),
        "the late answer to commit",
        || async { gateway.job(&job_id).await["state"] == "completed" },
    )
    .await;
    let replayed = post(&url, "charge-11", r#"{"n": 1}"#).await;
    assert_eq!(replayed.status, 200);
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    assert_eq!(posts(&upstream), 1, "one charge");
    assert_eq!(lookups_counted(&gateway, "settled_no_effect").await, 0.0);
}

async fn a_lookup_answering_500_asks_again_until_it_answers_200(store: TestStore) {
    let silent = Gate::new();
    // Lookups answer 500 until the test says the upstream knows.
    let knows = Arc::new(AtomicBool::new(false));
    let upstream = upstream_with_lookups(&silent, {
        let knows = knows.clone();
        move |_| match knows.load(Ordering::SeqCst) {
            false => json_response(500, json!({"error": "try later"})),
            true => json_response(200, json!({"charge": "ch_3"})),
        }
    })
    .await;
    let gateway = gateway(&store, &upstream).await;
    let url = gateway.path("/v1/charges");

    let first = post(&url, "charge-3", "{}").await;
    assert_eq!(first.status, 504);
    let job_id = first.job().unwrap();

    // The first lookup says nothing: still unknown, and recorded as such.
    eventually(
        Duration::from_secs(10),
        "the first lookup to be recorded",
        || async { first_attempt(&gateway.job(&job_id).await)["lookups"]["count"] != 0 },
    )
    .await;
    let job = gateway.job(&job_id).await;
    assert_eq!(job["state"], "unknown");
    assert_eq!(first_attempt(&job)["state"], "unknown");
    assert_eq!(
        first_attempt(&job)["lookups"]["last"]["result"],
        "still_unknown"
    );
    assert_eq!(first_attempt(&job)["lookups"]["last"]["status"], 500);
    assert_eq!(post(&url, "charge-3", "{}").await.status, 409);
    assert!(lookups_counted(&gateway, "still_unknown").await >= 1.0);

    // The next one, after the backoff, settles it.
    knows.store(true, Ordering::SeqCst);
    eventually(
        Duration::from_secs(10),
        "the second lookup to commit its answer",
        || async { gateway.job(&job_id).await["state"] == "completed" },
    )
    .await;
    let job = gateway.job(&job_id).await;
    assert!(first_attempt(&job)["lookups"]["count"].as_u64().unwrap() >= 2);
    assert_eq!(
        first_attempt(&job)["lookups"]["last"]["result"],
        "settled_succeeded"
    );
    let retry = post(&url, "charge-3", "{}").await;
    assert_eq!(retry.status, 200);
    assert_eq!(retry.json()["charge"], "ch_3");
    assert_eq!(posts(&upstream), 1);
    silent.open(1);
}

async fn a_bad_lookup_path_is_refused_at_start_up_naming_the_key(store: TestStore) {
    for (path, says) in [
        ("v1/charges/lookup/{job}", "must start with `/`"),
        ("/v1/charges/lookup", "put {job} where"),
    ] {
        let stderr = Gateway::builder(&store, "http://127.0.0.1:9")
            .tables(&format!(
                "[[routes]]\npath_prefix = \"/v1/charges\"\n[routes.reconcile]\npath = {path:?}\n"
            ))
            .start_and_fail()
            .await;
        assert!(
            stderr.contains("routes[0].reconcile.path"),
            "{path}: {stderr}"
        );
        assert!(stderr.contains(says), "{path}: {stderr}");
    }
}

/// The lookup goes to the attempt's upstream with that upstream's headers,
/// its credential included, as the attempt did.
#[tokio::test]
async fn the_lookup_carries_the_upstreams_credential() {
    let store = TestStore::embedded();
    let silent = Gate::new();
    let upstream =
        upstream_with_lookups(&silent, |_| json_response(200, json!({"charge": "ch_4"}))).await;
    let gateway = Gateway::builder(&store, "http://unused")
        .unset("upstreams")
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"30s\"")
        .env("TEST_PROVIDER_KEY", "sk-provider-secret")
        .tables(&format!(
            "[[upstreams]]\nname = \"provider\"\nurl = {:?}\n[upstreams.headers]\nauthorization = {{ env = \"TEST_PROVIDER_KEY\", prefix = \"Bearer \" }}\n\
             [[clients]]\nname = \"app\"\nkey_sha256 = {{ value = {:?} }}\n\
             [[routes]]\nname = \"charges\"\npath_prefix = \"/v1/charges\"\nrequire_client = true\n\
             [routes.reconcile]\npath = \"/v1/charges/lookup/{{job}}\"\n",
            upstream.url(),
            crate::support::sha256_hex("client-token"),
        ))
        .start()
        .await;
    let headers = [
        ("idempotency-key", "charge-4"),
        ("authorization", "Bearer client-token"),
    ];
    let first = send(Method::POST, &gateway.path("/v1/charges"), &headers, "{}").await;
    assert_eq!(first.status, 504);
    let job_id = first.job().unwrap();
    eventually(
        Duration::from_secs(10),
        "the lookup's answer to be committed",
        || async { gateway.job(&job_id).await["state"] == "completed" },
    )
    .await;
    let recorded = upstream.recorded();
    let lookup = recorded.iter().find(|r| is_lookup(r)).unwrap();
    assert_eq!(
        lookup.header("authorization"),
        Some("Bearer sk-provider-secret")
    );
    let retry = send(Method::POST, &gateway.path("/v1/charges"), &headers, "{}").await;
    assert_eq!(retry.status, 200);
    assert_eq!(retry.json()["charge"], "ch_4");
    silent.open(1);
}

/// An attempt whose gateway died is made unknown by another replica's
/// sweeper when its lease lapses, and that replica looks it up.
#[tokio::test]
async fn an_attempt_the_sweeper_makes_unknown_is_looked_up_too() {
    let store = TestStore::postgres().await;
    let silent = Gate::new();
    let upstream =
        upstream_with_lookups(&silent, |_| json_response(200, json!({"charge": "ch_5"}))).await;
    let builder = || {
        Gateway::builder(&store, &upstream.url())
            .set("lease_ttl", "\"600ms\"")
            .set("upstream_timeout", "\"30s\"")
            .set("attempt_deadline", "\"60s\"")
            .tables(ROUTE)
    };
    let doomed = builder().start().await;
    let survivor = builder().start().await;
    let job_id = killed_mid_call(&upstream, doomed, "charge-5").await;

    eventually(
        Duration::from_secs(15),
        "the lapsed attempt to be looked up and its answer committed",
        || async { survivor.job(&job_id).await["state"] == "completed" },
    )
    .await;
    let job = survivor.job(&job_id).await;
    assert_eq!(first_attempt(&job)["state"], "succeeded");
    assert_eq!(first_attempt(&job)["lookups"]["count"], 1);
    let retry = post(&survivor.path("/v1/charges"), "charge-5", "{}").await;
    assert_eq!(retry.status, 200);
    assert_eq!(retry.json()["charge"], "ch_5");
    assert_eq!(posts(&upstream), 1);
    silent.open(1);
}

/// Two replicas on one PostgreSQL whose route looks up, a 600 ms lease, and
/// an upstream that answers lookups "no such charge" (`404`) until told the
/// charge went through (`200`).
async fn orphaning(
    store: &TestStore,
    deadline: &str,
) -> (FakeUpstream, Arc<AtomicBool>, Gateway, Gateway) {
    let silent = Gate::new();
    let charged = Arc::new(AtomicBool::new(false));
    let lookup = {
        let charged = charged.clone();
        move |_: &Recorded| match charged.load(Ordering::SeqCst) {
            true => json_response(200, json!({"charge": "ch_6"})),
            false => json_response(404, json!({"error": "no such charge"})),
        }
    };
    let upstream = upstream_with_lookups(&silent, lookup).await;
    let builder = || {
        Gateway::builder(store, &upstream.url())
            .set("lease_ttl", "\"600ms\"")
            .set("upstream_timeout", "\"2s\"")
            .set("attempt_deadline", &format!("\"{deadline}\""))
            .tables(ROUTE)
    };
    let (doomed, survivor) = (builder().start().await, builder().start().await);
    (upstream, charged, doomed, survivor)
}

/// Posts `key` through `gateway` without waiting for its answer; returns
/// the request and its job's id once the upstream has the call.
async fn at_upstream(
    upstream: &FakeUpstream,
    gateway: &Gateway,
    key: &'static str,
) -> (JoinHandle<PostResult>, String) {
    let in_flight = crate::support::post_detached(gateway.path("/v1/charges"), key);
    let arrived = upstream.arrival().await;
    (
        in_flight,
        arrived.header("idempotency-key").unwrap().to_owned(),
    )
}

type PostResult = Result<http::StatusCode, hyper_util::client::legacy::Error>;

/// Posts `key` through `doomed` and kills it once the upstream has the
/// call; returns the job's id.
async fn killed_mid_call(
    upstream: &FakeUpstream,
    mut doomed: Gateway,
    key: &'static str,
) -> String {
    let (in_flight, job_id) = at_upstream(upstream, &doomed, key).await;
    doomed.kill().await;
    let _ = in_flight.await;
    job_id
}

/// [`killed_mid_call`], then waits until `survivor` has looked the lapsed
/// attempt up and been told `404`.
async fn orphaned_with_404(
    upstream: &FakeUpstream,
    doomed: Gateway,
    survivor: &Gateway,
    key: &'static str,
) -> String {
    let job_id = killed_mid_call(upstream, doomed, key).await;
    eventually(
        Duration::from_secs(15),
        "the lapsed attempt looked up, answered 404",
        || async {
            first_attempt(&survivor.job(&job_id).await)["lookups"]["last"]["status"] == 404
        },
    )
    .await;
    job_id
}

/// A replica's attempt lapses (its replica killed mid-call), and the one
/// that adopts it is told "no such charge". That proves nothing before
/// the attempt's deadline: a replica cut off from the database, not dead,
/// goes on calling until it, and an upstream still working on a call
/// whose connection was cut has no record of it yet. So the job stays
/// unknown (a retry is told `409`, no second charge runs), and the next
/// lookup finds the charge. Before, the `404` reopened the job at once and
/// the retry charged again beside the first.
#[tokio::test]
async fn a_404_about_an_adopted_attempt_proves_nothing_before_its_deadline() {
    let store = TestStore::postgres().await;
    let (upstream, charged, doomed, survivor) = orphaning(&store, "60s").await;
    let job_id = orphaned_with_404(&upstream, doomed, &survivor, "charge-6").await;
    let job = survivor.job(&job_id).await;
    assert_eq!(job["state"], "unknown", "{job}");
    assert_eq!(
        first_attempt(&job)["lookups"]["last"]["result"],
        "still_unknown"
    );
    let retry = post(&survivor.path("/v1/charges"), "charge-6", "{}").await;
    assert_eq!(retry.status, 409, "no second charge beside the first");

    charged.store(true, Ordering::SeqCst);
    eventually(
        Duration::from_secs(15),
        "the next lookup's answer committed",
        || async { survivor.job(&job_id).await["state"] == "completed" },
    )
    .await;
    let retry = post(&survivor.path("/v1/charges"), "charge-6", "{}").await;
    assert_eq!(retry.json()["charge"], "ch_6");
    assert_eq!(posts(&upstream), 1, "one charge");
}

/// A replica cut off from PostgreSQL while its call is out goes on
/// calling (silent past its 2 s timeout, the call is unknown and still
/// out until its 60 s deadline); its lease lapses, and another replica's sweeper makes the
/// attempt unknown and looks it up: "no such charge" (the charge is still
/// being made). The job stays unknown, past the other replica's own
/// `attempt_deadline` (8 s) and the grace too, so a retry there is told `409` and
/// charges nothing; once the network heals, the call's late
/// answer commits and the retry replays it, one charge. Before, the `404`
/// reopened the job while the call was out, and the retry charged again.
#[tokio::test]
async fn a_404_while_a_replica_cut_off_still_calls_reopens_nothing() {
    use crate::support::reply_cutter::ReplyCutter;
    let db = crate::support::TestDb::new().await;
    let (cutter, relayed) = ReplyCutter::relay(&db).await;
    let silent = Gate::new();
    let lookup = |_: &Recorded| json_response(404, json!({"error": "no such charge"}));
    let upstream = upstream_with_lookups(&silent, lookup).await;
    let replica = |store: &TestStore, deadline: &str| {
        Gateway::builder(store, &upstream.url())
            .set("lease_ttl", "\"600ms\"")
            .set("upstream_timeout", "\"2s\"")
            .set("attempt_deadline", &format!("\"{deadline}\""))
            .tables(ROUTE)
    };
    let cut_off = replica(&relayed, "60s").start().await;
    // Its own deadline is shorter: the attempt's recorded one counts.
    let survivor = replica(&TestStore::external(db.url.clone()), "8s");
    let survivor = survivor.start().await;
    let sent = std::time::Instant::now();
    let (in_flight, job_id) = at_upstream(&upstream, &cut_off, "charge-8").await;
    cutter.go_down();
    eventually(
        Duration::from_secs(15),
        "the lapsed attempt looked up, answered 404",
        || async {
            first_attempt(&survivor.job(&job_id).await)["lookups"]["last"]["status"] == 404
        },
    )
    .await;
    let job = survivor.job(&job_id).await;
    assert_eq!(job["state"], "unknown", "{job}");
    let retry = post(&survivor.path("/v1/charges"), "charge-8", "{}").await;
    assert_eq!(retry.status, 409, "no second charge while the call is out");
    // Past the survivor's own deadline and the grace: still unknown.
    tokio::time::sleep(Duration::from_secs(15).saturating_sub(sent.elapsed())).await;
    assert_eq!(survivor.job(&job_id).await["state"], "unknown");

    cutter.heal();
    silent.open(1);
    let _ = in_flight.await;
    eventually(
        Duration::from_secs(15),
        "the late answer committed",
        || async { survivor.job(&job_id).await["state"] == "completed" },
    )
    .await;
    let retry = post(&survivor.path("/v1/charges"), "charge-8", "{}").await;
    assert_eq!(retry.status, 200);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(posts(&upstream), 1, "one charge");
}

/// An adopted attempt (its replica killed) told `404` until past its
/// deadline (6 s, a minute for an answer's commit, and 5 s for the
/// clocks): once no call of it can be out anywhere, the lookup
/// asked once more is taken as no effect, and the job reopens for a retry.
#[tokio::test]
async fn a_404_about_an_adopted_attempt_reopens_its_job_past_the_deadline() {
    let store = TestStore::postgres().await;
    let (upstream, _, doomed, survivor) = orphaning(&store, "6s").await;
    let job_id = orphaned_with_404(&upstream, doomed, &survivor, "charge-7").await;
    assert_eq!(survivor.job(&job_id).await["state"], "unknown");
    eventually(
        Duration::from_secs(120),
        "the job reopened once the deadline passed",
        || async { first_attempt(&survivor.job(&job_id).await)["state"] == "failed" },
    )
    .await;
    let job = survivor.job(&job_id).await;
    assert_eq!(
        first_attempt(&job)["lookups"]["last"]["result"],
        "settled_no_effect"
    );
    let started = first_attempt(&job)["started_at"]
        .as_str()
        .unwrap()
        .to_owned();
    let settled = first_attempt(&job)["lookups"]["last"]["at"]
        .as_str()
        .unwrap()
        .to_owned();
    let at = |t: &str| humantime::parse_rfc3339(t).unwrap();
    let waited = at(&settled).duration_since(at(&started)).unwrap();
    // The 6 s deadline, then the grace: a minute for an answer's commit,
    // and 5 s.
    assert!(waited >= Duration::from_secs(71), "{started} {settled}");
    let retry = post(&survivor.path("/v1/charges"), "charge-7", "{}").await;
    assert_eq!(retry.status, 200, "attempt 2 runs");
    assert_eq!(posts(&upstream), 2);
}

/// A route that answers duplicates at once (`in_progress = "conflict"`)
/// holds nobody, a lookup under way or not: a duplicate of its unknown
/// job is told `409` at once. Before, it was held for the lookup, here up
/// to the upstream's 20 s timeout.
async fn a_conflict_route_does_not_hold_a_duplicate_for_a_lookup(store: TestStore) {
    let asked = Gate::new();
    let upstream = lookups_waiting_for(&asked, "ch_late").await;
    let conflict = ROUTE.replace(
        "path_prefix = \"/v1/charges\"",
        "path_prefix = \"/v1/charges\"\nin_progress = \"conflict\"\nfirst_byte_timeout = \"300ms\"",
    );
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"20s\"")
        .set("attempt_deadline", "\"60s\"")
        .tables(&conflict)
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    assert_eq!(post(&url, "charge-c", "{}").await.status, 504);
    lookup_arrival(&upstream).await;
    let duplicate = tokio::time::timeout(Duration::from_secs(5), post(&url, "charge-c", "{}"))
        .await
        .expect("answered at once, not held for the lookup");
    assert_eq!(duplicate.status, 409);
    assert_eq!(duplicate.problem(), "attempt-outcome-unknown");
    asked.open(1);
}

async fn a_duplicate_of_an_unknown_job_is_told_when_the_next_lookup_is(store: TestStore) {
    let silent = Gate::new();
    let upstream = upstream_with_lookups(&silent, |_| {
        json_response(500, json!({"error": "try later"}))
    })
    .await;
    let gateway = gateway(&store, &upstream).await;
    let url = gateway.path("/v1/charges");
    let first = post(&url, "charge-4", "{}").await;
    assert_eq!(first.status, 504);
    let job_id = first.job().unwrap();
    // Three lookups made (at once, after 1 s, after 2 s more): the next
    // comes 4 s after the third.
    eventually(Duration::from_secs(15), "three lookups", || async {
        first_attempt(&gateway.job(&job_id).await)["lookups"]["count"]
            .as_u64()
            .unwrap()
            >= 3
    })
    .await;
    let duplicate = post(&url, "charge-4", "{}").await;
    assert_eq!(duplicate.status, 409);
    assert_eq!(duplicate.problem(), "attempt-outcome-unknown");
    let after: u64 = duplicate.header("retry-after").unwrap().parse().unwrap();
    let count = first_attempt(&gateway.job(&job_id).await)["lookups"]["count"]
        .as_u64()
        .unwrap();
    // The backoff after lookup n is 2^(n-1) s: at most that, and (checked
    // soon after the lookup) more than the fixed 1 s it used to say.
    let backoff = 1u64 << (count - 1).min(4);
    assert!(
        after > 1 && after <= backoff,
        "Retry-After {after} with {count} lookups made (next in at most {backoff} s)"
    );
    silent.open(1);
}

/// How a [`deduplicating_upstream`]'s first POST of a key ends, once it
/// has acted and stored its answer.
#[derive(Clone, Copy, PartialEq)]
enum FirstCall {
    /// Silent until the gate opens, then answered.
    Held,
    /// Its connection drops: the call is over, its outcome unknown.
    Dropped,
}

/// An upstream that deduplicates by the forwarded key, as payment APIs
/// do: the first POST of a key acts (counted in `effects`) and stores its
/// answer, then ends as `first` says; a POST of a stored key answers the
/// stored answer without acting, except while the first POST of the key
/// is still in progress, and to the first such POST after it, which are
/// answered `409` as Stripe answers a key in use (that proves nothing of
/// the first).
async fn deduplicating_upstream(
    silent: &Gate,
    first: FirstCall,
) -> (FakeUpstream, Arc<AtomicUsize>) {
    let effects = Arc::new(AtomicUsize::new(0));
    let stored = Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
    let in_use = Arc::new(AtomicBool::new(false));
    let busy_once = Arc::new(AtomicBool::new(true));
    let (silent, counted) = (silent.clone(), effects.clone());
    let upstream = FakeUpstream::start(move |r| {
        let (silent, effects, stored) = (silent.clone(), counted.clone(), stored.clone());
        let (in_use, busy_once) = (in_use.clone(), busy_once.clone());
        async move {
            let key = r.header("idempotency-key").unwrap_or_default().to_owned();
            let known = stored.lock().unwrap().get(&key).cloned();
            if let Some(answer) = known {
                if in_use.load(Ordering::SeqCst) || busy_once.swap(false, Ordering::SeqCst) {
                    let code = json!({"error": {"code": "idempotency_key_in_use"}});
                    return json_response(409, code);
                }
                return json_response(201, answer);
            }
            let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
            let answer =
                json!({"charge": format!("ch_{n}"), "body": String::from_utf8_lossy(&r.body)});
            stored.lock().unwrap().insert(key, answer.clone());
            if first == FirstCall::Dropped {
                panic!("the upstream drops the first call's connection");
            }
            in_use.store(true, Ordering::SeqCst);
            silent.pass().await;
            in_use.store(false, Ordering::SeqCst);
            json_response(201, answer)
        }
    })
    .await;
    (upstream, effects)
}

/// A gateway whose route resends unknown attempts, calling an attempt
/// unknown after 300 ms of silence.
async fn resending(store: &TestStore, upstream: &FakeUpstream) -> Gateway {
    Gateway::builder(store, &upstream.url())
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"30s\"")
        .tables(
            "[[routes]]\nname = \"charges\"\npath_prefix = \"/v1/charges\"\nreconcile = \"resend\"\n",
        )
        .start()
        .await
}

/// Once the attempt's call is over (its connection broke), it is resent:
/// the first resend is answered `409` ("in use": still unknown, never
/// committed), the next the stored answer, which settles the attempt.
async fn a_resend_to_an_upstream_that_deduplicates_settles_the_attempt(store: TestStore) {
    let silent = Gate::new();
    let (upstream, effects) = deduplicating_upstream(&silent, FirstCall::Dropped).await;
    let gateway = resending(&store, &upstream).await;
    let url = gateway.path("/v1/charges");
    let body = r#"{"amount": 7}"#;
    let first = post(&url, "charge-7", body).await;
    assert_eq!(first.status, 502, "{first:?}");
    let job_id = first.job().unwrap();

    // Resent at once (answered 409: still unknown), then after a second
    // (the stored answer): settled with it.
    eventually(
        Duration::from_secs(10),
        "the resend's answer to be committed",
        || async { gateway.job(&job_id).await["state"] == "completed" },
    )
    .await;
    let job = gateway.job(&job_id).await;
    assert_eq!(first_attempt(&job)["state"], "succeeded");
    assert_eq!(first_attempt(&job)["lookups"]["count"], 2);
    assert_eq!(first_attempt(&job)["lookups"]["last"]["status"], 201);
    let recorded = upstream.recorded();
    assert_eq!(recorded.len(), 3, "the attempt and two resends");
    for resend in &recorded[1..] {
        assert_eq!(resend.method, "POST");
        assert_eq!(resend.path, recorded[0].path);
        assert_eq!(resend.body, recorded[0].body, "byte for byte");
        assert_eq!(resend.header("idempotency-key"), Some(job_id.as_str()));
        assert_eq!(resend.header("idempotency-attempt"), Some("1"));
    }

    let retry = post(&url, "charge-7", body).await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.json()["charge"], "ch_1");
    assert_eq!(effects.load(Ordering::SeqCst), 1, "one charge");
    assert_eq!(counted_by(&gateway, "resend", "still_unknown").await, 1.0);
    assert_eq!(
        counted_by(&gateway, "resend", "settled_succeeded").await,
        1.0
    );
}

/// A resend while the attempt's call is still out (the upstream silent
/// past `upstream_timeout`, the call going on) is answered `409`: "a
/// request with this key is in progress", as Stripe answers. That says
/// nothing of the first call: still unknown, asked again, and the call's
/// own late answer commits. Before, the `409` was committed as the job's
/// answer, replayed to every retry, and the charge's `201` dropped.
async fn a_resend_answered_in_progress_is_never_the_answer(store: TestStore) {
    let silent = Gate::new();
    let (upstream, effects) = deduplicating_upstream(&silent, FirstCall::Held).await;
    let gateway = resending(&store, &upstream).await;
    let url = gateway.path("/v1/charges");
    let body = r#"{"amount": 8}"#;
    let job_id = unknown_and_asked(&gateway, &url, "charge-8", body).await;
    let job = gateway.job(&job_id).await;
    assert_eq!(job["state"], "unknown", "{job}");
    assert_eq!(first_attempt(&job)["lookups"]["last"]["status"], 409);

    silent.open(1);
    eventually(
        Duration::from_secs(10),
        "the late answer to commit",
        || async { gateway.job(&job_id).await["state"] == "completed" },
    )
    .await;
    let retry = post(&url, "charge-8", body).await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.json()["charge"], "ch_1");
    assert_eq!(effects.load(Ordering::SeqCst), 1, "one charge");
}

/// A resend in flight when the gateway is told to stop is waited for, and
/// what it learns is written before the process exits: no replica resends
/// an attempt another one asked about, so a resend dropped at exit would
/// leave the job `unknown` for an operator (`docs/design.md` §12,
/// "Termination"). The first call's connection breaks after it was sent
/// (its attempt `unknown`, its task ended: nothing else keeps the drain).
#[tokio::test]
async fn a_resend_in_flight_at_shutdown_is_recorded_before_the_exit() {
    let store = TestStore::postgres().await;
    let resent = Gate::new();
    let upstream = FakeUpstream::start({
        let resent = resent.clone();
        move |r| {
            let resent = resent.clone();
            async move {
                if r.hit == 1 {
                    panic!("the upstream drops the first call's connection");
                }
                resent.pass().await;
                json_response(201, json!({"charge": "ch_1"}))
            }
        }
    })
    .await;
    let mut gateway = Gateway::builder(&store, &upstream.url())
        .set("shutdown_grace", "\"30s\"")
        .tables(
            "[[routes]]\nname = \"charges\"\npath_prefix = \"/v1/charges\"\nreconcile = \"resend\"\n",
        )
        .start()
        .await;
    let first = post(&gateway.path("/v1/charges"), "charge-9", "{}").await;
    assert_eq!(first.status, 502, "{first:?}");
    eventually(
        Duration::from_secs(10),
        "the resend at the upstream",
        || async { upstream.hits() == 2 },
    )
    .await;
    gateway.stop_listening().await;
    let early = tokio::time::timeout(Duration::from_secs(2), gateway.exited()).await;
    assert!(early.is_err(), "the drain waits for the resend");
    resent.open(1);
    assert!(gateway.exited().await.success(), "a clean exit");
    let states = store
        .column("SELECT j.state || '/' || a.state FROM jobs j JOIN attempts a ON a.job_id = j.id")
        .await;
    assert_eq!(
        states,
        ["completed/succeeded"],
        "the resend's answer recorded"
    );
}

crate::on_each_deployment!(
    [embedded, postgres]
    a_duplicate_held_meanwhile_gets_the_looked_up_answer,
    lookups_resume_after_the_gateway_that_asked_is_gone,
    a_resend_to_an_upstream_that_deduplicates_settles_the_attempt,
    a_duplicate_of_an_unknown_job_is_told_when_the_next_lookup_is,
    a_conflict_route_does_not_hold_a_duplicate_for_a_lookup,
    a_lookup_answering_200_commits_its_answer_for_every_retry,
    a_lookup_answering_404_reopens_the_job_for_attempt_two,
    a_lookup_404_while_the_call_is_out_keeps_the_job_unknown,
    a_404_held_back_is_asked_again_when_the_call_ends_at_its_deadline,
    a_last_ask_that_errs_is_asked_again,
    a_last_ask_that_errs_before_the_deadline_is_asked_again,
    a_resend_answered_in_progress_is_never_the_answer,
    a_lookup_answering_500_asks_again_until_it_answers_200,
    a_bad_lookup_path_is_refused_at_start_up_naming_the_key,
);

/// Lookups outlive the process that asked: after a restart (or on another
/// replica, when the one that asked stopped), the scan finds the unknown
/// attempt whose next lookup is overdue and asks again.
async fn lookups_resume_after_the_gateway_that_asked_is_gone(store: TestStore) {
    let silent = Gate::new();
    let settled = Arc::new(AtomicBool::new(false));
    let answer = settled.clone();
    let upstream = upstream_with_lookups(&silent, move |_| {
        if answer.load(Ordering::SeqCst) {
            json_response(200, json!({"charge": "ch_9"}))
        } else {
            json_response(503, json!({"error": "not yet"}))
        }
    })
    .await;
    let builder = || {
        Gateway::builder(&store, &upstream.url())
            .set("upstream_timeout", "\"300ms\"")
            .set("attempt_deadline", "\"60s\"")
            .set("sweep_interval", "\"200ms\"")
            .tables(ROUTE)
    };
    let mut first = builder().start().await;
    let reply = post(&first.path("/v1/charges"), "charge-9", "{}").await;
    assert_eq!(reply.status, 504);
    let job_id = reply.job().unwrap();
    eventually(Duration::from_secs(10), "a first lookup", || async {
        first_attempt(&first.job(&job_id).await)["lookups"]["count"] == 1
    })
    .await;
    first.kill().await;

    settled.store(true, Ordering::SeqCst);
    let second = builder().start().await;
    eventually(
        Duration::from_secs(15),
        "the restarted gateway to look the attempt up again and commit its answer",
        || async { second.job(&job_id).await["state"] == "completed" },
    )
    .await;
    let job = second.job(&job_id).await;
    assert_eq!(first_attempt(&job)["lookups"]["count"], 2);
    assert_eq!(
        first_attempt(&job)["lookups"]["last"]["result"],
        "settled_succeeded"
    );
    let retry = post(&second.path("/v1/charges"), "charge-9", "{}").await;
    assert_eq!(retry.json()["charge"], "ch_9");
    assert_eq!(posts(&upstream), 1);
    silent.open(1);
}
