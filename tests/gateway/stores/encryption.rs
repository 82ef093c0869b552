//! Responses at rest: sealed in the database and in Redis when keys are
//! configured, keys rotate, and nothing secret reaches the logs.

use std::time::Duration;

use http::Method;

use crate::support::{eventually, post, send, FakeUpstream, Gateway, TestStore, ThrowawayRedis};

const KEY_A: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
const KEY_B: &str = "ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8=";
const MARKER: &str = "BODY-MARKER-7f3a";

fn keys(active: &str, ids: &[&str]) -> String {
    let mut toml = format!("[encryption]\nactive = \"{active}\"\n");
    for id in ids {
        toml.push_str(&format!(
            "[[encryption.keys]]\nid = \"{id}\"\nenv = \"IDEMGATE_TEST_KEY_{}\"\n",
            id.to_uppercase()
        ));
    }
    toml
}

fn sealed(
    builder: crate::support::gateway::Builder,
    active: &str,
    ids: &[&str],
) -> crate::support::gateway::Builder {
    builder
        .tables(&keys(active, ids))
        .env("IDEMGATE_TEST_KEY_A", KEY_A)
        .env("IDEMGATE_TEST_KEY_B", KEY_B)
}

fn holds(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

#[tokio::test]
async fn the_database_and_redis_hold_no_plaintext_response() {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = sealed(
        Gateway::builder(&store, &upstream.url()).set("redis_url", &format!("{:?}", redis.url())),
        "a",
        &["a"],
    )
    .start()
    .await;
    let url = gateway.path("/v1/charges");
    let body = format!("{{\"secret\":\"{MARKER}\"}}");
    let first = post(&url, "sealed-1", &body).await;
    assert_eq!(first.status, 200);
    assert!(
        holds(&first.body, MARKER),
        "the client gets the answer in the clear"
    );

    let TestStore::Postgres(db) = &store else {
        unreachable!()
    };
    let row = db
        .connect()
        .await
        .query_one(
            "SELECT response_body, array_to_string(response_header_names, ','), \
                    response_header_values FROM jobs",
            &[],
        )
        .await
        .unwrap();
    let (stored_body, names, values): (Vec<u8>, String, Vec<Vec<u8>>) =
        (row.get(0), row.get(1), row.get(2));
    assert!(
        !holds(&stored_body, MARKER),
        "no plaintext body in PostgreSQL"
    );
    assert_eq!(names, ":sealed", "no header names either");
    assert_eq!(values, vec![b"a".to_vec()], "only the key id");

    let (owner, key) = (
        idemgate_domain::key::Owner::anonymous(),
        idemgate_domain::key::IdempotencyKey::new("sealed-1").unwrap(),
    );
    let binding = idemgate_store::fastpath::Binding::of(&owner, &key);
    let redis_key = idemgate_store::fastpath::redis_key("idemgate:", &binding, &owner, &key);
    eventually(Duration::from_secs(5), "the fast-path entry", || async {
        redis.get(&redis_key).await.is_some()
    })
    .await;
    let cached = redis.get(&redis_key).await.unwrap();
    assert!(!holds(&cached, MARKER), "no plaintext body in Redis");
    assert!(
        !holds(&cached, "application/json"),
        "no plaintext headers in Redis"
    );

    // Replays (from Redis, then from the database) open it again.
    let replay = post(&url, "sealed-1", &body).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body);
    redis.flush().await;
    let from_store = post(&url, "sealed-1", &body).await;
    assert_eq!(from_store.body, first.body);
    let job = gateway.job(&first.job().unwrap()).await;
    assert!(
        job["response"]["body"].as_str().unwrap().contains(MARKER),
        "the operator sees it"
    );
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn keys_rotate_and_a_missing_key_is_an_explained_error() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let body = format!("{{\"secret\":\"{MARKER}\"}}");

    let mut old = sealed(Gateway::builder(&store, &upstream.url()), "a", &["a"])
        .start()
        .await;
    let first = post(&old.path("/v1/charges"), "rotate-1", &body).await;
    assert_eq!(first.status, 200);
    old.kill().await;

    // The new key seals; the old one still opens what it sealed.
    let mut rotated = sealed(Gateway::builder(&store, &upstream.url()), "b", &["b", "a"])
        .start()
        .await;
    let replay = post(&rotated.path("/v1/charges"), "rotate-1", &body).await;
    assert_eq!(replay.body, first.body);
    let second = post(&rotated.path("/v1/charges"), "rotate-2", &body).await;
    assert_eq!(second.status, 200);
    let ids = store
        .column("SELECT key || ' ' || hex(response_headers) FROM jobs ORDER BY key")
        .await;
    let sealed_with = |row: &str| {
        let hex = row.split(' ').nth(1).unwrap();
        // ":sealed" then the key id, length-prefixed.
        hex.ends_with(&format!("00000001{}", hex::encode_upper("a")))
            || hex.ends_with(&format!("00000001{}", hex::encode_upper("b")))
    };
    assert!(ids.iter().all(|r| sealed_with(r)), "{ids:?}");
    assert!(
        ids[0].ends_with(&hex::encode_upper("a")) && ids[1].ends_with(&hex::encode_upper("b")),
        "{ids:?}"
    );
    rotated.kill().await;

    // Without the old key its responses cannot be opened: a problem answer
    // that says so, never a wrong or garbled replay.
    let missing = sealed(Gateway::builder(&store, &upstream.url()), "b", &["b"])
        .start()
        .await;
    let lost = post(&missing.path("/v1/charges"), "rotate-1", &body).await;
    assert_eq!(lost.status, 500);
    assert_eq!(lost.problem(), "internal-error");
    assert_eq!(upstream.hits(), 2, "never executed again");
}

