//! The operator console, served on the admin listener under `/console/`:
//! static pages compiled into the binary (no CDN, no build step) over the
//! admin API.
//!
//! Signing in with the admin token opens a session (`session.rs`): the
//! cookie carries only its random id (`HttpOnly`, `SameSite=Strict`, and
//! `Secure` under a `__Host-` name when configured); nothing of the console
//! but the sign-in page is served without a live one, and signing out ends
//! it. The admin API accepts the cookie in place of the bearer token only
//! on requests that carry `X-Idemgate-Console: 1`, which a page on another
//! site cannot send, so the cookie alone never authorizes anything (no
//! cross-site request forgery). `docs/design.md`, §14.

mod session;
mod throttle;

use std::net::IpAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Response, StatusCode};
use subtle::ConstantTimeEq;

use idemgate_proxy::http::cookie::{CONSOLE_COOKIE, CONSOLE_COOKIE_SECURE};
use idemgate_proxy::http::{full, Body};

pub use session::Limits;
use session::Sessions;
use throttle::Throttle;
pub use throttle::Try;
pub use throttle::{MAX_FAILURES, WINDOW};

const LOGIN: &str = include_str!("login.html");
const INDEX: &str = include_str!("index.html");
const SCRIPT: &str = include_str!("console.js");
const STYLE: &str = include_str!("console.css");

/// The header console requests carry (see the module's documentation).
pub const CONSOLE_HEADER: &str = "x-idemgate-console";

/// How the console keeps its sessions.
#[derive(Debug, Clone, Copy, Default)]
pub struct Config {
    /// Whether the cookie is `Secure` (and named with the `__Host-`
    /// prefix): for a console reached over HTTPS, through a proxy that
    /// terminates TLS (the admin listener itself speaks plain HTTP).
    pub secure_cookie: bool,
    /// How long sessions live, and how many there may be.
    pub sessions: Limits,
}

/// The console: its sessions and how its cookie is set.
pub struct Console {
    sessions: Sessions,
    secure: bool,
    throttle: Throttle,
}

impl Console {
    /// A console with no session open.
    pub fn new(config: Config) -> Self {
        Console {
            sessions: Sessions::new(config.sessions),
            secure: config.secure_cookie,
            throttle: Throttle::default(),
        }
    }

    /// The name of the session cookie.
    fn cookie_name(&self) -> &'static str {
        if self.secure {
            CONSOLE_COOKIE_SECURE
        } else {
            CONSOLE_COOKIE
        }
    }

    /// The session ids `headers` carry in the console's cookie.
    fn presented<'h>(&self, headers: &'h HeaderMap) -> impl Iterator<Item = &'h str> {
        let name = self.cookie_name();
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|pair| pair.trim().split_once('='))
            .filter(move |(given, _)| *given == name)
            .map(|(_, id)| id)
    }

    /// Whether `headers` carry a live session.
    pub fn signed_in(&self, headers: &HeaderMap) -> bool {
        self.presented(headers).any(|id| self.sessions.check(id))
    }

    /// The name the operator of the live session `headers` carry gave at
    /// sign-in, if they gave one.
    pub fn operator(&self, headers: &HeaderMap) -> Option<String> {
        self.presented(headers)
            .find_map(|id| self.sessions.name(id))
    }

    /// A try at the admin token for the client at `addr`, a sign-in's or
    /// a bearer token's, or how long it must wait first, if it failed too
    /// often lately (`throttle.rs`; `docs/design.md` §14).
    pub fn try_token(&self, addr: IpAddr) -> Result<Try<'_>, Duration> {
        self.throttle.take(addr, Instant::now())
    }

    /// Answers the sign-in form (`token=…`, form-encoded) of a client's
    /// `try` for admin `token`: a new session, or the form again (a
    /// failure counted against the client's address).
    pub fn sign_in(&self, try_: Try<'_>, form: &[u8], token: &str) -> Response<Body> {
        let given = form_urlencoded::parse(form)
            .find(|(name, _)| name == "token")
            .map(|(_, value)| value.into_owned())
            .unwrap_or_default();
        if !bool::from(given.as_bytes().ct_eq(token.as_bytes())) {
            try_.failed();
            return login(
                StatusCode::UNAUTHORIZED,
                Some(
                    "That is not the admin token. Use the value of admin_token (IDEMGATE_ADMIN_TOKEN).",
                ),
            );
        }
        try_.succeeded();
        let id = self.sessions.open_named(operator_name(form));
        let max_age = self.sessions.limits().absolute.as_secs();
        redirect(self.set_cookie(&id, max_age))
    }

    /// Signs out: the session ends here, and its cookie is cleared.
    pub fn sign_out(&self, headers: &HeaderMap) -> Response<Body> {
        for id in self.presented(headers) {
            self.sessions.close(id);
        }
        redirect(self.set_cookie("", 0))
    }

    /// The `Set-Cookie` value for session `id`, kept `max_age` seconds.
    fn set_cookie(&self, id: &str, max_age: u64) -> String {
        let secure = if self.secure { "; Secure" } else { "" };
        format!(
            "{}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}",
            self.cookie_name()
        )
    }
}

