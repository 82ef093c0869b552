//! TLS to PostgreSQL (docs/design.md §16), against a throwaway server that
//! accepts TCP connections only over TLS (`hostssl`; `hostnossl … reject`),
//! with a certificate for localhost and 127.0.0.1 from a CA the test makes.
//! The server is shared by the tests that run at the same time (it costs
//! seconds to start) and stopped when the last of them ends; each test has
//! a database of its own.

use std::time::Duration;

use crate::support::postgres::ThrowawayPostgres;
use crate::support::postgres_tls::server;
use crate::support::{eventually, post, FakeUpstream, Gateway};

/// One keyed request and its duplicate: one upstream call, one replay.
async fn runs_a_keyed_request(gateway: &Gateway, upstream: &FakeUpstream) {
    let url = gateway.path("/v1/charges");
    let first = post(&url, "over-tls", "{\"amount\":1}").await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let replay = post(&url, "over-tls", "{\"amount\":1}").await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn verify_full_with_the_servers_ca_runs_requests_on_encrypted_sessions_only() {
    let server = server().await;
    let db = server.database("postgres").await;
    let upstream = FakeUpstream::echo().await;
    let url = server.url(&db, "sslmode=verify-full&sslrootcert=ca.pem");
    let gateway = server.gateway(&url, &upstream.url()).start().await;
    runs_a_keyed_request(&gateway, &upstream).await;
    // The pool's sessions and the listener's, all over TLS.
    eventually(
        Duration::from_secs(10),
        "the pool and the listener to be connected",
        || async { server.sessions(&db).await.0 >= 2 },
    )
    .await;
    let (sessions, encrypted) = server.sessions(&db).await;
    assert_eq!(
        encrypted, sessions,
        "every session of the gateway is encrypted"
    );
}

#[tokio::test]
async fn a_plaintext_connection_is_refused_and_start_up_says_what_to_change() {
    let server = server().await;
    let db = server.database("postgres").await;
    let err = server
        .gateway(&server.url(&db, "sslmode=disable"), "http://unused")
        .start_and_fail()
        .await;
    assert!(
        err.contains("`database_url`: the server refused the connection"),
        "{err}"
    );
    assert!(err.contains("use sslmode=verify-full"), "{err}");
    assert!(
        err.contains("no encryption"),
        "the server's own words: {err}"
    );
}

#[tokio::test]
async fn a_certificate_from_another_ca_stops_start_up_naming_database_url() {
    let server = server().await;
    let db = server.database("postgres").await;
    let url = server.url(&db, "sslmode=verify-full&sslrootcert=other-ca.pem");
    let err = server.gateway(&url, "http://unused").start_and_fail().await;
    assert!(
        err.contains("`database_url`: the server's certificate did not verify"),
        "{err}"
    );
    assert!(err.contains("UnknownIssuer"), "{err}");
}

#[tokio::test]
async fn verify_ca_accepts_a_host_name_the_certificate_does_not_name_and_verify_full_refuses_it() {
    let server = server().await;
    let db = server.database("postgres").await;
    // Reached as db.invalid at 127.0.0.1: the certificate names neither.
    let url = |mode: &str, ca: &str| {
        format!(
            "host=db.invalid hostaddr=127.0.0.1 port={} user=postgres dbname={db} \
             sslmode={mode} sslrootcert={ca}",
            server.pg.port
        )
    };
    let upstream = FakeUpstream::echo().await;
    let gateway = server
        .gateway(&url("verify-ca", "ca.pem"), &upstream.url())
        .start()
        .await;
    runs_a_keyed_request(&gateway, &upstream).await;

    let err = server
        .gateway(&url("verify-full", "ca.pem"), "http://unused")
        .start_and_fail()
        .await;
    assert!(
        err.contains("`database_url`: the server's certificate did not verify"),
        "{err}"
    );
    assert!(err.contains("not valid for name \"db.invalid\""), "{err}");

    // verify-ca still checks the chain.
    let err = server
        .gateway(&url("verify-ca", "other-ca.pem"), "http://unused")
        .start_and_fail()
        .await;
    assert!(err.contains("UnknownIssuer"), "{err}");
}

#[tokio::test]
async fn ssl_cert_file_and_ssl_cert_dir_name_the_ca_for_verify_full() {
    let server = server().await;
    let url = server.url(&server.database("postgres").await, "sslmode=verify-full");
    for (var, path) in [
        ("SSL_CERT_FILE", server.file("ca.pem")),
        ("SSL_CERT_DIR", server.certs.path().to_owned()),
    ] {
        let url = server.url(&server.database("postgres").await, "sslmode=verify-full");
        let upstream = FakeUpstream::echo().await;
        let gateway = server
            .gateway(&url, &upstream.url())
            .env(var, path.to_str().unwrap())
            .start()
            .await;
        runs_a_keyed_request(&gateway, &upstream).await;
    }
    // The system's roots alone do not know the test's CA.
    let err = server
        .gateway(&url, "http://unused")
        .env(
            "SSL_CERT_FILE",
            server.file("other-ca.pem").to_str().unwrap(),
        )
        .start_and_fail()
        .await;
    assert!(err.contains("did not verify"), "{err}");
}

#[tokio::test]
async fn a_client_certificate_is_accepted_when_given_and_refused_when_not() {
    let server = server().await;
    let db = server.database("certuser").await;
    let url = |client: &str| {
        format!(
            "postgres://certuser@127.0.0.1:{}/{db}?sslmode=verify-full&sslrootcert=ca.pem{client}",
            server.pg.port
        )
    };
    let upstream = FakeUpstream::echo().await;
    let gateway = server
        .gateway(
            &url("&sslcert=client.pem&sslkey=client.key"),
            &upstream.url(),
        )
        .start()
        .await;
    runs_a_keyed_request(&gateway, &upstream).await;

    let err = server
        .gateway(&url(""), "http://unused")
        .start_and_fail()
        .await;
    assert!(
        err.contains("`database_url`: the server refused the connection"),
        "{err}"
    );
    assert!(
        err.contains("requires a valid client certificate"),
        "the server's own words: {err}"
    );
}

#[tokio::test]
async fn each_url_is_checked_with_its_own_settings_at_start_up() {
    let server = server().await;
    let db = server.database("postgres").await;
    let good = server.url(&db, "sslmode=verify-full&sslrootcert=ca.pem");
    let bad = server.url(&db, "sslmode=verify-full&sslrootcert=other-ca.pem");
    // Migrations and LISTEN go over database_direct_url.
    let err = server
        .gateway(&good, "http://unused")
        .set("database_direct_url", &format!("{bad:?}"))
        .start_and_fail()
        .await;
    assert!(
        err.contains("`database_direct_url`: the server's certificate"),
        "{err}"
    );
    // The pool, over database_url, is tried at start-up too.
    let err = server
        .gateway(&bad, "http://unused")
        .set("database_direct_url", &format!("{good:?}"))
        .start_and_fail()
        .await;
    assert!(
        err.contains("`database_url`: the server's certificate"),
        "{err}"
    );
}

#[tokio::test]
async fn prefer_and_require_encrypt_without_checking_and_require_says_so() {
    let server = server().await;
    for query in ["application_name=prefer-by-default", "sslmode=require"] {
        let db = server.database("postgres").await;
        let logs = tempfile::NamedTempFile::new().unwrap();
        let upstream = FakeUpstream::echo().await;
        let gateway = server
            .gateway(&server.url(&db, query), &upstream.url())
            .stderr_to(logs.path())
            .start()
            .await;
        runs_a_keyed_request(&gateway, &upstream).await;
        drop(gateway);
        let logged = std::fs::read_to_string(logs.path()).unwrap();
        assert_eq!(
            logged.contains("NOT verified"),
            query == "sslmode=require",
            "require (asked for by the operator) warns that it proves nothing: {logged}"
        );
    }
}

/// The TLS URL of the example config file, as `docs/stores.md` shows it too.
fn documented_url() -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let example = std::fs::read_to_string(root.join("config/idemgate.example.toml")).unwrap();
    let line = example
        .lines()
        .find(|l| l.starts_with("# database_url = ") && l.contains("sslmode=verify-full"))
        .expect("the example file shows a verify-full database_url");
    let url = line
        .trim_start_matches("# database_url = ")
        .trim_matches('"')
        .to_owned();
    assert_eq!(
        crate::support::docs::block("postgres-tls-url").trim_end(),
        url,
        "docs/stores.md shows the example file's URL"
    );
    url
}

