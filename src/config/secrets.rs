//! Every secret the configuration names, looked up before any is read:
//! all those missing (a variable unset, a file unreadable, a secret the
//! deployment needs and nobody gave) are told in one error, each with its
//! key and its fix, so one run names them all rather than one per run.

use std::path::Path;

use super::file::{FileConfig, UpstreamFile};
use super::flags::Flags;
use super::trust::SecretFile;
use super::{bad, ConfigError};
use idemgate_store::StoreSettings;

/// Owner digests with PostgreSQL: every replica must salt them alike.
pub(super) const OWNER_SALT_NEEDED: &str = "every replica sharing PostgreSQL must salt owner digests with one secret kept outside the database: \
     set IDEMGATE_OWNER_SALT (or [owner] salt = { env = \"…\" }) to `openssl rand -base64 32`";

/// Replay entries in Redis with PostgreSQL: every replica must
/// authenticate them alike.
pub(super) const REPLAY_KEY_NEEDED: &str = "every replica sharing Redis must authenticate its replay entries with one secret kept outside Redis: \
     set IDEMGATE_REPLAY_KEY (or replay_key = { env = \"…\" }) to `openssl rand -base64 32`, \
     or configure [encryption] to derive it from the encryption keys";

/// `Ok` when every secret named is there; else every one that is not.
pub(super) fn all_present(
    file: &FileConfig,
    flags: &Flags,
    store: &StoreSettings,
) -> Result<(), ConfigError> {
    let base = &file.base_dir;
    let mut missing: Vec<ConfigError> = named(file, flags)
        .into_iter()
        .filter_map(|(key, secret)| secret.absent(base).map(|why| bad(key, why)))
        .collect();
    missing.extend(upstream_credentials(file, flags));
    missing.extend(encryption_keys(file, base));
    missing.extend(needed(file, flags, store));
    ConfigError::all(missing).map_or(Ok(()), Err)
}

/// The secrets written as `{ env | file | value }`, by key; those a flag
/// or its variable gives are not read from the file.
fn named<'a>(file: &'a FileConfig, flags: &Flags) -> Vec<(String, &'a SecretFile)> {
    let given = |flag: &Option<String>| flag.as_ref().is_some_and(|t| !t.is_empty());
    let mut found = Vec::new();
    if let Some(owner) = &file.owner {
        if let (false, Some(salt)) = (given(&flags.owner_salt), &owner.salt) {
            found.push(("owner.salt".to_owned(), salt));
        }
        owner.secrets("owner", &mut found);
    }
    for (i, route) in file.routes.iter().enumerate() {
        if let Some(owner) = &route.owner {
            owner.secrets(&format!("routes[{i}].owner"), &mut found);
        }
    }
    if let (false, Some(key)) = (given(&flags.replay_key), &file.replay_key) {
        found.push(("replay_key".to_owned(), key));
    }
    if flags.replay_previous_keys.iter().all(String::is_empty) {
        for (i, key) in file.replay_previous_keys.iter().enumerate() {
            found.push((format!("replay_previous_keys[{i}]"), key));
        }
    }
    for (i, client) in file.clients.iter().enumerate() {
        found.push((format!("clients[{i}].key_sha256"), &client.key_sha256));
    }
    found
}

/// Upstream headers read from a variable that is not set (the file's
/// upstreams, unless `--upstream` replaces them).
fn upstream_credentials(file: &FileConfig, flags: &Flags) -> Vec<ConfigError> {
    if !flags.upstreams.is_empty() {
        return Vec::new();
    }
    let mut missing = Vec::new();
    for (i, upstream) in file.upstreams.iter().flatten().enumerate() {
        let UpstreamFile::Table(table) = upstream else {
            continue;
        };
        for (name, source) in &table.headers {
            let Some(var) = source.env.as_deref().filter(|_| source.value.is_none()) else {
                continue;
            };
            if std::env::var_os(var).is_none() {
                missing.push(bad(
                    format!("upstreams[{i}].headers.{name}"),
                    format!("environment variable {var} is not set; export it, it holds this upstream's credential"),
                ));
            }
        }
    }
    missing
}

