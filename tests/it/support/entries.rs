//! Reading, writing and forging Redis replay entries as the gateway does
//! (`docs/design.md` §17), with the keys a test's gateways run with.

use std::time::SystemTime;

use base64::Engine;
use bytes::Bytes;
use idemgate::domain::key::{IdempotencyKey, Owner};
use idemgate::idempotency::fastpath::keys::derive_from_encryption_key;
use idemgate::idempotency::fastpath::{self, Binding, Entry, EntryKeys, Unusable};

/// The replay key of every gateway of the suite (`SUITE_ENV`).
pub const SUITE_REPLAY_KEY: &str = "dGhlIHRlc3Qgc3VpdGUncyByZXBsYXkga2V5OiAzMiBieXRlcyBhbmQgbW9yZQ==";

pub fn bytes_of(base64: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(base64)
        .unwrap()
}

/// The keys of the suite's gateways without `[encryption]`.
pub fn suite_keys() -> EntryKeys {
    EntryKeys::new(&bytes_of(SUITE_REPLAY_KEY), [], false)
}

/// The keys of a gateway whose `[encryption]` active key is `base64` and
/// which derives its replay key from it.
pub fn derived_keys(base64: &str) -> EntryKeys {
    let key: [u8; 32] = bytes_of(base64).try_into().unwrap();
    EntryKeys::new(&derive_from_encryption_key(&key), [], true)
}

/// A key nobody's gateway has: what a forger writes with.
pub fn forger_keys(sealed: bool) -> EntryKeys {
    EntryKeys::new(b"a forger's key, not the gateway's!", [], sealed)
}

/// The suite's (anonymous) owner.
pub fn owner() -> Owner {
    Owner::anonymous()
}

pub fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::new(k).unwrap()
}

/// The Redis key of the anonymous owner's `k`.
pub fn redis_key(k: &str) -> String {
    fastpath::redis_key(&Binding::of(&owner(), &key(k)), &owner(), &key(k))
}

/// Reads an entry of the anonymous owner's `k` as a gateway with `keys`.
pub fn decode(bytes: &[u8], k: &str, keys: &EntryKeys) -> Result<Entry, Unusable> {
    fastpath::decode(
        Bytes::copy_from_slice(bytes),
        &owner(),
        &key(k),
        keys,
        SystemTime::now(),
    )
}

/// Writes an entry of the anonymous owner's `k` as a gateway with `keys`.
pub fn encode(entry: &Entry, k: &str, keys: &EntryKeys) -> Vec<u8> {
    fastpath::encode(entry, &owner(), &key(k), keys)
}
