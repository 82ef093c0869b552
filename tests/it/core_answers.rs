//! The HTTP contract: replays, mismatches, bad input, pass-through, admin
//! auth, and a store that cannot be reached.

use std::time::Duration;

use bytes::Bytes;
use http::Method;
use http_body_util::Full;

use crate::support::{eventually, post, send, FakeUpstream, Gateway, TestStore};

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
    }
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(first.job(), replay.job());
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

fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> + Send {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

async fn requests_that_do_not_opt_in_pass_through_untouched(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let get = send(
        Method::GET,
        &gateway.path("/v1/models?x=1"),
        &[("idempotency-key", "ignored-on-get")],
        "",
    )
    .await;
    assert_eq!(get.status, 200);
    assert_eq!(get.job(), None, "GET is not opted in, even with a key");
    let put = send(
        Method::PUT,
        &gateway.path("/v1/thing"),
        &[("idempotency-key", "k")],
        "body",
    )
    .await;
    assert_eq!(put.job(), None);
    let post_without_key = send(Method::POST, &gateway.path("/v1/thing"), &[], "body").await;
    assert_eq!(post_without_key.job(), None);
    assert_eq!(upstream.hits(), 3);
    let seen = upstream.recorded();
    assert_eq!(seen[0].path, "/v1/models?x=1");
    assert_eq!(
        seen[0].header("idempotency-key"),
        Some("ignored-on-get"),
        "untouched"
    );
    let jobs = store.job_count().await;
    assert_eq!(jobs, 0);
}

async fn hop_by_hop_headers_are_not_forwarded_and_forwarding_headers_are_added(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let reply = send(
        Method::POST,
        &gateway.path("/v1/x"),
        &[
            ("idempotency-key", "hops"),
            ("connection", "x-private-hop"),
            ("x-private-hop", "secret"),
            ("proxy-authorization", "Basic abc"),
            ("x-end-to-end", "kept"),
        ],
        "{}",
    )
    .await;
    assert_eq!(reply.status, 200);
    let seen = &upstream.recorded()[0];
    assert!(seen.headers.get("x-private-hop").is_none());
    assert!(seen.headers.get("proxy-authorization").is_none());
    assert_eq!(seen.header("x-end-to-end"), Some("kept"));
    assert_eq!(seen.header("x-forwarded-for"), Some("127.0.0.1"));
    assert_eq!(seen.header("x-forwarded-proto"), Some("http"));
    assert_eq!(
        seen.header("idempotency-key"),
        reply.job().as_deref(),
        "the job id replaces the client's key"
    );
    assert_eq!(seen.header("idempotency-attempt"), Some("1"));
    assert_eq!(
        seen.header("host"),
        Some(upstream.addr.to_string().as_str())
    );
}

async fn forwarded_identity_header_names_are_configurable(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("forward_key_header", "\"x-job-id\"")
        .set("forward_attempt_header", "\"x-attempt\"")
        .start()
        .await;
    let reply = post(&gateway.path("/v1/x"), "names", "{}").await;
    let seen = &upstream.recorded()[0];
    assert_eq!(seen.header("x-job-id"), reply.job().as_deref());
    assert_eq!(seen.header("x-attempt"), Some("1"));
}

async fn admin_api_needs_the_bearer_token_and_probes_do_not(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let job = post(&gateway.path("/v1/x"), "admin-auth", "{}")
        .await
        .job()
        .unwrap();
    let path = format!("{}/admin/v1/jobs/{job}", gateway.admin_url);
    let none = send(Method::GET, &path, &[], "").await;
    assert_eq!(none.status, 401);
    assert_eq!(none.problem(), "unauthorized");
    let wrong = send(Method::GET, &path, &[("authorization", "Bearer nope")], "").await;
    assert_eq!(wrong.status, 401);
    let right = gateway.job(&job).await;
    assert_eq!(right["state"], "completed");
    assert_eq!(right["attempts"][0]["upstream"], "primary");
    for probe in ["/healthz", "/readyz", "/metrics"] {
        let r = send(
            Method::GET,
            &format!("{}{probe}", gateway.admin_url),
            &[],
            "",
        )
        .await;
        assert_eq!(r.status, 200, "{probe}");
    }
    assert!(gateway.metric("idemgate_commits_total").await >= 1.0);

    let other_store = TestStore::embedded();
    let without_token = Gateway::builder(&other_store, &upstream.url())
        .unset("admin_token")
        .start()
        .await;
    let r = send(
        Method::GET,
        &format!("{}/admin/v1/jobs/{job}", without_token.admin_url),
        &[("authorization", "Bearer ")],
        "",
    )
    .await;
    assert_eq!(r.status, 403);
    assert_eq!(r.problem(), "admin-disabled");
}

/// One row of [`upstream_connections_are_reused_unless_the_upstream_forbids_it`].
#[derive(Clone, Copy)]
struct Reuse {
    /// What the row shows; its failures name it.
    what: &'static str,
    /// Its keys' prefix (the rows share one store).
    key: &'static str,
    /// The upstream answers `Connection: close`.
    closes: bool,
    /// The upstream's `idle_timeout`, when it has one.
    idle_timeout: Option<&'static str>,
    /// Rounds of one keyed and one passed-through request.
    rounds: usize,
    /// Connections the upstream accepts over all of them.
    connections: usize,
}

/// Requests one after another, keyed or not, share one upstream connection:
/// the gateway keeps it open once an answer has been read to the end. An
/// upstream that closes every connection costs a new one per request, never
/// a failed request, and so does one with no idle time.
async fn upstream_connections_are_reused_unless_the_upstream_forbids_it(store: TestStore) {
    let cases = [
        Reuse {
            what: "kept open between requests",
            key: "kept",
            closes: false,
            idle_timeout: None,
            rounds: 10,
            connections: 1,
        },
        Reuse {
            what: "closed by the upstream after every answer",
            key: "closed",
            closes: true,
            idle_timeout: None,
            rounds: 10,
            connections: 20,
        },
        Reuse {
            what: "with idle_timeout = \"0s\"",
            key: "fresh",
            closes: false,
            idle_timeout: Some("0s"),
            rounds: 5,
            connections: 10,
        },
    ];
    for case in cases {
        let upstream = FakeUpstream::start(move |r| async move {
            let mut response = crate::support::upstream::echo_response(&r);
            if case.closes {
                let close = http::HeaderValue::from_static("close");
                response.headers_mut().insert("connection", close);
            }
            response
        })
        .await;
        let mut gateway = reuse_gateway(&store, &upstream, case.idle_timeout).await;
        for n in 0..case.rounds {
            let key = format!("{}-{n}", case.key);
            let keyed = post(&gateway.path("/v1/charges"), &key, "{}").await;
            assert_eq!(keyed.status, 200, "{}: {:?}", case.what, keyed.body);
            // Hop-by-hop: the upstream's `Connection` is not the client's.
            assert!(keyed.headers.get("connection").is_none(), "{}", case.what);
            let plain = send(Method::GET, &gateway.path("/v1/models"), &[], "").await;
            assert_eq!(plain.status, 200, "{}: {:?}", case.what, plain.body);
            assert!(plain.headers.get("connection").is_none(), "{}", case.what);
        }
        assert_eq!(upstream.hits(), 2 * case.rounds, "{}", case.what);
        assert_eq!(upstream.connections(), case.connections, "{}", case.what);
        // Gone before the next case opens the same embedded store (it
        // serves one gateway): a drop only sends the signal.
        gateway.kill().await;
    }
}

/// A gateway whose one upstream has `idle_timeout` when given one.
async fn reuse_gateway(
    store: &TestStore,
    upstream: &FakeUpstream,
    idle_timeout: Option<&str>,
) -> Gateway {
    let builder = Gateway::builder(store, &upstream.url());
    let builder = match idle_timeout {
        None => builder,
        Some(idle) => builder.unset("upstreams").tables(&format!(
            "[[upstreams]]\nname = \"fresh\"\nurl = {:?}\nidle_timeout = {idle:?}\n",
            upstream.url()
        )),
    };
    builder.start().await
}

async fn pass_through_bodies_stream_past_the_opt_in_limit(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .tables("[[routes]]\nbody_limit = \"1KiB\"\n")
        .start()
        .await;
    // No key: not opted in, so not buffered and not limited.
    let big = "z".repeat(256 * 1024);
    let reply = send(Method::POST, &gateway.path("/v1/upload"), &[], big.clone()).await;
    assert_eq!(reply.status, 200);
    assert_eq!(upstream.recorded()[0].body.len(), big.len());
    assert_eq!(reply.job(), None);
}

#[tokio::test]
async fn variables_override_the_file_and_flags_override_variables() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    // The file's value alone would stop start-up; the variable wins over it.
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("hold_timeout", "\"0s\"")
        .env("IDEMGATE_HOLD_TIMEOUT", "2s")
        .start()
        .await;
    assert_eq!(
        post(&gateway.path("/x"), "precedence", "{}").await.status,
        200
    );
    drop(gateway);

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args([
            "serve",
            "--upstream",
            "http://127.0.0.1:1",
            "--hold-timeout",
            "0s",
        ])
        .env("IDEMGATE_HOLD_TIMEOUT", "2s")
        .env("IDEMGATE_EMBEDDED_PATH", "/nonexistent/never-opened.db")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success(), "the flag wins over the variable");
    assert!(String::from_utf8_lossy(&out.stderr).contains("hold_timeout"));
}

