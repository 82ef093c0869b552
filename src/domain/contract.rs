//! Response contracts: the shape a route's answers must have, and the probe
//! requests that prove an upstream honours it.
//!
//! A contract is a JSON Schema for response bodies, optionally with a JSON
//! document embedded as a string inside them (the `content` of a JSON-mode
//! chat answer) that must parse and satisfy a schema of its own. Every
//! successful (2xx) answer on a route with a contract is checked before it
//! may commit; one that breaks it is `rejected`, kept for inspection and
//! never replayed. Error answers (4xx, 5xx) are not checked: they are the
//! upstream's own verdict, committed or retried as the route says.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method};
use serde::Deserialize;
use serde_json::Value;

use crate::config::ConfigError;

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

/// What an answer must look like.
struct Shape {
    schema: jsonschema::Validator,
    embedded: Option<(String, jsonschema::Validator)>,
}

/// A loaded contract.
pub struct Contract {
    /// Its name, as routes refer to it.
    pub name: String,
    shape: Shape,
    events: Option<jsonschema::Validator>,
    /// The probes that prove an upstream honours it.
    pub probes: Vec<Probe>,
}

/// One probe request and the shape its answer must have.
pub struct Probe {
    /// Its name in reports.
    pub name: String,
    /// Request method.
    pub method: Method,
    /// Path and query, appended to the upstream's base URL.
    pub path: String,
    /// Extra request headers.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The request body.
    pub body: Bytes,
    shape: Shape,
}

impl std::fmt::Debug for Contract {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Contract")
            .field("name", &self.name)
            .field(
                "probes",
                &self.probes.iter().map(|p| &p.name).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Contract {
    /// Loads `[contracts.NAME]`; file paths are relative to `base` (the
    /// config file's folder).
    pub fn load(name: &str, file: ContractFile, base: &Path) -> Result<Contract, ConfigError> {
        let key = |field: &str| format!("contracts.{name}.{field}");
        let schema = load_schema(&key("schema"), base, &file.schema)?;
        let embedded = match &file.embedded {
            None => None,
            Some(e) => {
                if !e.pointer.starts_with('/') {
                    return Err(ConfigError::new(
                        key("embedded.pointer"),
                        format!("{:?} is not a JSON pointer; write it like \"/choices/0/message/content\"", e.pointer),
                    ));
                }
                Some((
                    e.pointer.clone(),
                    load_schema(&key("embedded.schema"), base, &e.schema)?,
                ))
            }
        };
        let mut probes = Vec::with_capacity(file.probes.len());
        for (i, p) in file.probes.into_iter().enumerate() {
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
            let mut headers = vec![(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )];
            for (n, v) in &p.headers {
                let n = HeaderName::from_bytes(n.as_bytes()).map_err(|_| {
                    ConfigError::new(pkey("headers"), format!("{n:?} is not a header name"))
                })?;
                let v = HeaderValue::from_str(v).map_err(|_| {
                    ConfigError::new(
                        pkey("headers"),
                        format!("the value of {n} is not a valid header value"),
                    )
                })?;
                headers.retain(|(existing, _)| *existing != n);
                headers.push((n, v));
            }
            let shape = Shape {
                schema: match &p.schema {
                    Some(path) => load_schema(&pkey("schema"), base, path)?,
                    None => load_schema(&key("schema"), base, &file.schema)?,
                },
                embedded: match (&file.embedded, &p.embedded_schema) {
                    (Some(e), Some(path)) => Some((
                        e.pointer.clone(),
                        load_schema(&pkey("embedded_schema"), base, path)?,
                    )),
                    (Some(e), None) => Some((
                        e.pointer.clone(),
                        load_schema(&key("embedded.schema"), base, &e.schema)?,
                    )),
                    (None, Some(_)) => {
                        return Err(ConfigError::new(
                            pkey("embedded_schema"),
                            "needs an [contracts.NAME.embedded] section naming the pointer",
                        ))
                    }
                    (None, None) => None,
                },
            };
            probes.push(Probe {
                name: p.name,
                method,
                path: p.path,
                headers,
                body: Bytes::from(body),
                shape,
            });
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
        })
    }

    /// Checks a successful answer's body; the error says what broke.
    pub fn check(&self, body: &[u8]) -> Result<(), String> {
        self.shape.check(body)
    }

    /// Checks a streamed answer (server-sent events): every event's data
    /// but `[DONE]` must be JSON of the `events` schema. `None` when the
    /// contract has no events schema: a stream is then checked for its
    /// status only.
    pub fn check_stream(&self, body: &[u8]) -> Option<Result<(), String>> {
        let schema = self.events.as_ref()?;
        let text = String::from_utf8_lossy(body);
        for (n, event) in text.replace("\r\n", "\n").split("\n\n").enumerate() {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if data.is_empty() || data == ["[DONE]"] {
                continue;
            }
            let check = serde_json::from_str::<Value>(&data.join("\n"))
                .map_err(|e| format!("event {} is not JSON: {e}", n + 1))
                .and_then(|value| validate(schema, &value, &format!("event {}", n + 1)));
            if check.is_err() {
                return Some(check);
            }
        }
        Some(Ok(()))
    }
}

impl Probe {
    /// Checks a probe's answer: a 2xx status and a body of the probe's shape.
    pub fn check(&self, status: u16, body: &[u8]) -> Result<(), String> {
        if !(200..300).contains(&status) {
            return Err(format!("answered {status}"));
        }
        self.shape.check(body)
    }
}

impl Shape {
    fn check(&self, body: &[u8]) -> Result<(), String> {
        let value: Value =
            serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
        validate(&self.schema, &value, "")?;
        if let Some((pointer, schema)) = &self.embedded {
            let text = value
                .pointer(pointer)
                .and_then(Value::as_str)
                .ok_or_else(|| format!("{pointer} is missing or not a string"))?;
            let inner: Value = serde_json::from_str(text).map_err(|e| {
                format!("{pointer} is not JSON ({e}): {}", excerpt(text.as_bytes()))
            })?;
            validate(schema, &inner, pointer)?;
        }
        Ok(())
    }
}

fn validate(schema: &jsonschema::Validator, value: &Value, within: &str) -> Result<(), String> {
    let errors: Vec<String> = schema
        .iter_errors(value)
        .take(3)
        .map(|e| {
            let at = e.instance_path().to_string();
            let at = if at.is_empty() { "/".to_owned() } else { at };
            format!("{within}{at}: {e}")
        })
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// The start of a body, for operators reading why an answer was rejected.
pub fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
    if body.len() > 200 {
        format!("{text}…")
    } else {
        text
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
        Contract::load("c", toml::from_str(text).unwrap(), dir).unwrap()
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
    }

    #[test]
    fn missing_files_name_their_key() {
        let dir = tempfile::tempdir().unwrap();
        let err = Contract::load(
            "c",
            toml::from_str("schema = \"nope.json\"").unwrap(),
            dir.path(),
        )
        .unwrap_err();
        assert_eq!(err.key, "contracts.c.schema");
    }
}
