//! The chaos run: two gateway replicas on one throwaway PostgreSQL and one
//! throwaway Redis, a recording upstream, a load of keyed requests (new keys,
//! sequential and concurrent duplicates, mismatched bodies) and a schedule
//! of faults (a replica SIGKILLed and another SIGSTOPped past its lease,
//! Redis killed and back empty, PostgreSQL restarted fast and immediately,
//! an upstream slower than the timeout, retryable statuses). Then a checker
//! reads the client log, the upstream log and the admin API and holds the
//! history to every promise, printing examples of any violation.
//!
//! Loopback only, bounded in time, stops by itself. The README's test
//! command runs it for `IDEMGATE_CHAOS_SECONDS` (30 by default); set it
//! higher for a long run.

#[allow(unused_imports)]
#[path = "../support/mod.rs"]
mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tokio::sync::RwLock;
use tokio::time::Instant;

use support::gateway::Builder;
use support::postgres::ThrowawayPostgres;
use support::upstream::json_response;
use support::{FakeUpstream, Gateway, TestStore, ThrowawayRedis};

const REPLICAS: usize = 2;
const WORKERS: usize = 12;
const LEASE: Duration = Duration::from_secs(2);
const TIMEOUT: Duration = Duration::from_secs(1);
const SLOW: Duration = Duration::from_millis(1500);

/// One execution the upstream performed.
#[derive(Debug, Clone)]
struct Execution {
    job: String,
    attempt: u32,
    replica: usize,
    mismatch: bool,
    started: Instant,
    answered: Option<(Instant, u16)>,
}

/// The recording upstream: one listener per replica, one log.
#[derive(Default)]
struct UpstreamLog {
    executions: Mutex<Vec<Execution>>,
    counter: AtomicUsize,
}

/// One request a client made, and what became of it.
#[derive(Debug, Clone)]
struct Sent {
    key: String,
    mismatch: bool,
    replica: usize,
    generation: usize,
    sent: Instant,
    done: Instant,
    outcome: Result<Answer, String>,
}

#[derive(Debug, Clone)]
struct Answer {
    status: u16,
    body: Bytes,
    problem: Option<String>,
    replayed: bool,
}

/// A replica slot: the running gateway and how often it was replaced.
struct Replica {
    gateway: Gateway,
    generation: usize,
    builder: Builder,
}

/// What the fault schedule did, and when.
#[derive(Debug, Clone)]
struct Fault {
    what: String,
    from: Instant,
    to: Instant,
    killed: Option<usize>,
}

struct Run {
    replicas: Vec<RwLock<Replica>>,
    upstream: Arc<UpstreamLog>,
    sent: Mutex<Vec<Sent>>,
    faults: Mutex<Vec<Fault>>,
    /// Keys whose result a client has seen: picked for duplicates and
    /// mismatches.
    keys: Mutex<Vec<(String, String)>>,
    /// Every key used, with its body.
    all: Mutex<Vec<(String, String)>>,
    seq: AtomicUsize,
}