#[tokio::test]
async fn the_documented_url_runs_as_written_with_only_the_place_swapped() {
    let server = server().await;
    let db = server.database("postgres").await;
    let written = documented_url();
    let url = written
        .replace(
            "idemgate@db.example.com:5432/idemgate",
            &format!("postgres@127.0.0.1:{}/{db}", server.pg.port),
        )
        .replace(
            "/etc/idemgate-tls/postgres/ca.pem",
            server.file("ca.pem").to_str().unwrap(),
        );
    assert_eq!(url.matches(&db).count(), 1, "{written}");
    assert!(
        url.contains(server.files.path().to_str().unwrap()),
        "{written}"
    );
    let upstream = FakeUpstream::echo().await;
    let gateway = server.gateway(&url, &upstream.url()).start().await;
    runs_a_keyed_request(&gateway, &upstream).await;
}

/// Against a server without TLS: `prefer` (libpq's default) goes on in
/// plaintext, as libpq does; `require` and the verify modes refuse to.
#[tokio::test]
async fn without_tls_at_the_server_prefer_goes_on_in_plaintext_and_verify_full_stops() {
    let tls = server().await;
    let plain = ThrowawayPostgres::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = tls.gateway(&plain.url(), &upstream.url()).start().await;
    runs_a_keyed_request(&gateway, &upstream).await;
    let ssl: Vec<bool> = plain
        .socket_client()
        .await
        .query(
            "SELECT s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.application_name = 'idemgate'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(!ssl.is_empty() && ssl.iter().all(|s| !s), "{ssl:?}");

    for mode in ["require", "verify-full&sslrootcert=ca.pem"] {
        let url = format!("{}?sslmode={mode}", plain.url());
        let err = tls.gateway(&url, "http://unused").start_and_fail().await;
        assert!(
            err.contains("`database_url`: the server does not offer TLS"),
            "{mode}: {err}"
        );
    }
}
