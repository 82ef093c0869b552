//! Owner evidence read off a request's head (`docs/design.md` §15): what
//! is not sent falls through, what is sent ambiguously or does not verify
//! refuses, and a claim's JSON type is part of the owner.

use std::sync::Arc;

use base64::engine::general_purpose::URL_SAFE_NO_PAD as URL_SAFE;
use base64::Engine;
use http::{HeaderName, Request};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde_json::{json, Value};

use super::*;
use idemgate_domain::key::OwnerSalt;

const SECRET: &[u8] = b"an HS256 secret of more than 32 bytes, for tests";

fn trust() -> Trust {
    Trust::with_salt(OwnerSalt::new(b"a salt of tests, sixteen bytes+"))
}

fn head(headers: &[(&str, &str)]) -> http::request::Parts {
    let mut req = Request::builder();
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    req.body(()).unwrap().into_parts().0
}

fn header(name: &'static str) -> OwnerSource {
    OwnerSource::Header(HeaderName::from_static(name))
}

fn rule(sources: Vec<OwnerSource>) -> OwnerRule {
    OwnerRule {
        sources,
        allow_anonymous: false,
    }
}

fn jwt(claim: &str, audience: Option<&str>) -> OwnerSource {
    let mut validation = Validation::new(Algorithm::HS256);
    match audience {
        Some(aud) => {
            validation.set_audience(&[aud]);
            validation.set_required_spec_claims(&["exp", "aud"]);
        }
        None => validation.validate_aud = false,
    }
    OwnerSource::Jwt(Arc::new(JwtSource {
        claim: claim.to_owned(),
        from: http::header::AUTHORIZATION,
        keys: vec![(None, DecodingKey::from_secret(SECRET))],
        validation,
        beside: Vec::new(),
        owned_by_issuer: false,
    }))
}

const OTHER_SECRET: &[u8] = b"another issuer's HS256 secret, 32 bytes and more";

/// A source of `sub` on `Authorization` for tokens `issuer` signs with
/// `secret`, beside sources of the same claim for `beside`; the first of
/// them (`owned` false) keeps its owners as they were.
fn issuer(issuer: &str, secret: &[u8], beside: &[&str], owned: bool) -> OwnerSource {
    let mut validation = Validation::new(Algorithm::HS256);
    validation.validate_aud = false;
    validation.set_issuer(&[issuer]);
    validation.set_required_spec_claims(&["exp", "iss"]);
    OwnerSource::Jwt(Arc::new(JwtSource {
        claim: "sub".to_owned(),
        from: http::header::AUTHORIZATION,
        keys: vec![(None, DecodingKey::from_secret(secret))],
        validation,
        beside: beside.iter().map(|b| (*b).to_owned()).collect(),
        owned_by_issuer: owned,
    }))
}

fn signed(claims: Value, secret: &[u8]) -> String {
    let key = EncodingKey::from_secret(secret);
    let token = jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &key).unwrap();
    format!("Bearer {token}")
}

/// Two issuers' tokens on one header (design §15, "Several issuers"):
/// each is verified by its own issuer's source, whatever the order, and
/// `alice` of one is not `alice` of the other. A token that names an
/// issuer no source is for, or names one and is signed by another's key,
/// is refused, never passed on to a wider source. Before, the second
/// issuer's users were refused by the first source.
#[test]
fn two_issuers_on_one_header_are_each_verified_by_their_own_source() {
    let trust = trust();
    let (a, b) = ("https://a.example", "https://b.example");
    let rule = rule(vec![
        issuer(a, SECRET, &[b], false),
        issuer(b, OTHER_SECRET, &[a], true),
        header("x-api-key"),
    ]);
    let owner = |token: &str| {
        trust.owner(
            &rule,
            &head(&[("authorization", token), ("x-api-key", "k")]),
        )
    };
    let of_a = signed(json!({ "sub": "alice", "iss": a, "exp": exp() }), SECRET);
    let of_b = signed(
        json!({ "sub": "alice", "iss": b, "exp": exp() }),
        OTHER_SECRET,
    );
    let (at_a, at_b) = (owner(&of_a).unwrap(), owner(&of_b).unwrap());
    assert_ne!(at_a, at_b, "alice of one issuer is not alice of the other");
    let alone = super::OwnerRule {
        sources: vec![issuer(a, SECRET, &[], false)],
        allow_anonymous: false,
    };
    let before = trust.owner(&alone, &head(&[("authorization", &of_a)]));
    assert_eq!(before.unwrap(), at_a, "the first source keeps its owners");
    assert_eq!(owner(&of_b).unwrap(), at_b);
    for refused in [
        signed(
            json!({ "sub": "alice", "iss": "https://c.example", "exp": exp() }),
            SECRET,
        ),
        signed(json!({ "sub": "alice", "iss": b, "exp": exp() }), SECRET),
        signed(json!({ "sub": "alice", "exp": exp() }), OTHER_SECRET),
    ] {
        let error = owner(&refused).unwrap_err();
        assert!(matches!(error, TrustError::OwnerUnproven { .. }), "{error}");
    }
}

fn bearer(claims: Value) -> String {
    let token = jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(SECRET),
    )
    .unwrap();
    format!("Bearer {token}")
}

fn exp() -> u64 {
    jsonwebtoken::get_current_timestamp() + 600
}

