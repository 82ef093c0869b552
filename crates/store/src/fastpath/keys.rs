//! The keys replay entries and mirrored stream records in Redis are
//! authenticated with (`docs/design.md` §17), and the one envelope every
//! such record shares.
//!
//! Redis is a cache that anyone able to write to it could fill, so nothing
//! read from it is believed on its checksum: every record carries a tag
//! under a server-side key over all it says and all it is for (the owner
//! and key, or the job and position, given by the reader, never read from
//! the record). Without `[encryption]` the tag is an HMAC-SHA256; with it the
//! record is AES-256-GCM with those fields as associated data, and a record
//! in the clear is refused however well it is tagged.
//!
//! A record is `mode 1 | key id 8 | … | payload | trailer`, where the
//! trailer is the HMAC (32) in mode `M`, or the GCM tag (16) and nonce (12)
//! after the ciphertext in mode `S`. The key id is the first 8 bytes of the
//! SHA-256 of the secret, so a reader finds which of its keys (the current
//! one, then the previous ones) wrote it, and keys rotate.

use std::borrow::Cow;

use aes_gcm::aead::rand_core::RngCore;
use aes_gcm::aead::{AeadInPlace, KeyInit, OsRng};
use aes_gcm::{Aes256Gcm, Nonce, Tag as GcmTag};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::seal::KeyRing;

/// Bytes of a key id.
pub const KEY_ID_LEN: usize = 8;
/// Bytes of the head every record starts with: mode, then key id.
pub const HEAD_LEN: usize = 1 + KEY_ID_LEN;
const MAC_LEN: usize = 32;
const GCM_TAG_LEN: usize = 16;
const NONCE_LEN: usize = 12;

/// How a record is protected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// In the clear, with an HMAC-SHA256 tag.
    Mac,
    /// Sealed with AES-256-GCM.
    Sealed,
}

impl Mode {
    fn byte(self) -> u8 {
        match self {
            Mode::Mac => b'M',
            Mode::Sealed => b'S',
        }
    }
}

/// Why a record read from Redis is not believed: it is a miss, never
/// served; the label of `idemgate_replay_entries_rejected_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// Too short, or not laid out as a record is.
    #[error("malformed")]
    Malformed,
    /// Written in another format (a release before this one, or not by
    /// idemgate at all).
    #[error("version")]
    Version,
    /// Written with a key this gateway does not have.
    #[error("unknown_key")]
    UnknownKey,
    /// Its tag does not verify: altered, forged, or moved from where it
    /// was written for.
    #[error("forged")]
    Forged,
    /// In the clear while `[encryption]` is on.
    #[error("plaintext")]
    Plaintext,
    /// A mirrored stream with a part missing, out of order, or an end that
    /// does not count what came before it.
    #[error("truncated")]
    Truncated,
}

impl Rejection {
    /// Every reason, for the metric's series at zero.
    pub const ALL: [Rejection; 6] = [
        Rejection::Malformed,
        Rejection::Version,
        Rejection::UnknownKey,
        Rejection::Forged,
        Rejection::Plaintext,
        Rejection::Truncated,
    ];

    /// The metric label.
    pub fn reason(self) -> &'static str {
        match self {
            Rejection::Malformed => "malformed",
            Rejection::Version => "version",
            Rejection::UnknownKey => "unknown_key",
            Rejection::Forged => "forged",
            Rejection::Plaintext => "plaintext",
            Rejection::Truncated => "truncated",
        }
    }
}

/// One replay key, as derived for each use.
#[derive(Clone)]
pub struct Key {
    id: [u8; KEY_ID_LEN],
    mac: Hmac<Sha256>,
    aead: Aes256Gcm,
}

impl Key {
    /// The key of `secret` (32 bytes or more, checked by the settings).
    /// The MAC and the cipher get keys of their own derived from it, so
    /// neither is the secret, nor the other.
    pub fn new(secret: &[u8]) -> Self {
        let mut id = [0; KEY_ID_LEN];
        id.copy_from_slice(&Sha256::digest(secret)[..KEY_ID_LEN]);
        let mac = derive(secret, b"idemgate replay entries: hmac-sha256");
        let aead = derive(secret, b"idemgate replay entries: aes-256-gcm");
        Key {
            id,
            mac: <Hmac<Sha256> as Mac>::new_from_slice(&mac)
                .expect("HMAC takes a key of any length"),
            aead: Aes256Gcm::new(&aead.into()),
        }
    }