#[tokio::test]
async fn store_unreachable_means_503_and_nothing_proxied() {
    let upstream = FakeUpstream::echo().await;
    let closed = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let nowhere = TestStore::external(format!("postgres://postgres@{closed}/nowhere"));
    let gateway = Gateway::builder(&nowhere, &upstream.url())
        .set("database_timeout", "\"500ms\"")
        .start()
        .await;
    let reply = post(&gateway.path("/v1/charges"), "no-store", "{}").await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.problem(), "store-unavailable");
    assert_eq!(
        upstream.hits(),
        0,
        "an opted-in request that cannot be recorded is never proxied"
    );

    // Ready all the same: the store is shared by every replica, and a
    // failing readiness would take all of them out of the Service at once
    // (docs/design.md §8). The body says what is down.
    let readyz = format!("{}/readyz", gateway.admin_url);
    eventually(
        Duration::from_secs(10),
        "the store reported down",
        || async {
            let ready = send(Method::GET, &readyz, &[], "").await;
            assert_eq!(
                ready.status,
                200,
                "{:?}",
                String::from_utf8_lossy(&ready.body)
            );
            ready.json()["dependencies"]["store"]["status"] == "down"
        },
    )
    .await;
    let ready = send(Method::GET, &readyz, &[], "").await.json();
    assert_eq!(ready["status"], "degraded");
    assert!(
        ready["dependencies"]["store"]["error"]
            .as_str()
            .is_some_and(|e| !e.is_empty()),
        "{ready}"
    );
    assert_eq!(
        gateway
            .metric("idemgate_dependency_up{dependency=\"store\"}")
            .await,
        0.0
    );
    // Traffic that does not opt in does not need the store.
    let get = send(Method::GET, &gateway.path("/v1/models"), &[], "").await;
    assert_eq!(get.status, 200);
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn bad_configuration_stops_start_up_naming_the_key() {
    let store = TestStore::embedded();
    let cases = [
        ("upstream_timeout", "\"soon\"", "upstream_timeout"),
        ("mismatch_status", "400", "422"),
        ("upstreams", "[\"ftp://api.example\"]", "upstreams[0]"),
        ("upstream_timout", "\"1s\"", "upstream_timout"),
        ("lease_ttl", "\"10ms\"", "lease_ttl"),
        ("worker_threads", "0", "worker_threads"),
    ];
    for (key, value, named) in cases {
        let err = Gateway::builder(&store, "http://127.0.0.1:1")
            .set(key, value)
            .start_and_fail()
            .await;
        assert!(err.contains(named), "{key} = {value}: {err}");
    }
    let err = Gateway::builder(&store, "http://127.0.0.1:1")
        .tables("[[routes]]\nmethods = [\"GET\"]\n")
        .start_and_fail()
        .await;
    assert!(err.contains("routes[0].methods"), "{err}");
    let err = Gateway::builder(&store, "http://127.0.0.1:1")
        .unset("upstreams")
        .tables("[[upstreams]]\nurl = \"http://127.0.0.1:1\"\nidle_timeout = \"soon\"\n")
        .start_and_fail()
        .await;
    assert!(err.contains("idle_timeout"), "{err}");

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args([
            "serve",
            "--upstream",
            "http://127.0.0.1:1",
            "--hold-timeout",
            "0s",
        ])
        .env_remove("IDEMGATE_DATABASE_URL")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("hold_timeout"));
}

