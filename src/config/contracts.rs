//! `[contracts.NAME]`: response contracts as written in the file, loaded
//! into the domain's [`Contract`] (schemas compiled, probe bodies read)
//! before anything starts, so a bad schema file stops start-up naming its
//! key (`contracts.NAME.schema`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method};
use serde::Deserialize;
use serde_json::Value;

use super::ConfigError;
use crate::domain::contract::{Contract, Embedded, Probe, Shape};

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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProbeFile {
    name: String,
    method: Option<String>,
    path: String,
    body: PathBuf,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    schema: Option<PathBuf>,
    embedded_schema: Option<PathBuf>,
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
    let probes = file
        .probes
        .iter()
        .enumerate()
        .map(|(i, p)| probe(name, i, p, &file, base))
        .collect::<Result<Vec<_>, _>>()?;
    let events = match &file.events {
        None => None,
        Some(path) => Some(load_schema(&key("events"), base, path)?),
    };
    Ok(Contract {
        name: name.to_owned(),
        shape: Shape { schema, embedded },
        events,
        probes,
    })
}

/// Probe `i` of contract `name`.
fn probe(
    name: &str,
    i: usize,
    p: &ProbeFile,
    contract: &ContractFile,
    base: &Path,
) -> Result<Probe, ConfigError> {
    let pkey = |field: &str| format!("contracts.{name}.probes[{i}].{field}");
    let method = match p.method.as_deref() {
        None => Method::POST,
        Some(m) => Method::from_bytes(m.to_ascii_uppercase().as_bytes()).map_err(|_| {
            ConfigError::new(pkey("method"), format!("{m:?} is not an HTTP method"))
        })?,
    };
    if !p.path.starts_with('/') {
        return Err(ConfigError::new(
            pkey("path"),
            format!("{:?} must start with `/`", p.path),
        ));
    }
    let body = read(&pkey("body"), base, &p.body)?;
    Ok(Probe {
        name: p.name.clone(),
        method,
        path: p.path.clone(),
        headers: probe_headers(&pkey("headers"), &p.headers)?,
        body: Bytes::from(body),
        shape: probe_shape(name, &pkey, p, contract, base)?,
    })
}

/// A probe's headers: JSON by default, then the ones it names.
fn probe_headers(
    key: &str,
    written: &BTreeMap<String, String>,
) -> Result<Vec<(HeaderName, HeaderValue)>, ConfigError> {
    let mut headers = vec![(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    )];
    for (n, v) in written {
        let n = HeaderName::from_bytes(n.as_bytes())
            .map_err(|_| ConfigError::new(key, format!("{n:?} is not a header name")))?;
        let v = HeaderValue::from_str(v).map_err(|_| {
            ConfigError::new(key, format!("the value of {n} is not a valid header value"))
        })?;
        headers.retain(|(existing, _)| *existing != n);
        headers.push((n, v));
    }
    Ok(headers)
}

/// What a probe's answer must look like: its own schemas where it names
/// them, the contract's otherwise.
fn probe_shape(
    name: &str,
    pkey: &dyn Fn(&str) -> String,
    p: &ProbeFile,
    contract: &ContractFile,
    base: &Path,
) -> Result<Shape, ConfigError> {
    let schema = match &p.schema {
        Some(path) => load_schema(&pkey("schema"), base, path)?,
        None => load_schema(&format!("contracts.{name}.schema"), base, &contract.schema)?,
    };
    let embedded = match (&contract.embedded, &p.embedded_schema) {
        (Some(e), Some(path)) => Some(Embedded {
            pointer: e.pointer.clone(),
            schema: load_schema(&pkey("embedded_schema"), base, path)?,
            // A probe asks for the embedded answer: it must be there.
            required: true,
        }),
        (Some(e), None) => Some(Embedded {
            pointer: e.pointer.clone(),
            schema: load_schema(
                &format!("contracts.{name}.embedded.schema"),
                base,
                &e.schema,
            )?,
            required: true,
        }),
        (None, Some(_)) => {
            return Err(ConfigError::new(
                pkey("embedded_schema"),
                "needs an [contracts.NAME.embedded] section naming the pointer",
            ))
        }
        (None, None) => None,
    };
    Ok(Shape { schema, embedded })
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
mod tests {
    use super::*;

    fn contract(dir: &Path, embedded: bool) -> Contract {
        std::fs::write(
            dir.join("envelope.json"),
            r#"{"type": "object", "required": ["choices"], "additionalProperties": false,
                "properties": {"choices": {"type": "array"}}}"#,
        )
        .unwrap();
        std::fs::write(
            dir.join("answer.json"),
            r#"{"type": "object", "required": ["answer"], "properties": {"answer": {"type": "string"}}}"#,
        )
        .unwrap();
        let text = if embedded {
            "schema = \"envelope.json\"\n[embedded]\npointer = \"/choices/0/content\"\nschema = \"answer.json\"\n"
        } else {
            "schema = \"envelope.json\"\n"
        };
        load("c", toml::from_str(text).unwrap(), dir).unwrap()
    }

    #[test]
    fn checks_the_envelope_and_the_embedded_document() {
        let dir = tempfile::tempdir().unwrap();
        let c = contract(dir.path(), true);
        assert!(c
            .check(br#"{"choices": [{"content": "{\"answer\": \"Paris\"}"}]}"#)
            .is_ok());
        let extra = c.check(br#"{"choices": [], "surprise": 1}"#).unwrap_err();
        assert!(extra.contains("surprise"), "{extra}");
        assert!(c
            .check(br#"{"other": []}"#)
            .unwrap_err()
            .contains("choices"));
        let prose = c
            .check(br#"{"choices": [{"content": "The answer is Paris."}]}"#)
            .unwrap_err();
        assert!(prose.contains("not JSON"), "{prose}");
        assert!(c.check(b"<html>").unwrap_err().contains("not JSON"));
        assert!(contract(dir.path(), false)
            .check(br#"{"choices": [{"content": "prose is fine here"}]}"#)
            .is_ok());
    }

    #[test]
    fn missing_files_name_their_key() {
        let dir = tempfile::tempdir().unwrap();
        let err = load(
            "c",
            toml::from_str("schema = \"nope.json\"").unwrap(),
            dir.path(),
        )
        .unwrap_err();
        assert_eq!(err.key, "contracts.c.schema");
    }
}