    /// Its id, as written in every record it protects.
    pub fn id(&self) -> [u8; KEY_ID_LEN] {
        self.id
    }
}

/// HMAC-SHA256 of `label` under `secret`: a key for one purpose only.
fn derive(secret: &[u8], label: &[u8]) -> [u8; 32] {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(label);
    mac.finalize().into_bytes().into()
}

/// The replay key derived from an `[encryption]` key, when no replay key is
/// configured: every replica sharing the encryption keys derives the same,
/// and it is not the encryption key itself.
pub fn derive_from_encryption_key(key: &[u8; 32]) -> [u8; 32] {
    derive(
        key,
        b"idemgate replay key, derived from an [encryption] key",
    )
}

/// A replay key scoped to a deployment's Redis key prefix: deployments
/// that share a Redis (each under its own prefix) and a replay key cannot
/// believe each other's entries, which would replay one deployment's
/// answers in another whose store never saw them (`docs/design.md` §13, "One Redis, several deployments").
pub fn scoped_to_prefix(key: &[u8], prefix: &str) -> [u8; 32] {
    let label = [
        b"idemgate replay key, scoped to the Redis key prefix ",
        prefix.as_bytes(),
    ];
    derive(key, &label.concat())
}

/// The keys of one gateway: the current one writes, every one verifies
/// (one [`KeyRing`], as the database's sealed answers have).
#[derive(Clone)]
pub struct EntryKeys {
    ring: KeyRing<[u8; KEY_ID_LEN], Key>,
    sealed: bool,
}

impl std::fmt::Debug for EntryKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Only the ids, never the keys.
        f.debug_struct("EntryKeys")
            .field("ids", &self.ring.ids().map(hex::encode).collect::<Vec<_>>())
            .field("sealed", &self.sealed)
            .finish()
    }
}

impl EntryKeys {
    /// Writes with `current`, verifies with it and with `previous`; seals
    /// (and accepts only sealed records) when `sealed`.
    pub fn new<'a>(
        current: &[u8],
        previous: impl IntoIterator<Item = &'a [u8]>,
        sealed: bool,
    ) -> Self {
        let keyed = |secret: &[u8]| {
            let key = Key::new(secret);
            (key.id, key)
        };
        EntryKeys {
            ring: KeyRing::new(keyed(current), previous.into_iter().map(keyed)),
            sealed,
        }
    }

    /// Whether records are sealed (`[encryption]` on).
    pub fn sealed(&self) -> bool {
        self.sealed
    }

    /// The ids of the keys, current first.
    pub fn ids(&self) -> Vec<[u8; KEY_ID_LEN]> {
        self.ring.ids().copied().collect()
    }

    fn mode(&self) -> Mode {
        if self.sealed {
            Mode::Sealed
        } else {
            Mode::Mac
        }
    }

    /// The head a record written now starts with: its mode and the current
    /// key's id.
    pub fn head(&self) -> [u8; HEAD_LEN] {
        let mut head = [0; HEAD_LEN];
        head[0] = self.mode().byte();
        head[1..].copy_from_slice(self.ring.current().0);
        head
    }

    /// Protects `out[start..]`, the payload the caller wrote there after
    /// [`EntryKeys::head`], bound to `bound` (the fields it is for, made by
    /// [`Fields`]): appends the HMAC, or seals it in place and appends the
    /// GCM tag and nonce.
    pub fn protect(&self, bound: &[u8], out: &mut Vec<u8>, start: usize) {
        let (_, key) = self.ring.current();
        if !self.sealed {
            let tag = mac(key, bound, &out[start..]);
            out.extend_from_slice(&tag);
            return;
        }
        let mut nonce = [0u8; NONCE_LEN];
        OsRng.fill_bytes(&mut nonce);
        // Sealing in memory with a valid key cannot fail (only a payload
        // past GCM's 64 GiB limit could).
        let tag = key
            .aead
            .encrypt_in_place_detached(Nonce::from_slice(&nonce), bound, &mut out[start..])
            .expect("a payload within AES-GCM's limit");
        out.extend_from_slice(&tag);
        out.extend_from_slice(&nonce);
    }

    /// The key and mode a record starting with `head` was written with,
    /// if this gateway may believe such a record at all.
    pub fn reader(&self, head: &[u8]) -> Result<Reader<'_>, Rejection> {
        let (&mode, id) = head.split_first().ok_or(Rejection::Malformed)?;
        let mode = match mode {
            b'M' => Mode::Mac,
            b'S' => Mode::Sealed,
            _ => return Err(Rejection::Malformed),
        };
        if id.len() != KEY_ID_LEN {
            return Err(Rejection::Malformed);
        }
        let key = self.ring.find(id).ok_or(Rejection::UnknownKey)?;
        if self.sealed && mode != Mode::Sealed {
            return Err(Rejection::Plaintext);
        }
        Ok(Reader { key, mode })
    }
}