crate::on_both_stores!(
    upstream_connections_are_reused_unless_the_upstream_forbids_it,
    pass_through_bodies_stream_past_the_opt_in_limit,
    replay_is_faithful_to_status_end_to_end_headers_and_body_bytes,
    same_key_with_another_body_or_path_is_a_409_mismatch_and_never_proxied,
    mismatch_status_can_be_the_ietf_422,
    canonical_json_routes_ignore_key_order_and_excluded_fields,
    owners_are_isolated_and_stored_only_as_hashes,
    malformed_keys_are_refused_with_400_and_never_proxied,
    quoted_and_bare_forms_name_the_same_key,
    a_route_that_requires_a_key_refuses_requests_without_one,
    bodies_past_the_limit_get_413_and_nothing_is_stored,
    requests_that_do_not_opt_in_pass_through_untouched,
    hop_by_hop_headers_are_not_forwarded_and_forwarding_headers_are_added,
    forwarded_identity_header_names_are_configurable,
    admin_api_needs_the_bearer_token_and_probes_do_not,
);

/// A repeat of a request whose answer this replica has seen is replayed
/// from its memory, so it keeps working with the database stopped; with
/// `replay_cache_size = 0` the same repeat needs the database. A request
/// with another fingerprint is never answered from memory: the store
/// decides, and it is down.
#[tokio::test]
async fn a_repeat_is_replayed_from_memory_with_the_database_down() {
    let pg = crate::support::postgres::ThrowawayPostgres::start().await;
    let upstream = FakeUpstream::echo().await;
    let store = TestStore::external(pg.url());
    let remembering = Gateway::builder(&store, &upstream.url())
        .set("database_timeout", "\"500ms\"")
        .start()
        .await;
    let forgetting = Gateway::builder(&store, &upstream.url())
        .set("database_timeout", "\"500ms\"")
        .set("replay_cache_size", "0")
        .start()
        .await;
    let (on, off) = (
        remembering.path("/v1/charges"),
        forgetting.path("/v1/charges"),
    );
    let first = post(&on, "remembered", r#"{"amount": 1}"#).await;
    assert_eq!(first.status, 200);
    assert_eq!(post(&off, "forgotten", "{}").await.status, 200);
    assert_eq!(upstream.hits(), 2);

    pg.stop();
    let replay = post(&on, "remembered", r#"{"amount": 1}"#).await;
    assert_eq!(replay.status, 200, "{:?}", replay.body);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.job(), first.job());
    assert_eq!(
        remembering
            .metric("idemgate_replays_total{source=\"memory\"}")
            .await,
        1.0
    );
    let other = post(&on, "remembered", r#"{"amount": 2}"#).await;
    assert_eq!(other.status, 503);
    assert_eq!(other.problem(), "store-unavailable");
    let without = post(&off, "forgotten", "{}").await;
    assert_eq!(without.status, 503);
    assert_eq!(without.problem(), "store-unavailable");
    assert_eq!(upstream.hits(), 2, "nothing proxied again");
}

/// An answer is not replayed from memory near its job's expiry (another
/// replica's clock may already have let the key go): with keys kept for
/// less than that margin, every replay comes from the store.
#[tokio::test]
async fn answers_near_their_expiry_are_replayed_from_the_store() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("key_ttl", "\"3s\"")
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    let first = post(&url, "brief", "{}").await;
    for _ in 0..3 {
        let replay = post(&url, "brief", "{}").await;
        assert_eq!(replay.status, 200);
        assert_eq!(replay.job(), first.job());
    }
    assert_eq!(upstream.hits(), 1);
    assert_eq!(
        gateway
            .metric("idemgate_replays_total{source=\"store\"}")
            .await,
        3.0
    );
    assert_eq!(
        gateway
            .metric("idemgate_replays_total{source=\"memory\"}")
            .await,
        0.0
    );
}

/// At the default `info` logs only a request with a key is logged inside a
/// span of its own (id, method, path); one without a key is only proxied,
/// and its span is made at `debug` (at `info` it cost a fifth of a
/// passed-through request's CPU: docs/performance.md, item 16). The upstream
/// refuses both: the keyed failure's line names its request, the
/// passed-through one's is logged without it, until `idemgate=debug` asks
/// for its span.
#[tokio::test]
async fn only_keyed_requests_are_logged_in_a_span_at_the_default_level() {
    for (level, passed_through_in_span) in [("info", false), ("info,idemgate=debug", true)] {
        let store = TestStore::embedded();
        let log = tempfile::NamedTempFile::new().unwrap();
        let gateway = Gateway::builder(&store, "http://127.0.0.1:1")
            .env("RUST_LOG", level)
            .stderr_to(log.path())
            .start()
            .await;
        let keyed = send(
            Method::POST,
            &gateway.path("/v1/keyed"),
            &[("idempotency-key", "k"), ("x-request-id", "keyed-request")],
            "{}",
        )
        .await;
        let plain = send(
            Method::POST,
            &gateway.path("/v1/plain"),
            &[("x-request-id", "plain-request")],
            "{}",
        )
        .await;
        assert!(keyed.status >= 500 && plain.status >= 500, "{level}");
        crate::support::eventually(
            std::time::Duration::from_secs(5),
            "both failures logged",
            || async {
                let logged = std::fs::read_to_string(log.path()).unwrap();
                logged.matches("response failed").count() == 2
            },
        )
        .await;
        let logged = std::fs::read_to_string(log.path()).unwrap();
        assert!(
            logged.contains("request_id=keyed-request"),
            "{level}: {logged}"
        );
        assert_eq!(
            logged.contains("request_id=plain-request"),
            passed_through_in_span,
            "{level}: {logged}"
        );
    }
}

#[tokio::test]
async fn every_series_has_help_text_and_latencies_are_timed_by_outcome_and_upstream() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    assert_eq!(
        post(&gateway.path("/v1/charges"), "timed", "{}")
            .await
            .status,
        200
    );
    let passed = send(Method::GET, &gateway.path("/v1/models"), &[], "").await;
    assert_eq!(passed.status, 200);
    let text = send(
        Method::GET,
        &format!("{}/metrics", gateway.admin_url),
        &[],
        "",
    )
    .await;
    let text = String::from_utf8_lossy(&text.body).into_owned();
    let typed: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split(' ').next().unwrap())
        .collect();
    assert!(typed.len() > 20, "{text}");
    for name in typed {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("# HELP {name} "))),
            "{name} has no # HELP line"
        );
    }
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        text.contains(&format!("idemgate_build_info{{version=\"{version}\"}} 1")),
        "{text}"
    );
    for series in [
        "idemgate_request_duration_seconds_count{outcome=\"executed\"} 1",
        "idemgate_request_duration_seconds_count{outcome=\"passed_through\"} 1",
        "idemgate_upstream_response_seconds_count{upstream=\"primary\"} 2",
    ] {
        assert!(text.contains(series), "missing {series} in:\n{text}");
    }
}
