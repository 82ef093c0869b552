//! Fingerprints that cannot be fooled (issue 22), on a route with
//! `canonical_json`: a body naming a JSON member twice is refused with
//! `400 …/ambiguous-json` (parsers disagree on which one counts, so two
//! bodies an upstream reads differently could share a fingerprint), and
//! numbers keep the text they were written with.

use crate::support::deployment::Deployment;
use http::Method;

use crate::support::{post, send, FakeUpstream};

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

/// An item `ignore_fields` names is left out in its place: a chat whose
/// first message is ignored is still another request than one with no
/// messages, or one whose last message differs (before, the item was
/// taken out, `[x]` hashed as `[]`, and a second pointer into the array
/// named the item after the one it was written for).
async fn an_ignored_item_keeps_its_place(env: Deployment) {
    let upstream = FakeUpstream::echo().await;
    let route = "[[routes]]\npath_prefix = \"/v1/chat\"\nignore_fields = [\"/m/0\", \"/m/1\"]\n";
    let gateway = env.gateway(&upstream.url()).tables(route).start().await;
    let url = gateway.path("/v1/chat");
    let chat = |t: u32, ask: &str| format!(r#"{{"m":["sys t={t}","terse","{ask}"]}}"#);
    assert_eq!(
        post(&url, "c", &chat(1, "refund order 1")).await.status,
        200
    );
    let retry = post(&url, "c", &chat(2, "refund order 1")).await;
    assert_eq!(
        retry.header("idempotent-replayed"),
        Some("true"),
        "the ignored items changed"
    );
    let other = post(&url, "c", &chat(2, "refund order 2")).await;
    assert_eq!(
        other.problem(),
        "idempotency-key-mismatch",
        "the ask changed"
    );
    assert_eq!(post(&url, "one", r#"{"m":[5]}"#).await.status, 200);
    let none = post(&url, "one", r#"{"m":[]}"#).await;
    assert_eq!(none.problem(), "idempotency-key-mismatch");
    assert_eq!(upstream.hits(), 2);
}

/// A header that tells a route's requests apart, sent spelled with `_`
/// (which an upstream behind CGI reads as the header, and another does
/// not), is refused before anything is read or stored: it would hash as
/// absent, so two versions of a request would be one.
async fn a_significant_header_spelled_another_way_is_refused(env: Deployment) {
    let upstream = FakeUpstream::echo().await;
    let route = "[[routes]]\npath_prefix = \"/v1\"\nsignificant_headers = [\"content-type\", \"x-api-version\"]\n";
    let gateway = env.gateway(&upstream.url()).tables(route).start().await;
    let url = gateway.path("/v1/charges");
    let spelled = [("idempotency-key", "v"), ("X_Api_Version", "2024-06-01")];
    let reply = send(Method::POST, &url, &spelled, "{}").await;
    assert_eq!(
        (reply.status, reply.problem()),
        (400, "ambiguous-header".to_owned())
    );
    let detail = reply.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("send it as `x-api-version`"), "{detail}");
    assert_eq!(upstream.hits(), 0);
    assert_eq!(env.store.job_count().await, 0, "nothing stored");
    let plain = [("idempotency-key", "v"), ("x-api-version", "2024-06-01")];
    assert_eq!(send(Method::POST, &url, &plain, "{}").await.status, 200);
}

/// The same bytes sent encoded and not are two requests to the upstream,
/// and two here, though the route does not list `Content-Encoding`.
async fn a_body_encoded_is_another_request(env: Deployment) {
    let upstream = FakeUpstream::echo().await;
    let gateway = env.gateway(&upstream.url()).start().await;
    let url = gateway.path("/v1/charges");
    let gzip = [("idempotency-key", "enc"), ("content-encoding", "gzip")];
    let bytes = "\u{1f}\u{8b}";
    assert_eq!(send(Method::POST, &url, &gzip, bytes).await.status, 200);
    let again = send(Method::POST, &url, &gzip, bytes).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    let plain = send(Method::POST, &url, &[("idempotency-key", "enc")], bytes).await;
    assert_eq!(plain.problem(), "idempotency-key-mismatch");
    assert_eq!(upstream.hits(), 1);
}

crate::on_each_deployment!(
    [embedded, postgres_redis]
    an_ignored_item_keeps_its_place,
    a_significant_header_spelled_another_way_is_refused,
    a_body_encoded_is_another_request,
    a_member_named_twice_is_refused_and_creates_nothing,
    numbers_are_the_text_the_client_wrote,
);