fn seconds() -> u64 {
    std::env::var("IDEMGATE_CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_run_keeps_every_promise() {
    let duration = Duration::from_secs(seconds());
    let mut pg = ThrowawayPostgres::start().await;
    let mut redis = ThrowawayRedis::start().await;
    let log = Arc::new(UpstreamLog::default());
    let upstreams: Vec<FakeUpstream> = futures_util::future::join_all(
        (0..REPLICAS).map(|replica| recording_upstream(log.clone(), replica)),
    )
    .await;
    let store = TestStore::external(pg.url());
    let mut replicas = Vec::new();
    for upstream in &upstreams {
        let builder = Gateway::builder(&store, &upstream.url())
            .set("redis_url", &format!("{:?}", redis.url()))
            .set("lease_ttl", &format!("\"{}ms\"", LEASE.as_millis()))
            .set(
                "upstream_timeout",
                &format!("\"{}ms\"", TIMEOUT.as_millis()),
            )
            .set("attempt_deadline", "\"10s\"")
            .set("hold_timeout", "\"3s\"")
            .set("sweep_interval", "\"250ms\"")
            .set("database_timeout", "\"500ms\"")
            .set("shutdown_grace", "\"1s\"");
        let gateway = builder.clone().start().await;
        replicas.push(RwLock::new(Replica {
            gateway,
            generation: 0,
            builder,
        }));
    }
    let run = Arc::new(Run {
        replicas,
        upstream: log.clone(),
        sent: Mutex::default(),
        faults: Mutex::default(),
        keys: Mutex::default(),
        all: Mutex::default(),
        seq: AtomicUsize::new(0),
    });

    let until = Instant::now() + duration;
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| tokio::spawn(worker(run.clone(), w, until)))
        .collect();
    faults(&run, &mut pg, &mut redis, until).await;
    for w in workers {
        w.await.unwrap();
    }
    // Let attempts cut off by the last faults settle: leases lapse, late
    // answers and retried writes land.
    tokio::time::sleep(LEASE * 3).await;

    let report = check(&run).await;
    println!("{}", report.summary);
    assert!(
        report.violations.is_empty(),
        "the chaos run broke a promise:\n{}",
        report.violations.join("\n")
    );
    drop(upstreams);
}

/// Serves the recording upstream for `replica` on a port of its own, so
/// every execution is known to have come from that replica.
async fn recording_upstream(log: Arc<UpstreamLog>, replica: usize) -> FakeUpstream {
    FakeUpstream::start(move |r| {
        let log = log.clone();
        async move {
            let job = r.header("idempotency-key").unwrap_or_default().to_owned();
            let attempt = r
                .header("idempotency-attempt")
                .and_then(|a| a.parse().ok())
                .unwrap_or(0);
            let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
            let mode = body["mode"].as_str().unwrap_or("ok").to_owned();
            let index = {
                let mut executions = log.executions.lock().unwrap();
                executions.push(Execution {
                    job: job.clone(),
                    attempt,
                    replica,
                    mismatch: body["mismatch"].as_bool().unwrap_or(false),
                    started: Instant::now(),
                    answered: None,
                });
                executions.len() - 1
            };
            let exec = log.counter.fetch_add(1, Ordering::SeqCst);
            let status = match mode.as_str() {
                "slow" => {
                    tokio::time::sleep(SLOW).await;
                    200
                }
                // A retryable status on the first try of a job only.
                "busy" if attempt == 1 => 503,
                _ => 200,
            };
            log.executions.lock().unwrap()[index].answered = Some((Instant::now(), status));
            json_response(
                status,
                json!({"exec": exec, "job": job, "attempt": attempt}),
            )
        }
    })
    .await
}

/// One client: new keys, duplicates and mismatches, until `until`.
async fn worker(run: Arc<Run>, w: usize, until: Instant) {
    let mut rng = fastrand::Rng::with_seed(w as u64 + 1);
    while Instant::now() < until {
        let roll = rng.u32(0..100);
        let used = run.keys.lock().unwrap().len();
        if roll < 55 || used == 0 {
            let (key, body) = new_key(&run, &mut rng);
            if send(&run, &key, &body, false, rng.usize(0..REPLICAS)).await {
                run.keys.lock().unwrap().push((key, body));
            }
        } else if roll < 75 {
            let (key, body) = run.keys.lock().unwrap()[rng.usize(0..used)].clone();
            send(&run, &key, &body, false, rng.usize(0..REPLICAS)).await;
        } else if roll < 90 {
            let (key, body) = new_key(&run, &mut rng);
            let copies = (0..3).map(|_| send(&run, &key, &body, false, rng.usize(0..REPLICAS)));
            if futures_util::future::join_all(copies).await.contains(&true) {
                run.keys.lock().unwrap().push((key, body));
            }
        } else {
            let (key, _) = run.keys.lock().unwrap()[rng.usize(0..used)].clone();
            let body = json!({"mode": "ok", "mismatch": true}).to_string();
            send(&run, &key, &body, true, rng.usize(0..REPLICAS)).await;
        }
        tokio::time::sleep(Duration::from_millis(rng.u64(5..20))).await;
    }
}

