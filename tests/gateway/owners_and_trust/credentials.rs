//! The operator's credentials and the gateway's own (`docs/design.md` §15):
//! every header an upstream is given is a credential of the operator's
//! unless marked `credential = false`, so a route to it must prove its
//! clients; and the header the gateway's clients present their client key
//! in never reaches an upstream, whether the request was routed or not.

use std::time::Duration;

use http::Method;

use crate::support::deployment::Deployment;
use crate::support::{eventually, send, sha256_hex, FakeUpstream, Gate, Gateway, TestStore};

/// An upstream at `url` given `headers` (TOML entries of
/// `[upstreams.headers]`), and then `rest`.
fn upstream_with(url: &str, headers: &str, rest: &str) -> String {
    format!(
        "[[upstreams]]\nname = \"provider\"\nurl = {url:?}\n[upstreams.headers]\n{headers}\n{rest}"
    )
}

/// A provider header whose name says nothing of what it is (Google's API
/// key) is a credential: no route may send anonymous requests with it.
#[tokio::test]
async fn an_injected_header_of_any_name_is_a_credential_unless_marked() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let goog = "x-goog-api-key = { value = \"AIza-operator\" }";
    for routes in ["", "[[routes]]\npath_prefix = \"/v1\"\n"] {
        let stderr = Gateway::builder(&store, "http://unused")
            .unset("upstreams")
            .tables(&upstream_with(&upstream.url(), goog, routes))
            .start_and_fail()
            .await;
        let key = if routes.is_empty() {
            "routes"
        } else {
            "routes[0].require_client"
        };
        assert!(stderr.contains(key), "{stderr}");
        assert!(stderr.contains("x-goog-api-key"), "{stderr}");
        assert!(stderr.contains("credential = false"), "{stderr}");
    }
    // A header that authenticates by its name cannot be marked otherwise.
    let marked = "authorization = { value = \"Bearer sk\", credential = false }";
    let stderr = Gateway::builder(&store, "http://unused")
        .unset("upstreams")
        .tables(&upstream_with(&upstream.url(), marked, ""))
        .start_and_fail()
        .await;
    assert!(
        stderr.contains("upstreams[0].headers.authorization.credential"),
        "{stderr}"
    );
    assert_eq!(upstream.hits(), 0);
}

/// A header marked `credential = false` goes with every request, proven or
/// not, with no guard needed; beside a credential, it still goes with every
/// request, and the credential only with a proven client's.
#[tokio::test]
async fn a_header_marked_as_no_credential_goes_with_every_request() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let tenant = "x-tenant = { value = \"acme\", credential = false }";
    let gateway = Gateway::builder(&store, "http://unused")
        .unset("upstreams")
        .tables(&upstream_with(&upstream.url(), tenant, ""))
        .start()
        .await;
    // A client's `X_Tenant` would be the CGI-style upstream's `X-Tenant`
    // too, beside the one put in: it never goes.
    let reply = send(
        Method::GET,
        &gateway.path("/v1/models"),
        &[("x_tenant", "evil")],
        "",
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(upstream.recorded()[0].header("x-tenant"), Some("acme"));
    assert_eq!(upstream.recorded()[0].header("x_tenant"), None);

    // Another store: one embedded store serves one gateway.
    let store = TestStore::embedded();
    let provider = FakeUpstream::echo().await;
    let guarded = Gateway::builder(&store, "http://unused")
        .unset("upstreams")
        .tables(&upstream_with(
            &provider.url(),
            &format!("{tenant}\nx-goog-api-key = {{ value = \"AIza-operator\" }}"),
            &format!(
                "[[clients]]\nname = \"web\"\nkey_sha256 = {{ value = {:?} }}\n\
                 [[routes]]\npath_prefix = \"/v1\"\nrequire_client = true\n",
                sha256_hex("web-key")
            ),
        ))
        .start()
        .await;
    let client = [("authorization", "Bearer web-key")];
    assert_eq!(
        send(Method::POST, &guarded.path("/v1/x"), &client, "{}")
            .await
            .status,
        200
    );
    assert_eq!(
        send(Method::GET, &guarded.path("/status"), &[], "")
            .await
            .status,
        200
    );
    let seen = provider.recorded();
    let sent: Vec<_> = seen
        .iter()
        .map(|r| (r.header("x-tenant"), r.header("x-goog-api-key")))
        .collect();
    assert_eq!(
        sent,
        [(Some("acme"), Some("AIza-operator")), (Some("acme"), None)]
    );
}

/// A gateway whose clients present their key in `authorization`, in front
/// of a provider that takes its own key in `x-api-key`: one route needs a
/// proven client; everything else passes through.
async fn gateway_with_clients(deployment: &Deployment, provider: &FakeUpstream) -> Gateway {
    deployment
        .gateway("http://unused")
        .unset("upstreams")
        .env("TEST_PROVIDER_KEY", "sk-operator")
        .tables(&upstream_with(
            &provider.url(),
            "x-api-key = { env = \"TEST_PROVIDER_KEY\" }",
            &format!(
                "[[clients]]\nname = \"web\"\nkey_sha256 = {{ value = {:?} }}\n\
                 [owner]\nsources = [{{ client = true }}]\n\
                 [[routes]]\npath_prefix = \"/v1/chat\"\nmethods = [\"POST\"]\n\
                 require_client = true\n",
                sha256_hex("web-key")
            ),
        ))
        .start()
        .await
}

