//! Keys a proxy could split (issue 22): a bare key with a comma may be two
//! header lines joined by an intermediary, and two lines on one request are
//! two keys; both are refused with `400 …/invalid-idempotency-key`, nothing
//! stored, nothing forwarded. The structured-field form `"a,b"` is one key.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::deployment::Deployment;
use crate::support::{post, FakeUpstream, Gateway};

/// A raw answer: status and body, the connection read until closed.
struct RawReply {
    status: u16,
    head: String,
    body: serde_json::Value,
}

/// Sends `request` as written (no client library to merge or reorder its
/// header lines) and reads the answer.
async fn raw(gateway: &Gateway, request: &str) -> RawReply {
    let authority = gateway.url.trim_start_matches("http://");
    let mut stream = TcpStream::connect(authority).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out))
        .await
        .expect("the gateway answered and closed within 10 s")
        .unwrap();
    let text = String::from_utf8(out).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
    RawReply {
        status: head[9..12].parse().unwrap(),
        head: head.to_ascii_lowercase(),
        body: serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body:?}")),
    }
}

fn keyed_post(key_lines: &[&str]) -> String {
    let keys: String = key_lines
        .iter()
        .map(|k| format!("idempotency-key: {k}\r\n"))
        .collect();
    format!(
        "POST /v1/charges HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{keys}\
         content-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}"
    )
}

/// Asserts a `400 …/invalid-idempotency-key` whose detail says `says`.
fn assert_refused(reply: &RawReply, says: &str) {
    assert_eq!(reply.status, 400, "{:?}", reply.body);
    assert!(reply
        .head
        .contains("content-type: application/problem+json"));
    assert!(
        reply.head.contains("x-should-retry: false"),
        "{}",
        reply.head
    );
    assert_eq!(
        reply.body["type"],
        "https://idemgate.dev/problems/invalid-idempotency-key"
    );
    let detail = reply.body["detail"].as_str().unwrap();
    assert!(detail.contains(says), "{detail}");
}

async fn a_bare_key_with_a_comma_is_refused_and_the_quoted_form_is_one_key(env: Deployment) {
    let upstream = FakeUpstream::echo().await;
    let gateway = env.gateway(&upstream.url()).start().await;
    // What a proxy makes of two lines `a` and `b`, or a client's own `a,b`.
    for joined in ["a,b", "a, b", "order-42,order-42"] {
        let reply = raw(&gateway, &keyed_post(&[joined])).await;
        assert_refused(&reply, r#"Idempotency-Key: "a,b""#);
    }
    assert_eq!(upstream.hits(), 0, "nothing forwarded");
    assert_eq!(env.store.job_count().await, 0, "nothing stored");

    let url = gateway.path("/v1/charges");
    let first = post(&url, r#""a,b""#, "{}").await;
    let again = post(&url, r#""a,b""#, "{}").await;
    assert_eq!(first.status, 200);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(first.job(), again.job());
    assert_eq!(upstream.hits(), 1);
    let stored = env.store.column("SELECT key FROM jobs").await;
    assert_eq!(stored, ["a,b"], "one key, the comma inside it");
}

async fn two_key_lines_on_one_request_are_refused(env: Deployment) {
    let upstream = FakeUpstream::echo().await;
    let gateway = env.gateway(&upstream.url()).start().await;
    for lines in [&["k1", "k2"][..], &["same", "same"], &["\"q\"", "q"]] {
        let reply = raw(&gateway, &keyed_post(lines)).await;
        assert_refused(&reply, "more than once");
    }
    assert_eq!(upstream.hits(), 0, "nothing forwarded");
    assert_eq!(env.store.job_count().await, 0, "nothing stored");
    // One line of the same key goes through.
    let reply = raw(&gateway, &keyed_post(&["k1"])).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(upstream.hits(), 1);
}

crate::on_each_deployment!(
    [embedded, postgres_redis]
    a_bare_key_with_a_comma_is_refused_and_the_quoted_form_is_one_key,
    two_key_lines_on_one_request_are_refused,
);
