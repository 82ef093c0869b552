//! Whose key is it (`docs/design.md` §15): owners from real identities,
//! callers proven before a credential of the operator's is spent, and
//! forwarding headers believed only from trusted proxies. Every refusal is
//! a 401 problem that creates no job and reaches no upstream. Each scenario
//! runs on the embedded store and on PostgreSQL with Redis.

use std::time::{SystemTime, UNIX_EPOCH};

use http::Method;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::json;

use crate::support::deployment::Deployment;
use crate::support::gateway::Builder;
use crate::support::{send, sha256_hex, FakeUpstream, Gateway, Reply, TestStore, ThrowawayRedis};

/// A scenario's gateways, on its deployment's Redis when it has one.
pub(super) struct Gateways(Option<ThrowawayRedis>);

impl Gateways {
    /// The deployment's store, and the maker of its gateways.
    pub(super) fn of(deployment: Deployment) -> (TestStore, Gateways) {
        (deployment.store, Gateways(deployment.redis))
    }

    /// A gateway on this deployment with default owner rules (keyed
    /// requests without an owner refused).
    pub(super) fn gateway(&self, store: &TestStore, upstream: &str) -> Builder {
        let builder = Gateway::builder(store, upstream).owners_required();
        match &self.0 {
            None => builder,
            Some(redis) => builder.set("redis_url", &format!("{:?}", redis.url())),
        }
    }
}

/// A keyed POST with these extra headers.
pub(super) async fn keyed(
    gateway: &Gateway,
    path: &str,
    key: &str,
    headers: &[(&str, &str)],
) -> Reply {
    let all: Vec<(&str, &str)> = [
        ("idempotency-key", key),
        ("content-type", "application/json"),
    ]
    .into_iter()
    .chain(headers.iter().copied())
    .collect();
    send(Method::POST, &gateway.path(path), &all, "{}").await
}

