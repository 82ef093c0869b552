//! A JWT owner source verifies like a careful verifier (`docs/design.md`
//! §15): a configured audience and issuer must be in the token, times are
//! numbers, a `crit` header is refused, the leeway is a setting, and a
//! claim's JSON type is part of the owner. Every refusal is the 401 an
//! invalid token gets, with nothing stored or sent.

use jsonwebtoken::{Algorithm, EncodingKey};
use serde_json::{json, Value};

use super::owners::{base64_url, keyed, now, refused, token, Gateways};
use crate::support::deployment::Deployment;
use crate::support::gateway::Builder;
use crate::support::{FakeUpstream, TestStore};

const SECRET: &str = "an HS256 secret of more than 32 bytes, for tests";

/// A gateway whose owner is the `claim` of an HS256 token in
/// `Authorization`, with these extra options on the source.
fn jwt_gateway(
    gateways: &Gateways,
    store: &TestStore,
    upstream: &FakeUpstream,
    claim: &str,
    options: &str,
) -> Builder {
    gateways.gateway(store, &upstream.url()).tables(&format!(
        "[owner]\nsources = [{{ jwt = {claim:?}, secret = {{ value = {SECRET:?} }}, algorithms = [\"HS256\"]{options} }}]\n"
    ))
}

fn signed(claims: Value) -> String {
    format!(
        "Bearer {}",
        token(
            Algorithm::HS256,
            &EncodingKey::from_secret(SECRET.as_bytes()),
            claims
        )
    )
}

/// A token signed as it should be, whose header is `header` as written.
fn signed_with_header(header: Value, claims: Value) -> String {
    let message = format!(
        "{}.{}",
        base64_url(&header.to_string()),
        base64_url(&claims.to_string())
    );
    let key = EncodingKey::from_secret(SECRET.as_bytes());
    let signature = jsonwebtoken::crypto::sign(message.as_bytes(), &key, Algorithm::HS256).unwrap();
    format!("Bearer {message}.{signature}")
}

/// With `audience` and `issuer` configured, a correctly signed token that
/// leaves either out, or gives one of another JSON type, proves nothing;
/// so does a time written as text, or a header with `crit`. `aud` may be
/// a string or an array of strings.
async fn a_configured_audience_and_issuer_must_be_in_the_token(on: Deployment) {
    let (store, gateways) = Gateways::of(on);
    let upstream = FakeUpstream::echo().await;
    let options = ", audience = \"orders\", issuer = \"https://id.example\"";
    let gateway = jwt_gateway(&gateways, &store, &upstream, "sub", options)
        .start()
        .await;
    let iss = "https://id.example";
    let exp = now() + 600;
    let one = signed(json!({ "sub": "alice", "aud": "orders", "iss": iss, "exp": exp }));
    let first = keyed(&gateway, "/v1/x", "k", &[("authorization", &one)]).await;
    assert_eq!(first.status, 200);
    let among =
        signed(json!({ "sub": "alice", "aud": ["billing", "orders"], "iss": iss, "exp": exp }));
    let again = keyed(&gateway, "/v1/x", "k", &[("authorization", &among)]).await;
    assert_eq!(again.status, 200);
    assert_eq!(
        again.job(),
        first.job(),
        "an array naming the audience is the same owner"
    );

    let tokens = [
        signed(json!({ "sub": "alice", "iss": iss, "exp": exp })),
        signed(json!({ "sub": "alice", "aud": 5, "iss": iss, "exp": exp })),
        signed(json!({ "sub": "alice", "aud": ["orders", 5], "iss": iss, "exp": exp })),
        signed(json!({ "sub": "alice", "aud": {"orders": true}, "iss": iss, "exp": exp })),
        signed(json!({ "sub": "alice", "aud": "orders", "exp": exp })),
        signed(json!({ "sub": "alice", "aud": "orders", "iss": [iss], "exp": exp })),
        signed(json!({ "sub": "alice", "aud": "orders", "iss": iss, "exp": exp.to_string() })),
        signed(
            json!({ "sub": "alice", "aud": "orders", "iss": iss, "exp": exp, "nbf": (now() + 600).to_string() }),
        ),
        signed_with_header(
            json!({ "alg": "HS256", "typ": "JWT", "crit": ["exp"] }),
            json!({ "sub": "alice", "aud": "orders", "iss": iss, "exp": exp }),
        ),
    ];
    for (i, bad) in tokens.iter().enumerate() {
        let reply = keyed(
            &gateway,
            "/v1/x",
            &format!("bad-{i}"),
            &[("authorization", bad)],
        )
        .await;
        refused(&reply, "owner-required", &store, &upstream, 1).await;
        assert!(
            reply.problem_detail().contains("authorization"),
            "token {i}: {}",
            reply.problem_detail()
        );
    }
}

