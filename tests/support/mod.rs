//! Test harness: per-test databases, a scriptable fake upstream, the real
//! gateway binary on OS-assigned ports, and a small HTTP client.

#![allow(dead_code)]

pub mod browser;
pub mod chart;
pub mod chat;
pub mod db;
pub mod deployment;
pub mod docs;
pub mod entries;
pub mod gateway;
pub mod h2;
pub mod mcp;
pub mod otlp;
pub mod pki;
pub mod postgres;
pub mod postgres_tls;
pub mod process;
pub mod promql;
pub mod python;
pub mod redis;
pub mod redis_cluster;
pub mod redis_tls;
pub mod reply_cutter;
pub mod scripted_sse;
pub mod sink;
pub mod sse;
pub mod store;
pub mod upstream;

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

pub use db::TestDb;
pub use gateway::Gateway;
pub use redis::ThrowawayRedis;
pub use store::TestStore;
// Not every test binary uses every re-export.
#[allow(unused_imports)]
pub use upstream::{FakeUpstream, Gate};

/// An answer, fully read.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    /// The problem type's slug, asserting the answer is problem+json.
    pub fn problem(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "expected a problem answer, got {} {:?}",
            self.status,
            String::from_utf8_lossy(&self.body)
        );
        let ty = self.json()["type"].as_str().unwrap().to_owned();
        ty.rsplit('/').next().unwrap().to_owned()
    }

    /// The `detail` of a problem answer.
    pub fn problem_detail(&self) -> String {
        self.problem();
        self.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    pub fn job(&self) -> Option<String> {
        self.header("idempotency-job").map(str::to_owned)
    }
}

/// A fresh client (each test has its own runtime, so no shared pool).
pub fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Sends one request and reads the whole answer (10 s at most).
pub async fn send(
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Reply {
    let mut req = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req.body(Full::new(body.into())).unwrap();
    let fut = async {
        let response = client().request(req).await.expect("request failed");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("body failed").to_bytes();
        Reply {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body,
        }
    };
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .unwrap_or_else(|_| panic!("no answer from {url} within 20 s"))
}

/// POST with an idempotency key.
pub async fn post(url: &str, key: &str, body: &str) -> Reply {
    send(
        Method::POST,
        url,
        &[
            ("idempotency-key", key),
            ("content-type", "application/json"),
        ],
        body.to_owned(),
    )
    .await
}

/// Starts a keyed JSON POST and leaves it running; resolves to the status,
/// or an error when the connection dies (as when the gateway is killed).
pub fn post_detached(
    url: String,
    key: &'static str,
) -> tokio::task::JoinHandle<Result<http::StatusCode, hyper_util::client::legacy::Error>> {
    tokio::spawn(async move {
        let req = Request::post(url)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        client().request(req).await.map(|r| r.status())
    })
}

/// A keyed POST of `key` to `path` on `a`, held at `upstream` (which the
/// test gates), and the same request sent to `b` and held there on the
/// running job (`b`'s held-requests gauge at 1, 20 s at most). Each handle
/// resolves to its answer once the test lets the upstream answer.
pub async fn held_on_the_other_replica(
    a: &Gateway,
    b: &Gateway,
    upstream: &FakeUpstream,
    path: &str,
    key: &str,
) -> (
    tokio::task::JoinHandle<Reply>,
    tokio::task::JoinHandle<Reply>,
) {
    let send_to = |gateway: &Gateway| {
        let (url, key) = (gateway.path(path), key.to_owned());
        tokio::spawn(async move { post(&url, &key, "{}").await })
    };
    let first = send_to(a);
    upstream.arrival().await;
    let held = send_to(b);
    eventually(
        Duration::from_secs(20),
        "the duplicate to be held on b",
        || async { b.metric("idemgate_held_requests").await == 1.0 },
    )
    .await;
    (first, held)
}

/// Waits until `check` holds, re-checking every 20 ms, for at most `limit`.
/// For conditions only observable from outside (a state in the store, a
/// gauge), never as a stand-in for ordering that a barrier can give.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if check().await {
            return;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {limit:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The SHA-256 of a client key, in hex: what `[[clients]] key_sha256` holds.
pub fn sha256_hex(key: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(key.as_bytes()))
}