/// A 401 problem of `kind`, with nothing stored or sent.
pub(super) async fn refused(
    reply: &Reply,
    kind: &str,
    store: &TestStore,
    upstream: &FakeUpstream,
    hits: usize,
) {
    assert_eq!(
        reply.status,
        401,
        "{:?}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(reply.problem(), kind);
    assert_eq!(
        reply.header("x-should-retry"),
        Some("false"),
        "the same request cannot win: the SDKs are told not to retry"
    );
    assert!(
        reply.header("www-authenticate").is_some(),
        "a 401 says how to authenticate"
    );
    assert!(reply.job().is_none());
    assert_eq!(upstream.hits(), hits, "the upstream got nothing");
    assert_eq!(store.job_count().await as usize, hits, "no job was made");
}

/// Two users of a cookie-session app who send one key get one job each and
/// their own answer (their own `Set-Cookie` included); a keyed request
/// without the cookie is refused, and by default so is one without
/// `Authorization`.
async fn cookie_users_with_one_key_are_two_owners(on: Deployment) {
    let (store, deployment) = Gateways::of(on);
    let upstream = FakeUpstream::start(|r| async move {
        let sid = r.header("cookie").unwrap_or_default().to_owned();
        http::Response::builder()
            .header(
                "set-cookie",
                format!("seen={}", sid.replace(['=', ';', ' '], "_")),
            )
            .body(http_body_util::Full::new(bytes::Bytes::from(format!(
                "{{\"for\":{sid:?}}}"
            ))))
            .unwrap()
    })
    .await;
    let mut gateway = deployment
        .gateway(&store, &upstream.url())
        .tables("[owner]\nsources = [{ cookie = \"sid\" }]\n")
        .start()
        .await;
    let alice = keyed(
        &gateway,
        "/v1/orders",
        "order-42",
        &[("cookie", "theme=dark; sid=alice")],
    )
    .await;
    let bob = keyed(&gateway, "/v1/orders", "order-42", &[("cookie", "sid=bob")]).await;
    assert_eq!((alice.status, bob.status), (200, 200));
    assert_ne!(alice.job(), bob.job(), "one job per owner");
    assert_eq!(upstream.hits(), 2);
    for _ in 0..2 {
        let again = keyed(&gateway, "/v1/orders", "order-42", &[("cookie", "sid=bob")]).await;
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(again.body, bob.body, "bob gets bob's answer");
        assert_eq!(again.header("set-cookie"), Some("seen=sid_bob"));
    }
    let hits = upstream.hits();
    let none = keyed(
        &gateway,
        "/v1/orders",
        "order-42",
        &[("authorization", "Bearer x")],
    )
    .await;
    refused(&none, "owner-required", &store, &upstream, hits).await;
    assert!(
        none.problem_detail().contains("sid cookie"),
        "the detail names the source"
    );
    // The embedded store serves one gateway at a time: the next starts
    // once this one has exited (a drop only sends the signal).
    gateway.kill().await;

    let by_default = deployment.gateway(&store, &upstream.url()).start().await;
    let anonymous = keyed(&by_default, "/v1/orders", "order-43", &[]).await;
    refused(&anonymous, "owner-required", &store, &upstream, hits).await;
    assert!(anonymous.problem_detail().contains("authorization header"));
}

pub(super) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

pub(super) fn token(alg: Algorithm, key: &EncodingKey, claims: serde_json::Value) -> String {
    jsonwebtoken::encode(&Header::new(alg), &claims, key).unwrap()
}

/// A JWT owner: a token that verifies names the owner by its `sub`; a bad
/// signature, an expired or not-yet-valid token, another audience, or an
/// unsigned one proves nothing, and the request is refused. HS256, RS256
/// and ES256.
async fn jwt_claims_are_owners_only_when_the_token_verifies(on: Deployment) {
    let (store, deployment) = Gateways::of(on);
    let upstream = FakeUpstream::echo().await;
    let dir = tempfile::tempdir().unwrap();
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/fixtures");
    std::fs::copy(
        fixtures.join("jwt-test-rsa.pub.pem"),
        dir.path().join("rsa.pub.pem"),
    )
    .unwrap();
    let ec = rcgen::KeyPair::generate().unwrap();
    std::fs::write(dir.path().join("ec.pub.pem"), ec.public_key_pem()).unwrap();
    let secret = "an HS256 secret of more than 32 bytes, for tests";
    let gateway = deployment
        .gateway(&store, &upstream.url())
        .files_from(dir.path())
        .tables(&format!(
            "[owner]\nsources = [\n\
             {{ jwt = \"sub\", keys = \"rsa.pub.pem\", algorithms = [\"RS256\"], audience = \"orders\" }},\n\
             {{ jwt = \"sub\", from = \"x-ec-token\", keys = \"ec.pub.pem\", algorithms = [\"ES256\"], audience = \"orders\" }},\n\
             {{ jwt = \"sub\", from = \"x-hs-token\", secret = {{ value = {secret:?} }}, algorithms = [\"HS256\"], audience = \"orders\" }},\n\
             ]\n"
        ))
        .start()
        .await;
    let rsa = EncodingKey::from_rsa_pem(&std::fs::read(fixtures.join("jwt-test-rsa.pem")).unwrap())
        .unwrap();
    let es = EncodingKey::from_ec_pem(ec.serialize_pem().as_bytes()).unwrap();
    let hs = EncodingKey::from_secret(secret.as_bytes());
    let claims = |sub: &str| json!({ "sub": sub, "aud": "orders", "exp": now() + 600 });
    let bearer = |t: String| format!("Bearer {t}");

    let alice = bearer(token(Algorithm::RS256, &rsa, claims("alice")));
    let first = keyed(&gateway, "/v1/x", "k", &[("authorization", &alice)]).await;
    assert_eq!(first.status, 200);
    // The same sub through another source is another owner (sources are
    // part of the digest); another sub through the same one too.
    let es_alice = token(Algorithm::ES256, &es, claims("alice"));
    let hs_bob = token(Algorithm::HS256, &hs, claims("bob"));
    let second = keyed(&gateway, "/v1/x", "k", &[("x-ec-token", &es_alice)]).await;
    let third = keyed(&gateway, "/v1/x", "k", &[("x-hs-token", &hs_bob)]).await;
    assert_eq!((second.status, third.status), (200, 200));
    assert_eq!(upstream.hits(), 3);
    // A fresh token for the same sub is the same owner: a replay.
    let again = bearer(token(
        Algorithm::RS256,
        &rsa,
        json!({ "sub": "alice", "aud": "orders", "exp": now() + 900 }),
    ));
    let replay = keyed(&gateway, "/v1/x", "k", &[("authorization", &again)]).await;
    assert_eq!(replay.job(), first.job());

    let other_key = EncodingKey::from_secret(b"not the configured secret, but as long as one");
    let forged = [
        bearer(token(Algorithm::HS256, &other_key, claims("alice"))),
        bearer(token(
            Algorithm::RS256,
            &rsa,
            json!({ "sub": "alice", "aud": "orders", "exp": now() - 120 }),
        )),
        bearer(token(
            Algorithm::RS256,
            &rsa,
            json!({ "sub": "alice", "aud": "orders", "exp": now() + 600, "nbf": now() + 300 }),
        )),
        bearer(token(
            Algorithm::RS256,
            &rsa,
            json!({ "sub": "alice", "aud": "billing", "exp": now() + 600 }),
        )),
        // Unsigned (`alg: none`): header and claims, no signature.
        format!(
            "Bearer eyJhbGciOiJub25lIn0.{}.",
            base64_url(&claims("alice").to_string())
        ),
        "Bearer not-a-token".to_owned(),
    ];
    for bad in &forged {
        let reply = keyed(&gateway, "/v1/x", "forged", &[("authorization", bad)]).await;
        refused(&reply, "owner-required", &store, &upstream, 3).await;
    }
}

pub(super) fn base64_url(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text)
}

