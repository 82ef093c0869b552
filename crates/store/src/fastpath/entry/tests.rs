use super::*;

fn entry(response: Option<StoredResponse>) -> Entry {
    Entry {
        job: JobId::new(),
        fingerprint: Fingerprint([3; 32]),
        // Whole milliseconds, as stored.
        expires_at: UNIX_EPOCH
            + Duration::from_millis(
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap()
                    .as_millis() as u64
                    + 3_600_000,
            ),
        response,
    }
}

fn answer(headers: &[(&str, &'static [u8])], body: &'static [u8]) -> Option<StoredResponse> {
    Some(StoredResponse {
        status: 201,
        headers: headers
            .iter()
            .map(|(n, v)| ((*n).to_owned(), Bytes::from_static(v)))
            .collect(),
        body: Bytes::from_static(body),
    })
}

fn at() -> (Owner, IdempotencyKey) {
    (Owner::anonymous(), IdempotencyKey::new("k").unwrap())
}

fn keys(sealed: bool) -> EntryKeys {
    EntryKeys::new(&[9; 32], [], sealed)
}

fn read(
    bytes: &[u8],
    owner: &Owner,
    key: &IdempotencyKey,
    keys: &EntryKeys,
) -> Result<Entry, Unusable> {
    decode(
        Bytes::copy_from_slice(bytes),
        owner,
        key,
        keys,
        SystemTime::now(),
    )
}

/// The HMAC an entry is written with (mode `M`: its last 32 bytes).
fn tag(e: &Entry, owner: &Owner, key: &IdempotencyKey) -> Vec<u8> {
    let bytes = encode(e, owner, key, &keys(false));
    bytes[bytes.len() - 32..].to_vec()
}

#[test]
fn entries_round_trip_inline_and_by_reference_in_either_mode() {
    let (o, k) = at();
    for sealed in [false, true] {
        let keys = keys(sealed);
        let inline = entry(answer(&[("x-a", b"1")], b"\x00body\xff"));
        assert_eq!(
            read(&encode(&inline, &o, &k, &keys), &o, &k, &keys),
            Ok(inline)
        );
        let reference = entry(None);
        assert_eq!(
            read(&encode(&reference, &o, &k, &keys), &o, &k, &keys),
            Ok(reference)
        );
    }
}

#[test]
fn every_field_changes_the_tag() {
    let (o, k) = at();
    let base = entry(answer(&[("x-a", b"1")], b"body"));
    let mut variants = vec![base.clone()];
    variants.push(Entry {
        job: JobId::new(),
        ..base.clone()
    });
    variants.push(Entry {
        fingerprint: Fingerprint([4; 32]),
        ..base.clone()
    });
    variants.push(Entry {
        expires_at: base.expires_at + Duration::from_millis(1),
        ..base.clone()
    });
    variants.push(Entry {
        response: None,
        ..base.clone()
    });
    let mut status = base.clone();
    status.response.as_mut().unwrap().status = 200;
    variants.push(status);
    variants.push(Entry {
        response: answer(&[("x-a", b"2")], b"body"),
        ..base.clone()
    });
    variants.push(Entry {
        response: answer(&[("x-b", b"1")], b"body"),
        ..base.clone()
    });
    variants.push(Entry {
        response: answer(&[], b"body"),
        ..base.clone()
    });
    variants.push(Entry {
        response: answer(&[("x-a", b"1")], b"bodY"),
        ..base.clone()
    });
    let mut tags: Vec<Vec<u8>> = variants.iter().map(|e| tag(e, &o, &k)).collect();
    let other = Owner::from_stored("hmac:00".into());
    tags.push(tag(&base, &other, &k));
    tags.push(tag(&base, &o, &IdempotencyKey::new("k2").unwrap()));
    let n = tags.len();
    tags.sort();
    tags.dedup();
    assert_eq!(tags.len(), n, "two variants share a tag");

    // And an entry read for another owner or key does not verify.
    let keys = keys(false);
    let bytes = encode(&base, &o, &k, &keys);
    assert_eq!(
        read(&bytes, &other, &k, &keys),
        Err(Rejection::Forged.into())
    );
    let moved = IdempotencyKey::new("k2").unwrap();
    assert_eq!(
        read(&bytes, &o, &moved, &keys),
        Err(Rejection::Forged.into())
    );
}

#[test]
fn two_spellings_never_share_a_tag() {
    let e = entry(answer(&[("x-a", b"1")], b"2"));
    let key = |k: &str| IdempotencyKey::new(k).unwrap();
    let owner = |o: &str| Owner::from_stored(o.to_owned());
    // Where owner ends and key begins.
    assert_ne!(
        tag(&e, &owner("hmac:ab"), &key("c")),
        tag(&e, &owner("hmac:a"), &key("bc"))
    );
    // Where the headers end and the body begins.
    let joined = entry(answer(&[("x-a", b"12")], b""));
    let joined = Entry {
        job: e.job,
        ..joined
    };
    let (o, k) = at();
    assert_ne!(tag(&e, &o, &k), tag(&joined, &o, &k));
    // Where a header's name ends and its value begins.
    let a = Entry {
        response: answer(&[("ab", b"c")], b""),
        ..e.clone()
    };
    let b = Entry {
        response: answer(&[("a", b"bc")], b""),
        ..e.clone()
    };
    assert_ne!(tag(&a, &o, &k), tag(&b, &o, &k));
}

#[test]
fn what_is_not_believed_says_why() {
    let (o, k) = at();
    let now = SystemTime::now();
    let e = entry(answer(&[], b"body"));
    let plain = keys(false);
    let bytes = encode(&e, &o, &k, &plain);
    let rejected = |r: Rejection| Err(Unusable::Rejected(r));
    let mut old = bytes.clone();
    old[..4].copy_from_slice(b"IGR1");
    assert_eq!(read(&old, &o, &k, &plain), rejected(Rejection::Version));
    assert_eq!(
        read(b"garbage", &o, &k, &plain),
        rejected(Rejection::Malformed)
    );
    assert_eq!(read(b"", &o, &k, &plain), rejected(Rejection::Malformed));
    assert_eq!(
        read(&bytes[..40], &o, &k, &plain),
        rejected(Rejection::Malformed)
    );
    let stranger = EntryKeys::new(&[1; 32], [], false);
    assert_eq!(
        read(&bytes, &o, &k, &stranger),
        rejected(Rejection::UnknownKey)
    );
    let sealing = EntryKeys::new(&[9; 32], [], true);
    assert_eq!(
        read(&bytes, &o, &k, &sealing),
        rejected(Rejection::Plaintext)
    );
    // A forger's entry under this gateway's key id.
    let mut forged = encode(&e, &o, &k, &stranger);
    forged[4..4 + HEAD_LEN].copy_from_slice(&plain.head());
    assert_eq!(read(&forged, &o, &k, &plain), rejected(Rejection::Forged));
    let later = now + Duration::from_secs(3600);
    assert_eq!(
        decode(Bytes::from(bytes), &o, &k, &plain, later),
        Err(Unusable::Expiring),
        "past its expiry margin"
    );
}

#[test]
fn an_inline_body_in_the_clear_is_not_copied() {
    let (o, k) = at();
    let keys = keys(false);
    let bytes = Bytes::from(encode(&entry(answer(&[], b"the body")), &o, &k, &keys));
    let read = decode(bytes.clone(), &o, &k, &keys, SystemTime::now()).unwrap();
    let body = read.response.unwrap().body;
    let within = bytes.as_ptr_range();
    assert!(
        within.contains(&body.as_ptr()),
        "a slice of what Redis returned"
    );
}

mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever Redis holds, reading it never panics (a panic fails the test).
        #[test]
        fn any_bytes_decode_or_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..400), sealed: bool) {
            let (o, k) = at();
            let _ = read(&bytes, &o, &k, &keys(sealed));
        }

        #[test]
        fn a_flipped_byte_is_always_refused(index in any::<prop::sample::Index>(), flip in 1..=255u8, sealed: bool) {
            let (o, k) = at();
            let keys = keys(sealed);
            let e = entry(answer(&[("x", b"y")], b"body"));
            let mut bytes = encode(&e, &o, &k, &keys);
            let i = index.index(bytes.len());
            bytes[i] ^= flip;
            prop_assert!(matches!(read(&bytes, &o, &k, &keys), Err(Unusable::Rejected(_))));
        }
    }
}