/// How one record is verified: the key and mode its head names.
pub struct Reader<'k> {
    key: &'k Key,
    mode: Mode,
}

impl Reader<'_> {
    /// The payload of `protected` (payload and trailer) if its tag
    /// verifies for `bound`: borrowed in the clear, opened when sealed.
    pub fn open<'a>(&self, bound: &[u8], protected: &'a [u8]) -> Result<Cow<'a, [u8]>, Rejection> {
        match self.mode {
            Mode::Mac => {
                let split = protected
                    .len()
                    .checked_sub(MAC_LEN)
                    .ok_or(Rejection::Malformed)?;
                let (payload, tag) = protected.split_at(split);
                let mut mac = self.key.mac.clone();
                feed(&mut mac, bound, payload);
                mac.verify_slice(tag).map_err(|_| Rejection::Forged)?;
                Ok(Cow::Borrowed(payload))
            }
            Mode::Sealed => {
                let split = protected
                    .len()
                    .checked_sub(GCM_TAG_LEN + NONCE_LEN)
                    .ok_or(Rejection::Malformed)?;
                let (sealed, trailer) = protected.split_at(split);
                let (tag, nonce) = trailer.split_at(GCM_TAG_LEN);
                let mut plain = sealed.to_vec();
                self.key
                    .aead
                    .decrypt_in_place_detached(
                        Nonce::from_slice(nonce),
                        bound,
                        &mut plain,
                        GcmTag::from_slice(tag),
                    )
                    .map_err(|_| Rejection::Forged)?;
                Ok(Cow::Owned(plain))
            }
        }
    }
}

fn mac(key: &Key, bound: &[u8], payload: &[u8]) -> [u8; MAC_LEN] {
    let mut mac = key.mac.clone();
    feed(&mut mac, bound, payload);
    mac.finalize().into_bytes().into()
}

/// The MAC's input: the bound fields, then the payload as one more
/// length-prefixed field.
fn feed(mac: &mut Hmac<Sha256>, bound: &[u8], payload: &[u8]) {
    mac.update(bound);
    mac.update(&(payload.len() as u64).to_be_bytes());
    mac.update(payload);
}

/// The fields a record is bound to, each prefixed with its length (u64,
/// big-endian), so that no two lists of fields encode alike: `("ab", "c")`
/// is not `("a", "bc")`.
#[derive(Debug, Default)]
pub struct Fields(Vec<u8>);

impl Fields {
    /// Fields of a record of format `version`.
    pub fn new(version: &[u8]) -> Self {
        let mut fields = Fields(Vec::with_capacity(512));
        fields.push(version);
        fields
    }

    /// Adds a field.
    pub fn push(&mut self, field: &[u8]) -> &mut Self {
        self.0
            .extend_from_slice(&(field.len() as u64).to_be_bytes());
        self.0.extend_from_slice(field);
        self
    }

