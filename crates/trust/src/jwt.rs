//! A JWT owner source: the token's signature verified with the configured
//! keys (`kid` picks one where the keys name theirs), `exp` and `nbf`
//! honoured within the source's `leeway`, audience and issuer present and
//! matching where configured; then the claim. The signature and times are
//! jsonwebtoken's to check; the shape of the claims, and the header's
//! `crit`, are checked here (`docs/design.md` §15).

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use http::HeaderMap;
use jsonwebtoken::errors::ErrorKind;
use serde_json::Value;

use super::headers::{bearer, one, One};
use crate::settings::JwtSource;

/// Why a token sent names no owner.
#[derive(Debug)]
pub(super) enum Refusal {
    /// Its header was sent twice, or empty.
    Ambiguous(&'static str),
    /// It does not verify, or verifies and names no owner.
    Unverified(String),
}

fn unverified(why: impl Into<String>) -> Refusal {
    Refusal::Unverified(why.into())
}

/// The owner claim of the token `headers` carry: `None` when no token was
/// sent. A claim that is a string is its text; any other JSON value is
/// its JSON behind a byte no UTF-8 text begins with, so `123` and `"123"`
/// are two owners.
pub(super) fn claim(source: &JwtSource, headers: &HeaderMap) -> Result<Option<Vec<u8>>, Refusal> {
    let raw = match one(headers, &source.from) {
        One::Absent => return Ok(None),
        One::Value(raw) => raw,
        sent => {
            return Err(Refusal::Ambiguous(
                sent.flaw().unwrap_or("it cannot be read"),
            ))
        }
    };
    let raw = std::str::from_utf8(raw).map_err(|_| unverified("it is not a token"))?;
    // Another source's issuer made it: that source verifies it.
    if !source.beside.is_empty() {
        if let Some(issuer) = issuer_named(bearer(raw)) {
            if source.issuer() != Some(&issuer) && source.beside.contains(&issuer) {
                return Ok(None);
            }
        }
    }
    let claims = verified(source, bearer(raw))?;
    shape(source, &claims)?;
    match claims.get(&source.claim) {
        Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone().into_bytes())),
        None | Some(Value::Null | Value::String(_)) => Err(unverified(format!(
            "the token has no `{}` claim to name its owner",
            source.claim
        ))),
        Some(other) => {
            let mut typed = vec![0xff];
            typed.extend_from_slice(other.to_string().as_bytes());
            Ok(Some(typed))
        }
    }
}

/// The claims of `token`, once its header is understood and its signature
/// and times verify under one of the source's keys.
fn verified(source: &JwtSource, token: &str) -> Result<Value, Refusal> {
    critical(token)?;
    let kid = jsonwebtoken::decode_header(token)
        .map_err(|_| unverified("it is not a token"))?
        .kid;
    let mut last = unverified("no configured key has its `kid`");
    for (_, key) in source
        .keys
        .iter()
        .filter(|(id, _)| kid.is_none() || id.is_none() || *id == kid)
    {
        match jsonwebtoken::decode::<Value>(token, key, &source.validation) {
            Ok(data) => return Ok(data.claims),
            Err(e) => last = unverified(words(e.kind())),
        }
    }
    Err(last)
}

/// The `iss` a token names, unverified: only which source's keys to
/// verify it with, never who it is (that is the verified claim's).
fn issuer_named(token: &str) -> Option<String> {
    part(token, 1)?.get("iss")?.as_str().map(str::to_owned)
}

/// The JSON of a token's `n`th part (0: its header, 1: its claims), as
/// written: unverified.
fn part(token: &str, n: usize) -> Option<Value> {
    let bytes = URL_SAFE_NO_PAD.decode(token.split('.').nth(n)?).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// A header's `crit` lists extensions a verifier must understand or refuse
/// the token (RFC 7515 §4.1.11); the gateway understands none.
fn critical(token: &str) -> Result<(), Refusal> {
    let header = part(token, 0).ok_or_else(|| unverified("it is not a token"))?;
    if header.get("crit").is_some() {
        return Err(unverified(
            "its header lists `crit` extensions, and the gateway understands none",
        ));
    }
    Ok(())
}

/// What jsonwebtoken's refusal means to the caller.
fn words(kind: &ErrorKind) -> String {
    match kind {
        ErrorKind::InvalidSignature => "its signature does not verify".to_owned(),
        ErrorKind::ExpiredSignature => "it has expired (`exp`)".to_owned(),
        ErrorKind::ImmatureSignature => "it is not valid yet (`nbf`)".to_owned(),
        ErrorKind::InvalidAudience => "it is for another audience (`aud`)".to_owned(),
        ErrorKind::InvalidIssuer => "another issuer made it (`iss`)".to_owned(),
        ErrorKind::InvalidAlgorithm => "its algorithm is not one the source accepts".to_owned(),
        ErrorKind::MissingRequiredClaim(claim) => {
            format!("its `{claim}` claim is missing or not of its type")
        }
        _ => "it is not a valid token".to_owned(),
    }
}

/// Claims of the wrong JSON type are refused rather than ignored: times are
/// numbers; where an audience is configured, `aud` is a string or an array
/// of strings (RFC 7519 §4.1.3); where an issuer is, `iss` is a string.
fn shape(source: &JwtSource, claims: &Value) -> Result<(), Refusal> {
    for time in ["exp", "nbf"] {
        if claims.get(time).is_some_and(|v| !v.is_number()) {
            return Err(unverified(format!("its `{time}` claim is not a number")));
        }
    }
    if source.validation.aud.is_some() {
        let strings = match claims.get("aud") {
            Some(Value::String(_)) => true,
            Some(Value::Array(all)) => all.iter().all(Value::is_string),
            _ => false,
        };
        if !strings {
            return Err(unverified(
                "its `aud` claim is missing, or neither a string nor an array of strings",
            ));
        }
    }
    if source.validation.iss.is_some() && !claims.get("iss").is_some_and(Value::is_string) {
        return Err(unverified("its `iss` claim is missing, or not a string"));
    }
    Ok(())
}
