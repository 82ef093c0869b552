//! `replay_key` and `replay_previous_keys`: the secret replay entries in
//! Redis are authenticated with (`docs/design.md` §17).
//!
//! Only a gateway with Redis needs one. Every replica sharing Redis must
//! use the same, so with PostgreSQL it is given, or derived from the
//! `[encryption]` keys every replica already shares; the embedded store
//! keeps a random one beside its file, as it keeps its owner salt.

use std::path::{Path, PathBuf};

use super::file::FileConfig;
use super::flags::Flags;
use super::store::StoreSettings;
use super::{bad, ConfigError};

/// Where the replay key comes from, and the previous keys that still
/// verify what they wrote.
#[derive(Clone)]
pub struct ReplayKeySettings {
    /// The key entries are written with.
    pub current: ReplayKeySource,
    /// Keys that still verify (rotation): each 32 bytes or more.
    pub previous: Vec<Vec<u8>>,
}

/// Where the current replay key comes from.
#[derive(Clone)]
pub enum ReplayKeySource {
    /// Configured (`replay_key`, `--replay-key`, `IDEMGATE_REPLAY_KEY`).
    Given(Vec<u8>),
    /// Derived from the active `[encryption]` key; the other encryption
    /// keys' derivations verify too, so it rotates with them.
    FromEncryption,
    /// The embedded store: a random key kept in this file beside the
    /// database, made on first start.
    BesideStore(PathBuf),
}

impl std::fmt::Debug for ReplayKeySettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let current = match &self.current {
            ReplayKeySource::Given(_) => "given <redacted>".to_owned(),
            ReplayKeySource::FromEncryption => "derived from [encryption]".to_owned(),
            ReplayKeySource::BesideStore(path) => format!("beside the store: {}", path.display()),
        };
        f.debug_struct("ReplayKeySettings")
            .field("current", &current)
            .field("previous", &self.previous.len())
            .finish()
    }
}

const MAKE_ONE: &str = "make one with `openssl rand -base64 32`";

/// The replay key settings; `None` without Redis, which is the only thing
/// that uses them.
pub(super) fn settings(
    file: &FileConfig,
    flags: &Flags,
    store: &StoreSettings,
) -> Result<Option<ReplayKeySettings>, ConfigError> {
    // An empty variable is an unset one (a Secret left empty, a test's unset).
    let flag = flags.replay_key.as_ref().filter(|text| !text.is_empty());
    let given = match (flag, &file.replay_key) {
        (Some(text), _) => Some(decode("replay_key", text)?),
        (None, Some(secret)) => Some(decode(
            "replay_key",
            &secret.read("replay_key", &file.base_dir)?,
        )?),
        (None, None) => None,
    };
    let previous = previous(file, flags, &file.base_dir)?;
    if flags.redis_url.is_none() && file.redis_url.is_none() {
        return Ok(None);
    }
    let current = match (given, store) {
        (Some(key), _) => ReplayKeySource::Given(key),
        (None, _) if file.encryption.is_some() => ReplayKeySource::FromEncryption,
        (None, StoreSettings::Embedded { path }) => {
            let mut beside = path.clone().into_os_string();
            beside.push(".replay-key");
            ReplayKeySource::BesideStore(beside.into())
        }
        (None, StoreSettings::Postgres(_)) => {
            return Err(bad(
                "replay_key",
                "every replica sharing Redis must authenticate its replay entries with one secret kept outside Redis: \
                 set IDEMGATE_REPLAY_KEY (or replay_key = { env = \"…\" }) to `openssl rand -base64 32`, \
                 or configure [encryption] to derive it from the encryption keys",
            ))
        }
    };
    Ok(Some(ReplayKeySettings { current, previous }))
}

/// `replay_previous_keys` (the flag's comma-separated list over the file's).
fn previous(file: &FileConfig, flags: &Flags, base: &Path) -> Result<Vec<Vec<u8>>, ConfigError> {
    let flags: Vec<&String> = flags
        .replay_previous_keys
        .iter()
        .filter(|text| !text.is_empty())
        .collect();
    if !flags.is_empty() {
        return flags
            .into_iter()
            .enumerate()
            .map(|(i, text)| decode(&format!("replay_previous_keys[{i}]"), text))
            .collect();
    }
    file.replay_previous_keys
        .iter()
        .enumerate()
        .map(|(i, secret)| {
            let key = format!("replay_previous_keys[{i}]");
            decode(&key, &secret.read(&key, base)?)
        })
        .collect()
}

/// A key as written: 32 bytes or more of base64.
fn decode(key: &str, text: &str) -> Result<Vec<u8>, ConfigError> {
    use base64::Engine;
    match base64::engine::general_purpose::STANDARD.decode(text.trim()) {
        Ok(bytes) if bytes.len() >= 32 => Ok(bytes),
        _ => Err(bad(
            key,
            format!("not 32 bytes or more of base64; {MAKE_ONE}"),
        )),
    }
}