fn new_key(run: &Run, rng: &mut fastrand::Rng) -> (String, String) {
    let n = run.seq.fetch_add(1, Ordering::SeqCst);
    let mode = match rng.u32(0..100) {
        0..70 => "ok",
        70..85 => "slow",
        _ => "busy",
    };
    // Other clients pick it for duplicates and mismatches only once a
    // request with it got its result: until then a mismatched body could
    // rightly be the one that creates the job (the first request may have
    // met a 503 while the database restarted, recording nothing).
    let (key, body) = (
        format!("chaos-{n}"),
        json!({"mode": mode, "n": n}).to_string(),
    );
    run.all.lock().unwrap().push((key.clone(), body.clone()));
    (key, body)
}

/// Sends one keyed request and logs it; true when it got a committed result.
async fn send(run: &Run, key: &str, body: &str, mismatch: bool, replica: usize) -> bool {
    let (url, generation) = {
        let slot = run.replicas[replica].read().await;
        (slot.gateway.path("/v1/charges"), slot.generation)
    };
    let sent = Instant::now();
    let request = Request::post(url)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(30), async {
        let response = support::client()
            .request(request)
            .await
            .map_err(|e| e.to_string())?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        let problem = (parts.headers.get("content-type").map(|v| v.as_bytes())
            == Some(b"application/problem+json"))
        .then(|| {
            serde_json::from_slice::<Value>(&body).ok()?["type"]
                .as_str()?
                .rsplit('/')
                .next()
                .map(str::to_owned)
        })
        .flatten();
        Ok(Answer {
            status: parts.status.as_u16(),
            replayed: parts.headers.contains_key("idempotent-replayed"),
            body,
            problem,
        })
    })
    .await
    .unwrap_or_else(|_| Err("no answer within 30 s".into()));
    let result = outcome
        .as_ref()
        .is_ok_and(|a| a.status == 200 && a.problem.is_none());
    run.sent.lock().unwrap().push(Sent {
        key: key.to_owned(),
        mismatch,
        replica,
        generation,
        sent,
        done: Instant::now(),
        outcome,
    });
    result
}

