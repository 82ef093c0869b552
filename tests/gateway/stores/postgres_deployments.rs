//! PostgreSQL as operators deploy it: primary failover on throwaway servers
//! (a primary and a streaming-replication standby made with `pg_basebackup
//! -R`; gateways given both hosts with `target_session_attrs=read-write`;
//! the primary killed with `-m immediate` under load and the standby
//! promoted), and sessions kept off a transaction pooler.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;

use crate::support::postgres::ThrowawayPostgres;
use crate::support::{
    eventually, held_on_the_other_replica, post, send, FakeUpstream, Gateway, Reply, TestStore,
};

const WAIT: Duration = Duration::from_secs(30);

/// A primary and its standby, streaming; synchronous when `synchronous`
/// (the standby's `cluster_name`, its application name, is listed).
async fn primary_and_standby(synchronous: bool) -> (ThrowawayPostgres, ThrowawayPostgres) {
    let primary = if synchronous {
        ThrowawayPostgres::start_with(&["synchronous_standby_names=standby"]).await
    } else {
        ThrowawayPostgres::start().await
    };
    let standby = ThrowawayPostgres::standby_of(&primary).await;
    let want = if synchronous { "sync" } else { "async" };
    let (client, conn) = tokio_postgres::connect(&primary.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    eventually(WAIT, "the standby to stream", || async {
        client
            .query_opt(
                "SELECT 1 FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = $1",
                &[&want],
            )
            .await
            .is_ok_and(|row| row.is_some())
    })
    .await;
    (primary, standby)
}

fn both(primary: &ThrowawayPostgres, standby: &ThrowawayPostgres) -> String {
    format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        primary.port, standby.port
    )
}

async fn replica(url: &str, upstream: &FakeUpstream, log: &std::path::Path) -> Gateway {
    Gateway::builder(&TestStore::external(url), &upstream.url())
        .set("database_timeout", "\"500ms\"")
        .set("hold_timeout", "\"20s\"")
        .stderr_to(log)
        .start()
        .await
}

/// How many times the upstream executed each key (each request's body is
/// its key: the upstream sees the job id, not the client's key).
fn executions(upstream: &FakeUpstream) -> HashMap<String, usize> {
    let mut count = HashMap::new();
    for r in upstream.recorded() {
        let key = String::from_utf8_lossy(&r.body).into_owned();
        *count.entry(key).or_default() += 1;
    }
    count
}

