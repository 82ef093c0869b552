//! Requests that pass through, and the gateway's manners with upstreams:
//! untouched bodies, hop-by-hop and forwarding headers, reused upstream
//! connections, and the admin API's bearer token.

use http::Method;

use crate::support::{post, send, FakeUpstream, Gateway, TestStore};

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

/// A request passed through on a route (an HTTP request without a key, an
/// MCP message that is not a keyed call) carries no job id or attempt
/// number of its client's, in any spelling: an upstream that deduplicates
/// by them would replay another owner's job to whoever names its id. A
/// request no route takes keeps them (above).
async fn a_request_passed_through_on_a_route_names_no_job(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .tables(
            "[[routes]]\npath_prefix = \"/mcp\"\nprotocol = \"mcp\"\n\
             [[routes]]\npath_prefix = \"/v1\"\n",
        )
        .start()
        .await;
    let theirs = send(
        Method::POST,
        &gateway.path("/v1/x"),
        &[("idempotency-key", "theirs"), ("authorization", "Bearer a")],
        "{}",
    )
    .await;
    let job = theirs.job().expect("a keyed request names its job");
    let named = [
        ("authorization", "Bearer b"),
        ("content-type", "application/json"),
        ("idempotency_key", job.as_str()),
        ("Idempotency-Attempt", "1"),
        ("idempotency_attempt", "1"),
    ];
    let passed = send(Method::POST, &gateway.path("/v1/x"), &named, "{}").await;
    assert_eq!((passed.status, passed.job()), (200, None));
    let list = r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#;
    let mut on_mcp = named.to_vec();
    on_mcp.push(("idempotency-key", job.as_str()));
    let message = send(Method::POST, &gateway.path("/mcp"), &on_mcp, list).await;
    assert_eq!((message.status, message.job()), (200, None));
    let seen = upstream.recorded();
    assert_eq!(seen.len(), 3);
    assert_eq!(seen[0].header("idempotency-key"), Some(job.as_str()));
    for (at, passed) in seen[1..].iter().enumerate() {
        for name in ["idempotency-key", "idempotency_key", "idempotency-attempt"] {
            assert_eq!(passed.header(name), None, "{name} in pass-through {at}");
        }
        assert_eq!(passed.header("idempotency_attempt"), None);
    }
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
    assert!(gateway.metric_sum("idemgate_commits_total").await >= 1.0);

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

crate::on_each_deployment!(
    [embedded, postgres]
    upstream_connections_are_reused_unless_the_upstream_forbids_it,
    pass_through_bodies_stream_past_the_opt_in_limit,
    requests_that_do_not_opt_in_pass_through_untouched,
    a_request_passed_through_on_a_route_names_no_job,
    hop_by_hop_headers_are_not_forwarded_and_forwarding_headers_are_added,
    forwarded_identity_header_names_are_configurable,
    admin_api_needs_the_bearer_token_and_probes_do_not,
);
