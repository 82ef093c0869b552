//! Byte formats shared by the stores that keep responses as blobs (the
//! embedded store, the Redis fast path).

use bytes::Bytes;

/// Headers as a blob: for each, a u32 name length, the name, a u32 value
/// length, the value (big-endian lengths). Values are opaque bytes.
pub(crate) fn encode_headers(headers: &[(String, Bytes)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        out.extend_from_slice(&(name.len() as u32).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value);
    }
    out
}

pub(crate) fn decode_headers(mut blob: &[u8]) -> Option<Vec<(String, Bytes)>> {
    fn take<'a>(blob: &mut &'a [u8]) -> Option<&'a [u8]> {
        let len = u32::from_be_bytes(blob.get(..4)?.try_into().ok()?) as usize;
        let item = blob.get(4..4 + len)?;
        *blob = &blob[4 + len..];
        Some(item)
    }
    let mut headers = Vec::new();
    while !blob.is_empty() {
        let name = String::from_utf8(take(&mut blob)?.to_vec()).ok()?;
        let value = Bytes::copy_from_slice(take(&mut blob)?);
        headers.push((name, value));
    }
    Some(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_including_opaque_bytes() {
        let headers = vec![
            ("content-type".to_owned(), Bytes::from_static(b"text/plain")),
            ("x-raw".to_owned(), Bytes::from_static(&[0xff, 0x00, b'a'])),
            ("x-empty".to_owned(), Bytes::new()),
        ];
        assert_eq!(decode_headers(&encode_headers(&headers)), Some(headers));
        assert_eq!(decode_headers(&[0, 0, 0, 9, b'a']), None);
    }

    mod props {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn any_blob_decodes_or_is_refused(blob in proptest::collection::vec(any::<u8>(), 0..300)) {
                let _ = decode_headers(&blob);
            }

            #[test]
            fn headers_round_trip(headers in proptest::collection::vec(("[a-z-]{1,20}", proptest::collection::vec(any::<u8>(), 0..40)), 0..8)) {
                let headers: Vec<(String, Bytes)> = headers.into_iter().map(|(n, v)| (n, Bytes::from(v))).collect();
                prop_assert_eq!(decode_headers(&encode_headers(&headers)), Some(headers));
            }
        }
    }
}
