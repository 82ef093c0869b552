//! Fingerprints that cannot be fooled (issue 22), on a route with
//! `canonical_json`: a body naming a JSON member twice is refused with
//! `400 …/ambiguous-json` (parsers disagree on which one counts, so two
//! bodies an upstream reads differently could share a fingerprint), and
//! numbers keep the text they were written with.

use crate::support::deployment::Deployment;
use crate::support::{post, FakeUpstream};

const CANONICAL_ROUTE: &str =
    "[[routes]]\nname = \"charges\"\npath_prefix = \"/v1/charges\"\ncanonical_json = true\n";

async fn a_member_named_twice_is_refused_and_creates_nothing(env: Deployment) {
    let upstream = FakeUpstream::echo().await;
    let gateway = env
        .gateway(&upstream.url())
        .tables(CANONICAL_ROUTE)
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    for (body, pointer) in [
        (r#"{"amount":1,"to":"x","amount":1000}"#, "/amount"),
        (r#"{"amount":1,"\u0061mount":1}"#, "/amount"),
        (
            r#"{"items":[{"sku":"a"},{"sku":"a","sku":"b"}]}"#,
            "/items/1/sku",
        ),
    ] {
        let reply = post(&url, "twice", body).await;
        assert_eq!(reply.status, 400, "{body}");
        assert_eq!(reply.problem(), "ambiguous-json");
        let detail = reply.json()["detail"].as_str().unwrap().to_owned();
        assert!(
            detail.contains(pointer) && detail.contains("send each member"),
            "{detail}"
        );
        assert_eq!(reply.job(), None);
    }
    assert_eq!(upstream.hits(), 0, "nothing forwarded");
    assert_eq!(env.store.job_count().await, 0, "nothing stored");

    // The key was not taken: the body sent right goes through.
    let reply = post(&url, "twice", r#"{"amount":1000,"to":"x"}"#).await;
    assert_eq!(reply.status, 200);
    assert_eq!(upstream.hits(), 1);
    // A route that hashes raw bytes merges nothing, so it refuses nothing.
    let raw = post(&gateway.path("/v1/other"), "raw", r#"{"a":1,"a":2}"#).await;
    assert_eq!(raw.status, 200);
}

async fn numbers_are_the_text_the_client_wrote(env: Deployment) {
    let upstream = FakeUpstream::echo().await;
    let gateway = env
        .gateway(&upstream.url())
        .tables(CANONICAL_ROUTE)
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    for (key, first, other) in [
        ("past-f64", "1.00000000000000001", "1"),
        ("exponent", "1e2", "100"),
        ("decimal", "1.0", "1"),
    ] {
        let sent = post(&url, key, &format!(r#"{{"amount":{first},"to":"x"}}"#)).await;
        assert_eq!(sent.status, 200);
        // The same text, another key order and spacing: the same intent.
        let again = post(&url, key, &format!(r#"{{ "to": "x", "amount": {first} }}"#)).await;
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{key}");
        let mismatch = post(&url, key, &format!(r#"{{"amount":{other},"to":"x"}}"#)).await;
        assert_eq!(mismatch.status, 409, "{first} and {other} are two intents");
        assert_eq!(mismatch.problem(), "idempotency-key-mismatch");
        // No retry can win it: the SDKs that retry a 409 are told not to.
        assert_eq!(mismatch.header("x-should-retry"), Some("false"));
    }
    assert_eq!(upstream.hits(), 3, "one execution per key");
}

crate::on_each_deployment!(
    [embedded, postgres_redis]
    a_member_named_twice_is_refused_and_creates_nothing,
    numbers_are_the_text_the_client_wrote,
);
