//! One reading of a request line (`docs/design.md` §2): a method, target,
//! path or `Host` an upstream could read otherwise than the gateway does is
//! refused `400` before any route is matched, so nothing reaches a route's
//! upstream without the route's rules; and a body its client broke is the
//! client's `400`, not the upstream's `502`. Sent as raw bytes over TCP,
//! since HTTP clients tidy these themselves.

use super::paths::{gateway, raw, raw_bytes};
use crate::support::deployment::Deployment;
use crate::support::{send, FakeUpstream};

/// `POST /v1/charges` requires a key; these spellings of its path are read
/// as it by some upstreams (a trailing `.` dropped), so none goes through.
const TRAILING_DOTS: [&str; 6] = [
    "/v1/charges.",
    "/v1/charges%2e",
    "/v1/charges%2E",
    "/v1/charges./",
    "/v1/charges..",
    "/v1/charges%2e?a=1",
];

async fn a_standard_method_in_another_case_is_refused(Deployment { store, redis }: Deployment) {
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, redis.as_ref(), &upstream.url()).await;
    for method in ["post", "Post", "pOST"] {
        for key in [None, Some("order-1")] {
            let reply = raw(&gateway, method, "/v1/charges", key).await;
            reply.assert_problem(400, "invalid-method", method);
            assert!(reply.body.contains("send POST"), "{}", reply.body);
        }
    }
    for method in ["get", "Delete"] {
        raw(&gateway, method, "/v1/models", None)
            .await
            .assert_problem(400, "invalid-method", method);
    }
    assert_eq!(
        upstream.hits(),
        0,
        "no method in another case went upstream"
    );
    assert_eq!(store.job_count().await, 0);
    // The control: an extension method is passed through as it is.
    assert_eq!(raw(&gateway, "PURGE", "/v1/cache", None).await.status, 200);
}

async fn a_trailing_dot_never_reaches_the_routes_upstream_without_a_key(
    Deployment { store, redis }: Deployment,
) {
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, redis.as_ref(), &upstream.url()).await;
    for target in TRAILING_DOTS {
        for (method, key) in [("POST", None), ("POST", Some("order-2")), ("GET", None)] {
            let reply = raw(&gateway, method, target, key).await;
            reply.assert_problem(400, "ambiguous-path", target);
            assert!(reply.body.contains("without"), "{target}: {}", reply.body);
        }
    }
    assert_eq!(upstream.hits(), 0, "no trailing dot went upstream");
    assert_eq!(store.job_count().await, 0);
    // The control: a dot inside a segment is part of its name.
    assert_eq!(
        raw(&gateway, "GET", "/v1/charges.json", None).await.status,
        200
    );
}

async fn targets_that_are_not_paths_are_refused(Deployment { store, redis }: Deployment) {
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, redis.as_ref(), &upstream.url()).await;
    let authority = gateway.url.trim_start_matches("http://").to_owned();
    for line in [
        "POST * HTTP/1.1".to_owned(),
        "OPTIONS * HTTP/1.1".to_owned(),
        format!("CONNECT {authority} HTTP/1.1"),
    ] {
        let request = format!(
            "{line}\r\nhost: {authority}\r\nconnection: close\r\nidempotency-key: k\r\n\
             content-length: 0\r\n\r\n"
        );
        raw_bytes(&gateway, &request)
            .await
            .assert_problem(400, "invalid-request-target", &line);
    }
    assert_eq!(upstream.hits(), 0, "nothing forwarded");
    assert_eq!(store.job_count().await, 0);
}

async fn two_host_headers_are_refused(Deployment { store, redis }: Deployment) {
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, redis.as_ref(), &upstream.url()).await;
    for (line, key) in [
        ("POST /v1/charges HTTP/1.1", "idempotency-key: order-3\r\n"),
        ("GET /v1/models HTTP/1.1", ""),
    ] {
        let request = format!(
            "{line}\r\nhost: a.example\r\nhost: b.example\r\nconnection: close\r\n{key}\
             content-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}"
        );
        raw_bytes(&gateway, &request)
            .await
            .assert_problem(400, "invalid-host", line);
    }
    assert_eq!(upstream.hits(), 0, "nothing forwarded");
    assert_eq!(store.job_count().await, 0);
}

/// A passed-through request whose chunks do not parse failed by its
/// client's doing: `400`, told apart from an upstream's failure (`502`).
async fn a_malformed_chunked_body_passed_through_is_the_clients_400(
    Deployment { store, redis }: Deployment,
) {
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, redis.as_ref(), &upstream.url()).await;
    let request = "POST /v1/uploads HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
                   content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n\
                   2\r\n{}\r\nzz\r\nnot a chunk\r\n0\r\n\r\n";
    let reply = raw_bytes(&gateway, request).await;
    reply.assert_problem(400, "request-body-unreadable", "a malformed chunk");
    assert_eq!(store.job_count().await, 0);
}