#[tokio::test]
async fn bodies_credentials_and_keys_never_reach_the_logs() {
    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let logs = tempfile::NamedTempFile::new().unwrap();
    let gateway = sealed(
        Gateway::builder(&store, &upstream.url())
            .set("redis_url", &format!("{:?}", redis.url()))
            .unset("upstreams")
            .tables(&format!(
                "[[upstreams]]\nname = \"provider\"\nurl = {:?}\n\
                 [upstreams.headers]\nx-api-key = {{ env = \"PROVIDER_KEY\" }}\n\
                 [[clients]]\nname = \"app\"\nkey_sha256 = {{ value = {:?} }}\n\
                 [[routes]]\npath_prefix = \"/v1\"\nrequire_client = true\n",
                upstream.url(),
                crate::support::sha256_hex("AUTH-SECRET-55d1"),
            ))
            .env("PROVIDER_KEY", "PROVIDER-SECRET-91c2")
            .env("RUST_LOG", "debug")
            .stderr_to(logs.path()),
        "a",
        &["a"],
    )
    .start()
    .await;
    let url = gateway.path("/v1/charges");
    let auth = "Bearer AUTH-SECRET-55d1";
    let body = format!("{{\"secret\":\"{MARKER}\"}}");
    let headers = [
        ("idempotency-key", "logged-1"),
        ("content-type", "application/json"),
        ("authorization", auth),
    ];
    for _ in 0..2 {
        let reply = send(Method::POST, &url, &headers, body.clone()).await;
        assert_eq!(reply.status, 200);
    }
    let mismatch = send(Method::POST, &url, &headers, "{\"other\":1}").await;
    assert_eq!(mismatch.status, 409);
    let job = gateway.job(&mismatch.job().unwrap()).await;
    assert_eq!(job["state"], "completed");
    let text = std::fs::read_to_string(logs.path()).unwrap();
    assert!(text.contains("DEBUG"), "a debug-level run was logged");
    for secret in [
        MARKER,
        "AUTH-SECRET",
        "PROVIDER-SECRET",
        KEY_A,
        crate::support::gateway::ADMIN_TOKEN,
    ] {
        assert!(!text.contains(secret), "{secret} appears in the logs");
    }
}
