//! Hop-by-hop headers (RFC 9110 §7.6.1): they describe one connection, so a
//! proxy never forwards, stores or replays them; neither are the headers a
//! `Connection` header names.

use http::header::{self, HeaderMap, HeaderName};

const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Whether `name` frames one message on one connection (a hop-by-hop
/// header, or the body's length) rather than describing the answer: never
/// taken from a stored answer onto a replay, which is framed afresh.
pub fn frames(name: &HeaderName) -> bool {
    *name == header::CONTENT_LENGTH || HOP_BY_HOP.contains(name) || *name == PROXY_CONNECTION
}

/// Removes hop-by-hop headers, and those listed in `Connection`, in place.
pub fn strip(headers: &mut HeaderMap) {
    strip_but(headers, None);
}

/// As [`strip`], but a `Connection` header naming `kept` does not remove
/// it: a header meant for the gateway itself (the client's
/// `Idempotency-Key`), which the gateway reads before it forwards anything.
pub fn strip_but(headers: &mut HeaderMap, kept: Option<&HeaderName>) {
    // One pass over the names a message carries (usually none of them is
    // hop-by-hop, or only `Connection: keep-alive`), then a removal for each
    // one found: cheaper than a lookup per hop-by-hop name per message.
    let mut found: [Option<HeaderName>; 9] = Default::default();
    let mut count = 0;
    for name in headers.keys() {
        if HOP_BY_HOP.contains(name) || *name == PROXY_CONNECTION {
            found[count] = Some(name.clone());
            count += 1;
        }
    }
    if count == 0 {
        return;
    }
    // Names listed in `Connection`, other than the hop-by-hop ones (found
    // above) and `close`.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|token| {
            !token.eq_ignore_ascii_case("close") && !token.eq_ignore_ascii_case("keep-alive")
        })
        .filter_map(|token| HeaderName::from_bytes(token.as_bytes()).ok())
        .filter(|name| Some(name) != kept)
        .collect();
    for name in named.into_iter().chain(found.into_iter().flatten()) {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_listed_and_named_headers() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            "keep-alive, X-Secret-Hop".parse().unwrap(),
        );
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("x-secret-hop", "1".parse().unwrap());
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        h.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        strip(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key(header::CONTENT_TYPE));
    }

    #[test]
    fn a_header_kept_for_the_gateway_survives_being_named() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            "idempotency-key, x-hop".parse().unwrap(),
        );
        h.insert("idempotency-key", "k".parse().unwrap());
        h.insert("x-hop", "1".parse().unwrap());
        let kept = HeaderName::from_static("idempotency-key");
        strip_but(&mut h, Some(&kept));
        assert_eq!(h.len(), 1);
        assert_eq!(h["idempotency-key"], "k");
    }

    #[test]
    fn strips_a_lone_hop_header_and_leaves_end_to_end_ones() {
        for hop in ["proxy-connection", "te", "upgrade", "keep-alive"] {
            let mut h = HeaderMap::new();
            h.insert(header::ACCEPT, "*/*".parse().unwrap());
            h.insert(HeaderName::from_static(hop), "x".parse().unwrap());
            strip(&mut h);
            assert_eq!(h.len(), 1, "{hop} stayed");
            assert!(h.contains_key(header::ACCEPT));
        }
        let mut h = HeaderMap::new();
        h.insert(header::ACCEPT, "*/*".parse().unwrap());
        strip(&mut h);
        assert_eq!(h.len(), 1);
    }
}
