//! What the fast path keeps in Redis, and under which keys: replay entries
//! (authenticated, and verified on the way back: `docs/design.md` §17) and
//! the names of mirrored streams.

use std::borrow::Cow;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use sha2::{Digest, Sha256};

use super::keys::{EntryKeys, Fields, Rejection, HEAD_LEN};
use crate::codec::{decode_headers, encode_headers};
use idemgate_domain::fingerprint::Fingerprint;
use idemgate_domain::id::JobId;
use idemgate_domain::job::EXPIRY_MARGIN;
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_domain::response::StoredResponse;

/// A cached entry, verified.
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
/// bytes of the digest of `(owner, key)`, in hex. Braces never occur in it,
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

/// The SHA-256 of an `(owner, key)`, whose first bytes are its [`Tag`]:
/// computed once per lookup or write. It names Redis keys and proves
/// nothing (anyone can compute it): entries are authenticated by their tag
/// under the replay key (`docs/design.md` §17).
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

/// The Redis key of a replay: the deployment's `prefix` (`idemgate:` by
/// default), the tag, then owner (`anonymous` or `hmac:<hex>`, never a
/// colon beyond that) and key, readable in `redis-cli`. `binding` is that
/// of `(owner, key)`.
pub fn redis_key(prefix: &str, binding: &Binding, owner: &Owner, key: &IdempotencyKey) -> String {
    format!("{prefix}{{{}}}:replay:{owner}:{key}", binding.tag())
}

/// The Redis Stream a streamed answer of `job`, made for the `(owner, key)`
/// of `tag`, is mirrored on, under the deployment's `prefix`.
pub fn stream_key(prefix: &str, tag: &Tag, job: JobId) -> String {
    format!("{prefix}{{{tag}}}:stream:{job}")
}

/// Entries of this format start with these bytes; any other `IGR` entry was
/// written by another release.
const MAGIC: &[u8; 4] = b"IGR2";
/// The fixed part after the record's head: job 16, fingerprint 32, expires
/// ms 8, kind 1, status 2.
const META_LEN: usize = 16 + 32 + 8 + 1 + 2;

/// The entry for an `(owner, key)` (`docs/design.md` §17): `IGR2 | mode 1 |
/// key id 8 | job 16 | fingerprint 32 | expires ms 8 | kind 1 | status 2 |
/// payload | trailer`, the payload being `headers len 4 | headers | body`
/// for an inline answer (kind 1) and empty for one kept by reference (kind
/// 0), in the clear with an HMAC or sealed (see [`keys`](super::keys)). The
/// tag covers the format, mode and key id, the owner and key (never written
/// in the entry: the reader brings its own), and every field after them.
pub fn encode(entry: &Entry, owner: &Owner, key: &IdempotencyKey, keys: &EntryKeys) -> Vec<u8> {
    let response = entry.response.as_ref();
    let body = response.map_or(0, |r| r.body.len());
    let mut out = Vec::with_capacity(128 + body);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&keys.head());
    let meta = meta(entry);
    out.extend_from_slice(&meta);
    let start = out.len();
    if let Some(r) = response {
        let headers = encode_headers(&r.headers);
        out.extend_from_slice(&(headers.len() as u32).to_be_bytes());
        out.extend_from_slice(&headers);
        out.extend_from_slice(&r.body);
    }
    let bound = bound(&out[MAGIC.len()..][..HEAD_LEN], owner, key, &meta);
    keys.protect(bound.bytes(), &mut out, start);
    out
}

/// Job, fingerprint, expiry, kind and status, as laid out in an entry.
fn meta(entry: &Entry) -> [u8; META_LEN] {
    let mut meta = [0; META_LEN];
    meta[..16].copy_from_slice(entry.job.0.as_bytes());
    meta[16..48].copy_from_slice(&entry.fingerprint.0);
    let ms = entry
        .expires_at
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    meta[48..56].copy_from_slice(&ms.to_be_bytes());
    if let Some(r) = &entry.response {
        meta[56] = 1;
        meta[57..].copy_from_slice(&r.status.to_be_bytes());
    }
    meta
}

