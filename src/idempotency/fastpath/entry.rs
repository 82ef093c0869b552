//! What the fast path keeps in Redis, and under which keys: replay entries
//! (validated on the way back) and the names of mirrored streams.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use sha2::{Digest, Sha256};

use crate::domain::fingerprint::Fingerprint;
use crate::domain::id::JobId;
use crate::domain::job::EXPIRY_MARGIN;
use crate::domain::key::{IdempotencyKey, Owner};
use crate::domain::response::StoredResponse;
use crate::store::codec::{decode_headers, encode_headers};

const MAGIC: &[u8; 4] = b"IGR1";

/// A cached entry, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The job it replays.
    pub job: JobId,
    /// The fingerprint of the request that made the job.
    pub fingerprint: Fingerprint,
    /// When the job expires.
    pub expires_at: SystemTime,
    /// The response, or `None` when kept by reference (read it from the store).
    pub response: Option<StoredResponse>,
}

/// The hash tag every Redis key of one `(owner, key)` carries, so that on a
/// Redis Cluster its replay entry and the stream its answer is mirrored on
/// live in one slot (on one shard, failing over together): the first 8
/// bytes of the digest that binds entries, in hex. Braces never occur in it,
/// and it comes first, so whatever the key holds cannot move the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tag([u8; 8]);

impl Tag {
    /// The tag of `(owner, key)`.
    pub fn of(owner: &Owner, key: &IdempotencyKey) -> Self {
        Binding::of(owner, key).tag()
    }
}

impl std::fmt::Display for Tag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// The digest that binds an entry to the `(owner, key)` it was written for,
/// and whose first bytes are its [`Tag`]: computed once per lookup or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding([u8; 32]);

impl Binding {
    /// The binding of `(owner, key)`.
    pub fn of(owner: &Owner, key: &IdempotencyKey) -> Self {
        let mut h = Sha256::new();
        h.update(owner.as_str().as_bytes());
        h.update([0]);
        h.update(key.as_str().as_bytes());
        Binding(h.finalize().into())
    }

    /// The hash tag of every Redis key of this `(owner, key)`.
    pub fn tag(&self) -> Tag {
        Tag(self.0[..8].try_into().expect("a digest is 32 bytes"))
    }
}

/// The Redis key of a replay: the tag, then owner (`anonymous` or
/// `sha256:<hex>`, never a colon beyond that) and key, readable in
/// `redis-cli`. `binding` is that of `(owner, key)`.
pub fn redis_key(binding: &Binding, owner: &Owner, key: &IdempotencyKey) -> String {
    format!("idemgate:{{{}}}:replay:{owner}:{key}", binding.tag())
}

/// The Redis Stream a streamed answer of `job`, made for the `(owner, key)`
/// of `tag`, is mirrored on.
pub fn stream_key(tag: &Tag, job: JobId) -> String {
    format!("idemgate:{{{tag}}}:stream:{job}")
}

/// The entry for an `(owner, key)`: `IGR1 | binding 32 | job 16 |
/// fingerprint 32 | expires ms 8 | kind 1 | [status 2 | headers len 4 |
/// headers | body] | checksum 8`, where the binding ties it to that `(owner,
/// key)`.
pub fn encode(entry: &Entry, binding: &Binding) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&binding.0);
    out.extend_from_slice(entry.job.0.as_bytes());
    out.extend_from_slice(&entry.fingerprint.0);
    let ms = entry
        .expires_at
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    out.extend_from_slice(&ms.to_be_bytes());
    match &entry.response {
        None => out.push(0),
        Some(r) => {
            out.push(1);
            out.extend_from_slice(&r.status.to_be_bytes());
            let headers = encode_headers(&r.headers);
            out.extend_from_slice(&(headers.len() as u32).to_be_bytes());
            out.extend_from_slice(&headers);
            out.extend_from_slice(&r.body);
        }
    }
    let checksum = Sha256::digest(&out);
    out.extend_from_slice(&checksum[..8]);
    out
}

