//! A contract's `[[probes]]`: the requests a verification sends and the
//! shape their answers must have; a probe with `cases` is one probe per
//! request of its folder.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method};
use serde::Deserialize;
use serde_json::Value;

use super::expect::{expectation, token_window, TokensFile};
use super::{load_schema, read, ConfigError, ContractFile};
use idemgate_domain::contract::{Embedded, Probe, Shape};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ProbeFile {
    name: String,
    method: Option<String>,
    path: String,
    /// The request body; or `cases`, a folder of them.
    body: Option<PathBuf>,
    /// A folder of real requests (`NAME.json`), each with its expected
    /// answer (`NAME.expect.json`: pointer → value, as `expect`).
    cases: Option<PathBuf>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    schema: Option<PathBuf>,
    embedded_schema: Option<PathBuf>,
    /// JSON pointer → expected value (TOML read as JSON).
    #[serde(default)]
    expect: BTreeMap<String, Value>,
    prompt_tokens: Option<TokensFile>,
    runs: Option<i64>,
    same: Option<bool>,
}

/// Sends per verification at most: a probe costs the provider a call each.
const MAX_RUNS: i64 = 20;

/// Probe `i` of contract `name`: one, or one per case of its `cases`.
pub(super) fn probe(
    name: &str,
    i: usize,
    p: &ProbeFile,
    contract: &ContractFile,
    base: &Path,
) -> Result<Vec<Probe>, ConfigError> {
    let pkey = |field: &str| format!("contracts.{name}.probes[{i}].{field}");
    let template = || one_probe(name, i, p, contract, base, Bytes::new());
    match (&p.body, &p.cases) {
        (Some(body), None) => {
            let body = read(&pkey("body"), base, body)?;
            Ok(vec![one_probe(
                name,
                i,
                p,
                contract,
                base,
                Bytes::from(body),
            )?])
        }
        (None, Some(folder)) => cases(&pkey("cases"), base, folder)?
            .into_iter()
            .map(|case| {
                let mut probe = template()?;
                probe.name = format!("{}/{}", p.name, case.name);
                probe.body = case.body;
                let key = format!("{}[{:?}]", pkey("cases"), case.name);
                for (pointer, value) in &case.expect {
                    // The case's value wins over the probe's for a pointer.
                    probe.expect.retain(|e| &e.written != pointer);
                    probe.expect.push(expectation(&key, pointer, value)?);
                }
                Ok(probe)
            })
            .collect(),
        _ => Err(ConfigError::new(
            pkey("body"),
            "give either `body` (a file holding the request body) or `cases` (a folder of \
             NAME.json requests, each with its NAME.expect.json), not both and not neither",
        )),
    }
}

/// One request of a `cases` folder and what its answer must say.
struct Case {
    name: String,
    body: Bytes,
    expect: BTreeMap<String, Value>,
}

/// The `cases` folder, sorted by name: every `NAME.json` beside its
/// `NAME.expect.json` (an object of pointer → expected value).
fn cases(key: &str, base: &Path, folder: &Path) -> Result<Vec<Case>, ConfigError> {
    let dir = base.join(folder);
    let entries = std::fs::read_dir(&dir)
        .map_err(|e| ConfigError::new(key, format!("cannot read {}: {e}", dir.display())))?;
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|f| f.ends_with(".json") && !f.ends_with(".expect.json"))
        .map(|f| f.trim_end_matches(".json").to_owned())
        .collect();
    names.sort();
    if names.is_empty() {
        return Err(ConfigError::new(
            key,
            format!(
                "{} holds no NAME.json request: add at least one, each with its NAME.expect.json",
                dir.display()
            ),
        ));
    }
    names
        .into_iter()
        .map(|name| {
            let body = read(key, &dir, Path::new(&format!("{name}.json")))?;
            let expected = dir.join(format!("{name}.expect.json"));
            let text = std::fs::read(&expected).map_err(|e| {
                ConfigError::new(
                    key,
                    format!(
                        "cannot read {} (every case needs what its answer must say): {e}",
                        expected.display()
                    ),
                )
            })?;
            let expect = serde_json::from_slice(&text).map_err(|e| {
                ConfigError::new(
                    key,
                    format!(
                        "{} is not a JSON object of pointer → expected value: {e}",
                        expected.display()
                    ),
                )
            })?;
            Ok(Case {
                name,
                body: Bytes::from(body),
                expect,
            })
        })
        .collect()
}

/// Probe `i` of contract `name`, sending `body`.
fn one_probe(
    name: &str,
    i: usize,
    p: &ProbeFile,
    contract: &ContractFile,
    base: &Path,
    body: Bytes,
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
    let runs = runs(&pkey("runs"), p.runs)?;
    Ok(Probe {
        name: p.name.clone(),
        method,
        path: p.path.clone(),
        headers: probe_headers(&pkey("headers"), &p.headers)?,
        body,
        shape: probe_shape(name, &pkey, p, contract, base)?,
        expect: p
            .expect
            .iter()
            .map(|(pointer, value)| expectation(&pkey("expect"), pointer, value))
            .collect::<Result<_, _>>()?,
        prompt_tokens: p
            .prompt_tokens
            .as_ref()
            .map(|t| token_window(&pkey("prompt_tokens"), t))
            .transpose()?,
        runs,
        // Comparing runs is the point of asking more than once.
        same: p.same.unwrap_or(runs > 1),
    })
}

/// `runs`: 1 unless written, between 1 and [`MAX_RUNS`].
fn runs(key: &str, written: Option<i64>) -> Result<u32, ConfigError> {
    match written {
        None => Ok(1),
        Some(n) if (1..=MAX_RUNS).contains(&n) => Ok(n as u32),
        Some(n) => Err(ConfigError::new(
            key,
            format!(
                "{n} runs cannot prove anything; write between 1 and {MAX_RUNS} (each run is \
                 one call to the provider per verification)"
            ),
        )),
    }
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