/// The name the sign-in form gives (`operator=…`), recorded with what the
/// session resolves: trimmed, without control characters, at most 64
/// characters; none when empty.
fn operator_name(form: &[u8]) -> Option<String> {
    let given = form_urlencoded::parse(form)
        .find(|(name, _)| name == "operator")?
        .1;
    let name: String = given
        .trim()
        .chars()
        .filter(|c| !c.is_control())
        .take(64)
        .collect();
    (!name.is_empty()).then_some(name)
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

fn redirect(cookie: String) -> Response<Body> {
    let mut response = page(StatusCode::SEE_OTHER, "", "text/plain; charset=utf-8");
    response
        .headers_mut()
        .insert(header::LOCATION, HeaderValue::from_static("/console/"));
    if let Ok(cookie) = HeaderValue::from_str(&cookie) {
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

    const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    fn set_cookie_of(response: &Response<Body>) -> &str {
        response.headers()[header::SET_COOKIE].to_str().unwrap()
    }

    /// The `Cookie` header a browser sends back after `response`.
    fn cookie_after(response: &Response<Body>) -> HeaderMap {
        let pair = set_cookie_of(response).split(';').next().unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(header::COOKIE, HeaderValue::from_str(pair).unwrap());
        headers
    }

    fn console(secure_cookie: bool) -> Console {
        Console::new(Config {
            secure_cookie,
            ..Config::default()
        })
    }

    #[test]
    fn only_the_token_signs_in_and_each_sign_in_is_a_new_session() {
        let console = console(false);
        let wrong = console.sign_in(console.try_token(LOCAL).unwrap(), b"token=nope", "s3cret");
        assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
        assert!(wrong.headers().get(header::SET_COOKIE).is_none());
        let first = console.sign_in(console.try_token(LOCAL).unwrap(), b"token=s3cret", "s3cret");
        assert_eq!(first.status(), StatusCode::SEE_OTHER);
        let second = console.sign_in(console.try_token(LOCAL).unwrap(), b"token=s3cret", "s3cret");
        let (a, b) = (cookie_after(&first), cookie_after(&second));
        assert_ne!(a, b, "a random id, not a digest of the token");
        assert!(!set_cookie_of(&first).contains("s3cret"));
        assert!(console.signed_in(&a) && console.signed_in(&b));
        assert!(!console.signed_in(&HeaderMap::new()));
        assert!(
            !self::console(false).signed_in(&a),
            "sessions are the process's own"
        );
    }

    #[test]
    fn signing_out_ends_the_session_for_good() {
        let console = console(false);
        let cookie =
            cookie_after(&console.sign_in(console.try_token(LOCAL).unwrap(), b"token=t", "t"));
        let out = console.sign_out(&cookie);
        assert_eq!(out.status(), StatusCode::SEE_OTHER);
        assert_eq!(
            set_cookie_of(&out),
            "idemgate_console=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"
        );
        assert!(!console.signed_in(&cookie), "the old cookie, replayed");
    }

    #[test]
    fn the_cookie_is_secure_and_host_prefixed_when_configured() {
        let plain = console(false);
        let plain = plain.sign_in(plain.try_token(LOCAL).unwrap(), b"token=t", "t");
        let plain = set_cookie_of(&plain);
        assert!(plain.starts_with("idemgate_console="), "{plain}");
        assert!(
            plain.ends_with("; Path=/; HttpOnly; SameSite=Strict; Max-Age=28800"),
            "{plain}"
        );

        let console = console(true);
        let signed_in = console.sign_in(console.try_token(LOCAL).unwrap(), b"token=t", "t");
        let secure = set_cookie_of(&signed_in);
        assert!(secure.starts_with("__Host-idemgate_console="), "{secure}");
        assert!(
            secure.ends_with("; Path=/; HttpOnly; SameSite=Strict; Max-Age=28800; Secure"),
            "{secure}"
        );
        let cookie = cookie_after(&signed_in);
        assert!(console.signed_in(&cookie));
        // The same id under the unprefixed name is not the session.
        let id = secure.split(';').next().unwrap().split_once('=').unwrap().1;
        let mut unprefixed = HeaderMap::new();
        let pair = format!("idemgate_console={id}");
        unprefixed.insert(header::COOKIE, HeaderValue::from_str(&pair).unwrap());
        assert!(!console.signed_in(&unprefixed));
        let out = console.sign_out(&cookie);
        assert!(set_cookie_of(&out).starts_with("__Host-idemgate_console=;"));
        assert!(set_cookie_of(&out).ends_with("; Secure"));
        assert!(!console.signed_in(&cookie));
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
