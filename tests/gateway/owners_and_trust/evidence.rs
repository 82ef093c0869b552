//! Owner evidence that names no one for certain — a header sent twice or
//! empty, a cookie sent twice or empty, one part of an `all` so — is
//! refused `400 …/owner-ambiguous`, naming the source, whatever sources
//! follow (`docs/design.md` §15): skipped, it would hand the request to a
//! wider owner, and that owner's stored answer to it. A source simply not
//! sent still lets the next one be tried.

use super::owners::{keyed, Gateways};
use crate::support::deployment::Deployment;
use crate::support::{sha256_hex, FakeUpstream, Gateway, Reply, TestStore};

/// A 400 problem naming `source`, with nothing stored, replayed or sent.
async fn ambiguous(
    reply: &Reply,
    source: &str,
    store: &TestStore,
    upstream: &FakeUpstream,
    jobs: usize,
) {
    let detail = reply.problem_detail();
    assert_eq!(reply.status, 400, "{detail}");
    assert_eq!(reply.problem(), "owner-ambiguous");
    assert!(
        detail.contains(source),
        "the detail names {source}: {detail}"
    );
    assert!(reply.job().is_none(), "no job of anyone's");
    assert_eq!(reply.header("idempotent-replayed"), None);
    assert_eq!(upstream.hits(), jobs, "the upstream got nothing");
    assert_eq!(store.job_count().await as usize, jobs, "no job was made");
}

/// `config/owners/ai-gateway.toml`'s rule, with the tests' address as the
/// trusted proxy: a client's own calls are the client's; a call the
/// proxy vouches for an end user with is the end user's. An end-user
/// header sent twice or empty by the proxy is refused, and never gets the
/// answer stored for the client's own call.
async fn an_ambiguous_end_user_is_refused_not_given_to_the_client(on: Deployment) {
    let (store, gateways) = Gateways::of(on);
    let upstream = FakeUpstream::echo().await;
    let gateway = gateways
        .gateway(&store, &upstream.url())
        .set("trusted_proxies", "[\"127.0.0.1/32\", \"::1\"]")
        .tables(&format!(
            "[[clients]]\nname = \"web-app\"\nkey_sha256 = {{ value = {:?} }}\n\
             [owner]\nsources = [\n\
             {{ all = [{{ client = true }}, {{ trusted_header = \"x-end-user\" }}] }},\n\
             {{ client = true }},\n]\n\
             [[routes]]\npath_prefix = \"/v1/chat\"\nrequire_client = true\n",
            sha256_hex("web-key"),
        ))
        .start()
        .await;
    let client = ("authorization", "Bearer web-key");
    let own = keyed(&gateway, "/v1/chat", "k", &[client]).await;
    assert_eq!(own.status, 200);
    let twice = [client, ("x-end-user", "alice"), ("x-end-user", "bob")];
    let reply = keyed(&gateway, "/v1/chat", "k", &twice).await;
    ambiguous(&reply, "x-end-user", &store, &upstream, 1).await;
    let empty = keyed(&gateway, "/v1/chat", "k", &[client, ("x-end-user", "")]).await;
    ambiguous(&empty, "x-end-user", &store, &upstream, 1).await;
    let alice = keyed(
        &gateway,
        "/v1/chat",
        "k",
        &[client, ("x-end-user", "alice")],
    )
    .await;
    assert_eq!(alice.status, 200);
    assert_ne!(
        alice.job(),
        own.job(),
        "the end user is an owner of its own"
    );
    assert_ne!(alice.body, own.body);
}

