//! Responses at rest: sealed with AES-256-GCM when keys are configured.
//!
//! Request bodies are only ever fingerprinted, but responses are stored
//! whole, in the database and in Redis. With `[encryption]` configured, a
//! committed response's headers and body are sealed before the store writes
//! them and opened when it reads them (`docs/design.md`, §5); Redis entries
//! are sealed by the fast path under keys of their own, bound to their
//! owner, key and job (§17):
//!
//! - the active key seals; every configured key opens, so keys rotate by
//!   adding a new active key and keeping the old ones until the responses
//!   they sealed have expired;
//! - a sealed response is stored as status, one pseudo-header
//!   `:sealed = <key id>` (a name no HTTP header can have, so it cannot be
//!   mistaken for an upstream's) and a body of `nonce (12) | ciphertext`;
//! - the job id is the associated data: a sealed response moved to another
//!   job does not open.
//!
//! The status stays in the clear (the stores' own checks need it).

use aes_gcm::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use aes_gcm::{Aes256Gcm, Key, Nonce};
use bytes::Bytes;

use idemgate_domain::id::JobId;

use crate::codec::{decode_headers, encode_headers};
use idemgate_domain::response::StoredResponse;

mod ring;

pub use ring::KeyRing;

/// The pseudo-header naming the key a response was sealed with.
pub const SEALED: &str = ":sealed";

/// Seals and opens stored responses: the `[encryption]` keys by name, the
/// active one first.
pub struct Sealer {
    ring: KeyRing<String, Aes256Gcm>,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys themselves.
        f.debug_struct("Sealer")
            .field("active", &self.active())
            .field("keys", &self.ring.ids().collect::<Vec<_>>())
            .finish()
    }
}

/// Why a stored response could not be opened.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SealError {
    /// Sealed with a key that is not configured (any more).
    #[error("the response was sealed with key {0:?}, which is not configured")]
    UnknownKey(String),
    /// The ciphertext does not open with its key and job: damaged or moved.
    #[error("the sealed response does not open: damaged, or stored under another job")]
    Damaged,
    /// Sealed, but no keys are configured at all.
    #[error("the response is sealed and no encryption keys are configured")]
    NoKeys,
}

impl Sealer {
    /// A sealer with `keys` (id, 32-byte key), sealing with `active`;
    /// `None` when `active` is not among them.
    pub fn new(active: &str, keys: Vec<(String, [u8; 32])>) -> Option<Self> {
        let cipher = |key: &[u8; 32]| Aes256Gcm::new(Key::<Aes256Gcm>::from_slice(key));
        let current = keys.iter().find(|(id, _)| id == active)?;
        let current = (current.0.clone(), cipher(&current.1));
        let previous = keys.iter().map(|(id, key)| (id.clone(), cipher(key)));
        Some(Sealer {
            ring: KeyRing::new(current, previous),
        })
    }

    /// The key new responses are sealed with.
    pub fn active(&self) -> &str {
        self.ring.current().0
    }

    /// Seals `response` for `job` with the active key.
    pub fn seal(&self, job: JobId, response: &StoredResponse) -> StoredResponse {
        let headers = encode_headers(&response.headers);
        let mut plain = Vec::with_capacity(4 + headers.len() + response.body.len());
        plain.extend_from_slice(&(headers.len() as u32).to_be_bytes());
        plain.extend_from_slice(&headers);
        plain.extend_from_slice(&response.body);
        StoredResponse {
            status: response.status,
            headers: vec![(SEALED.to_owned(), Bytes::from(self.active().to_owned()))],
            body: Bytes::from(self.seal_bytes(job, &plain)),
        }
    }