#[test]
fn a_source_not_sent_falls_through_and_one_sent_ambiguously_refuses() {
    let trust = trust();
    let tenant_user = rule(vec![
        OwnerSource::All(vec![header("x-tenant"), header("x-user")]),
        header("x-tenant"),
    ]);
    let tenant = trust
        .owner(&tenant_user, &head(&[("x-tenant", "acme")]))
        .unwrap();
    let user = trust
        .owner(
            &tenant_user,
            &head(&[("x-tenant", "acme"), ("x-user", "u1")]),
        )
        .unwrap();
    assert_ne!(tenant, user);
    for ambiguous in [
        &[("x-tenant", "acme"), ("x-user", "u1"), ("x-user", "u2")][..],
        &[("x-tenant", "acme"), ("x-user", "")][..],
        &[
            ("x-tenant", "acme"),
            ("x-tenant", "globex"),
            ("x-user", "u1"),
        ][..],
    ] {
        let refused = trust.owner(&tenant_user, &head(ambiguous)).unwrap_err();
        assert!(
            matches!(refused, TrustError::OwnerAmbiguous { .. }),
            "{refused}"
        );
    }
}

#[test]
fn a_cookie_sent_twice_or_empty_refuses() {
    let trust = trust();
    let cookie = rule(vec![
        OwnerSource::Cookie("sid".into()),
        header("authorization"),
    ]);
    for sent in ["sid=a; sid=b", "sid=", "theme=dark; sid="] {
        let refused = trust
            .owner(&cookie, &head(&[("cookie", sent), ("authorization", "x")]))
            .unwrap_err();
        assert!(
            matches!(refused, TrustError::OwnerAmbiguous { .. }),
            "{sent}"
        );
    }
    trust
        .owner(&cookie, &head(&[("cookie", "sid=a; sid=a")]))
        .expect("one value sent twice names one owner");
    let bare = trust
        .owner(
            &cookie,
            &head(&[("cookie", "sid; theme=dark"), ("authorization", "x")]),
        )
        .unwrap_err();
    assert!(matches!(bare, TrustError::OwnerAmbiguous { .. }), "{bare}");
}

/// A `Cookie` line that also carries another cookie's UTF-8 (a browser
/// sends them all on one line) still names its session: the owner is the
/// session's, not the next, wider source's. Before, the whole line was
/// skipped as unreadable text, and two users' requests with such a cookie
/// fell to one owner (a replay of one's answer to the other).
#[test]
fn a_session_cookie_beside_a_utf8_cookie_is_read() {
    let trust = trust();
    let cookie = rule(vec![
        OwnerSource::Cookie("sid".into()),
        header("authorization"),
    ]);
    let sent = |line: &[u8]| {
        let mut head = head(&[("authorization", "shared-client")]);
        let value = http::HeaderValue::from_bytes(line).unwrap();
        head.headers.insert(http::header::COOKIE, value);
        trust.owner(&cookie, &head).unwrap()
    };
    let alice = sent("sid=alice; name=José".as_bytes());
    let bob = sent("sid=bob; name=Renée".as_bytes());
    assert_ne!(alice, bob);
    assert_eq!(alice, sent(b"sid=alice"), "the same owner as without it");
    assert_ne!(alice, sent(b"theme=dark"), "not the wider source's");
    // A value of its own in UTF-8 is its bytes.
    assert_ne!(sent("sid=é".as_bytes()), sent("sid=e".as_bytes()));
}

#[test]
fn a_token_that_does_not_verify_refuses_rather_than_falls_through() {
    let trust = trust();
    let rule = rule(vec![jwt("sub", Some("orders")), header("x-api-key")]);
    let good = bearer(json!({ "sub": "alice", "aud": ["x", "orders"], "exp": exp() }));
    trust
        .owner(&rule, &head(&[("authorization", &good)]))
        .unwrap();
    let crit = {
        let header = URL_SAFE.encode(r#"{"alg":"HS256","crit":["exp"]}"#);
        let claims =
            URL_SAFE.encode(json!({ "sub": "a", "aud": "orders", "exp": exp() }).to_string());
        let message = format!("{header}.{claims}");
        let key = EncodingKey::from_secret(SECRET);
        let signature =
            jsonwebtoken::crypto::sign(message.as_bytes(), &key, Algorithm::HS256).unwrap();
        format!("Bearer {message}.{signature}")
    };
    for bad in [
        bearer(json!({ "sub": "alice", "exp": exp() })),
        bearer(json!({ "sub": "alice", "aud": 5, "exp": exp() })),
        bearer(json!({ "sub": "alice", "aud": ["orders", 5], "exp": exp() })),
        bearer(json!({ "sub": "alice", "aud": "orders", "exp": exp(), "nbf": "0" })),
        bearer(json!({ "aud": "orders", "exp": exp() })),
        crit,
        "Bearer not-a-token".to_owned(),
    ] {
        let sent = head(&[("authorization", &bad), ("x-api-key", "k")]);
        let refused = trust.owner(&rule, &sent).unwrap_err();
        assert!(
            matches!(refused, TrustError::OwnerUnproven { .. }),
            "{bad}: {refused}"
        );
    }
    let none = trust.owner(&rule, &head(&[("x-api-key", "k")]));
    assert!(none.is_ok(), "no token sent: the next source");
}

#[test]
fn a_claims_json_type_is_part_of_its_owner() {
    let trust = trust();
    let rule = rule(vec![jwt("uid", None)]);
    let owner = |uid: Value| {
        let token = bearer(json!({ "uid": uid, "exp": exp() }));
        trust
            .owner(&rule, &head(&[("authorization", &token)]))
            .unwrap()
    };
    assert_ne!(owner(json!(123)), owner(json!("123")));
    assert_ne!(owner(json!(true)), owner(json!("true")));
    assert_eq!(owner(json!(123)), owner(json!(123)));
}
