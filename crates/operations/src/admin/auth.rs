//! Who may call `/admin/v1/*`: whoever sends the admin token as a bearer
//! token, or the console's own page with a live session (`docs/design.md`,
//! §14; the sessions themselves are [`Console`]'s). Who they are is what
//! an operator's resolution records.

use http::{header, HeaderMap};
use subtle::ConstantTimeEq;

use super::error::AdminError;
use crate::console::{self, Console};

/// The header in which an operator calling with the token may give their
/// name, recorded with what they resolve (`idemgate jobs --operator`; the
/// console's operator gives it at sign-in): the token is shared, so this is
/// who they say they are, beside how they came.
pub const OPERATOR_HEADER: &str = "x-idemgate-operator";

/// The longest operator name kept.
const MAX_NAME: usize = 64;

/// Whether `headers` carry the admin `token` as a bearer token (compared
/// in constant time).
fn bearer_matches(token: Option<&str>, headers: &HeaderMap) -> bool {
    let Some(token) = token else {
        return false;
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    bool::from(given.as_bytes().ct_eq(token.as_bytes()))
}

/// Lets a request through when it carries the admin `token` (compared in
/// constant time) or a live session of `console` on a request from the
/// console; with no token configured, the API is off. Answers who called:
/// `admin token` or `console session`, with the name the operator gave
/// (`alice (admin token)`).
pub(super) fn authorize(
    token: Option<&str>,
    console: &Console,
    headers: &HeaderMap,
) -> Result<String, AdminError> {
    if token.is_none() {
        return Err(AdminError::Disabled);
    }
    let (how, named) = if bearer_matches(token, headers) {
        ("admin token", name(headers)?)
    } else if console::from_console(headers) && console.signed_in(headers) {
        // The name given at sign-in: the console's page sends no other.
        ("console session", console.operator(headers))
    } else {
        return Err(AdminError::Unauthorized);
    };
    Ok(match named {
        Some(name) => format!("{name} ({how})"),
        None => how.to_owned(),
    })
}

/// The operator's name, when the request gives one: printable, at most
/// [`MAX_NAME`] characters.
fn name(headers: &HeaderMap) -> Result<Option<String>, AdminError> {
    let Some(value) = headers.get(OPERATOR_HEADER) else {
        return Ok(None);
    };
    let refused = || {
        AdminError::bad_request(format!(
            "{OPERATOR_HEADER} must be a name of at most {MAX_NAME} printable characters"
        ))
    };
    let text = std::str::from_utf8(value.as_bytes())
        .map_err(|_| refused())?
        .trim();
    if text.chars().count() > MAX_NAME || text.chars().any(char::is_control) {
        return Err(refused());
    }
    Ok((!text.is_empty()).then(|| text.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in pairs {
            h.insert(*name, value.parse().unwrap());
        }
        h
    }

    #[test]
    fn the_caller_is_how_they_came_with_the_name_they_gave() {
        let console = Console::new(console::Config::default());
        let bearer = ("authorization", "Bearer t");
        let who = |pairs: &[(&'static str, &str)]| authorize(Some("t"), &console, &headers(pairs));
        assert_eq!(who(&[bearer]).unwrap(), "admin token");
        assert_eq!(
            who(&[bearer, (OPERATOR_HEADER, " alice ")]).unwrap(),
            "alice (admin token)"
        );
        assert_eq!(
            who(&[bearer, (OPERATOR_HEADER, "")]).unwrap(),
            "admin token"
        );
        let long = "a".repeat(MAX_NAME + 1);
        assert!(matches!(
            who(&[bearer, (OPERATOR_HEADER, &long)]),
            Err(AdminError::BadRequest(_))
        ));
        assert!(matches!(
            who(&[("authorization", "Bearer x")]),
            Err(AdminError::Unauthorized)
        ));
    }
}