/// A method-override (a header Rails, Express and ASP.NET run in place of
/// the line's method, any line of it, any item of a list, or a `_method`
/// query parameter) that names a method another route takes than the
/// line's is refused: a `POST` with `X-HTTP-Method-Override: DELETE` to a
/// route of `DELETE`s went through unrouted, without the key the route
/// requires, and ran twice. One naming the line's own route (its own
/// method, another of the route's, or a safe one) passes, and an override
/// is part of the fingerprint; so does any on a path no route takes.
async fn a_method_override_a_route_would_read_otherwise_is_refused(env: Deployment) {
    let upstream = FakeUpstream::echo().await;
    let route = "[[routes]]\npath_prefix = \"/v1/orders\"\nmethods = [\"PATCH\", \"DELETE\"]\nrequire_key = true\n\
                 [[routes]]\npath_prefix = \"/v1/charges\"\n\
                 [[routes]]\npath_prefix = \"/agents\"\nprotocol = \"mcp\"\n\
                 [[routes]]\npath_prefix = \"/agents/charges\"\n";
    let gateway = env.gateway(&upstream.url()).tables(route).start().await;
    let url = gateway.path("/v1/orders/9");
    let key = ("idempotency-key", "o-1");
    let refused: [&[(&str, &str)]; 6] = [
        &[("x-http-method-override", "DELETE")],
        &[("X_HTTP_Method_Override", "delete")],
        &[("x-method-override", "DELETE, POST")],
        &[
            ("x-http-method-override", "POST"),
            ("x-http-method", "DELETE"),
        ],
        &[("x-http-method-override", "DEL ETE")],
        &[("x-http-method", " patch ")],
    ];
    for headers in refused {
        let reply = send(http::Method::POST, &url, &[&[key], headers].concat(), "{}").await;
        assert_eq!(reply.status, 400, "{headers:?}");
        assert_eq!(reply.problem(), "ambiguous-method");
    }
    // In the query, as Express reads it and as PHP does for Laravel.
    for query in ["_%6Dethod=DELETE", "x=1&.method=delete"] {
        let reply = send(http::Method::POST, &format!("{url}?{query}"), &[key], "{}").await;
        assert_eq!(
            (reply.status, reply.problem()),
            (400, "ambiguous-method".to_owned())
        );
    }
    // A safe method another route takes is that route's: the MCP route's
    // rules (its GET is its event stream) are not stepped around by a
    // POST of another route that names GET.
    let reports = gateway.path("/agents/charges");
    let tunnelled = [("x-http-method-override", "GET")];
    let reply = send(http::Method::POST, &reports, &tunnelled, "{}").await;
    assert_eq!(reply.status, 400, "{reply:?}");
    assert_eq!(upstream.hits(), 0);
    // An empty override names nothing, as the frameworks read it.
    let empty = [("x-http-method-override", "")];
    assert_eq!(
        send(http::Method::POST, &url, &empty, "{}").await.status,
        200
    );
    // The line's own route: passes, and its override is part of the
    // request (a PATCH its upstream runs as a DELETE is not the PATCH).
    let patch = send(http::Method::PATCH, &url, &[key], "{}").await;
    assert_eq!(patch.status, 200);
    let named = [key, ("x-http-method-override", "DELETE")];
    let other = send(http::Method::PATCH, &url, &named, "{}").await;
    assert_eq!(other.problem(), "idempotency-key-mismatch");
    let charges = gateway.path("/v1/charges");
    let safe = [
        ("idempotency-key", "c-1"),
        ("x-http-method-override", "GET"),
    ];
    assert_eq!(
        send(http::Method::POST, &charges, &safe, "{}").await.status,
        200
    );
    let elsewhere = [("x-http-method-override", "DELETE")];
    let other = gateway.path("/v1/other");
    assert_eq!(
        send(http::Method::POST, &other, &elsewhere, "{}")
            .await
            .status,
        200
    );
    assert_eq!(
        upstream.hits(),
        4,
        "the empty one, the PATCH, the safe one and the one elsewhere"
    );
}

crate::on_each_deployment!(
    [embedded, postgres, postgres_redis]
    a_method_override_a_route_would_read_otherwise_is_refused,
    a_standard_method_in_another_case_is_refused,
    a_trailing_dot_never_reaches_the_routes_upstream_without_a_key,
    targets_that_are_not_paths_are_refused,
    two_host_headers_are_refused,
    a_malformed_chunked_body_passed_through_is_the_clients_400,
);
