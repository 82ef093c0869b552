//! Reading a credential off a request's headers: one value, none, or
//! evidence no one can stand behind (sent twice, or empty), which is
//! refused rather than skipped (`docs/design.md` §15).

use http::{HeaderMap, HeaderName};

/// What a request's headers say of one header.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum One<'a> {
    /// Not sent: the next source may be tried.
    Absent,
    /// Sent once, not empty.
    Value(&'a [u8]),
    /// Sent twice (two lines are ambiguous: which one names the owner?).
    Repeated,
    /// Sent, but empty.
    Empty,
}

impl One<'_> {
    /// Why the header cannot name an owner, in words, when it cannot.
    pub(super) fn flaw(&self) -> Option<&'static str> {
        match self {
            One::Repeated => Some("it was sent more than once"),
            One::Empty => Some("it was sent empty"),
            One::Absent | One::Value(_) => None,
        }
    }
}

/// What `headers` carry of `name`.
pub(super) fn one<'a>(headers: &'a HeaderMap, name: &HeaderName) -> One<'a> {
    let mut all = headers.get_all(name).iter();
    let Some(value) = all.next() else {
        return One::Absent;
    };
    if all.next().is_some() {
        return One::Repeated;
    }
    if value.as_bytes().iter().all(u8::is_ascii_whitespace) {
        return One::Empty;
    }
    One::Value(value.as_bytes())
}

/// A header's one non-empty value; two lines of it are ambiguous.
pub(super) fn only<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Option<&'a [u8]> {
    match one(headers, name) {
        One::Value(value) => Some(value),
        _ => None,
    }
}

/// A header value without its `Bearer ` scheme, if it has one.
pub(super) fn bearer(raw: &str) -> &str {
    match raw.split_once(' ') {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("bearer") => rest.trim(),
        _ => raw.trim(),
    }
}