/// The fault schedule, one fault every few seconds, in turn, until `until`.
async fn faults(run: &Run, pg: &mut ThrowawayPostgres, redis: &mut ThrowawayRedis, until: Instant) {
    let mut turn = 0;
    tokio::time::sleep(Duration::from_secs(2)).await;
    while Instant::now() + Duration::from_secs(3) < until {
        let from = Instant::now();
        let (what, killed) = match turn % 5 {
            0 => {
                let mut slot = run.replicas[0].write().await;
                slot.gateway.kill().await;
                slot.generation += 1;
                tokio::time::sleep(Duration::from_millis(500)).await;
                slot.gateway = slot.builder.clone().start().await;
                ("replica 0 SIGKILLed and restarted".to_owned(), Some(0))
            }
            1 => {
                let pid = run.replicas[1].read().await.gateway.pid();
                signal("STOP", pid);
                tokio::time::sleep(LEASE + Duration::from_millis(800)).await;
                signal("CONT", pid);
                ("replica 1 SIGSTOPped past its lease".to_owned(), None)
            }
            2 => {
                redis.kill().await;
                tokio::time::sleep(Duration::from_millis(500)).await;
                redis.restart().await;
                ("Redis killed, back empty".to_owned(), None)
            }
            3 => {
                pg.stop_fast();
                tokio::time::sleep(Duration::from_millis(300)).await;
                pg.start_again();
                ("PostgreSQL restarted (fast)".to_owned(), None)
            }
            _ => {
                pg.stop();
                tokio::time::sleep(Duration::from_millis(300)).await;
                pg.start_again();
                ("PostgreSQL restarted (immediate)".to_owned(), None)
            }
        };
        run.faults.lock().unwrap().push(Fault {
            what,
            from,
            to: Instant::now(),
            killed,
        });
        turn += 1;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

fn signal(sig: &str, pid: u32) {
    let ok = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig} {pid}");
}

struct Report {
    summary: String,
    violations: Vec<String>,
}

/// Holds the history to every promise.
async fn check(run: &Run) -> Report {
    let sent = run.sent.lock().unwrap().clone();
    let executions = run.upstream.executions.lock().unwrap().clone();
    let faults = run.faults.lock().unwrap().clone();
    let keys = run.all.lock().unwrap().clone();
    let admin = run.replicas[1].read().await;
    let admin = &admin.gateway;
    let mut violations = Vec::new();
    let mut flag = |rule: &str, example: String| {
        if violations
            .iter()
            .filter(|v: &&String| v.starts_with(rule))
            .count()
            < 5
        {
            violations.push(format!("{rule}: {example}"));
        }
    };

    // The jobs, as the admin API tells them.
    let mut jobs: BTreeMap<String, Value> = BTreeMap::new();
    for (key, _) in &keys {
        let reply = admin
            .admin(
                Method::GET,
                &format!("/admin/v1/jobs?owner=anonymous&key={key}"),
                "",
            )
            .await;
        match reply.status {
            200 => {
                jobs.insert(key.clone(), reply.json());
            }
            404 => {}
            other => flag("admin", format!("looking up {key} answered {other}")),
        }
    }
    let job_keys: HashMap<String, String> = jobs
        .iter()
        .map(|(k, j)| (j["id"].as_str().unwrap().to_owned(), k.clone()))
        .collect();
    let killed_during = |replica: usize, from: Instant, to: Instant| {
        faults
            .iter()
            .any(|f| f.killed == Some(replica) && f.from <= to && f.to >= from)
    };

    // No execution without its job and attempt; nothing run for a
    // mismatched body; no re-execution after an unknown outcome.
    for e in &executions {
        if e.mismatch {
            flag("mismatch executed", format!("{e:?}"));
        }
        let Some(job) = job_keys.get(&e.job).and_then(|k| jobs.get(k)) else {
            flag("execution without a job", format!("{e:?}"));
            continue;
        };
        let attempts = job["attempts"].as_array().unwrap();
        for earlier in attempts
            .iter()
            .filter(|a| a["number"].as_u64().unwrap() < u64::from(e.attempt))
        {
            let state = earlier["state"].as_str().unwrap();
            if !matches!(state, "failed" | "rejected") {
                flag(
                    "re-executed after an outcome that was not a safe failure",
                    format!(
                        "job {} attempt {} ran after attempt {} ended {state}",
                        e.job, e.attempt, earlier["number"]
                    ),
                );
            }
        }
        // An answer that reached a live gateway never ends unknown.
        if let Some((at, _)) = e.answered {
            let attempt = attempts
                .iter()
                .find(|a| a["number"].as_u64() == Some(u64::from(e.attempt)));
            let state = attempt
                .and_then(|a| a["state"].as_str())
                .unwrap_or("missing");
            let margin = Duration::from_millis(500);
            if matches!(state, "unknown" | "started" | "missing")
                && !killed_during(e.replica, e.started, at + margin)
            {
                flag(
                    "an answer that reached the gateway ended unknown",
                    format!(
                        "job {} attempt {} via replica {}: {state}",
                        e.job, e.attempt, e.replica
                    ),
                );
            }
        }
    }

    // One result per key, equal to the committed one; every request answered
    // or explained.
    let mut results: HashMap<&str, Vec<&Bytes>> = HashMap::new();
    for s in &sent {
        let answer = match &s.outcome {
            Ok(answer) => answer,
            Err(e) => {
                if !killed_during(s.replica, s.sent, s.done) {
                    flag(
                        "unexplained transport error",
                        format!(
                            "{} via replica {} (generation {}): {e}",
                            s.key, s.replica, s.generation
                        ),
                    );
                }
                continue;
            }
        };
        match (&answer.problem, s.mismatch) {
            (Some(p), true)
                if matches!(p.as_str(), "idempotency-key-mismatch" | "store-unavailable") => {}
            (_, true) => flag(
                "a mismatched body was not refused",
                format!("{} got {}", s.key, answer.status),
            ),
            // The upstream answered while the database could not take the
            // commit (a restart outlasting the gateway's patience): the
            // answer is still being recorded, and must have been, unless the
            // replica recording it was killed.
            (Some(p), false) if p == "outcome-not-recorded" => {
                let state = jobs.get(s.key.as_str()).and_then(|j| j["state"].as_str());
                if state != Some("completed") && !killed_during(s.replica, s.sent, Instant::now()) {
                    flag(
                        "an answer said to be being recorded was not recorded",
                        format!("{} via replica {}: job {state:?}", s.key, s.replica),
                    );
                }
            }
            (Some(p), false) => {
                if !matches!(
                    p.as_str(),
                    "attempt-outcome-unknown" | "request-in-progress" | "store-unavailable"
                ) {
                    flag(
                        "unexpected problem",
                        format!("{} got {} {p}", s.key, answer.status),
                    );
                }
            }
            (None, false) if answer.status == 503 => {} // the upstream's retryable answer, uncommitted
            (None, false) => results.entry(&s.key).or_default().push(&answer.body),
        }
    }
    for (key, bodies) in &results {
        let committed = jobs
            .get(*key)
            .and_then(|j| j["response"]["body"].as_str().map(str::to_owned));
        let Some(committed) = committed else {
            flag(
                "a client saw an answer that was not committed",
                format!("{key}: {:?}", bodies[0]),
            );
            continue;
        };
        for body in bodies {
            if body.as_ref() != committed.as_bytes() {
                flag(
                    "two results for one key",
                    format!("{key}: {:?} vs committed {committed}", body),
                );
            }
        }
    }

    // After the leases lapsed: nothing left started; unknown stays blocked.
    let mut by_state: BTreeMap<String, usize> = BTreeMap::new();
    for (key, job) in &jobs {
        *by_state
            .entry(job["state"].as_str().unwrap().to_owned())
            .or_default() += 1;
        for a in job["attempts"].as_array().unwrap() {
            if a["state"] == "started" {
                flag(
                    "left started after its lease lapsed",
                    format!("{key}: attempt {}", a["number"]),
                );
            }
        }
        if job["state"] == "unknown" {
            let body = keys.iter().find(|(k, _)| k == key).unwrap().1.clone();
            let retry = support::post(&admin.path("/v1/charges"), key, &body).await;
            if retry.status != 409 {
                flag(
                    "an unknown job was not blocked",
                    format!("{key} answered {}", retry.status),
                );
            }
        }
    }

    let errors = sent.iter().filter(|s| s.outcome.is_err()).count();
    let replays = sent
        .iter()
        .filter(|s| s.outcome.as_ref().is_ok_and(|a| a.replayed))
        .count();
    let summary = format!(
        "chaos run: {} requests ({} replays, {} transport errors on killed replicas), {} keys, {} jobs {:?}, {} executions, faults: {}",
        sent.len(),
        replays,
        errors,
        keys.len(),
        jobs.len(),
        by_state,
        executions.len(),
        faults
            .iter()
            .fold(BTreeMap::<&str, usize>::new(), |mut n, f| {
                *n.entry(f.what.as_str()).or_default() += 1;
                n
            })
            .iter()
            .map(|(what, n)| format!("{n} × {what}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Report {
        summary,
        violations,
    }
}
