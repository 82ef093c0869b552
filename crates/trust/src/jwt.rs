//! A JWT owner source: the token's signature verified with the configured
//! keys (`kid` picks one where the keys name theirs), `exp` and `nbf`
//! honoured, audience and issuer checked where configured; then the claim.
//! The verification is jsonwebtoken's, not ours.

use http::HeaderMap;
use serde_json::Value;

use super::headers::{bearer, only};
use crate::settings::JwtSource;

/// The owner claim of the token `headers` carry, if it verifies.
pub(super) fn claim(source: &JwtSource, headers: &HeaderMap) -> Option<String> {
    let raw = std::str::from_utf8(only(headers, &source.from)?).ok()?;
    let token = bearer(raw);
    let kid = jsonwebtoken::decode_header(token).ok()?.kid;
    let claims = source
        .keys
        .iter()
        .filter(|(id, _)| kid.is_none() || id.is_none() || *id == kid)
        .find_map(|(_, key)| jsonwebtoken::decode::<Value>(token, key, &source.validation).ok())?
        .claims;
    match claims.get(&source.claim)? {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Null | Value::String(_) => None,
        other => Some(other.to_string()),
    }
}
