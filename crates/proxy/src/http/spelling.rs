//! Header names as an upstream may read them. A CGI-style upstream (WSGI,
//! Rack, PHP-FPM) folds `_` into `-` (`X_End_User` and `X-End-User` are
//! both its `HTTP_X_END_USER`), so removing a header an untrusted peer may
//! not set means removing every spelling of it (nginx drops names with `_`
//! by default for this reason; `docs/design.md` §15).

use http::header::{HeaderMap, HeaderName};

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
