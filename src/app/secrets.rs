//! The deployment's secrets that are not configured as components are: the
//! owner salt (`docs/design.md` §15) and the replay keys (§17). Each is
//! given, or with the embedded store kept in a file beside its database,
//! made on first start.

use std::path::Path;

use super::StartError;
use crate::config::{
    EncryptionSettings, OwnerSaltSetting, ReplayKeySettings, ReplayKeySource,
    DEFAULT_REDIS_KEY_PREFIX,
};
use idemgate_domain::key::OwnerSalt;
use idemgate_store::fastpath::keys::{derive_from_encryption_key, scoped_to_prefix, EntryKeys};

/// The owner salt: configured, or (embedded store) kept beside the database.
pub(super) fn owner_salt(setting: &OwnerSaltSetting) -> Result<OwnerSalt, StartError> {
    match setting {
        OwnerSaltSetting::Given(bytes) => Ok(OwnerSalt::new(bytes)),
        OwnerSaltSetting::BesideStore(path) => {
            let bytes = beside_store(path, "owner digests are salted with")
                .map_err(StartError::OwnerSalt)?;
            Ok(OwnerSalt::new(&bytes))
        }
    }
}

/// The keys Redis replay entries are written and verified with, under the
/// deployment's Redis key `prefix`; sealed when `[encryption]` is on.
pub(super) fn replay_keys(
    setting: &ReplayKeySettings,
    encryption: Option<&EncryptionSettings>,
    prefix: &str,
) -> Result<EntryKeys, StartError> {
    let mut previous = setting.previous.clone();
    let current = match &setting.current {
        ReplayKeySource::Given(key) => key.clone(),
        ReplayKeySource::BesideStore(path) => {
            beside_store(path, "Redis replay entries are authenticated with")
                .map_err(StartError::ReplayKey)?
        }
        ReplayKeySource::FromEncryption => {
            let e = encryption.ok_or(StartError::ReplayKey(
                "cannot be derived: [encryption] is not configured".into(),
            ))?;
            let derived = |id: &str| {
                let (_, key) = e.keys.iter().find(|(k, _)| k == id)?;
                Some(derive_from_encryption_key(key).to_vec())
            };
            // Every other encryption key still verifies what it wrote: the
            // replay key rotates with the encryption keys.
            previous.extend(
                e.keys
                    .iter()
                    .filter(|(id, _)| *id != e.active)
                    .filter_map(|(id, _)| derived(id)),
            );
            derived(&e.active).ok_or(StartError::ReplayKey(
                "cannot be derived: the active encryption key is not configured".into(),
            ))?
        }
    };
    // Scoped to the prefix, but for the default's, whose entries stay as
    // they were written before keys were scoped: of two deployments on one
    // Redis, at most one has it (docs/design.md §13, "One Redis, several deployments").
    let scoped = |key: &[u8]| match prefix == DEFAULT_REDIS_KEY_PREFIX {
        true => key.to_vec(),
        false => scoped_to_prefix(key, prefix).to_vec(),
    };
    let previous: Vec<Vec<u8>> = previous.iter().map(|key| scoped(key)).collect();
    let keys = EntryKeys::new(
        &scoped(&current),
        previous.iter().map(Vec::as_slice),
        encryption.is_some(),
    );
    tracing::info!(
        ids = ?keys.ids().iter().map(hex::encode).collect::<Vec<_>>(),
        sealed = keys.sealed(),
        "Redis replay entries are authenticated (the first key id writes, every one verifies)"
    );
    Ok(keys)
}

/// A secret of 32 random bytes kept (base64) in `path`, beside the embedded
/// store, readable by this user only: read, or made when there is none.
/// The error says which file and why.
fn beside_store(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    use base64::Engine;
    let engine = base64::engine::general_purpose::STANDARD;
    let unusable = |why: String| format!("{}: {why}", path.display());
    if let Some(kept) = read_kept(path)? {
        return Ok(kept);
    }
    let mut bytes = [0u8; 32];
    aes_gcm::aead::rand_core::RngCore::fill_bytes(&mut aes_gcm::aead::OsRng, &mut bytes);
    let mut file = std::fs::OpenOptions::new();
    file.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut file, 0o600);
    let mut file = file.open(path).map_err(|e| unusable(e.to_string()))?;
    std::io::Write::write_all(&mut file, engine.encode(bytes).as_bytes())
        .map_err(|e| unusable(e.to_string()))?;
    tracing::info!(path = %path.display(), "{what} a new secret kept beside the embedded store");
    Ok(bytes.to_vec())
}

/// Where each secret comes from, for `idemgate check`: read (never made)
/// where it is kept in a file, so a broken one is named now rather than at
/// start-up.
pub(super) fn describe(settings: &crate::config::Settings) -> Result<Vec<String>, StartError> {
    let mut lines = Vec::new();
    // Both files are told when both are broken: one run, every fix.
    let mut broken = Vec::new();
    match &settings.owner_salt {
        OwnerSaltSetting::Given(_) => lines.push("owner_salt = given".to_owned()),
        OwnerSaltSetting::BesideStore(path) => match kept_in(path) {
            Ok(state) => lines.push(format!("owner_salt = {state}")),
            Err(e) => broken.push(StartError::OwnerSalt(e)),
        },
    }
    if let Some(replay) = &settings.replay_keys {
        let state = match &replay.current {
            ReplayKeySource::Given(_) => Ok("given".to_owned()),
            ReplayKeySource::FromEncryption => Ok("derived from [encryption]".to_owned()),
            ReplayKeySource::BesideStore(path) => kept_in(path).map_err(StartError::ReplayKey),
        };
        match state {
            Ok(state) => lines.push(format!("replay_key = {state}")),
            Err(e) => broken.push(e),
        }
    }
    if let Some(encryption) = &settings.encryption {
        lines.push(format!(
            "encryption = on (active key {}, {} in all)",
            encryption.active,
            encryption.keys.len()
        ));
    }
    match broken.len() {
        0 => Ok(lines),
        1 => Err(broken.remove(0)),
        _ => Err(StartError::Secrets(broken)),
    }
}

/// A secret file beside the embedded store: whether it is there and reads.
fn kept_in(path: &Path) -> Result<String, String> {
    Ok(match read_kept(path)? {
        Some(_) => format!("kept in {}", path.display()),
        None => format!("made in {} on first start", path.display()),
    })
}

/// The secret kept (base64) in `path`; `None` when there is no such file.
/// The error says which file and why.
fn read_kept(path: &Path) -> Result<Option<Vec<u8>>, String> {
    use base64::Engine;
    let unusable = |why: String| format!("{}: {why}", path.display());
    match std::fs::read_to_string(path) {
        Ok(text) => base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .map(Some)
            .map_err(|e| unusable(e.to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(unusable(e.to_string())),
    }
}
