//! `idemgate check`: the whole configuration read and validated without
//! connecting to anything; what it would run with printed, secrets left
//! out; the first bad key named, exit 2.

use std::time::{Duration, Instant};

use crate::support::{Gateway, TestStore};

/// A port with nothing listening on it.
async fn closed_port() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
}

#[tokio::test]
async fn a_valid_configuration_is_summarised_without_connecting_and_without_its_secrets() {
    let (pg, redis) = (closed_port().await, closed_port().await);
    let store = TestStore::external(format!(
        "postgres://idemgate:s3cret-password@127.0.0.1:{pg}/payments"
    ));
    let started = Instant::now();
    let out = Gateway::builder(&store, "http://127.0.0.1:1")
        .set("redis_url", &format!("\"redis://:redis-s3cret@127.0.0.1:{redis}/0\""))
        .set("attempt_deadline", "\"7m\"")
        .set("keepalive_timeout", "\"90s\"")
        .tables(
            "[[routes]]\nname = \"charges\"\npath_prefix = \"/v1/charges\"\nmethods = [\"POST\"]\nmax_attempts = 3\n",
        )
        .run("check")
        .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // Nothing listens on either port: a check that connected would fail
    // or wait out its timeouts.
    assert!(started.elapsed() < Duration::from_secs(10));
    for line in [
        "store = postgres database payments as idemgate on 127.0.0.1",
        &format!("redis = node 127.0.0.1:{redis} (plaintext)"),
        "route.charges = POST /v1/charges",
        "max_attempts 3",
        "attempt_deadline = 7m",
        // The drain lasts as long as the longest attempt may (§12).
        "shutdown_grace = 7m",
        "keepalive_timeout = 1m 30s",
        "admin_api = on",
        "replay_key = given",
        "configuration ok",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in:\n{stdout}");
    }
    for secret in ["s3cret-password", "redis-s3cret", "test-admin-token"] {
        assert!(!stdout.contains(secret), "{secret} printed:\n{stdout}");
    }
}

#[tokio::test]
async fn the_embedded_store_and_its_secrets_are_not_made_by_a_check() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gateway.db");
    let store = TestStore::embedded();
    let out = Gateway::builder(&store, "http://127.0.0.1:1")
        .set("embedded_path", &format!("{:?}", db.display().to_string()))
        .env("IDEMGATE_OWNER_SALT", "")
        .run("check")
        .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!("store = embedded {}", db.display())),
        "{stdout}"
    );
    assert!(stdout.contains("owner_salt = made in"), "{stdout}");
    let made: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(made.is_empty(), "a check wrote {made:?}");

    // A salt file that is there and broken is named now, not at start-up.
    let salt = dir.path().join("gateway.db.owner-salt");
    std::fs::write(&salt, "not base64 !!").unwrap();
    let out = Gateway::builder(&store, "http://127.0.0.1:1")
        .set("embedded_path", &format!("{:?}", db.display().to_string()))
        .env("IDEMGATE_OWNER_SALT", "")
        .run("check")
        .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(&salt.display().to_string()), "{stderr}");
}

#[tokio::test]
async fn a_bad_key_is_named_with_its_fix_and_exits_2() {
    let store = TestStore::embedded();
    let cases: [(&str, &str, &str); 4] = [
        ("upstream_timout", "\"1s\"", "upstream_timout"),
        ("keepalive_timeout", "\"0s\"", "keepalive_timeout"),
        ("database_pool_size", "32.0", "database_pool_size"),
        ("attempt_deadline", "\"1s\"", "attempt_deadline"),
    ];
    for (key, value, named) in cases {
        let out = Gateway::builder(&store, "http://127.0.0.1:1")
            .set(key, value)
            .run("check")
            .await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{key} = {value}: {stderr}");
        assert!(stderr.contains(named), "{key} = {value}: {stderr}");
        assert!(out.stdout.is_empty(), "nothing summarised for a bad config");
        if value == "32.0" {
            assert!(stderr.contains("whole number"), "the fix: {stderr}");
        }
    }
    // A credential the config reads from the environment must be there.
    let out = Gateway::builder(&store, "http://127.0.0.1:1")
        .unset("upstreams")
        .tables(
            "[[upstreams]]\nname = \"provider\"\nurl = \"http://127.0.0.1:1\"\n\
             [upstreams.headers]\nauthorization = { env = \"IDEMGATE_TEST_NEVER_SET\", prefix = \"Bearer \" }\n",
        )
        .run("check")
        .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("IDEMGATE_TEST_NEVER_SET"), "{stderr}");
}