/// Reads an entry back, refusing anything corrupt, written for another
/// `(owner, key)` than `binding`'s, or within the expiry margin at `now`.
pub fn decode(bytes: &[u8], binding: &Binding, now: SystemTime) -> Option<Entry> {
    let (payload, checksum) = bytes.split_at_checked(bytes.len().checked_sub(8)?)?;
    if Sha256::digest(payload)[..8] != *checksum {
        return None;
    }
    let rest = payload.strip_prefix(MAGIC)?;
    let (written_for, rest) = rest.split_at_checked(32)?;
    if written_for != binding.0 {
        return None;
    }
    let (job, rest) = rest.split_at_checked(16)?;
    let (fingerprint, rest) = rest.split_at_checked(32)?;
    let (ms, rest) = rest.split_at_checked(8)?;
    let expires_at = UNIX_EPOCH + Duration::from_millis(u64::from_be_bytes(ms.try_into().ok()?));
    if expires_at.checked_sub(EXPIRY_MARGIN)? <= now {
        return None;
    }
    let (&kind, rest) = rest.split_first()?;
    let response = match kind {
        0 if rest.is_empty() => None,
        1 => {
            let (status, rest) = rest.split_at_checked(2)?;
            let (len, rest) = rest.split_at_checked(4)?;
            let len = u32::from_be_bytes(len.try_into().ok()?) as usize;
            let (headers, body) = rest.split_at_checked(len)?;
            Some(StoredResponse {
                status: u16::from_be_bytes(status.try_into().ok()?),
                headers: decode_headers(headers)?,
                body: Bytes::copy_from_slice(body),
            })
        }
        _ => return None,
    };
    Some(Entry {
        job: JobId(uuid::Uuid::from_slice(job).ok()?),
        fingerprint: Fingerprint::from_slice(fingerprint)?,
        expires_at,
        response,
    })
}

#[cfg(test)]
mod tests {
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

    fn at() -> (Owner, IdempotencyKey) {
        (Owner::anonymous(), IdempotencyKey::new("k").unwrap())
    }

    #[test]
    fn entries_round_trip_inline_and_by_reference() {
        let (o, k) = at();
        let inline = entry(Some(StoredResponse {
            status: 201,
            headers: vec![("x-a".into(), Bytes::from_static(b"1"))],
            body: Bytes::from_static(b"\x00body\xff"),
        }));
        assert_eq!(
            decode(
                &encode(&inline, &Binding::of(&o, &k)),
                &Binding::of(&o, &k),
                SystemTime::now()
            ),
            Some(inline)
        );
        let reference = entry(None);
        assert_eq!(
            decode(
                &encode(&reference, &Binding::of(&o, &k)),
                &Binding::of(&o, &k),
                SystemTime::now()
            ),
            Some(reference)
        );
    }

    #[test]
    fn corrupt_misplaced_or_expiring_entries_are_refused() {
        let (o, k) = at();
        let now = SystemTime::now();
        let e = entry(None);
        let mut bytes = encode(&e, &Binding::of(&o, &k));
        let other = IdempotencyKey::new("other").unwrap();
        assert!(
            decode(&bytes, &Binding::of(&o, &other), now).is_none(),
            "another key's entry"
        );
        bytes[40] ^= 1;
        assert!(
            decode(&bytes, &Binding::of(&o, &k), now).is_none(),
            "flipped bit"
        );
        assert!(decode(b"garbage", &Binding::of(&o, &k), now).is_none());
        assert!(decode(b"", &Binding::of(&o, &k), now).is_none());
        let later = now + Duration::from_secs(3600);
        assert!(
            decode(
                &encode(&e, &Binding::of(&o, &k)),
                &Binding::of(&o, &k),
                later
            )
            .is_none(),
            "past its expiry margin"
        );
    }

    mod props {
        use super::super::*;
        use super::{at, entry};
        use proptest::prelude::*;

        proptest! {
            /// Whatever Redis holds, reading it never panics (a panic fails the test).
            #[test]
            fn any_bytes_decode_or_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
                let (o, k) = at();
                let _ = decode(&bytes, &Binding::of(&o, &k), SystemTime::now());
            }

            #[test]
            fn a_flipped_byte_is_always_refused(index in any::<prop::sample::Index>(), flip in 1..=255u8) {
                let (o, k) = at();
                let e = entry(Some(StoredResponse { status: 200, headers: vec![], body: Bytes::from_static(b"body") }));
                let mut bytes = encode(&e, &Binding::of(&o, &k));
                let i = index.index(bytes.len());
                bytes[i] ^= flip;
                prop_assert!(decode(&bytes, &Binding::of(&o, &k), SystemTime::now()).is_none());
            }
        }
    }
}