    /// The encoding.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(keys: &EntryKeys, bound: &[u8], payload: &[u8]) -> Vec<u8> {
        let mut out = keys.head().to_vec();
        let start = out.len();
        out.extend_from_slice(payload);
        keys.protect(bound, &mut out, start);
        out
    }

    fn read(keys: &EntryKeys, bound: &[u8], record: &[u8]) -> Result<Vec<u8>, Rejection> {
        let (head, protected) = record.split_at(HEAD_LEN);
        Ok(keys.reader(head)?.open(bound, protected)?.into_owned())
    }

    #[test]
    fn length_prefixes_keep_two_spellings_apart() {
        let mut a = Fields::new(b"v");
        a.push(b"ab").push(b"c");
        let mut b = Fields::new(b"v");
        b.push(b"a").push(b"bc");
        assert_ne!(a.bytes(), b.bytes());
        let mut empty = Fields::new(b"v");
        empty.push(b"").push(b"abc");
        let mut none = Fields::new(b"v");
        none.push(b"abc");
        assert_ne!(empty.bytes(), none.bytes());
    }

    #[test]
    fn records_verify_under_their_key_and_fields_only() {
        for sealed in [false, true] {
            let keys = EntryKeys::new(&[1; 32], [], sealed);
            let record = write(&keys, b"bound", b"payload");
            assert_eq!(read(&keys, b"bound", &record).unwrap(), b"payload");
            assert_eq!(
                read(&keys, b"other", &record),
                Err(Rejection::Forged),
                "moved"
            );
            let stranger = EntryKeys::new(&[2; 32], [], sealed);
            assert_eq!(
                read(&stranger, b"bound", &record),
                Err(Rejection::UnknownKey)
            );
            // A stranger's record under this gateway's key id: its tag fails.
            let mut forged = write(&stranger, b"bound", b"payload");
            forged[1..HEAD_LEN].copy_from_slice(&keys.head()[1..]);
            assert_eq!(read(&keys, b"bound", &forged), Err(Rejection::Forged));
            for i in HEAD_LEN..record.len() {
                let mut flipped = record.clone();
                flipped[i] ^= 0x20;
                assert_eq!(read(&keys, b"bound", &flipped), Err(Rejection::Forged));
            }
            assert_eq!(
                read(&keys, b"bound", &record[..HEAD_LEN + 3]),
                Err(Rejection::Malformed)
            );
        }
    }

    #[test]
    fn sealed_records_hold_no_plaintext_and_plaintext_is_refused_when_sealing() {
        let sealing = EntryKeys::new(&[1; 32], [], true);
        let record = write(&sealing, b"bound", b"the secret answer");
        assert!(!record.windows(6).any(|w| w == b"secret"));
        let clear = EntryKeys::new(&[1; 32], [], false);
        let plain = write(&clear, b"bound", b"the secret answer");
        assert_eq!(
            read(&sealing, b"bound", &plain),
            Err(Rejection::Plaintext),
            "a well-tagged record in the clear"
        );
        assert_eq!(
            read(&clear, b"bound", &record).unwrap(),
            b"the secret answer",
            "a gateway without [encryption] but with the key opens it"
        );
    }

    #[test]
    fn previous_keys_verify_and_only_the_current_one_writes() {
        let old = EntryKeys::new(&[1; 32], [], false);
        let record = write(&old, b"b", b"p");
        let rotated = EntryKeys::new(&[2; 32], [[1u8; 32].as_slice()], false);
        assert_eq!(read(&rotated, b"b", &record).unwrap(), b"p");
        assert_eq!(
            rotated.head()[1..],
            EntryKeys::new(&[2; 32], [], false).head()[1..]
        );
        let dropped = EntryKeys::new(&[2; 32], [], false);
        assert_eq!(read(&dropped, b"b", &record), Err(Rejection::UnknownKey));
    }

    #[test]
    fn derived_keys_are_stable_and_not_the_encryption_key() {
        let key = [7; 32];
        assert_eq!(
            derive_from_encryption_key(&key),
            derive_from_encryption_key(&key)
        );
        assert_ne!(derive_from_encryption_key(&key), key);
        assert_ne!(
            derive_from_encryption_key(&key),
            derive_from_encryption_key(&[8; 32])
        );
        assert_eq!(Key::new(&key).id(), Sha256::digest(key)[..8]);
    }
}
