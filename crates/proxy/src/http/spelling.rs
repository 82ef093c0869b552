//! Header names as an upstream may read them. A CGI-style upstream (WSGI,
//! Rack, PHP-FPM) folds `_` into `-` (`X_End_User` and `X-End-User` are
//! both its `HTTP_X_END_USER`), so removing a header an untrusted peer may
//! not set means removing every spelling of it (nginx drops names with `_`
//! by default for this reason; `docs/design.md` §15).

use http::header::{HeaderMap, HeaderName, HeaderValue};

/// Trims the whitespace around each header value, in place. An HTTP/1
/// parser drops it (RFC 9110 §5.5); HTTP/2 hands a value over as sent
/// (RFC 9113 §8.2.1 calls such a field malformed, and hyper passes it
/// on), so `Bearer alice ` over HTTP/2 would name another owner than the
/// same credential over HTTP/1, and its retry would run again. A request
/// with no padded value, nearly every one, costs a look at each value's
/// ends and allocates nothing.
pub fn trim_values(headers: &mut HeaderMap) {
    let padded = |v: &HeaderValue| {
        let b = v.as_bytes();
        b.first().is_some_and(u8::is_ascii_whitespace)
            || b.last().is_some_and(u8::is_ascii_whitespace)
    };
    if !headers.values().any(padded) {
        return;
    }
    for value in headers.values_mut().filter(|v| padded(v)) {
        let sensitive = value.is_sensitive();
        // The trimmed bytes of a valid value are a valid value.
        if let Ok(mut trimmed) = HeaderValue::from_bytes(value.as_bytes().trim_ascii()) {
            trimmed.set_sensitive(sensitive);
            *value = trimmed;
        }
    }
}

/// Removes each of `names`, and any header that is one of them once its
/// `_` are read as `-` (names are lowercase already, so the match is
/// case-insensitive). A request without `_` in its header names, nearly
/// every one, costs a scan of its names and allocates nothing.
pub fn remove_every_spelling(headers: &mut HeaderMap, names: &[HeaderName]) {
    for name in names {
        headers.remove(name);
    }
    let folded: Vec<HeaderName> = headers
        .keys()
        .filter(|sent| sent.as_str().contains('_'))
        .filter(|sent| names.iter().any(|name| folds_to(sent, name)))
        .cloned()
        .collect();
    for sent in folded {
        headers.remove(sent);
    }
}

/// A header of `headers` that is one of `names` spelled with `_` for some
/// of its `-` (`X_Api_Version` for `x-api-version`): one an upstream
/// behind CGI reads as that header, and another upstream as another. A
/// request without `_` in its header names costs a scan of its names.
pub fn spelled_otherwise<'h, 'n>(
    headers: &'h HeaderMap,
    names: &'n [HeaderName],
) -> Option<(&'h HeaderName, &'n HeaderName)> {
    headers
        .keys()
        .filter(|sent| sent.as_str().contains('_'))
        .find_map(|sent| {
            let other = |name: &&HeaderName| *name != sent && folds_to(sent, name);
            Some((sent, names.iter().find(other)?))
        })
}

/// Whether `sent` is one of `names`, or one of them with some of its `-`
/// written `_`.
pub fn is_spelling_of(sent: &HeaderName, names: &[HeaderName]) -> bool {
    names
        .iter()
        .any(|name| sent == name || folds_to(sent, name))
}

/// `bytes` with each `%XX` decoded and `+` read as a space, as a query's
/// parameters are read by the frameworks that read them (a malformed `%`
/// is kept as it is).
pub fn percent_decoded(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
                continue;
            }
            (b'+', _) => out.push(b' '),
            (byte, _) => out.push(byte),
        }
        i += 1;
    }
    out
}

/// Whether `sent` is `name` with some of its `-` written `_`.
fn folds_to(sent: &HeaderName, name: &HeaderName) -> bool {
    let (sent, name) = (sent.as_str().as_bytes(), name.as_str().as_bytes());
    sent.len() == name.len()
        && sent
            .iter()
            .zip(name)
            .all(|(s, n)| s == n || (*s == b'_' && *n == b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_spelled_with_underscores_is_found() {
        let names = [HeaderName::from_static("x-api-version")];
        let mut h = HeaderMap::new();
        h.insert("x-api-version", HeaderValue::from_static("1"));
        h.insert("x_other", HeaderValue::from_static("1"));
        assert_eq!(spelled_otherwise(&h, &names), None);
        h.insert("x_api-version", HeaderValue::from_static("2"));
        let (sent, name) = spelled_otherwise(&h, &names).unwrap();
        assert_eq!(
            (sent.as_str(), name.as_str()),
            ("x_api-version", "x-api-version")
        );
        // A name configured with `_` is its own spelling.
        let own = [HeaderName::from_static("x_tenant")];
        let mut h = HeaderMap::new();
        h.insert("x_tenant", HeaderValue::from_static("a"));
        assert_eq!(spelled_otherwise(&h, &own), None);
    }

    #[test]
    fn query_values_are_read_as_frameworks_read_them() {
        assert_eq!(percent_decoded(b"_%6Dethod"), b"_method");
        assert_eq!(percent_decoded(b"a+b%2"), b"a b%2", "a malformed % is kept");
        let names = [HeaderName::from_static("x-http-method")];
        assert!(is_spelling_of(
            &HeaderName::from_static("x_http-method"),
            &names
        ));
        assert!(!is_spelling_of(
            &HeaderName::from_static("x-http-methods"),
            &names
        ));
    }

    #[test]
    fn values_lose_their_surrounding_whitespace_only() {
        let mut h = HeaderMap::new();
        h.insert("authorization", HeaderValue::from_static("Bearer alice \t"));
        h.append("x-a", HeaderValue::from_static(" a  b "));
        h.append("x-a", HeaderValue::from_static("c"));
        h.insert("x-empty", HeaderValue::from_static("  "));
        trim_values(&mut h);
        assert_eq!(h["authorization"], "Bearer alice");
        let a: Vec<_> = h.get_all("x-a").iter().collect();
        assert_eq!(a, ["a  b", "c"], "inner whitespace and order kept");
        assert_eq!(h["x-empty"], "");
    }

    #[test]
    fn removes_the_name_and_its_underscore_spellings_only() {
        let mut h = HeaderMap::new();
        for name in [
            "x-end-user",
            "X_End_User",
            "x_end-user",
            "x-end_users",
            "x_other",
        ] {
            h.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                "v".parse().unwrap(),
            );
        }
        remove_every_spelling(&mut h, &[HeaderName::from_static("x-end-user")]);
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["x-end_users", "x_other"]);
    }
}