/// `leeway` is how far the issuer's clock may be from the gateway's: 60 s
/// unless set. With `leeway = "0s"` a token expired 30 s ago, or valid
/// only in 30 s, proves nothing; with the default it does.
async fn the_jwt_leeway_is_a_setting(on: Deployment) {
    let (store, gateways) = Gateways::of(on);
    let upstream = FakeUpstream::echo().await;
    let expired = signed(json!({ "sub": "alice", "exp": now() - 30 }));
    let early = signed(json!({ "sub": "bob", "exp": now() + 600, "nbf": now() + 30 }));
    let mut strict = jwt_gateway(&gateways, &store, &upstream, "sub", ", leeway = \"0s\"")
        .start()
        .await;
    for (i, bad) in [&expired, &early].into_iter().enumerate() {
        let reply = keyed(
            &strict,
            "/v1/x",
            &format!("k{i}"),
            &[("authorization", bad)],
        )
        .await;
        refused(&reply, "owner-required", &store, &upstream, 0).await;
    }
    // The embedded store serves one gateway at a time: the next starts
    // once this one has exited (a drop only sends the signal).
    strict.kill().await;

    let lenient = jwt_gateway(&gateways, &store, &upstream, "sub", "")
        .start()
        .await;
    for (i, within) in [&expired, &early].into_iter().enumerate() {
        let reply = keyed(
            &lenient,
            "/v1/x",
            &format!("k{i}"),
            &[("authorization", within)],
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.problem_detail());
    }
}

/// A claim that is the number `123` and one that is the text `"123"` are
/// two owners: neither gets the other's stored answer.
async fn claims_of_two_json_types_are_two_owners(on: Deployment) {
    let (store, gateways) = Gateways::of(on);
    let upstream = FakeUpstream::echo().await;
    let gateway = jwt_gateway(&gateways, &store, &upstream, "uid", "")
        .start()
        .await;
    let number = signed(json!({ "uid": 123, "exp": now() + 600 }));
    let text = signed(json!({ "uid": "123", "exp": now() + 600 }));
    let first = keyed(&gateway, "/v1/x", "k", &[("authorization", &number)]).await;
    let second = keyed(&gateway, "/v1/x", "k", &[("authorization", &text)]).await;
    assert_eq!((first.status, second.status), (200, 200));
    assert_eq!(second.header("idempotent-replayed"), None);
    assert_ne!(first.job(), second.job(), "one job per owner");
    assert_ne!(first.body, second.body);
    assert_eq!(upstream.hits(), 2);
    let again = keyed(&gateway, "/v1/x", "k", &[("authorization", &number)]).await;
    assert_eq!(
        again.job(),
        first.job(),
        "the number is still its own owner"
    );
}

crate::on_each_deployment!(
    [embedded, postgres, postgres_redis]
    a_configured_audience_and_issuer_must_be_in_the_token,
    the_jwt_leeway_is_a_setting,
    claims_of_two_json_types_are_two_owners,
);

/// A leeway that would make `exp` meaningless stops start-up, naming the
/// key and the fix.
#[tokio::test]
async fn a_leeway_past_five_minutes_stops_start_up() {
    let (store, gateways) = Gateways::of(Deployment::embedded().await);
    let upstream = FakeUpstream::echo().await;
    let failed = jwt_gateway(&gateways, &store, &upstream, "sub", ", leeway = \"10m\"")
        .start_and_fail()
        .await;
    assert!(
        failed.contains("owner.sources[0].leeway") && failed.contains("five minutes"),
        "{failed}"
    );
}
