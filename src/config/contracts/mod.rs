//! `[contracts.NAME]`: response contracts as written in the file, loaded
//! into the domain's [`Contract`] (schemas compiled, probe bodies read)
//! before anything starts, so a bad schema file stops start-up naming its
//! key (`contracts.NAME.schema`), and a bad `expect` names its pointer
//! (`contracts.NAME.probes[0].expect."/answer"`).
//!
//! This module reads the contract and its schemas; `probes` reads its
//! probes and their `cases` folders; `expect` reads what a probe's answer
//! must hold (`expect`) and its prompt's token window (`prompt_tokens`).

mod expect;
mod probes;

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use super::ConfigError;
use idemgate_domain::contract::{Contract, Embedded, Shape};
use probes::{probe, ProbeFile};

/// A contract as written under `[contracts.NAME]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContractFile {
    schema: PathBuf,
    embedded: Option<EmbeddedFile>,
    /// A schema every event of a streamed answer (each `data:` of a
    /// server-sent event stream but `[DONE]`) must honour.
    events: Option<PathBuf>,
    #[serde(default)]
    probes: Vec<ProbeFile>,
    /// Passing verifications in a row an upstream needs to be eligible
    /// again after failing one.
    recover_after: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EmbeddedFile {
    pointer: String,
    schema: PathBuf,
    /// false: an answer whose pointer is absent or `null` (a chat answer
    /// calling tools, or refusing) passes on the envelope's schema alone.
    #[serde(default = "yes")]
    required: bool,
}

fn yes() -> bool {
    true
}

/// Loads `[contracts.NAME]`; file paths are relative to `base` (the config
/// file's folder).
pub fn load(name: &str, file: ContractFile, base: &Path) -> Result<Contract, ConfigError> {
    let key = |field: &str| format!("contracts.{name}.{field}");
    let schema = load_schema(&key("schema"), base, &file.schema)?;
    let embedded = match &file.embedded {
        None => None,
        Some(e) => {
            if !e.pointer.starts_with('/') {
                return Err(ConfigError::new(
                    key("embedded.pointer"),
                    format!(
                        "{:?} is not a JSON pointer; write it like \"/choices/0/message/content\"",
                        e.pointer
                    ),
                ));
            }
            Some(Embedded {
                pointer: e.pointer.clone(),
                schema: load_schema(&key("embedded.schema"), base, &e.schema)?,
                required: e.required,
            })
        }
    };
    let mut probes = Vec::new();
    for (i, p) in file.probes.iter().enumerate() {
        probes.extend(probe(name, i, p, &file, base)?);
    }
    let events = match &file.events {
        None => None,
        Some(path) => Some(load_schema(&key("events"), base, path)?),
    };
    Ok(Contract {
        name: name.to_owned(),
        shape: Shape { schema, embedded },
        events,
        probes,
        recover_after: recover_after(&key("recover_after"), file.recover_after)?,
    })
}

/// `recover_after`: 2 unless written, at least 1.
fn recover_after(key: &str, written: Option<i64>) -> Result<u32, ConfigError> {
    match written {
        None => Ok(2),
        Some(n) if (1..=1000).contains(&n) => Ok(n as u32),
        Some(n) => Err(ConfigError::new(
            key,
            format!(
                "{n} is not a number of verifications; write 1 (eligible again after one \
                 passing verification) or more"
            ),
        )),
    }
}

fn read(key: &str, base: &Path, path: &Path) -> Result<Vec<u8>, ConfigError> {
    let full = base.join(path);
    std::fs::read(&full)
        .map_err(|e| ConfigError::new(key, format!("cannot read {}: {e}", full.display())))
}

fn load_schema(key: &str, base: &Path, path: &Path) -> Result<jsonschema::Validator, ConfigError> {
    let bytes = read(key, base, path)?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| {
        ConfigError::new(
            key,
            format!("{} is not JSON: {e}", base.join(path).display()),
        )
    })?;
    jsonschema::validator_for(&value).map_err(|e| {
        ConfigError::new(
            key,
            format!(
                "{} is not a valid JSON Schema: {e}",
                base.join(path).display()
            ),
        )
    })
}

#[cfg(test)]
mod tests;
