//! The operator console, served on the admin listener under `/console/`:
//! static pages compiled into the binary (no CDN, no build step) over the
//! admin API.
//!
//! Signing in with the admin token sets a session cookie (a digest of the
//! token, `HttpOnly`, `SameSite=Strict`); nothing of the console but the
//! sign-in page is served without it. The admin API accepts the cookie in
//! place of the bearer token only on requests that carry
//! `X-Idemgate-Console: 1`, which a page on another site cannot send, so the
//! cookie alone never authorizes anything (no cross-site request forgery).

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Response, StatusCode};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::proxy::http::{full, Body};

const LOGIN: &str = include_str!("login.html");
const INDEX: &str = include_str!("index.html");
const SCRIPT: &str = include_str!("console.js");
const STYLE: &str = include_str!("console.css");

/// The cookie holding a console session.
const COOKIE: &str = "idemgate_console";
/// The header console requests carry (see the module's documentation).
pub const CONSOLE_HEADER: &str = "x-idemgate-console";

/// The console's session value for `token`: a digest, so the token itself
/// is never stored in the browser.
fn session(token: &str) -> String {
    let digest = Sha256::digest(format!("idemgate-console\0{token}").as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `headers` carry a console session for `token`.
pub fn signed_in(headers: &HeaderMap, token: &str) -> bool {
    let expected = session(token);
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .any(|(name, value)| {
            name == COOKIE && bool::from(value.as_bytes().ct_eq(expected.as_bytes()))
        })
}

/// Whether a request comes from the console's own page.
pub fn from_console(headers: &HeaderMap) -> bool {
    headers.get(CONSOLE_HEADER).is_some_and(|v| v == "1")
}

/// A console page or asset: `path` is what follows `/console/`.
pub fn asset(path: &str, signed_in: bool) -> Response<Body> {
    match (path, signed_in) {
        ("" | "index.html", true) => page(StatusCode::OK, INDEX, "text/html; charset=utf-8"),
        ("" | "index.html", false) => login(StatusCode::OK, None),
        ("console.js", true) => page(StatusCode::OK, SCRIPT, "text/javascript; charset=utf-8"),
        ("console.css", true) => page(StatusCode::OK, STYLE, "text/css; charset=utf-8"),
        ("console.js" | "console.css", false) => page(
            StatusCode::UNAUTHORIZED,
            "sign in at /console/ first\n",
            "text/plain; charset=utf-8",
        ),
        _ => not_found(),
    }
}

/// Anything else under `/console/`.
pub fn not_found() -> Response<Body> {
    page(
        StatusCode::NOT_FOUND,
        "no such console page\n",
        "text/plain; charset=utf-8",
    )
}

/// Answers the sign-in form (`token=…`, form-encoded) for admin `token`.
pub fn sign_in(form: &[u8], token: &str) -> Response<Body> {
    let given = form_urlencoded::parse(form)
        .find(|(name, _)| name == "token")
        .map(|(_, value)| value.into_owned())
        .unwrap_or_default();
    if !bool::from(given.as_bytes().ct_eq(token.as_bytes())) {
        return login(
            StatusCode::UNAUTHORIZED,
            Some(
                "That is not the admin token. Use the value of admin_token (IDEMGATE_ADMIN_TOKEN).",
            ),
        );
    }
    let cookie = format!(
        "{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict; Max-Age=43200",
        session(token)
    );
    redirect(Some(cookie))
}

/// Signs out: the session cookie is cleared.
pub fn sign_out() -> Response<Body> {
    redirect(Some(format!(
        "{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"
    )))
}

/// The sign-in page when the admin API is off: it says why.
pub fn disabled() -> Response<Body> {
    login(
        StatusCode::FORBIDDEN,
        Some("The admin API is off: no admin token is configured. Set admin_token (--admin-token, IDEMGATE_ADMIN_TOKEN) and restart."),
    )
}

fn login(status: StatusCode, error: Option<&str>) -> Response<Body> {
    let text = match error {
        Some(error) => LOGIN.replace(
            "<!--error-->",
            &format!(
                "<div class=\"error\" id=\"error\" role=\"alert\">{}</div>",
                escape(error)
            ),
        ),
        None => LOGIN.to_owned(),
    };
    page(status, text, "text/html; charset=utf-8")
}

fn redirect(cookie: Option<String>) -> Response<Body> {
    let mut response = page(StatusCode::SEE_OTHER, "", "text/plain; charset=utf-8");
    response
        .headers_mut()
        .insert(header::LOCATION, HeaderValue::from_static("/console/"));
    if let Some(cookie) = cookie.and_then(|c| HeaderValue::from_str(&c).ok()) {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    response
}

fn page(status: StatusCode, body: impl Into<Bytes>, content_type: &'static str) -> Response<Body> {
    let mut response = Response::new(full(body.into()));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    // Only its own script; inline styles for the timeline's bars.
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
             frame-ancestors 'none'; form-action 'self'",
        ),
    );
    response
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cookie_of(response: &Response<Body>) -> String {
        let set = response.headers()[header::SET_COOKIE].to_str().unwrap();
        set.split(';').next().unwrap().to_owned()
    }

    #[test]
    fn only_the_token_signs_in_and_the_cookie_is_not_the_token() {
        let wrong = sign_in(b"token=nope", "s3cret");
        assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
        assert!(wrong.headers().get(header::SET_COOKIE).is_none());
        let right = sign_in(b"token=s3cret", "s3cret");
        assert_eq!(right.status(), StatusCode::SEE_OTHER);
        let cookie = cookie_of(&right);
        assert!(!cookie.contains("s3cret"));
        let mut headers = HeaderMap::new();
        headers.insert(header::COOKIE, HeaderValue::from_str(&cookie).unwrap());
        assert!(signed_in(&headers, "s3cret"));
        assert!(!signed_in(&headers, "another token"));
        assert!(!signed_in(&HeaderMap::new(), "s3cret"));
    }

    #[test]
    fn nothing_but_the_sign_in_page_without_a_session() {
        assert_eq!(
            asset("console.js", false).status(),
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            asset("console.css", false).status(),
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(asset("console.js", true).status(), StatusCode::OK);
        assert_eq!(asset("nope", true).status(), StatusCode::NOT_FOUND);
    }
}
