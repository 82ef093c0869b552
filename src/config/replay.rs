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
use super::{bad, ConfigError};
use idemgate_store::StoreSettings;

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
            return Err(bad("replay_key", super::secrets::REPLAY_KEY_NEEDED))
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

#[cfg(test)]
mod tests {
    use super::super::Settings;
    use super::*;

    const KEY: &str = "dGhpcnR5LXR3byBieXRlcyBvZiByZXBsYXkga2V5LCBhdCBsZWFzdA==";
    const SALT: &str = "c2FsdCBvZiB0ZXN0cywgbm90IGEgc2VjcmV0";

    fn load(toml: &str, flags: Flags) -> Result<Option<ReplayKeySettings>, ConfigError> {
        let flags = Flags {
            upstreams: vec!["http://127.0.0.1:8000".into()],
            owner_salt: Some(SALT.into()),
            ..flags
        };
        Settings::from_sources(Settings::parse_file(toml).unwrap(), flags).map(|s| s.replay_keys)
    }

    const PG_REDIS: &str = "database_url = \"postgres://u@h/db\"\nredis_url = \"redis://h\"\n";

    #[test]
    fn with_postgres_and_redis_a_key_is_required_naming_the_fix() {
        let err = load(PG_REDIS, Flags::default()).unwrap_err();
        assert_eq!(err.key, "replay_key");
        assert!(
            err.message.contains("IDEMGATE_REPLAY_KEY") && err.message.contains("openssl rand")
        );
        let given = load(
            PG_REDIS,
            Flags {
                replay_key: Some(KEY.into()),
                replay_previous_keys: vec![KEY.into()],
                ..Flags::default()
            },
        )
        .unwrap()
        .unwrap();
        assert!(matches!(given.current, ReplayKeySource::Given(ref k) if k.len() >= 32));
        assert_eq!(given.previous.len(), 1);
    }

    #[test]
    fn without_redis_nothing_is_needed_and_the_embedded_store_keeps_one() {
        assert!(
            load("database_url = \"postgres://u@h/db\"", Flags::default())
                .unwrap()
                .is_none()
        );
        let embedded = load(
            "embedded_path = \"/data/x.db\"\nredis_url = \"redis://h\"",
            Flags::default(),
        )
        .unwrap()
        .unwrap();
        assert!(matches!(
            embedded.current,
            ReplayKeySource::BesideStore(ref p) if p == Path::new("/data/x.db.replay-key")
        ));
    }

    #[test]
    fn encryption_derives_it_and_a_given_key_wins() {
        let sealed = format!(
            "{PG_REDIS}[encryption]\nactive = \"a\"\n[[encryption.keys]]\nid = \"a\"\nfile = \"/nonexistent\"\n"
        );
        // The encryption key's file is read later: only the replay key's
        // source matters here.
        let file = Settings::parse_file(&sealed).unwrap();
        let flags = Flags::default();
        let store = super::super::store::store_settings(&file, &flags).unwrap();
        let derived = settings(&file, &flags, &store).unwrap().unwrap();
        assert!(matches!(derived.current, ReplayKeySource::FromEncryption));
        let flags = Flags {
            replay_key: Some(KEY.into()),
            ..Flags::default()
        };
        let given = settings(&file, &flags, &store).unwrap().unwrap();
        assert!(matches!(given.current, ReplayKeySource::Given(_)));
    }

    #[test]
    fn keys_are_read_from_the_file_and_bad_ones_are_named() {
        let written = format!(
            "{PG_REDIS}replay_key = {{ value = \"{KEY}\" }}\nreplay_previous_keys = [{{ value = \"{KEY}\" }}, {{ value = \"c2hvcnQ=\" }}]\n"
        );
        let err = load(&written, Flags::default()).unwrap_err();
        assert_eq!(err.key, "replay_previous_keys[1]");
        assert!(err.message.contains("32 bytes"), "{}", err.message);
        let err = load(
            PG_REDIS,
            Flags {
                replay_key: Some("not base64!".into()),
                ..Flags::default()
            },
        )
        .unwrap_err();
        assert_eq!(err.key, "replay_key");
        let err = load(
            &format!("{PG_REDIS}replay_key = {{ env = \"IDEMGATE_TEST_UNSET_REPLAY_KEY\" }}\n"),
            Flags::default(),
        )
        .unwrap_err();
        assert_eq!(err.key, "replay_key");
        assert!(err.message.contains("IDEMGATE_TEST_UNSET_REPLAY_KEY"));
    }
}
