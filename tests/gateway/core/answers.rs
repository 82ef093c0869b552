//! Keyed answers: replays faithful to what the upstream sent, mismatches,
//! owners kept apart, malformed or missing keys, and bodies past the limit.

use bytes::Bytes;
use http::Method;
use http_body_util::Full;

use crate::support::{post, send, FakeUpstream, Gateway, TestStore};

async fn replay_is_faithful_to_status_end_to_end_headers_and_body_bytes(store: TestStore) {
    let upstream = FakeUpstream::start(|_| async move {
        http::Response::builder()
            .status(202)
            .header("content-type", "application/octet-stream")
            .header("x-request-cost", "0.42")
            .header("set-cookie", "a=1")
            .header("set-cookie", "b=2")
            .header("connection", "x-hop-secret")
            .header("x-hop-secret", "never forwarded")
            .header("keep-alive", "timeout=5")
            // The gateway's own answer headers, as an upstream might send
            // them (an idempotent API of its own, a gateway behind this one).
            .header("idempotency-job", "forged-job")
            .header("idempotent-replayed", "true")
            .header("idempotency-events-skipped", "3")
            .body(Full::new(Bytes::from_static(&[
                0, 159, 146, 150, 255, b'\n',
            ])))
            .unwrap()
    })
    .await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let url = gateway.path("/v1/blobs?kind=raw");
    let first = post(&url, "fidelity", "{}").await;
    let replay = post(&url, "fidelity", "{}").await;
    assert_eq!(upstream.hits(), 1);
    for r in [&first, &replay] {
        assert_eq!(r.status, 202);
        assert_eq!(r.body.as_ref(), &[0, 159, 146, 150, 255, b'\n']);
        assert_eq!(r.header("content-type"), Some("application/octet-stream"));
        assert_eq!(r.header("x-request-cost"), Some("0.42"));
        let cookies: Vec<_> = r
            .headers
            .get_all("set-cookie")
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        assert_eq!(cookies, ["a=1", "b=2"]);
        assert!(
            r.headers.get("x-hop-secret").is_none(),
            "headers named in Connection are hop-by-hop"
        );
        assert!(r.headers.get("keep-alive").is_none());
        assert_eq!(r.header("idempotency-events-skipped"), None);
        let jobs = r.headers.get_all("idempotency-job").iter().count();
        assert_eq!(jobs, 1, "one job named: the gateway's");
    }
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(first.job(), replay.job());
    assert_ne!(first.job().as_deref(), Some("forged-job"));
}

/// A stored error is what every retry of its key gets: its replays tell
/// the SDKs that retry on their own not to (`x-should-retry: false`, in
/// place of the upstream's `true`, which spoke of its first sending); the
/// first answer passes the upstream's header on as it came.
async fn a_replayed_error_says_no_retry_can_win(store: TestStore) {
    let upstream = FakeUpstream::start(|_| async move {
        let mut answer =
            crate::support::upstream::json_response(500, serde_json::json!({"error": "boom"}));
        let headers = answer.headers_mut();
        headers.insert("x-should-retry", http::HeaderValue::from_static("true"));
        answer
    })
    .await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let url = gateway.path("/v1/charges");
    let first = post(&url, "kept-error", "{}").await;
    assert_eq!(
        (first.status, first.header("x-should-retry")),
        (500, Some("true"))
    );
    let replay = post(&url, "kept-error", "{}").await;
    assert_eq!(replay.status, 500);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    let said: Vec<_> = replay.headers.get_all("x-should-retry").iter().collect();
    assert_eq!(said, ["false"], "one value, the gateway's");
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.hits(), 1);
}