/// `[[encryption.keys]]` whose variable is unset or whose file does not read.
fn encryption_keys(file: &FileConfig, base: &Path) -> Vec<ConfigError> {
    let Some(encryption) = &file.encryption else {
        return Vec::new();
    };
    let fix = "export the key (32 bytes, base64: `openssl rand -base64 32`)";
    encryption
        .keys
        .iter()
        .enumerate()
        .filter_map(|(i, k)| {
            let why = match (&k.env, &k.file) {
                (Some(var), None) if std::env::var_os(var).is_none() => {
                    format!("environment variable {var} is not set; {fix}")
                }
                (None, Some(path)) => {
                    let e = std::fs::File::open(base.join(path)).err()?;
                    format!(
                        "cannot read {}: {e}; put the key there, or point `file` at it",
                        path.display()
                    )
                }
                _ => return None,
            };
            Some(bad(format!("encryption.keys[{i}]"), why))
        })
        .collect()
}

/// The secrets a deployment on PostgreSQL must be given, none given: the
/// owner salt, and with Redis the replay key (unless `[encryption]`
/// derives it). The embedded store keeps its own beside its file.
fn needed(file: &FileConfig, flags: &Flags, store: &StoreSettings) -> Vec<ConfigError> {
    if !matches!(store, StoreSettings::Postgres(_)) {
        return Vec::new();
    }
    let given = |flag: &Option<String>| flag.as_ref().is_some_and(|t| !t.is_empty());
    let mut missing = Vec::new();
    let salt = file.owner.as_ref().and_then(|o| o.salt.as_ref());
    if !given(&flags.owner_salt) && salt.is_none() {
        missing.push(bad("owner.salt", OWNER_SALT_NEEDED));
    }
    let redis = flags.redis_url.is_some() || file.redis_url.is_some();
    if redis && !given(&flags.replay_key) && file.replay_key.is_none() && file.encryption.is_none()
    {
        missing.push(bad("replay_key", REPLAY_KEY_NEEDED));
    }
    missing
}

#[cfg(test)]
mod tests {
    use super::super::{Flags, Settings};

    /// The error of `text` with an upstream from the flags (so the file's
    /// own upstreams are not read) or without.
    fn error(text: &str, flags: Flags) -> super::ConfigError {
        Settings::from_sources(Settings::parse_file(text).unwrap(), flags).unwrap_err()
    }

    #[test]
    fn every_missing_secret_is_one_error_each_with_its_key() {
        let text = r#"
upstreams = [{ url = "http://127.0.0.1:1", headers = { x-key = { env = "IDEMGATE_UNIT_NEVER_SET_1" } } }]
replay_previous_keys = [{ env = "IDEMGATE_UNIT_NEVER_SET_2" }]
[owner]
salt = { file = "no-such-salt" }
[encryption]
active = "k1"
keys = [{ id = "k1", env = "IDEMGATE_UNIT_NEVER_SET_3" }, { id = "k0", file = "no-such-key" }]
"#;
        let e = error(text, Flags::default());
        let keys: Vec<&str> = e.each().map(|p| p.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "owner.salt",
                "replay_previous_keys[0]",
                "upstreams[0].headers.x-key",
                "encryption.keys[0]",
                "encryption.keys[1]",
            ],
            "{e}"
        );
        assert!(e.to_string().contains("5 problems"), "{e}");
        for said in [
            "IDEMGATE_UNIT_NEVER_SET_1",
            "IDEMGATE_UNIT_NEVER_SET_3",
            "no-such-key",
        ] {
            assert!(e.to_string().contains(said), "{said}: {e}");
        }
        // Replaced by `--upstream`, the file's upstreams need no credential.
        let flags = Flags {
            upstreams: vec!["http://127.0.0.1:8000".into()],
            ..Flags::default()
        };
        let e = error(text, flags);
        assert!(e.each().all(|p| !p.key.starts_with("upstreams")), "{e}");
        // One problem reads as it always has.
        let e = error(
            "[owner]\nsalt = { env = \"IDEMGATE_UNIT_NEVER_SET_4\" }",
            Flags::default(),
        );
        assert!(e.others.is_empty());
        assert_eq!(
            e.to_string(),
            "invalid configuration: `owner.salt`: environment variable IDEMGATE_UNIT_NEVER_SET_4 is not set; export it"
        );
    }
}