/// A header set by a trusted proxy names the owner only when the
/// connection comes from `trusted_proxies`; the forwarding headers are
/// appended to from a trusted proxy and replaced from anyone else.
async fn trusted_headers_are_believed_only_from_trusted_proxies(on: Deployment) {
    let (store, deployment) = Gateways::of(on);
    let upstream = FakeUpstream::echo().await;
    let owner = "[owner]\nsources = [{ trusted_header = \"x-authenticated-user\" }]\n";
    let spoofed = [
        ("x-authenticated-user", "alice"),
        ("x-forwarded-for", "203.0.113.9"),
        ("forwarded", "for=203.0.113.9"),
        ("x-forwarded-proto", "https"),
    ];
    let mut untrusting = deployment
        .gateway(&store, &upstream.url())
        .set("trusted_proxies", "[\"10.0.0.0/8\"]")
        .tables(owner)
        .start()
        .await;
    let ignored = keyed(&untrusting, "/v1/x", "k", &spoofed).await;
    refused(&ignored, "owner-required", &store, &upstream, 0).await;
    let passed = send(Method::GET, &untrusting.path("/v1/x"), &spoofed, "").await;
    assert_eq!(passed.status, 200);
    // The embedded store serves one gateway at a time: the next starts
    // once this one has exited (a drop only sends the signal).
    untrusting.kill().await;
    let seen = &upstream.recorded()[0];
    assert_eq!(
        seen.header("x-forwarded-for"),
        Some("127.0.0.1"),
        "the client's own list is dropped"
    );
    assert_eq!(seen.header("forwarded"), Some("for=127.0.0.1"));
    assert_eq!(seen.header("x-forwarded-proto"), Some("http"));

    let trusting = deployment
        .gateway(&store, &upstream.url())
        .set("trusted_proxies", "[\"127.0.0.1/32\", \"::1\"]")
        .tables(owner)
        .start()
        .await;
    let alice = keyed(&trusting, "/v1/x", "k", &spoofed).await;
    let bob = keyed(&trusting, "/v1/x", "k", &[("x-authenticated-user", "bob")]).await;
    assert_eq!((alice.status, bob.status), (200, 200));
    assert_ne!(alice.job(), bob.job());
    let seen = upstream.recorded();
    let from_alice = seen
        .iter()
        .find(|r| r.header("x-forwarded-proto") == Some("https"))
        .unwrap();
    assert_eq!(
        from_alice.header("x-forwarded-for"),
        Some("203.0.113.9, 127.0.0.1")
    );
    assert_eq!(
        from_alice.header("forwarded"),
        Some("for=203.0.113.9, for=127.0.0.1")
    );
}

