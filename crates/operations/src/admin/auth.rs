//! Who may call `/admin/v1/*`: whoever sends the admin token as a bearer
//! token, or the console's own page with a live session (`docs/design.md`,
//! §14; the sessions themselves are [`Console`]'s).

use http::{header, HeaderMap};
use subtle::ConstantTimeEq;

use super::error::AdminError;
use crate::console::{self, Console};

/// Lets a request through when it carries the admin `token` (compared in
/// constant time) or a live session of `console` on a request from the
/// console; with no token configured, the API is off.
pub(super) fn authorize(
    token: Option<&str>,
    console: &Console,
    headers: &HeaderMap,
) -> Result<(), AdminError> {
    let Some(token) = token else {
        return Err(AdminError::Disabled);
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    let bearer = bool::from(given.as_bytes().ct_eq(token.as_bytes()));
    if bearer || (console::from_console(headers) && console.signed_in(headers)) {
        Ok(())
    } else {
        Err(AdminError::Unauthorized)
    }
}