/// The client key is the gateway's: it is not sent upstream on the route
/// (keyed or not), on another method of the route's path, or on a path no
/// route has; the operator's key goes only with the proven client's.
async fn the_client_key_never_reaches_an_upstream(deployment: Deployment) {
    let provider = FakeUpstream::echo().await;
    let gateway = gateway_with_clients(&deployment, &provider).await;
    let client = ("authorization", "Bearer web-key");
    let keyed = [client, ("idempotency-key", "k-1")];
    let sent = [
        (Method::POST, "/v1/chat", &keyed[..]),
        (Method::POST, "/v1/chat", &[client][..]),
        (Method::GET, "/v1/chat", &[client][..]),
        (Method::POST, "/v1/files", &[client][..]),
        (Method::DELETE, "/elsewhere", &[client][..]),
    ];
    for (method, path, headers) in &sent {
        let reply = send(method.clone(), &gateway.path(path), headers, "{}").await;
        assert_eq!(reply.status, 200, "{method} {path}");
    }
    let seen = provider.recorded();
    assert_eq!(seen.len(), sent.len());
    for (r, (method, path, _)) in seen.iter().zip(&sent) {
        assert_eq!(r.header("authorization"), None, "{method} {path}");
    }
    let spent: Vec<Option<&str>> = seen.iter().map(|r| r.header("x-api-key")).collect();
    assert_eq!(
        spent,
        [Some("sk-operator"), Some("sk-operator"), None, None, None],
        "the operator's key only with a proven client's routed request"
    );
    assert_eq!(deployment.store.job_count().await, 1);
}

/// A long call of a proven client (its owner the client: `[owner] sources
/// = [{ client = true }]`) is polled with the client's key: `202` while it
/// runs, then its answer. A poll that proves no client, or another client,
/// gets what a job that does not exist gets (`docs/design.md` §10,
/// "Answered later"; §15).
async fn a_proven_clients_long_call_is_polled_with_its_key(deployment: Deployment) {
    let gate = Gate::new();
    let provider = FakeUpstream::gated_echo(&gate, |_| true).await;
    let gateway = gateway_with_clients(&deployment, &provider).await;
    let client = ("authorization", "Bearer web-key");
    let headers = [
        client,
        ("idempotency-key", "long-1"),
        ("prefer", "respond-async"),
    ];
    let accepted = send(Method::POST, &gateway.path("/v1/chat"), &headers, "{}").await;
    assert_eq!(accepted.status, 202, "{accepted:?}");
    let location = accepted.header("location").unwrap().to_owned();
    provider.arrival().await;
    let poll = |headers: Vec<(&'static str, &'static str)>| {
        let url = gateway.path(&location);
        async move { send(Method::GET, &url, &headers, "").await }
    };
    let running = poll(vec![client]).await;
    assert_eq!(running.status, 202, "{running:?}");
    let nowhere = gateway.path("/.well-known/idemgate/jobs/00000000-0000-4000-8000-000000000000");
    let absent = send(Method::GET, &nowhere, &[], "").await;
    for stranger in [vec![], vec![("authorization", "Bearer other-key")]] {
        let refused = poll(stranger.clone()).await;
        assert_eq!(
            (refused.status, refused.problem()),
            (absent.status, absent.problem()),
            "{stranger:?}: as if there were no job"
        );
    }
    gate.open(1);
    eventually(Duration::from_secs(10), "the polled answer", || async {
        poll(vec![client]).await.status == 200
    })
    .await;
    assert_eq!(
        poll(vec![client]).await.header("idempotent-replayed"),
        Some("true")
    );
    assert_eq!(provider.hits(), 1);
}

/// On an MCP route that serves only proven clients, the transport's `GET`
/// (its event stream) and `DELETE` (session end) are refused without a
/// client key, before anything is sent; a proven client's reach the
/// server with the operator's credential (`docs/design.md` §15, §19).
#[tokio::test]
async fn an_mcp_routes_get_and_delete_need_a_proven_client() {
    let deployment = Deployment::embedded().await;
    let provider = FakeUpstream::echo().await;
    let gateway = deployment
        .gateway("http://unused")
        .unset("upstreams")
        .env("TEST_PROVIDER_KEY", "sk-operator")
        .tables(&upstream_with(
            &provider.url(),
            "x-api-key = { env = \"TEST_PROVIDER_KEY\" }",
            &format!(
                "[[clients]]\nname = \"agent\"\nkey_sha256 = {{ value = {:?} }}\n\
                 [[routes]]\npath_prefix = \"/mcp\"\nprotocol = \"mcp\"\n\
                 require_client = true\n",
                sha256_hex("agent-key")
            ),
        ))
        .start()
        .await;
    let session = ("mcp-session-id", "s-1");
    for method in [Method::GET, Method::DELETE] {
        let refused = send(method.clone(), &gateway.path("/mcp"), &[session], "").await;
        assert_eq!(refused.status, 401, "{method}: {refused:?}");
        assert_eq!(refused.problem(), "client-unauthenticated", "{method}");
    }
    assert_eq!(provider.hits(), 0, "nothing sent for an unproven client");
    let client = ("authorization", "Bearer agent-key");
    for method in [Method::GET, Method::DELETE] {
        let reply = send(
            method.clone(),
            &gateway.path("/mcp"),
            &[client, session],
            "",
        )
        .await;
        assert_eq!(reply.status, 200, "{method}: {reply:?}");
    }
    let seen = provider.recorded();
    let sent: Vec<_> = seen
        .iter()
        .map(|r| (r.header("x-api-key"), r.header("authorization")))
        .collect();
    assert_eq!(sent, [(Some("sk-operator"), None); 2]);
}

crate::on_each_deployment!(
    [embedded, postgres, postgres_redis]
    the_client_key_never_reaches_an_upstream,
    a_proven_clients_long_call_is_polled_with_its_key,
);