/// A combination: a tenant header and a user cookie together name the
/// owner; either alone proves nothing.
async fn combined_sources_need_every_part(on: Deployment) {
    let (store, deployment) = Gateways::of(on);
    let upstream = FakeUpstream::echo().await;
    let gateway = deployment
        .gateway(&store, &upstream.url())
        .tables(
            "[owner]\nsources = [{ all = [{ header = \"x-tenant\" }, { cookie = \"sid\" }] }]\n",
        )
        .start()
        .await;
    let a = keyed(
        &gateway,
        "/v1/x",
        "k",
        &[("x-tenant", "acme"), ("cookie", "sid=u1")],
    )
    .await;
    let b = keyed(
        &gateway,
        "/v1/x",
        "k",
        &[("x-tenant", "globex"), ("cookie", "sid=u1")],
    )
    .await;
    assert_eq!((a.status, b.status), (200, 200));
    assert_ne!(a.job(), b.job(), "one user in two tenants is two owners");
    let half = keyed(&gateway, "/v1/x", "k", &[("cookie", "sid=u1")]).await;
    refused(&half, "owner-required", &store, &upstream, 2).await;
    assert!(half
        .problem_detail()
        .contains("x-tenant header and the sid cookie"));
}

/// Clients prove themselves with a client key before a route whose upstream
/// holds the operator's credential is used; the client is the owner of its
/// keys. A wrong or missing key is refused (keyed or not) and the provider
/// never sees its credential spent.
async fn clients_are_proven_before_a_credential_is_spent(on: Deployment) {
    let (store, deployment) = Gateways::of(on);
    let provider = FakeUpstream::echo().await;
    let gateway = deployment
        .gateway(&store, "http://unused")
        .unset("upstreams")
        .env("TEST_PROVIDER_KEY", "sk-operator")
        .tables(&format!(
            "[[upstreams]]\nname = \"provider\"\nurl = {:?}\n[upstreams.headers]\nauthorization = {{ env = \"TEST_PROVIDER_KEY\", prefix = \"Bearer \" }}\n\
             [[clients]]\nname = \"web\"\nkey_sha256 = {{ value = {:?} }}\n\
             [[clients]]\nname = \"batch\"\nkey_sha256 = {{ value = {:?} }}\n\
             [owner]\nsources = [{{ client = true }}]\n\
             [[routes]]\npath_prefix = \"/v1/chat\"\nrequire_client = true\n",
            provider.url(),
            sha256_hex("web-key"),
            sha256_hex("batch-key"),
        ))
        .start()
        .await;
    let web = keyed(
        &gateway,
        "/v1/chat",
        "k",
        &[("authorization", "Bearer web-key")],
    )
    .await;
    let batch = keyed(
        &gateway,
        "/v1/chat",
        "k",
        &[("authorization", "Bearer batch-key")],
    )
    .await;
    assert_eq!((web.status, batch.status), (200, 200));
    assert_ne!(web.job(), batch.job(), "each client owns its keys");
    assert!(provider
        .recorded()
        .iter()
        .all(|r| r.header("authorization") == Some("Bearer sk-operator")));
    for who in [&[][..], &[("authorization", "Bearer web-key-guess")][..]] {
        let reply = keyed(&gateway, "/v1/chat", "k2", who).await;
        refused(&reply, "client-unauthenticated", &store, &provider, 2).await;
        let unkeyed = send(Method::POST, &gateway.path("/v1/chat"), who, "{}").await;
        assert_eq!(unkeyed.status, 401);
    }
    let elsewhere = send(Method::GET, &gateway.path("/status"), &[], "").await;
    assert_eq!(elsewhere.status, 200);
    let seen = provider.recorded();
    assert_eq!(seen.len(), 3);
    assert_eq!(
        seen[2].header("authorization"),
        None,
        "no route: no credential of the operator's"
    );
}

