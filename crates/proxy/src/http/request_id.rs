//! Request ids for requests that arrive without an `X-Request-Id`.
//!
//! A random 64-bit prefix drawn once per process, then a counter: unique
//! across replicas for any practical purpose, and made with one atomic add
//! and a hex encode. A random UUID per request (format, validate, copy) was
//! a visible share of a passed-through request's CPU (docs/performance.md).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use http::{HeaderValue, Request};
use tower_http::request_id::{MakeRequestId, RequestId};

/// Makes `<16 hex digits of this process>-<16 hex digits of a counter>`.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestIds;

static NEXT: AtomicU64 = AtomicU64::new(0);

fn prefix() -> &'static [u8; 16] {
    static PREFIX: OnceLock<[u8; 16]> = OnceLock::new();
    PREFIX.get_or_init(|| {
        let mut hex = [0u8; 16];
        let random = uuid::Uuid::new_v4().as_u64_pair().0;
        hex::encode_to_slice(random.to_be_bytes(), &mut hex).expect("16 hex digits");
        hex
    })
}

impl RequestIds {
    /// The next id.
    pub fn next() -> HeaderValue {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let mut id = [0u8; 33];
        id[..16].copy_from_slice(prefix());
        id[16] = b'-';
        hex::encode_to_slice(n.to_be_bytes(), &mut id[17..]).expect("16 hex digits");
        HeaderValue::from_bytes(&id).expect("hex digits and a dash are a valid header value")
    }
}

impl MakeRequestId for RequestIds {
    fn make_request_id<B>(&mut self, _request: &Request<B>) -> Option<RequestId> {
        Some(RequestId::new(Self::next()))
    }
}

/// A client's request id as the request's log lines show it: at most 128
/// characters, and any character an id is not made of (letters, digits,
/// `-_.:/+=@`) shown as `_`. The id goes into every line of the request's
/// span, and in the text format a value with a space or a brace would
/// close the span and forge fields (`job.id=…`). The answer and the
/// access log carry it as sent (the access log escaped, as JSON).
pub struct Logged<'a>(pub &'a str);

impl std::fmt::Display for Logged<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let id_char = |c: char| c.is_ascii_alphanumeric() || "-_.:/+=@".contains(c);
        let shown = self
            .0
            .char_indices()
            .nth(128)
            .map_or(self.0, |(at, _)| &self.0[..at]);
        if shown.chars().all(id_char) {
            return f.write_str(shown);
        }
        for c in shown.chars() {
            std::fmt::Write::write_char(f, if id_char(c) { c } else { '_' })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_logged_id_cannot_forge_fields() {
        let forged = "abc} job.id=0 request{request_id=x";
        assert_eq!(
            Logged(forged).to_string(),
            "abc}_job.id=0_request{request_id=x".replace(['{', '}'], "_")
        );
        assert_eq!(Logged("req_01J-x.y:z/+=@").to_string(), "req_01J-x.y:z/+=@");
        assert_eq!(Logged(&"i".repeat(300)).to_string().len(), 128);
    }

    #[test]
    fn ids_share_the_process_prefix_and_never_repeat() {
        let (a, b) = (RequestIds::next(), RequestIds::next());
        let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
        assert_ne!(a, b);
        assert_eq!(a.len(), 33);
        assert_eq!(a[..17], b[..17]);
        assert!(a[17..] < b[17..], "{a} then {b}: a counter, in order");
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit() || c == b'-'));
    }
}
