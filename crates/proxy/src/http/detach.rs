//! A request head copied out of the connection's read buffer.
//!
//! hyper parses a request's URI and header values as slices of its
//! connection's read buffer (8 KiB at least). While a request is in flight
//! hyper reads ahead into a fresh buffer, because the request's slices
//! still point into the first; so a request kept for long (a duplicate held
//! while its job runs) keeps two read buffers alive: its own, of which it
//! uses a few hundred bytes, and hyper's (`docs/performance.md`, item 11).
//! Copied into one allocation of its own size, the head lets the first
//! buffer go.

use bytes::{BufMut, Bytes, BytesMut};
use http::request::Parts;
use http::{HeaderValue, Uri};

/// Moves `parts`' URI and header values into one allocation of their own,
/// so they no longer keep the buffer they were parsed from. Header names
/// need no copy (hyper copies the names it does not know; the rest are
/// static), nor the method (a standard one is a constant, another a copy).
/// A value that would not parse again (never, for what hyper accepted) is
/// left as it was.
pub fn detach_head(parts: &mut Parts) {
    let uri = uri_text(&parts.uri);
    let values: usize = parts.headers.values().map(HeaderValue::len).sum();
    let mut buf = BytesMut::with_capacity(uri.len() + values);
    buf.put_slice(uri.as_bytes());
    for value in parts.headers.values() {
        buf.put_slice(value.as_bytes());
    }
    let mut buf: Bytes = buf.freeze();
    if let Ok(copied) = Uri::from_maybe_shared(buf.split_to(uri.len())) {
        parts.uri = copied;
    }
    for value in parts.headers.values_mut() {
        let copy = buf.split_to(value.len());
        if let Ok(mut copied) = HeaderValue::from_maybe_shared(copy) {
            copied.set_sensitive(value.is_sensitive());
            *value = copied;
        }
    }
}

/// The URI as it was written: an origin-form request's path and query
/// without formatting; any other form through its `Display`.
fn uri_text(uri: &Uri) -> std::borrow::Cow<'_, str> {
    match (uri.scheme(), uri.authority(), uri.path_and_query()) {
        (None, None, Some(pq)) => pq.as_str().into(),
        _ => uri.to_string().into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parts of a request parsed from `buf`, as hyper slices them.
    fn parsed(buf: &Bytes) -> Parts {
        let mut req = http::Request::builder()
            .uri(Uri::from_maybe_shared(buf.slice(0..13)).unwrap())
            .body(())
            .unwrap();
        let value = HeaderValue::from_maybe_shared(buf.slice(14..)).unwrap();
        req.headers_mut().insert("x-a", value.clone());
        let mut secret = value;
        secret.set_sensitive(true);
        req.headers_mut().append("authorization", secret);
        req.into_parts().0
    }

    #[test]
    fn the_head_is_the_same_and_no_longer_shares_the_read_buffer() {
        let buf = Bytes::copy_from_slice(b"/v1/a?b=c&d=e value");
        let mut parts = parsed(&buf);
        let before = (parts.uri.clone(), parts.headers.clone());
        detach_head(&mut parts);
        assert_eq!(parts.uri, before.0);
        assert_eq!(parts.headers, before.1);
        assert!(parts.headers["authorization"].is_sensitive());
        assert!(!parts.headers["x-a"].is_sensitive());
        drop(before);
        // Only this test's handle is left on the "read buffer".
        assert!(buf.is_unique(), "the read buffer is no longer shared");
    }

    #[test]
    fn an_absolute_uri_keeps_its_scheme_and_authority() {
        let mut parts = http::Request::builder()
            .uri("http://example.com:8080/p?q=1")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        detach_head(&mut parts);
        assert_eq!(parts.uri, "http://example.com:8080/p?q=1");
        assert_eq!(parts.uri.authority().unwrap().port_u16(), Some(8080));
    }
}