/// `[all(x-tenant, x-user), x-tenant]`: a tenant's own calls are the
/// tenant's; a user header sent twice or empty beside the tenant's is
/// refused rather than read as the tenant's call.
async fn an_ambiguous_part_of_all_is_refused_not_skipped(on: Deployment) {
    let (store, gateways) = Gateways::of(on);
    let upstream = FakeUpstream::echo().await;
    let gateway = gateways
        .gateway(&store, &upstream.url())
        .tables(
            "[owner]\nsources = [\n\
             { all = [{ header = \"x-tenant\" }, { header = \"x-user\" }] },\n\
             { header = \"x-tenant\" },\n]\n",
        )
        .start()
        .await;
    let tenant = ("x-tenant", "acme");
    let own = keyed(&gateway, "/v1/x", "k", &[tenant]).await;
    assert_eq!(own.status, 200);
    let twice = [tenant, ("x-user", "u1"), ("x-user", "u2")];
    ambiguous(
        &keyed(&gateway, "/v1/x", "k", &twice).await,
        "x-user",
        &store,
        &upstream,
        1,
    )
    .await;
    let empty = [tenant, ("x-user", "")];
    ambiguous(
        &keyed(&gateway, "/v1/x", "k", &empty).await,
        "x-user",
        &store,
        &upstream,
        1,
    )
    .await;
    // The tenant header twice is refused though the user's is fine.
    let tenants = [
        ("x-tenant", "acme"),
        ("x-tenant", "globex"),
        ("x-user", "u1"),
    ];
    ambiguous(
        &keyed(&gateway, "/v1/x", "k", &tenants).await,
        "x-tenant",
        &store,
        &upstream,
        1,
    )
    .await;
    let user = keyed(&gateway, "/v1/x", "k", &[tenant, ("x-user", "u1")]).await;
    assert_eq!(user.status, 200);
    assert_ne!(user.job(), own.job(), "the user is an owner of its own");
}

/// A session cookie sent twice with two values, empty or with no value,
/// is refused rather than skipped for the `Authorization` that follows
/// it; a request without the cookie is the bearer's, and one whose cookie
/// line also holds another cookie's UTF-8 is the session's (before, the
/// whole line was skipped and the request was the bearer's).
async fn an_ambiguous_cookie_is_refused_not_skipped(on: Deployment) {
    let (store, gateways) = Gateways::of(on);
    let upstream = FakeUpstream::echo().await;
    let gateway = gateways
        .gateway(&store, &upstream.url())
        .tables("[owner]\nsources = [{ cookie = \"sid\" }, { header = \"authorization\" }]\n")
        .start()
        .await;
    let bearer = ("authorization", "Bearer app");
    let own = keyed(&gateway, "/v1/x", "k", &[bearer]).await;
    assert_eq!(own.status, 200);
    for cookie in [
        "sid=alice; sid=bob",
        "sid=",
        "theme=dark; sid=",
        "sid; theme=dark",
    ] {
        let reply = keyed(&gateway, "/v1/x", "k", &[bearer, ("cookie", cookie)]).await;
        ambiguous(&reply, "sid cookie", &store, &upstream, 1).await;
    }
    let twice = [bearer, ("cookie", "sid=alice"), ("cookie", "sid=bob")];
    let reply = keyed(&gateway, "/v1/x", "k", &twice).await;
    ambiguous(&reply, "sid cookie", &store, &upstream, 1).await;
    let alice = keyed(&gateway, "/v1/x", "k", &[bearer, ("cookie", "sid=alice")]).await;
    assert_eq!(alice.status, 200);
    assert_ne!(alice.job(), own.job());
    let utf8 = [bearer, ("cookie", "sid=alice; name=José")];
    let beside = keyed(&gateway, "/v1/x", "k", &utf8).await;
    assert_eq!(beside.status, 200);
    assert_eq!(beside.job(), alice.job(), "the session's, not the bearer's");
}

crate::on_each_deployment!(
    [embedded, postgres, postgres_redis]
    an_ambiguous_end_user_is_refused_not_given_to_the_client,
    an_ambiguous_part_of_all_is_refused_not_skipped,
    an_ambiguous_cookie_is_refused_not_skipped,
);

/// The default owner, `Authorization`, sent twice: refused as ambiguous
/// rather than as missing.
#[tokio::test]
async fn a_repeated_authorization_is_ambiguous() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .owners_required()
        .start()
        .await;
    let twice = [("authorization", "Bearer a"), ("authorization", "Bearer b")];
    let reply = keyed(&gateway, "/v1/x", "k", &twice).await;
    ambiguous(&reply, "authorization header", &store, &upstream, 0).await;
}