async fn until_answered(url: &str, key: &str) -> Reply {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let reply = send(
            http::Method::POST,
            url,
            &[("idempotency-key", key)],
            key.to_owned(),
        )
        .await;
        if reply.status != 503 || tokio::time::Instant::now() > deadline {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_promoted_synchronous_standby_keeps_every_acknowledged_commit() {
    let (primary, standby) = primary_and_standby(true).await;
    let url = both(&primary, &standby);
    let upstream = FakeUpstream::echo().await;
    let logs = tempfile::tempdir().unwrap();
    let a = replica(&url, &upstream, &logs.path().join("a.log")).await;
    let b = replica(&url, &upstream, &logs.path().join("b.log")).await;

    // New keys from six clients across both replicas, before, during and
    // after the switch (until told to stop).
    let done = Arc::new(AtomicUsize::new(0));
    let refused_live = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (clients, rounds) = (6, 40);
    let workers: Vec<_> = (0..clients)
        .map(|c| {
            let urls = [a.path("/v1/charges"), b.path("/v1/charges")];
            let (done, stop, refused) = (done.clone(), stop.clone(), refused_live.clone());
            tokio::spawn(async move {
                let mut answers = Vec::new();
                for r in 0.. {
                    if r >= rounds && stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let key = format!("fo-{c}-{r}");
                    let url = &urls[(c + r) % 2];
                    let reply = send(
                        http::Method::POST,
                        url,
                        &[("idempotency-key", &key)],
                        key.clone(),
                    )
                    .await;
                    // Only a begin refused for want of a primary: an
                    // answer whose commit met the switch (503
                    // outcome-not-recorded) does not show the load met it.
                    if reply.status == 503 && reply.problem() == "store-unavailable" {
                        refused.fetch_add(1, Ordering::SeqCst);
                    }
                    answers.push((key, reply));
                    done.fetch_add(1, Ordering::SeqCst);
                }
                answers
            })
        })
        .collect();
    eventually(WAIT, "a third of the load to be done", || async {
        done.load(Ordering::SeqCst) >= clients * rounds / 3
    })
    .await;
    primary.stop();
    // No primary now (the standby is read-only): a new key is refused, and
    // the load meets the same while the standby waits to be promoted.
    let probe = send(
        http::Method::POST,
        &a.path("/v1/charges"),
        &[("idempotency-key", "probe")],
        "probe",
    )
    .await;
    assert_eq!(probe.status, 503);
    assert_eq!(probe.problem(), "store-unavailable");
    eventually(WAIT, "the load to meet the switch", || async {
        refused_live.load(Ordering::SeqCst) >= clients
    })
    .await;
    standby.promote();
    let at_promotion = done.load(Ordering::SeqCst);
    eventually(WAIT, "load after the promotion", || async {
        done.load(Ordering::SeqCst) >= at_promotion + 60
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let answers: Vec<(String, Reply)> = join_all(workers)
        .await
        .into_iter()
        .flat_map(|w| w.unwrap())
        .collect();

    // During the switch: 503s that proxied nothing; never another error.
    let executed = executions(&upstream);
    let mut refused = 0;
    for (key, reply) in &answers {
        match reply.status {
            200 => {}
            503 if reply.problem() == "store-unavailable" => {
                refused += 1;
                assert_eq!(executed.get(key), None, "{key} was refused yet proxied");
            }
            503 => assert_eq!(reply.problem(), "outcome-not-recorded", "{key}"),
            other => panic!("{key}: {other} {:?}", reply.body),
        }
    }
    assert_eq!(executed.get("probe"), None, "refused, so not proxied");
    assert!(refused > 0, "the load met the switch");
    assert!(
        answers.iter().filter(|(_, r)| r.status == 200).count() > clients * rounds / 3,
        "the load ran before and after the switch"
    );

    // Every key retried on the other replica once the standby is primary:
    // what was acknowledged is replayed byte for byte, the rest executes
    // now; no key ever executes twice.
    for (i, (key, first)) in answers.iter().enumerate() {
        let other = [&b, &a][i % 2];
        let retry = until_answered(&other.path("/v1/charges"), key).await;
        assert_eq!(retry.status, 200, "{key}: {:?}", retry.body);
        if first.status == 200 {
            assert_eq!(
                retry.body, first.body,
                "{key}: an acknowledged commit was lost"
            );
            assert_eq!(retry.header("idempotent-replayed"), Some("true"));
        }
    }
    let executed = executions(&upstream);
    for (key, _) in &answers {
        assert_eq!(executed.get(key), Some(&1), "{key} executed once");
    }
    eprintln!(
        "{} requests, {refused} refused with 503 during the switch",
        answers.len()
    );

    // Synchronous replication: no warning, before or after the switch.
    for log in ["a.log", "b.log"] {
        let text = std::fs::read_to_string(logs.path().join(log)).unwrap();
        assert!(!text.contains("asynchronously"), "{log}: {text}");
    }
}

#[tokio::test]
async fn asynchronous_replication_is_warned_about_at_start_up() {
    let (primary, standby) = primary_and_standby(false).await;
    let upstream = FakeUpstream::echo().await;
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("gateway.log");
    let _gateway = replica(&both(&primary, &standby), &upstream, &log).await;
    eventually(WAIT, "the warning", || async {
        std::fs::read_to_string(&log).is_ok_and(|t| {
            t.contains("replicate this database asynchronously")
                && t.contains("synchronous_commit = on (or remote_apply)")
        })
    })
    .await;
}

#[tokio::test]
async fn held_duplicates_are_answered_across_a_failover() {
    let (primary, standby) = primary_and_standby(true).await;
    let url = both(&primary, &standby);
    let gate = crate::support::Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    let logs = tempfile::tempdir().unwrap();
    let a = replica(&url, &upstream, &logs.path().join("a.log")).await;
    let b = replica(&url, &upstream, &logs.path().join("b.log")).await;
    let (first, held) = held_on_the_other_replica(&a, &b, &upstream, "/v1/charges", "held").await;
    // The primary dies with the attempt upstream; the standby takes over;
    // then the upstream answers: the commit lands on the new primary and
    // the duplicate held on the other replica (whose LISTEN connection
    // died with the old primary) is answered with it.
    primary.stop();
    standby.promote();
    gate.open(1);
    let first = first.await.unwrap();
    let held = held.await.unwrap();
    assert_eq!(held.status, 200, "{:?}", held.body);
    assert_eq!(held.header("idempotent-replayed"), Some("true"));
    if first.status == 200 {
        assert_eq!(held.body, first.body);
    } else {
        assert_eq!(first.problem(), "outcome-not-recorded");
    }
    assert_eq!(upstream.hits(), 1);
}

/// Behind a transaction pooler LISTEN and the migration lock cannot work:
/// with `database_direct_url` they use a connection of their own, and the
/// pool uses `database_url`.
#[tokio::test]
async fn listen_and_migrations_use_the_direct_url() {
    let db = crate::support::TestDb::new().await;
    let upstream = FakeUpstream::echo().await;
    let direct = format!("{}?application_name=idemgate-direct", db.url);
    let gateway = Gateway::builder(&TestStore::external(&db.url), &upstream.url())
        .set("database_direct_url", &format!("{direct:?}"))
        .start()
        .await;
    let reply = send(
        http::Method::POST,
        &gateway.path("/v1/charges"),
        &[("idempotency-key", "direct")],
        "{}",
    )
    .await;
    assert_eq!(reply.status, 200);
    let client = db.connect().await;
    let sessions = |name: &'static str| {
        let client = &client;
        let db = db.name.clone();
        async move {
            client
                .query(
                    "SELECT query FROM pg_stat_activity WHERE datname = $1 AND application_name = $2",
                    &[&db, &name],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>()
        }
    };
    // The listener checks the server (replication, connection budget) before
    // it listens, in the background: wait for it to get there.
    eventually(WAIT, "the direct session listening", || async {
        let direct = sessions("idemgate-direct").await;
        direct.len() == 1 && direct[0].starts_with("LISTEN")
    })
    .await;
    let direct = sessions("idemgate-direct").await;
    assert_eq!(direct.len(), 1, "one direct session: {direct:?}");
    let pooled = sessions("idemgate").await;
    assert!(!pooled.is_empty());
    assert!(
        pooled.iter().all(|q| !q.starts_with("LISTEN")),
        "{pooled:?}"
    );
}

#[tokio::test]
async fn a_pool_that_cannot_fit_is_warned_about_at_start_up() {
    let pg = ThrowawayPostgres::start_with(&["max_connections=12"]).await;
    let upstream = FakeUpstream::echo().await;
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("gateway.log");
    let _gateway = Gateway::builder(&TestStore::external(pg.url()), &upstream.url())
        .set("database_pool_size", "16")
        .stderr_to(&log)
        .start()
        .await;
    eventually(WAIT, "the warning", || async {
        std::fs::read_to_string(&log).is_ok_and(|t| {
            t.contains("database_pool_size = 16, but the database has")
                && t.contains("max_connections 12")
        })
    })
    .await;
}

/// A primary fenced read-only (as failover tools do before a switch)
/// refuses writes with SQLSTATE 25006: requests answer `503`, nothing is
/// proxied, and once writes are allowed again the gateway serves as before.
///
/// A reloaded setting reaches each idle backend only after it has run one
/// more command under the old one, so a request racing the fence itself may
/// still be proxied (and its answer recorded once writes are back). What is
/// asserted is what holds once the database has said "read-only" once.
#[tokio::test]
async fn a_read_only_database_is_a_503_and_nothing_is_proxied() {
    let pg = ThrowawayPostgres::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&TestStore::external(pg.url()), &upstream.url())
        .set("database_timeout", "\"500ms\"")
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    assert_eq!(post(&url, "before", "{}").await.status, 200);
    let (admin, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let fence = |on: bool| {
        let admin = &admin;
        async move {
            let set = format!("ALTER SYSTEM SET default_transaction_read_only = {on}");
            admin.batch_execute(&set).await.unwrap();
            admin
                .batch_execute("SELECT pg_reload_conf()")
                .await
                .unwrap();
        }
    };
    fence(true).await;
    let probes = AtomicUsize::new(0);
    eventually(WAIT, "writes refused as read-only", || async {
        let key = format!("probe-{}", probes.fetch_add(1, Ordering::Relaxed));
        let reply = post(&url, &key, "{}").await;
        reply.status == 503 && reply.problem() == "store-unavailable"
    })
    .await;
    assert!(gateway.metric("idemgate_database_read_only_total").await >= 1.0);
    let fenced = upstream.hits();
    for _ in 0..5 {
        let reply = post(&url, "fenced", "{}").await;
        assert_eq!(reply.status, 503, "{:?}", reply.body);
        assert_eq!(reply.problem(), "store-unavailable");
    }
    assert_eq!(upstream.hits(), fenced, "nothing proxied while read-only");
    fence(false).await;
    eventually(WAIT, "writes taken again", || async {
        post(&url, "fenced", "{}").await.status == 200
    })
    .await;
    assert_eq!(
        upstream.hits(),
        fenced + 1,
        "executed once writes were back"
    );
    let replay = post(&url, "fenced", "{}").await;
    assert_eq!(replay.status, 200);
    assert_eq!(upstream.hits(), fenced + 1, "then replayed");
}
