//! The deployment's secrets that are not configured as components are: the
//! owner salt (`docs/design.md` §15) and the replay keys (§17). Each is
//! given, or with the embedded store kept in a file beside its database,
//! made on first start.

use std::path::Path;

use super::StartError;
use crate::config::{EncryptionSettings, OwnerSaltSetting, ReplayKeySettings, ReplayKeySource};
use crate::domain::key::OwnerSalt;
use crate::idempotency::fastpath::keys::{derive_from_encryption_key, EntryKeys};

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

/// The keys Redis replay entries are written and verified with; sealed
/// when `[encryption]` is on.
pub(super) fn replay_keys(
    setting: &ReplayKeySettings,
    encryption: Option<&EncryptionSettings>,
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
    let keys = EntryKeys::new(
        &current,
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
    match std::fs::read_to_string(path) {
        Ok(text) => {
            return engine
                .decode(text.trim())
                .map_err(|e| unusable(e.to_string()))
        }
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(unusable(e.to_string())),
        Err(_) => {}
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
