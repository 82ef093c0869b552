//! The Redis fast path over TLS, against `redis-server`s the tests start
//! with their own certificates (rcgen), TLS only, and one ACL user (the
//! default user off): replays come from Redis over `rediss://` as that
//! user, on one node, a cluster and behind Sentinel; a server whose
//! certificate is not trusted, that refuses the password, or that wants a
//! client certificate the gateway does not have is never used, the store
//! answers every request correctly, and the log names `redis_url` and what
//! to fix. Private CAs come from `redis_ca_file` or, without it, from
//! `SSL_CERT_FILE` / `SSL_CERT_DIR` (docs/design.md §16).

use std::path::Path;
use std::time::Duration;

use crate::support::gateway::Builder;
use crate::support::redis_cluster::Node;
use crate::support::redis_tls::{self, keys, subscribers, Pki, TlsCluster, TlsSentinel};
use crate::support::{eventually, post, FakeUpstream, Gateway, TestStore};

const WAIT: Duration = Duration::from_secs(15);

/// `rediss://user:password@` the node.
fn url(node: &Node, password: &str) -> String {
    format!("rediss://{}:{password}@{}", redis_tls::USER, node.addr())
}

/// A gateway on PostgreSQL replaying from the TLS Redis at `redis_url`,
/// with the PKI's files beside its config and its log in `log`.
fn gateway(
    store: &TestStore,
    upstream: &FakeUpstream,
    pki: &Pki,
    redis_url: &str,
    log: &Path,
) -> Builder {
    Gateway::builder(store, &upstream.url())
        .replaying_from_redis(redis_url)
        .files_from(pki.dir())
        .stderr_to(log)
}

/// Proves that `key`'s answer is replayed from Redis: written there (the
/// test retries the key until the gateway has written it), then taken out
/// of the database, and replayed all the same, the upstream called once.
async fn replays_from_redis(
    gateway: &Gateway,
    store: &TestStore,
    upstream: &FakeUpstream,
    key: &str,
) {
    let url = gateway.path("/v1/charges");
    let first = post(&url, key, "{}").await;
    assert_eq!(first.status, 200);
    eventually(
        WAIT,
        "the answer to be written to Redis over TLS",
        || async {
            if gateway.metric("idemgate_fastpath_writes_total").await >= 1.0 {
                return true;
            }
            // Until Redis is reached (Sentinel asked, a node's slots known),
            // each replay from the store writes the entry again.
            post(&url, key, "{}").await;
            false
        },
    )
    .await;
    let TestStore::Postgres(db) = store else {
        unreachable!("replays from Redis are proven on PostgreSQL")
    };
    db.connect()
        .await
        .execute("DELETE FROM jobs", &[])
        .await
        .unwrap();
    let replay = post(&url, key, "{}").await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.job(), first.job());
    assert_eq!(upstream.hits(), 1, "only Redis could have answered");
    assert!(
        gateway
            .metric("idemgate_fastpath_lookups_total{result=\"hit\"}")
            .await
            >= 1.0
    );
}

/// Proves that Redis was not used and the store answered correctly: one
/// execution, a replay from the store, fast-path errors counted, nothing
/// written to `node`, and the log naming `redis_url` and `says`.
async fn answers_without_redis(
    gateway: &Gateway,
    upstream: &FakeUpstream,
    node: &Node,
    log: &Path,
    says: &[&str],
) {
    let url = gateway.path("/v1/charges");
    let first = post(&url, "without-redis", "{}").await;
    assert_eq!(first.status, 200);
    let replay = post(&url, "without-redis", "{}").await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!((&replay.body, replay.job()), (&first.body, first.job()));
    assert_eq!(upstream.hits(), 1);
    assert!(gateway.metric("idemgate_fastpath_errors_total").await >= 1.0);
    eprintln!(
        "TMPLOG {}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    assert_eq!(keys(node).await, 0, "nothing reached Redis");
    eventually(WAIT, "the failure to be logged", || async {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        text.lines().any(|l| {
            l.contains("redis_url: Redis not reached") && says.iter().all(|s| l.contains(s))
        })
    })
    .await;
}

#[tokio::test]
async fn replays_come_from_redis_over_tls_as_an_acl_user() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let node = redis_tls::node(&pki, dir.path(), "optional").await;
    let store = TestStore::postgres().await;
    let upstream = FakeUpstream::echo().await;
    let log = dir.path().join("gateway.log");
    let gateway = gateway(
        &store,
        &upstream,
        &pki,
        &url(&node, redis_tls::PASSWORD),
        &log,
    )
    .set("redis_ca_file", "\"ca.pem\"")
    .start()
    .await;
    replays_from_redis(&gateway, &store, &upstream, "tls-1").await;
    assert!(keys(&node).await >= 1);
    eventually(WAIT, "the gateway to subscribe over TLS", || async {
        subscribers(&node).await >= 1
    })
    .await;
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_refused_and_the_store_answers() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let node = redis_tls::node(&pki, dir.path(), "optional").await;
    let store = TestStore::postgres().await;
    let upstream = FakeUpstream::echo().await;
    let log = dir.path().join("gateway.log");
    let gateway = gateway(
        &store,
        &upstream,
        &pki,
        &url(&node, redis_tls::PASSWORD),
        &log,
    )
    .set("redis_ca_file", "\"other-ca.pem\"")
    .start()
    .await;
    answers_without_redis(
        &gateway,
        &upstream,
        &node,
        &log,
        &[
            "other-ca.pem",
            "certificate was not accepted",
            "UnknownIssuer",
        ],
    )
    .await;
}

