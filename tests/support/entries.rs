//! Reading, writing and forging Redis replay entries as the gateway does
//! (`docs/design.md` §17), with the keys a test's gateways run with.

use std::time::SystemTime;

use base64::Engine;
use bytes::Bytes;
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_store::fastpath::keys::derive_from_encryption_key;
use idemgate_store::fastpath::{self, Binding, Entry, EntryKeys, Unusable};

/// The replay key of every gateway of the suite (`SUITE_ENV`).
pub const SUITE_REPLAY_KEY: &str =
    "dGhlIHRlc3Qgc3VpdGUncyByZXBsYXkga2V5OiAzMiBieXRlcyBhbmQgbW9yZQ==";

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
    fastpath::redis_key(
        "idemgate:",
        &Binding::of(&owner(), &key(k)),
        &owner(),
        &key(k),
    )
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

/// Redis commands a test runs beside the gateway, on a connection of its
/// own to `url` (streams: `XLEN`, `XRANGE`, `XADD`, `XDEL`).
pub struct Raw(redis::aio::MultiplexedConnection);

impl Raw {
    pub async fn connect(url: &str) -> Raw {
        let client = redis::Client::open(url).unwrap();
        Raw(client.get_multiplexed_async_connection().await.unwrap())
    }

    /// The entries of a stream, in order: each id with its one field and
    /// value.
    pub async fn entries(&mut self, stream: &str) -> Vec<(String, String, Vec<u8>)> {
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(stream)
            .arg("-")
            .arg("+")
            .query_async(&mut self.0)
            .await
            .unwrap();
        reply
            .ids
            .into_iter()
            .map(|entry| {
                let (field, value) = entry.map.into_iter().next().expect("one field");
                let value: Vec<u8> = redis::from_redis_value(value).unwrap();
                (entry.id, field, value)
            })
            .collect()
    }

    /// Appends an entry of one field to a stream.
    pub async fn append(&mut self, stream: &str, field: &str, value: &[u8]) {
        redis::cmd("XADD")
            .arg(stream)
            .arg("*")
            .arg(field)
            .arg(value)
            .query_async::<String>(&mut self.0)
            .await
            .unwrap();
    }

    /// Removes an entry of a stream by its id.
    pub async fn remove(&mut self, stream: &str, id: &str) {
        redis::cmd("XDEL")
            .arg(stream)
            .arg(id)
            .query_async::<i64>(&mut self.0)
            .await
            .unwrap();
    }
}