    /// Seals bytes of `job` with the active key: `nonce (12) | ciphertext`.
    pub fn seal_bytes(&self, job: JobId, plain: &[u8]) -> Vec<u8> {
        let nonce = Aes256Gcm::generate_nonce(&mut OsRng);
        let aad = job.0.as_bytes();
        // Encryption with a valid key and a fresh nonce cannot fail.
        let sealed = self
            .ring
            .current()
            .1
            .encrypt(&nonce, Payload { msg: plain, aad })
            .unwrap_or_default();
        let mut out = Vec::with_capacity(nonce.len() + sealed.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        out
    }

    /// Opens bytes [`Sealer::seal_bytes`] sealed for `job` with key `key`.
    pub fn open_bytes(&self, key: &str, job: JobId, sealed: &[u8]) -> Result<Vec<u8>, SealError> {
        let cipher = self
            .ring
            .find(key)
            .ok_or_else(|| SealError::UnknownKey(key.to_owned()))?;
        let (nonce, sealed) = sealed.split_at_checked(12).ok_or(SealError::Damaged)?;
        let aad = job.0.as_bytes();
        cipher
            .decrypt(Nonce::from_slice(nonce), Payload { msg: sealed, aad })
            .map_err(|_| SealError::Damaged)
    }
}

/// Whether a stored response is sealed, and with which key.
pub fn sealed_with(response: &StoredResponse) -> Option<&[u8]> {
    match response.headers.as_slice() {
        [(name, key)] if name == SEALED => Some(key),
        _ => None,
    }
}

/// Opens `response` of `job` if it is sealed; a response stored in the
/// clear (before encryption was configured) is returned as it is.
pub fn open(
    sealer: Option<&Sealer>,
    job: JobId,
    response: StoredResponse,
) -> Result<StoredResponse, SealError> {
    let Some(key) = sealed_with(&response) else {
        return Ok(response);
    };
    let sealer = sealer.ok_or(SealError::NoKeys)?;
    let key = String::from_utf8_lossy(key).into_owned();
    let plain = sealer.open_bytes(&key, job, &response.body)?;
    let (len, rest) = plain.split_at_checked(4).ok_or(SealError::Damaged)?;
    let len = u32::from_be_bytes(len.try_into().map_err(|_| SealError::Damaged)?) as usize;
    let (headers, body) = rest.split_at_checked(len).ok_or(SealError::Damaged)?;
    Ok(StoredResponse {
        status: response.status,
        headers: decode_headers(headers).ok_or(SealError::Damaged)?,
        body: Bytes::copy_from_slice(body),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), Bytes::from_static(b"text/plain"))],
            body: Bytes::from_static(b"the secret answer"),
        }
    }

    fn sealer(active: &str) -> Sealer {
        Sealer::new(active, vec![("k1".into(), [1; 32]), ("k2".into(), [2; 32])]).unwrap()
    }

    #[test]
    fn sealed_responses_hold_no_plaintext_and_open_again() {
        let job = JobId::new();
        let sealed = sealer("k1").seal(job, &response());
        assert_eq!(sealed_with(&sealed), Some(b"k1".as_ref()));
        let raw = [sealed.body.as_ref(), sealed.headers[0].1.as_ref()].concat();
        assert!(!raw.windows(6).any(|w| w == b"secret"));
        assert!(!raw.windows(10).any(|w| w == b"text/plain"));
        assert_eq!(open(Some(&sealer("k2")), job, sealed), Ok(response()));
    }

    #[test]
    fn another_job_a_missing_key_or_a_flipped_bit_do_not_open() {
        let job = JobId::new();
        let sealed = sealer("k1").seal(job, &response());
        assert_eq!(
            open(Some(&sealer("k1")), JobId::new(), sealed.clone()),
            Err(SealError::Damaged)
        );
        let only_k3 = Sealer::new("k3", vec![("k3".into(), [3; 32])]).unwrap();
        assert_eq!(
            open(Some(&only_k3), job, sealed.clone()),
            Err(SealError::UnknownKey("k1".into()))
        );
        assert_eq!(open(None, job, sealed.clone()), Err(SealError::NoKeys));
        let mut damaged = sealed.body.to_vec();
        damaged[20] ^= 1;
        let damaged = StoredResponse {
            body: Bytes::from(damaged),
            ..sealed
        };
        assert_eq!(
            open(Some(&sealer("k1")), job, damaged),
            Err(SealError::Damaged)
        );
    }

    #[test]
    fn clear_responses_pass_through_and_an_unknown_active_key_is_refused() {
        assert_eq!(open(None, JobId::new(), response()), Ok(response()));
        assert!(Sealer::new("k9", vec![("k1".into(), [1; 32])]).is_none());
    }
}
