//! The operator console's session cookie, as the proxy sees it: its names
//! (set by the console, in the operations layer) and its removal from
//! every request forwarded upstream (`docs/design.md`, §14), which also
//! joins an HTTP/2 client's split `Cookie` headers into one.
//!
//! Browsers keep cookies per host, not per port: a console signed in at
//! `gateway:9090` sends its cookie to the proxy at `gateway:8080` too, and a
//! forwarded cookie would hand a live console session to the upstream and to
//! whatever it logs.

use http::header::{self, HeaderMap, HeaderValue};

/// The console cookie's name when it is not `Secure` (a plain-HTTP admin
/// listener, the default).
pub const CONSOLE_COOKIE: &str = "idemgate_console";

/// Its name when it is `Secure`: with the `__Host-` prefix a browser takes
/// the cookie only from a secure origin, with `Path=/` and no `Domain`, so no
/// other host (a sibling subdomain) can set or shadow it.
pub const CONSOLE_COOKIE_SECURE: &str = "__Host-idemgate_console";

/// The `Cookie` header as an upstream gets it: the console's cookie
/// (either name) removed, every other cookie kept byte for byte, and
/// cookies an HTTP/2 client split across several headers (RFC 9113
/// §8.2.3) joined into one with `; `, as that section asks of anything
/// passing them on: an HTTP/1.1 server reads one `Cookie` line (RFC 6265
/// §5.4), and may keep only the first or the last of several. A header
/// left empty is not sent at all. Allocates nothing for one header without
/// a console cookie.
pub fn for_upstream(headers: &mut HeaderMap) {
    let mut values = headers.get_all(header::COOKIE).iter();
    let Some(first) = values.next() else {
        return;
    };
    if values.next().is_none() && !carries_console(first) {
        return;
    }
    let kept: Vec<HeaderValue> = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(without_console)
        .collect();
    headers.remove(header::COOKIE);
    if let Some(one) = joined(kept) {
        headers.insert(header::COOKIE, one);
    }
}

/// `values` as one `Cookie` value, `; ` between them; `None` for none.
fn joined(values: Vec<HeaderValue>) -> Option<HeaderValue> {
    if values.len() <= 1 {
        return values.into_iter().next();
    }
    let mut out = Vec::with_capacity(values.iter().map(|v| v.len() + 2).sum());
    for (i, value) in values.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(b"; ");
        }
        out.extend_from_slice(value.as_bytes());
    }
    // Valid values and `; ` between them: still a valid value.
    HeaderValue::from_bytes(&out).ok()
}

/// Whether a `Cookie` header value holds a console cookie.
fn carries_console(value: &HeaderValue) -> bool {
    pairs(value).any(is_console)
}

/// A `Cookie` value without its console cookies; `None` when nothing else
/// is left.
fn without_console(value: &HeaderValue) -> Option<HeaderValue> {
    if !carries_console(value) {
        return Some(value.clone());
    }
    let mut out = Vec::with_capacity(value.len());
    let mut first = true;
    for pair in pairs(value).filter(|pair| !is_console(pair)) {
        if first {
            // The space that followed a removed first cookie's `;`.
            out.extend_from_slice(pair.trim_ascii_start());
            first = false;
        } else {
            out.push(b';');
            out.extend_from_slice(pair);
        }
    }
    if out.trim_ascii().is_empty() {
        return None;
    }
    // Bytes of a valid value, none added but `;`: still a valid value.
    HeaderValue::from_bytes(&out).ok()
}

/// The `name=value` pairs of a `Cookie` value, as sent (spaces included).
fn pairs(value: &HeaderValue) -> impl Iterator<Item = &[u8]> {
    value.as_bytes().split(|&b| b == b';')
}

/// Whether a pair is the console's cookie, under either name (cookie names
/// are case-sensitive, RFC 6265 §5.4; the browser sends the name as set).
fn is_console(pair: &[u8]) -> bool {
    let name = pair.split(|&b| b == b'=').next().unwrap_or_default();
    let name = name.trim_ascii();
    name == CONSOLE_COOKIE.as_bytes() || name == CONSOLE_COOKIE_SECURE.as_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stripped(values: &[&str]) -> Vec<String> {
        let mut headers = HeaderMap::new();
        headers.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
        for value in values {
            headers.append(header::COOKIE, HeaderValue::from_str(value).unwrap());
        }
        for_upstream(&mut headers);
        assert_eq!(headers[header::ACCEPT], "*/*", "other headers stay");
        headers
            .get_all(header::COOKIE)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn the_console_cookie_goes_under_either_name_and_the_others_stay_as_sent() {
        for name in [CONSOLE_COOKIE, CONSOLE_COOKIE_SECURE] {
            let cases: [(&str, &[&str]); 6] = [
                ("a=1; {c}=s; b=2", &["a=1; b=2"]),
                ("{c}=s; a=1", &["a=1"]),
                ("a=1;{c}=s", &["a=1"]),
                ("{c}=s", &[]),
                ("a=1;b=\"x y\";  c=3", &["a=1;b=\"x y\";  c=3"]),
                ("a=1; {c}=s; {c}=t; z", &["a=1; z"]),
            ];
            for (sent, forwarded) in cases {
                let sent = sent.replace("{c}", name);
                assert_eq!(stripped(&[&sent]), forwarded, "{sent}");
            }
        }
    }

    #[test]
    fn cookies_split_across_headers_go_on_as_one() {
        assert_eq!(
            stripped(&[
                "a=1",
                "idemgate_console=s",
                "__Host-idemgate_console=s; b=2"
            ]),
            ["a=1; b=2"]
        );
        assert_eq!(
            stripped(&["a=1", "b=2;c=3", "d=\"x y\""]),
            ["a=1; b=2;c=3; d=\"x y\""]
        );
        assert_eq!(stripped(&["idemgate_console=s", "a=1"]), ["a=1"]);
        assert!(stripped(&["idemgate_console=s"]).is_empty());
        assert!(stripped(&["idemgate_console=s", "idemgate_console=t"]).is_empty());
        assert_eq!(stripped(&[]), Vec::<String>::new());
    }

    #[test]
    fn only_those_names_are_the_console_cookie() {
        let others =
            "idemgate_console_x=1; xidemgate_console=2; Idemgate_Console=3; __Host-other=4";
        assert_eq!(stripped(&[others]), [others]);
    }
}