/// What an entry's tag covers besides its payload, each field on its own.
fn bound(head: &[u8], owner: &Owner, key: &IdempotencyKey, meta: &[u8; META_LEN]) -> Fields {
    let mut fields = Fields::new(MAGIC);
    fields
        .push(head)
        .push(owner.as_str().as_bytes())
        .push(key.as_str().as_bytes())
        .push(&meta[..16])
        .push(&meta[16..48])
        .push(&meta[48..56])
        .push(&meta[56..57])
        .push(&meta[57..]);
    fields
}

/// Why an entry read from Redis is not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unusable {
    /// It is not believed (counted and logged: see [`Rejection`]).
    Rejected(Rejection),
    /// It is genuine but its job expires within the margin.
    Expiring,
}

impl From<Rejection> for Unusable {
    fn from(r: Rejection) -> Self {
        Unusable::Rejected(r)
    }
}

/// Reads the entry Redis holds for `(owner, key)` back, believing it only
/// if its tag verifies for them under one of `keys` (and, with sealing on,
/// only if it is sealed); a genuine entry within the expiry margin at `now`
/// is not used either. An inline body in the clear is a slice of `bytes`.
pub fn decode(
    bytes: Bytes,
    owner: &Owner,
    key: &IdempotencyKey,
    keys: &EntryKeys,
    now: SystemTime,
) -> Result<Entry, Unusable> {
    let rest = match bytes.strip_prefix(MAGIC) {
        Some(rest) => rest,
        None if bytes.starts_with(&MAGIC[..3]) => return Err(Rejection::Version.into()),
        None => return Err(Rejection::Malformed.into()),
    };
    let (head, rest) = rest
        .split_at_checked(HEAD_LEN)
        .ok_or(Rejection::Malformed)?;
    let reader = keys.reader(head)?;
    let (meta, protected) = rest
        .split_at_checked(META_LEN)
        .ok_or(Rejection::Malformed)?;
    let meta: &[u8; META_LEN] = meta.try_into().map_err(|_| Rejection::Malformed)?;
    let payload = reader.open(bound(head, owner, key, meta).bytes(), protected)?;
    let entry = read(meta, payload, &bytes).ok_or(Rejection::Malformed)?;
    if entry
        .expires_at
        .checked_sub(EXPIRY_MARGIN)
        .is_none_or(|t| t <= now)
    {
        return Err(Unusable::Expiring);
    }
    Ok(entry)
}

/// The entry a verified `meta` and payload make; `whole` is the record the
/// payload may be a slice of.
fn read(meta: &[u8; META_LEN], payload: Cow<'_, [u8]>, whole: &Bytes) -> Option<Entry> {
    let ms = u64::from_be_bytes(meta[48..56].try_into().ok()?);
    let response = match meta[56] {
        0 if payload.is_empty() => None,
        1 => {
            let (len, rest) = payload.split_at_checked(4)?;
            let len = u32::from_be_bytes(len.try_into().ok()?) as usize;
            let (headers, body) = rest.split_at_checked(len)?;
            let headers = decode_headers(headers)?;
            let body = match &payload {
                Cow::Borrowed(_) => whole.slice_ref(body),
                Cow::Owned(_) => Bytes::copy_from_slice(body),
            };
            Some(StoredResponse {
                status: u16::from_be_bytes(meta[57..].try_into().ok()?),
                headers,
                body,
            })
        }
        _ => return None,
    };
    Some(Entry {
        job: JobId(uuid::Uuid::from_slice(&meta[..16]).ok()?),
        fingerprint: Fingerprint::from_slice(&meta[16..48])?,
        expires_at: UNIX_EPOCH + Duration::from_millis(ms),
        response,
    })
}

#[cfg(test)]
mod tests;