async fn same_key_with_another_body_or_path_is_a_409_mismatch_and_never_proxied(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let first = post(&gateway.path("/v1/charges"), "reused", r#"{"amount": 1}"#).await;
    assert_eq!(first.status, 200);

    let other_body = post(&gateway.path("/v1/charges"), "reused", r#"{"amount": 2}"#).await;
    assert_eq!(other_body.status, 409);
    assert_eq!(other_body.problem(), "idempotency-key-mismatch");
    assert_eq!(other_body.job(), first.job());

    let other_path = post(&gateway.path("/v1/refunds"), "reused", r#"{"amount": 1}"#).await;
    assert_eq!(other_path.status, 409);
    assert_eq!(other_path.problem(), "idempotency-key-mismatch");

    // A line added to a significant header (an upstream may read the
    // second `Content-Type`) makes another request, not a replay.
    let headers = [
        ("idempotency-key", "reused"),
        ("content-type", "application/json"),
        ("content-type", "application/x-www-form-urlencoded"),
    ];
    let url = gateway.path("/v1/charges");
    let added_line = send(Method::POST, &url, &headers, r#"{"amount": 1}"#).await;
    assert_eq!(added_line.status, 409, "{added_line:?}");
    assert_eq!(added_line.problem(), "idempotency-key-mismatch");
    assert_eq!(upstream.hits(), 1);
}

async fn mismatch_status_can_be_the_ietf_422(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("mismatch_status", "422")
        .start()
        .await;
    post(&gateway.path("/a"), "k", "1").await;
    let reply = post(&gateway.path("/a"), "k", "2").await;
    assert_eq!(reply.status, 422);
    assert_eq!(reply.problem(), "idempotency-key-mismatch");
}

async fn canonical_json_routes_ignore_key_order_and_excluded_fields(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .tables("[[routes]]\nname = \"chat\"\npath_prefix = \"/v1/chat\"\ncanonical_json = true\nignore_fields = [\"/metadata/sent_at\"]\n")
        .start()
        .await;
    let url = gateway.path("/v1/chat/completions");
    let a = post(
        &url,
        "canon",
        r#"{"model":"m","metadata":{"sent_at":1},"temperature":0}"#,
    )
    .await;
    let b = post(
        &url,
        "canon",
        r#"{ "temperature": 0, "metadata": {"sent_at": 2}, "model": "m" }"#,
    )
    .await;
    assert_eq!(a.status, 200);
    assert_eq!(b.status, 200);
    assert_eq!(b.header("idempotent-replayed"), Some("true"));
    let c = post(
        &url,
        "canon",
        r#"{"model":"other","metadata":{"sent_at":1},"temperature":0}"#,
    )
    .await;
    assert_eq!(c.status, 409);
    assert_eq!(upstream.hits(), 1);
}

async fn owners_are_isolated_and_stored_only_as_hashes(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let url = gateway.path("/v1/charges");
    let as_alice = |key: &'static str| {
        let url = url.clone();
        async move {
            send(
                Method::POST,
                &url,
                &[
                    ("idempotency-key", key),
                    ("authorization", "Bearer alice-secret"),
                ],
                "{}",
            )
            .await
        }
    };
    let alice = as_alice("shared-key").await;
    let bob = send(
        Method::POST,
        &url,
        &[
            ("idempotency-key", "shared-key"),
            ("authorization", "Bearer bob-secret"),
        ],
        "{}",
    )
    .await;
    let anonymous = post(&url, "shared-key", "{}").await;
    assert_eq!(upstream.hits(), 3, "one job per owner");
    assert_ne!(alice.job(), bob.job());
    assert_ne!(alice.job(), anonymous.job());
    assert_eq!(
        as_alice("shared-key").await.header("idempotent-replayed"),
        Some("true")
    );

    let owners = store.column("SELECT owner FROM jobs").await;
    assert_eq!(owners.len(), 3);
    assert!(owners.iter().all(|o| !o.contains("secret")));
    // Salted digests (HMAC-SHA256 under the deployment's salt), never the
    // plain SHA-256 of the credential, which a guess could be checked against.
    assert_eq!(owners.iter().filter(|o| o.starts_with("hmac:")).count(), 2);
    use sha2::Digest;
    let plain = hex::encode(sha2::Sha256::digest(b"Bearer alice-secret"));
    assert!(owners.iter().all(|o| !o.contains(&plain)));

    // The admin API finds a job by the raw owner value, digesting it itself.
    let found = gateway
        .admin(
            Method::GET,
            "/admin/v1/jobs?owner=Bearer%20alice-secret&key=shared-key",
            "",
        )
        .await;
    assert_eq!(found.status, 200);
    assert_eq!(found.json()["id"].as_str(), alice.job().as_deref());
}

async fn malformed_keys_are_refused_with_400_and_never_proxied(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let url = gateway.path("/v1/x");
    let long = "k".repeat(256);
    for key in [
        "",
        "\"\"",
        "has space",
        "\"unterminated",
        "\"a\"b",
        long.as_str(),
    ] {
        let reply = send(Method::POST, &url, &[("idempotency-key", key)], "{}").await;
        assert_eq!(reply.status, 400, "key {key:?}");
        assert_eq!(reply.problem(), "invalid-idempotency-key");
        assert_eq!(reply.job(), None);
    }
    let non_ascii = http::Request::post(&url)
        .header(
            "idempotency-key",
            http::HeaderValue::from_bytes("clé".as_bytes()).unwrap(),
        )
        .body(Full::new(Bytes::new()))
        .unwrap();
    let status = crate::support::client()
        .request(non_ascii)
        .await
        .unwrap()
        .status();
    assert_eq!(status, 400);
    assert_eq!(upstream.hits(), 0);
}

async fn quoted_and_bare_forms_name_the_same_key(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let url = gateway.path("/v1/x");
    let bare = post(&url, "order-7", "{}").await;
    let quoted = post(&url, "\"order-7\"", "{}").await;
    assert_eq!(quoted.header("idempotent-replayed"), Some("true"));
    assert_eq!(bare.job(), quoted.job());
    assert_eq!(upstream.hits(), 1);
}

async fn a_route_that_requires_a_key_refuses_requests_without_one(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .tables(
            "[[routes]]\nname = \"payments\"\npath_prefix = \"/v1/payments\"\nrequire_key = true\n",
        )
        .start()
        .await;
    let refused = send(Method::POST, &gateway.path("/v1/payments"), &[], "{}").await;
    assert_eq!(refused.status, 400);
    assert_eq!(refused.problem(), "idempotency-key-missing");
    assert_eq!(refused.header("x-should-retry"), Some("false"));
    // Outside that route, POST without a key is not opted in: passed through.
    let passed = send(Method::POST, &gateway.path("/v1/other"), &[], "{}").await;
    assert_eq!(passed.status, 200);
    assert_eq!(passed.job(), None);
    assert_eq!(upstream.hits(), 1);
    // The prefix matches whole path segments: `/v1/paymentsx` is another
    // path, not the payments route; `/v1/payments/42` is the route.
    let neighbour = send(Method::POST, &gateway.path("/v1/paymentsx"), &[], "{}").await;
    assert_eq!(neighbour.status, 200, "{:?}", neighbour.body);
    assert_eq!(upstream.hits(), 2);
    let below = send(Method::POST, &gateway.path("/v1/payments/42"), &[], "{}").await;
    assert_eq!(below.status, 400);
    assert_eq!(upstream.hits(), 2);
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> + Send {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

async fn bodies_past_the_limit_get_413_and_nothing_is_stored(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .tables("[[routes]]\nbody_limit = \"1KiB\"\n")
        .start()
        .await;
    let url = gateway.path("/v1/x");
    let big = "x".repeat(2048);
    let declared = post(&url, "big", &big).await;
    assert_eq!(declared.status, 413);
    assert_eq!(declared.problem(), "request-too-large");

    // Without a declared length the limit still holds, mid-stream.
    let (tx, rx) =
        tokio::sync::mpsc::channel::<Result<http_body::Frame<Bytes>, std::convert::Infallible>>(4);
    let body = http_body_util::StreamBody::new(tokio_stream_from(rx));
    let req = http::Request::post(&url)
        .header("idempotency-key", "big-chunked")
        .body(body)
        .unwrap();
    let sender = tokio::spawn(async move {
        for _ in 0..4 {
            if tx
                .send(Ok(http_body::Frame::data(Bytes::from(vec![b'y'; 700]))))
                .await
                .is_err()
            {
                break;
            }
        }
    });
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let status = client.request(req).await.unwrap().status();
    let _ = sender.await;
    assert_eq!(status, 413);

    assert_eq!(upstream.hits(), 0);
    let jobs = store.job_count().await;
    assert_eq!(jobs, 0, "nothing is stored for a refused body");
    let small = post(&url, "big", "small enough").await;
    assert_eq!(
        small.status, 200,
        "the key was not burnt by the refused request"
    );
}

/// An upstream's own `Idempotency-Job`, `Idempotent-Replayed` and
/// `Idempotency-Events-Skipped` never reach a keyed client: not on a
/// streamed first answer (sent as it comes, never rebuilt from what is
/// stored), not on its replay. A request passed through (no key) gets them
/// as the upstream sent them: there its own idempotency speaks.
async fn an_upstreams_own_answer_headers_reach_no_keyed_client(store: TestStore) {
    let upstream = FakeUpstream::start(|r| async move {
        // A retryable status: passed on, never stored.
        let status = if r.path.starts_with("/v1/limited") {
            429
        } else {
            200
        };
        http::Response::builder()
            .status(status)
            .header("content-type", "text/event-stream")
            .header("idempotency-job", "forged-job")
            .header("idempotent-replayed", "true")
            .header("idempotency-events-skipped", "3")
            .body(Full::new(Bytes::from_static(b"data: one\n\n")))
            .unwrap()
    })
    .await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let url = gateway.path("/v1/chat/completions");
    let first = post(&url, "streamed", "{}").await;
    let replay = post(&url, "streamed", "{}").await;
    assert_eq!(upstream.hits(), 1);
    for r in [&first, &replay] {
        assert_eq!(r.body.as_ref(), b"data: one\n\n");
        assert_eq!(r.header("idempotency-events-skipped"), None);
        let jobs = r.headers.get_all("idempotency-job").iter().count();
        assert_eq!(jobs, 1, "one job named: the gateway's");
    }
    assert_ne!(first.job().as_deref(), Some("forged-job"));
    assert_eq!(first.job(), replay.job());
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    // Nor kept, for a replica of an earlier version to replay.
    let stored = "SELECT count(*) FROM jobs WHERE response_status = 200";
    assert_eq!(store.column(stored).await, ["1"], "the answer is stored");
    let kept = match &store {
        TestStore::Embedded(_) => {
            "SELECT count(*) FROM jobs WHERE instr(response_headers, CAST('forged-job' AS BLOB)) > 0"
        }
        _ => "SELECT count(*) FROM jobs WHERE 'idempotency-job' = ANY(response_header_names)",
    };
    assert_eq!(store.column(kept).await, ["0"]);
    let limited = post(&gateway.path("/v1/limited"), "limited", "{}").await;
    assert_eq!(limited.status, 429);
    assert_eq!(limited.header("idempotent-replayed"), None);
    assert_eq!(limited.header("idempotency-events-skipped"), None);
    let jobs: Vec<_> = limited.headers.get_all("idempotency-job").iter().collect();
    assert_eq!(jobs.len(), 1);
    assert_ne!(jobs[0], "forged-job");
    let passed = send(Method::GET, &url, &[], "").await;
    assert_eq!(passed.job().as_deref(), Some("forged-job"));
    assert_eq!(passed.header("idempotent-replayed"), Some("true"));
}

/// An answer's head is stored and replayed with its body: a head past
/// what the gateway reads of an upstream (64 KiB) is no answer to store.
/// The call was made, so its outcome is unknown: nothing is committed,
/// and the retry is not sent again. A head of 20 KiB is stored as ever.
#[tokio::test]
async fn an_answer_whose_head_is_too_large_is_never_stored() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::start(|r| async move {
        let padding = if r.path == "/v1/huge" {
            70 << 10
        } else {
            20 << 10
        };
        http::Response::builder()
            .header("content-type", "application/json")
            .header("x-padding", "a".repeat(padding))
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    })
    .await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let url = gateway.path("/v1/huge");
    let first = post(&url, "huge", "{}").await;
    assert_eq!(first.status, 502, "{:?}", first.body);
    assert_eq!(first.problem(), "upstream-response-too-large");
    let retry = post(&url, "huge", "{}").await;
    assert_ne!(retry.status, 200, "{:?}", retry.body);
    assert_eq!(upstream.hits(), 1, "sent once: its outcome is unknown");
    let stored = "SELECT count(*) FROM jobs WHERE response_status IS NOT NULL";
    assert_eq!(store.column(stored).await, ["0"]);
    let url = gateway.path("/v1/padded");
    let padded = post(&url, "padded", "{}").await;
    let replay = post(&url, "padded", "{}").await;
    for r in [&padded, &replay] {
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-padding").map(str::len), Some(20 << 10));
    }
    assert_eq!(upstream.hits(), 2);
}

crate::on_each_deployment!(
    [embedded, postgres]
    replay_is_faithful_to_status_end_to_end_headers_and_body_bytes,
    an_upstreams_own_answer_headers_reach_no_keyed_client,
    a_replayed_error_says_no_retry_can_win,
    same_key_with_another_body_or_path_is_a_409_mismatch_and_never_proxied,
    mismatch_status_can_be_the_ietf_422,
    canonical_json_routes_ignore_key_order_and_excluded_fields,
    owners_are_isolated_and_stored_only_as_hashes,
    malformed_keys_are_refused_with_400_and_never_proxied,
    quoted_and_bare_forms_name_the_same_key,
    a_route_that_requires_a_key_refuses_requests_without_one,
    bodies_past_the_limit_get_413_and_nothing_is_stored,
);