#[tokio::test]
async fn a_wrong_password_is_refused_and_the_store_answers() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let node = redis_tls::node(&pki, dir.path(), "optional").await;
    let store = TestStore::postgres().await;
    let upstream = FakeUpstream::echo().await;
    let log = dir.path().join("gateway.log");
    let gateway = gateway(&store, &upstream, &pki, &url(&node, "not-alices"), &log)
        .set("redis_ca_file", "\"ca.pem\"")
        .start()
        .await;
    answers_without_redis(
        &gateway,
        &upstream,
        &node,
        &log,
        &["refused the credentials"],
    )
    .await;
}

#[tokio::test]
async fn a_server_that_wants_a_client_certificate_gets_the_configured_one() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let node = redis_tls::node(&pki, dir.path(), "yes").await;
    let store = TestStore::postgres().await;
    let upstream = FakeUpstream::echo().await;
    let redis_url = url(&node, redis_tls::PASSWORD);

    let without = dir.path().join("without.log");
    let gateway_without = gateway(&store, &upstream, &pki, &redis_url, &without)
        .set("redis_ca_file", "\"ca.pem\"")
        .start()
        .await;
    answers_without_redis(
        &gateway_without,
        &upstream,
        &node,
        &without,
        &["redis_client_cert", "CertificateRequired"],
    )
    .await;
    drop(gateway_without);

    let store = TestStore::postgres().await;
    let upstream = FakeUpstream::echo().await;
    let with = dir.path().join("with.log");
    let gateway = gateway(&store, &upstream, &pki, &redis_url, &with)
        .set("redis_ca_file", "\"ca.pem\"")
        .set("redis_client_cert", "\"client.pem\"")
        .set("redis_client_key", "\"client.key\"")
        .start()
        .await;
    replays_from_redis(&gateway, &store, &upstream, "with-a-client-certificate").await;
}

#[tokio::test]
async fn without_redis_ca_file_ssl_cert_file_and_ssl_cert_dir_name_the_ca() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let node = redis_tls::node(&pki, dir.path(), "optional").await;
    let redis_url = url(&node, redis_tls::PASSWORD);
    let ca = pki.path("ca.pem").display().to_string();
    for (var, value) in [
        ("SSL_CERT_FILE", ca.as_str()),
        ("SSL_CERT_DIR", &pki.dir().display().to_string()),
    ] {
        let store = TestStore::postgres().await;
        let upstream = FakeUpstream::echo().await;
        let log = dir.path().join(format!("{var}.log"));
        let gateway = gateway(&store, &upstream, &pki, &redis_url, &log)
            .env(var, value)
            .start()
            .await;
        replays_from_redis(&gateway, &store, &upstream, var).await;
    }

    // A variable naming nothing readable stops start-up, naming it.
    let store = TestStore::postgres().await;
    let err = Gateway::builder(&store, "http://127.0.0.1:1")
        .set("redis_url", &format!("{redis_url:?}"))
        .env("SSL_CERT_FILE", "/nonexistent/ca.pem")
        .start_and_fail()
        .await;
    assert!(err.contains("SSL_CERT_FILE=/nonexistent/ca.pem"), "{err}");
    assert!(err.contains("redis_ca_file"), "{err}");
}

#[tokio::test]
async fn a_tls_cluster_is_reached_over_tls_on_every_node() {
    let pki = Pki::new();
    let cluster = TlsCluster::start(&pki).await;
    let store = TestStore::postgres().await;
    let upstream = FakeUpstream::echo().await;
    let dir = tempfile::tempdir().unwrap();
    let gateway = gateway(
        &store,
        &upstream,
        &pki,
        &cluster.url(),
        &dir.path().join("gateway.log"),
    )
    .set("redis_ca_file", "\"ca.pem\"")
    .start()
    .await;
    replays_from_redis(&gateway, &store, &upstream, "cluster-over-tls").await;
    let mut written = 0;
    for node in &cluster.nodes {
        written += keys(node).await;
    }
    assert!(written >= 1);
    eventually(
        WAIT,
        "the gateway to subscribe to a node over TLS",
        || async {
            let mut total = 0;
            for node in &cluster.nodes {
                total += subscribers(node).await;
            }
            total >= 1
        },
    )
    .await;
}

#[tokio::test]
async fn sentinel_over_tls_names_a_master_reached_over_tls() {
    let pki = Pki::new();
    let redis = TlsSentinel::start(&pki).await;
    let store = TestStore::postgres().await;
    let upstream = FakeUpstream::echo().await;
    let dir = tempfile::tempdir().unwrap();
    let gateway = gateway(
        &store,
        &upstream,
        &pki,
        &redis.url(),
        &dir.path().join("gateway.log"),
    )
    .set("redis_ca_file", "\"ca.pem\"")
    .start()
    .await;
    replays_from_redis(&gateway, &store, &upstream, "sentinel-over-tls").await;
    assert!(keys(&redis.master).await >= 1);
}