/// A client's `Connection` header names only its own hop-by-hop headers:
/// it cannot strip the job id and attempt the gateway adds, nor send its
/// own beside them in another spelling (`Idempotency_Key`, which a
/// CGI-style server reads as the same header).
async fn a_connection_header_cannot_remove_what_the_gateway_adds(on: Deployment) {
    let (store, deployment) = Gateways::of(on);
    let upstream = FakeUpstream::echo().await;
    let gateway = deployment.gateway(&store, &upstream.url()).start().await;
    let reply = keyed(
        &gateway,
        "/v1/x",
        "k",
        &[
            ("authorization", "Bearer alice"),
            (
                "connection",
                "idempotency-key, idempotency-attempt, x-forwarded-for",
            ),
            ("idempotency_key", "01a24f27-0000-7000-8000-000000000000"),
            ("Idempotency_Attempt", "7"),
        ],
    )
    .await;
    assert_eq!(reply.status, 200);
    assert!(
        reply.job().is_some(),
        "the key is the gateway's to read, named or not"
    );
    let seen = &upstream.recorded()[0];
    assert_eq!(seen.header("idempotency-key"), reply.job().as_deref());
    assert_eq!(seen.header("idempotency-attempt"), Some("1"));
    assert_eq!(seen.header("x-forwarded-for"), Some("127.0.0.1"));
    assert_eq!(seen.header("idempotency_key"), None);
    assert_eq!(seen.header("idempotency_attempt"), None);
}

/// A route may allow anonymous owners; others keep refusing.
async fn anonymous_owners_are_a_route_by_route_choice(on: Deployment) {
    let (store, deployment) = Gateways::of(on);
    let upstream = FakeUpstream::echo().await;
    let gateway = deployment
        .gateway(&store, &upstream.url())
        .tables(
            "[[routes]]\npath_prefix = \"/v1/open\"\n[routes.owner]\nallow_anonymous = true\n\
             [[routes]]\npath_prefix = \"/v1/closed\"\n",
        )
        .start()
        .await;
    let open = keyed(&gateway, "/v1/open", "k", &[]).await;
    assert_eq!(open.status, 200);
    let again = keyed(&gateway, "/v1/open", "k", &[]).await;
    assert_eq!(again.job(), open.job(), "anonymous callers share one owner");
    let closed = keyed(&gateway, "/v1/closed", "k", &[]).await;
    refused(&closed, "owner-required", &store, &upstream, 1).await;
}

crate::on_each_deployment!(
    [embedded, postgres_redis]
    cookie_users_with_one_key_are_two_owners,
    jwt_claims_are_owners_only_when_the_token_verifies,
    trusted_headers_are_believed_only_from_trusted_proxies,
    combined_sources_need_every_part,
    clients_are_proven_before_a_credential_is_spent,
    a_connection_header_cannot_remove_what_the_gateway_adds,
    anonymous_owners_are_a_route_by_route_choice,
);

/// What cannot be trusted stops start-up, naming the key and the fix.
#[tokio::test]
async fn untrustworthy_configurations_stop_start_up() {
    let store = TestStore::postgres().await;
    let upstream = FakeUpstream::echo().await;
    let unsalted = Gateway::builder(&store, &upstream.url())
        .env("IDEMGATE_OWNER_SALT", "")
        .start_and_fail()
        .await;
    assert!(
        unsalted.contains("owner.salt") && unsalted.contains("openssl rand"),
        "{unsalted}"
    );

    let embedded = TestStore::embedded();
    let spendable = Gateway::builder(&embedded, "http://unused")
        .unset("upstreams")
        .env("TEST_PROVIDER_KEY", "sk-operator")
        .tables(&format!(
            "[[upstreams]]\nurl = {:?}\n[upstreams.headers]\nx-api-key = {{ env = \"TEST_PROVIDER_KEY\" }}\n\
             [[routes]]\npath_prefix = \"/v1\"\n",
            upstream.url()
        ))
        .start_and_fail()
        .await;
    assert!(
        spendable.contains("routes[0].require_client"),
        "{spendable}"
    );
    let clientless = Gateway::builder(&embedded, &upstream.url())
        .tables("[[routes]]\npath_prefix = \"/v1\"\nrequire_client = true\n")
        .start_and_fail()
        .await;
    assert!(clientless.contains("[[clients]]"), "{clientless}");
}

/// Allowing anonymous owners is said at start-up, with what it means.
#[tokio::test]
async fn allowing_anonymous_owners_is_warned_of() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let logs = tempfile::NamedTempFile::new().unwrap();
    let gateway = Gateway::builder(&store, &upstream.url())
        .stderr_to(logs.path())
        .start()
        .await;
    drop(gateway);
    let text = std::fs::read_to_string(logs.path()).unwrap();
    assert!(text.contains("share the owner `anonymous`"), "{text}");
}
