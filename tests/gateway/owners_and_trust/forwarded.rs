//! Headers the gateway believes only from a trusted proxy — a
//! `trusted_header` owner source's, `X-Real-IP`, `True-Client-IP`, the
//! `X-Forwarded-*` family — do not reach the upstream as another peer
//! wrote them (`docs/design.md` §15): an upstream that reads them would be
//! told another client's address or user.

use http::Method;

use super::owners::{keyed, Gateways};
use crate::support::deployment::Deployment;
use crate::support::{send, FakeUpstream};

/// What an attacker writes to pass for someone else.
const SPOOFED: [(&str, &str); 5] = [
    ("x-authenticated-user", "alice"),
    ("x-end-user", "alice"),
    ("x-real-ip", "203.0.113.9"),
    ("true-client-ip", "203.0.113.9"),
    ("x-forwarded-for", "203.0.113.9"),
];

/// `[owner]` reads a trusted header; a route's own rule reads another
/// inside an `all`.
const OWNERS: &str = "[owner]\nsources = [{ trusted_header = \"x-authenticated-user\" }, { header = \"authorization\" }]\n\
     [[routes]]\npath_prefix = \"/v1/chat\"\n[routes.owner]\nsources = [\n\
     { all = [{ header = \"authorization\" }, { trusted_header = \"x-end-user\" }] },\n\
     { header = \"authorization\" },\n]\n\
     [[routes]]\npath_prefix = \"/v1\"\n";

/// From an address that is not a trusted proxy, keyed or not, on a route
/// reading them or not, none of those headers reaches the upstream as
/// written; from a trusted proxy, all do.
async fn trusted_only_headers_are_removed_from_anyone_else(on: Deployment) {
    let (store, gateways) = Gateways::of(on);
    let upstream = FakeUpstream::echo().await;
    let mut untrusting = gateways
        .gateway(&store, &upstream.url())
        .set("trusted_proxies", "[\"10.0.0.0/8\"]")
        .tables(OWNERS)
        .start()
        .await;
    let mut spoofed = vec![("authorization", "Bearer mallory")];
    spoofed.extend(SPOOFED);
    for (path, key) in [("/v1/chat", "k-chat"), ("/v1/x", "k-x")] {
        let reply = keyed(&untrusting, path, key, &spoofed).await;
        assert_eq!(reply.status, 200);
        let passed = send(Method::GET, &untrusting.path(path), &spoofed, "").await;
        assert_eq!(passed.status, 200);
    }
    // The embedded store serves one gateway at a time: the next starts
    // once this one has exited (a drop only sends the signal).
    untrusting.kill().await;
    let seen = upstream.recorded();
    assert_eq!(seen.len(), 4);
    for request in &seen {
        for name in [
            "x-authenticated-user",
            "x-end-user",
            "x-real-ip",
            "true-client-ip",
        ] {
            assert_eq!(
                request.header(name),
                None,
                "{name} reached {}",
                request.path
            );
        }
        assert_eq!(request.header("x-forwarded-for"), Some("127.0.0.1"));
        assert_eq!(request.header("authorization"), Some("Bearer mallory"));
    }

    let trusting = gateways
        .gateway(&store, &upstream.url())
        .set("trusted_proxies", "[\"127.0.0.1/32\", \"::1\"]")
        .tables(OWNERS)
        .start()
        .await;
    let passed = send(Method::GET, &trusting.path("/v1/chat"), &spoofed, "").await;
    assert_eq!(passed.status, 200);
    let seen = &upstream.recorded()[4];
    for (name, value) in SPOOFED {
        if name != "x-forwarded-for" {
            assert_eq!(seen.header(name), Some(value), "a trusted proxy's {name}");
        }
    }
    assert_eq!(
        seen.header("x-forwarded-for"),
        Some("203.0.113.9, 127.0.0.1")
    );
}

/// An upstream behind CGI (WSGI, Rack, PHP-FPM) reads `X_End_User` as
/// `X-End-User`: from an address that is not a trusted proxy, no spelling
/// of a trusted-only header reaches it, keyed or not; a header merely
/// spelled with `_` still does.
async fn underscore_spellings_of_trusted_only_headers_are_removed(on: Deployment) {
    let (store, gateways) = Gateways::of(on);
    let upstream = FakeUpstream::echo().await;
    let gateway = gateways
        .gateway(&store, &upstream.url())
        .set("trusted_proxies", "[\"10.0.0.0/8\"]")
        .tables(OWNERS)
        .start()
        .await;
    let spoofed = [
        ("authorization", "Bearer mallory"),
        ("X_End_User", "v"),
        ("X_Forwarded_For", "1.2.3.4"),
        ("x-forwarded_host", "victim.example"),
        ("X_Real_IP", "1.2.3.4"),
        ("x_tag", "kept"),
    ];
    let reply = keyed(&gateway, "/v1/chat", "k-underscore", &spoofed).await;
    assert_eq!(reply.status, 200);
    let passed = send(Method::GET, &gateway.path("/v1/chat"), &spoofed, "").await;
    assert_eq!(passed.status, 200);
    let seen = upstream.recorded();
    assert_eq!(seen.len(), 2);
    for request in &seen {
        for name in [
            "x_end_user",
            "x-end-user",
            "x_forwarded_for",
            "x-forwarded_host",
            "x_real_ip",
        ] {
            assert_eq!(request.header(name), None, "{name} reached the upstream");
        }
        assert_eq!(request.header("x-forwarded-for"), Some("127.0.0.1"));
        assert_eq!(request.header("x_tag"), Some("kept"));
    }
}

crate::on_each_deployment!(
    [embedded, postgres, postgres_redis]
    trusted_only_headers_are_removed_from_anyone_else,
    underscore_spellings_of_trusted_only_headers_are_removed,
);
