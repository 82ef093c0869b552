//! Reading a credential off a request's headers: one value, or none when
//! it is absent, empty or sent twice (two lines are ambiguous).

use http::{HeaderMap, HeaderName};

/// A header's one non-empty value; two lines of it are ambiguous.
pub(super) fn only<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Option<&'a [u8]> {
    let mut all = headers.get_all(name).iter();
    let value = all.next()?;
    if all.next().is_some() || value.is_empty() {
        return None;
    }
    Some(value.as_bytes())
}

/// A header value without its `Bearer ` scheme, if it has one.
pub(super) fn bearer(raw: &str) -> &str {
    match raw.split_once(' ') {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("bearer") => rest.trim(),
        _ => raw.trim(),
    }
}
