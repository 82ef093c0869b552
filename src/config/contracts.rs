//! `[contracts.NAME]`: response contracts as written in the file, loaded
//! into the domain's [`Contract`] (schemas compiled, probe bodies read)
//! before anything starts, so a bad schema file stops start-up naming its
//! key (`contracts.NAME.schema`), and a bad `expect` names its pointer
//! (`contracts.NAME.probes[0].expect."/answer"`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method};
use serde::Deserialize;
use serde_json::Value;

use super::ConfigError;
use idemgate_domain::contract::expect::{
    Expectation, Expected, Target, TokenWindow, ENVELOPE_PREFIX,
};
use idemgate_domain::contract::{Contract, Embedded, Probe, Shape};

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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProbeFile {
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    pointer: String,
    min: Option<i64>,
    max: Option<i64>,
}

/// Sends per verification at most: a probe costs the provider a call each.
const MAX_RUNS: i64 = 20;

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

/// Probe `i` of contract `name`: one, or one per case of its `cases`.
fn probe(
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

/// One `expect` entry: `pointer` (a JSON pointer, `body:` for the envelope)
/// and the value written for it.
fn expectation(key: &str, pointer: &str, value: &Value) -> Result<Expectation, ConfigError> {
    let key = format!("{key}.{pointer:?}");
    let (target, bare) = match pointer.strip_prefix(ENVELOPE_PREFIX) {
        Some(bare) => (Target::Envelope, bare),
        None => (Target::Document, pointer),
    };
    if !bare.starts_with('/') {
        return Err(ConfigError::new(
            key,
            format!(
                "{pointer:?} is not a JSON pointer; write it like \"/answer\" (the embedded \
                 document, or the body without one) or \"body:/model\" (always the body)"
            ),
        ));
    }
    Ok(Expectation {
        written: pointer.to_owned(),
        target,
        pointer: bare.to_owned(),
        expected: expected(&key, value)?,
    })
}

/// The forms keys of an expected value: a table made only of them is a
/// form; any other value is compared exactly.
const FORMS: [&str; 4] = ["matches", "one_of", "min", "max"];

fn expected(key: &str, value: &Value) -> Result<Expected, ConfigError> {
    let Some(table) = value.as_object() else {
        return Ok(Expected::Exact(value.clone()));
    };
    let forms: Vec<&str> = table
        .keys()
        .map(String::as_str)
        .filter(|k| FORMS.contains(k))
        .collect();
    if forms.is_empty() {
        return Ok(Expected::Exact(value.clone()));
    }
    let bad = |message: String| ConfigError::new(key, message);
    if forms.len() != table.len()
        || (forms.len() > 1 && forms.iter().any(|f| !["min", "max"].contains(f)))
    {
        return Err(bad(format!(
            "mixes {}; write one of {{ matches = \"regex\" }}, {{ one_of = [ … ] }}, \
             {{ min = …, max = … }}, or compare a table's fields one pointer each",
            table
                .keys()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    match forms[0] {
        "matches" => {
            let pattern = table["matches"].as_str().ok_or_else(|| {
                bad("`matches` takes a regular expression, as a string".to_owned())
            })?;
            regex::Regex::new(pattern)
                .map(Expected::Matches)
                .map_err(|e| bad(format!("`matches` is not a regular expression: {e}")))
        }
        "one_of" => match table["one_of"].as_array() {
            Some(values) if !values.is_empty() => Ok(Expected::OneOf(values.clone())),
            _ => Err(bad(
                "`one_of` takes a list of the values allowed, like [\"Paris\", \"PARIS\"]"
                    .to_owned(),
            )),
        },
        _ => range(key, table.get("min"), table.get("max")),
    }
}

fn range(key: &str, min: Option<&Value>, max: Option<&Value>) -> Result<Expected, ConfigError> {
    let number = |v: Option<&Value>, name: &str| match v {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| ConfigError::new(key, format!("`{name}` is {v}; write a number"))),
    };
    let (min, max) = (number(min, "min")?, number(max, "max")?);
    if let (Some(lo), Some(hi)) = (min, max) {
        if lo > hi {
            return Err(ConfigError::new(
                key,
                format!("min {lo} is above max {hi}; no value could pass"),
            ));
        }
    }
    Ok(Expected::Range { min, max })
}

/// `prompt_tokens = { pointer, min, max }`: a pointer into the body and a
/// window of whole numbers.
fn token_window(key: &str, t: &TokensFile) -> Result<TokenWindow, ConfigError> {
    if !t.pointer.starts_with('/') {
        return Err(ConfigError::new(
            format!("{key}.pointer"),
            format!(
                "{:?} is not a JSON pointer into the body; write it like \"/usage/prompt_tokens\"",
                t.pointer
            ),
        ));
    }
    let count = |n: Option<i64>, name: &str| match n {
        None => Ok(None),
        Some(n) => u64::try_from(n).map(Some).map_err(|_| {
            ConfigError::new(
                format!("{key}.{name}"),
                format!("{n} is not a count of tokens"),
            )
        }),
    };
    let (min, max) = (count(t.min, "min")?, count(t.max, "max")?);
    match (min, max) {
        (None, None) => Err(ConfigError::new(
            key,
            "a window needs `min`, `max` or both, like { pointer = \"/usage/prompt_tokens\", min = 20, max = 40 }",
        )),
        (Some(lo), Some(hi)) if lo > hi => Err(ConfigError::new(
            key,
            format!("min {lo} is above max {hi}; no count could pass"),
        )),
        _ => Ok(TokenWindow {
            pointer: t.pointer.clone(),
            min,
            max,
        }),
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

    /// Contract `c` with one probe, the probe's extra lines `probe`, and the
    /// contract's extra lines `extra`.
    fn with_probe(dir: &Path, probe: &str, extra: &str) -> Result<Contract, ConfigError> {
        contract(dir, true);
        std::fs::write(dir.join("probe.json"), "{}").unwrap();
        let text = format!(
            "schema = \"envelope.json\"\n{extra}\n[embedded]\npointer = \"/choices/0/content\"\n\
             schema = \"answer.json\"\n[[probes]]\nname = \"p\"\npath = \"/v1\"\nbody = \"probe.json\"\n{probe}"
        );
        load("c", toml::from_str(&text).unwrap(), dir)
    }

    #[test]
    fn expect_reads_every_form_and_runs_default_to_compare() {
        let dir = tempfile::tempdir().unwrap();
        let c = with_probe(
            dir.path(),
            r#"runs = 3
expect = { "/answer" = "Paris", "/n" = 2, "body:/model" = { matches = "^gpt-" }, "/lang" = { one_of = ["fr", "en"] }, "/p" = { min = 0.5 }, "/o" = { a = 1 } }
prompt_tokens = { pointer = "/usage/prompt_tokens", min = 20, max = 40 }"#,
            "recover_after = 3",
        )
        .unwrap();
        assert_eq!(c.recover_after, 3);
        let p = &c.probes[0];
        assert_eq!(
            (p.runs, p.same),
            (3, true),
            "same defaults to true past one run"
        );
        let form = |w: &str| &p.expect.iter().find(|e| e.written == w).unwrap().expected;
        assert!(matches!(form("/answer"), Expected::Exact(v) if v == "Paris"));
        assert!(matches!(form("/n"), Expected::Exact(v) if v == 2));
        assert!(
            matches!(form("/o"), Expected::Exact(v) if v["a"] == 1),
            "a table of other keys is a value"
        );
        assert!(matches!(form("body:/model"), Expected::Matches(r) if r.as_str() == "^gpt-"));
        assert!(matches!(form("/lang"), Expected::OneOf(v) if v.len() == 2));
        assert!(matches!(form("/p"), Expected::Range { min: Some(m), max: None } if *m == 0.5));
        let model = p
            .expect
            .iter()
            .find(|e| e.written == "body:/model")
            .unwrap();
        assert_eq!(
            (model.target, model.pointer.as_str()),
            (Target::Envelope, "/model")
        );
        let window = p.prompt_tokens.as_ref().unwrap();
        assert_eq!((window.min, window.max), (Some(20), Some(40)));
        assert!(!c.proves_only_the_shape());

        let plain = with_probe(dir.path(), "", "").unwrap();
        assert_eq!(
            (
                plain.recover_after,
                plain.probes[0].runs,
                plain.probes[0].same
            ),
            (2, 1, false)
        );
        assert!(plain.proves_only_the_shape());
        let differ = with_probe(dir.path(), "runs = 2\nsame = false", "").unwrap();
        assert!(!differ.probes[0].same);
    }

    #[test]
    fn a_bad_expectation_names_its_pointer_and_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let err = |probe: &str, extra: &str| with_probe(dir.path(), probe, extra).unwrap_err();
        for (probe, key, says) in [
            (
                r#"expect = { "answer" = "Paris" }"#,
                r#"contracts.c.probes[0].expect."answer""#,
                "not a JSON pointer",
            ),
            (
                r#"expect = { "body:answer" = 1 }"#,
                r#"contracts.c.probes[0].expect."body:answer""#,
                "\"body:/model\"",
            ),
            (
                r#"expect = { "/a" = { matches = "(" } }"#,
                r#"contracts.c.probes[0].expect."/a""#,
                "not a regular expression",
            ),
            (
                r#"expect = { "/a" = { matches = 3 } }"#,
                r#"contracts.c.probes[0].expect."/a""#,
                "as a string",
            ),
            (
                r#"expect = { "/a" = { one_of = [] } }"#,
                r#"contracts.c.probes[0].expect."/a""#,
                "list of the values",
            ),
            (
                r#"expect = { "/a" = { min = 5, max = 1 } }"#,
                r#"contracts.c.probes[0].expect."/a""#,
                "above max",
            ),
            (
                r#"expect = { "/a" = { min = "low" } }"#,
                r#"contracts.c.probes[0].expect."/a""#,
                "write a number",
            ),
            (
                r#"expect = { "/a" = { matches = "x", min = 1 } }"#,
                r#"contracts.c.probes[0].expect."/a""#,
                "mixes",
            ),
            (
                r#"expect = { "/a" = { one_of = [1], b = 2 } }"#,
                r#"contracts.c.probes[0].expect."/a""#,
                "mixes",
            ),
            ("runs = 0", "contracts.c.probes[0].runs", "between 1 and 20"),
            (
                "runs = 21",
                "contracts.c.probes[0].runs",
                "between 1 and 20",
            ),
            (
                r#"prompt_tokens = { pointer = "usage", min = 1 }"#,
                "contracts.c.probes[0].prompt_tokens.pointer",
                "/usage/prompt_tokens",
            ),
            (
                r#"prompt_tokens = { pointer = "/u" }"#,
                "contracts.c.probes[0].prompt_tokens",
                "`min`, `max` or both",
            ),
            (
                r#"prompt_tokens = { pointer = "/u", min = -1 }"#,
                "contracts.c.probes[0].prompt_tokens.min",
                "not a count",
            ),
            (
                r#"prompt_tokens = { pointer = "/u", min = 9, max = 3 }"#,
                "contracts.c.probes[0].prompt_tokens",
                "above max",
            ),
        ] {
            let e = err(probe, "");
            assert_eq!(e.key, key, "{probe}: {}", e.message);
            assert!(e.message.contains(says), "{probe}: {}", e.message);
        }
        let e = err("", "recover_after = 0");
        assert_eq!(e.key, "contracts.c.recover_after");
        assert!(e.message.contains("write 1"), "{}", e.message);
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

    /// Writes the probe `p` of contract `c` with `cases = "cases"` in `dir`.
    fn with_cases(dir: &Path, files: &[(&str, &str)]) -> Result<Contract, ConfigError> {
        contract(dir, true);
        let folder = dir.join("cases");
        std::fs::create_dir_all(&folder).unwrap();
        for (name, text) in files {
            std::fs::write(folder.join(name), text).unwrap();
        }
        let text = "schema = \"envelope.json\"\n[embedded]\npointer = \"/choices/0/content\"\n\
             schema = \"answer.json\"\n[[probes]]\nname = \"real\"\npath = \"/v1\"\n\
             cases = \"cases\"\nexpect = { \"/answer\" = \"Paris\", \"/lang\" = \"fr\" }\n";
        load("c", toml::from_str(text).unwrap(), dir)
    }

    #[test]
    fn each_case_is_a_probe_whose_expectations_win_over_the_probes() {
        let dir = tempfile::tempdir().unwrap();
        let c = with_cases(
            dir.path(),
            &[
                ("b-rome.json", r#"{"q": "italy"}"#),
                ("b-rome.expect.json", r#"{"/answer": "Rome"}"#),
                ("a-paris.json", r#"{"q": "france"}"#),
                ("a-paris.expect.json", r#"{"/n": {"min": 1}}"#),
                ("notes.txt", "not a case"),
            ],
        )
        .unwrap();
        let names: Vec<&str> = c.probes.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["real/a-paris", "real/b-rome"], "sorted by name");
        assert_eq!(&c.probes[1].body[..], br#"{"q": "italy"}"#);
        let expected = |p: &Probe, w: &str| {
            p.expect
                .iter()
                .find(|e| e.written == w)
                .map(|e| format!("{:?}", e.expected))
        };
        assert_eq!(
            expected(&c.probes[1], "/answer").unwrap(),
            "Exact(String(\"Rome\"))"
        );
        assert_eq!(
            expected(&c.probes[1], "/lang").unwrap(),
            "Exact(String(\"fr\"))"
        );
        assert_eq!(
            expected(&c.probes[0], "/answer").unwrap(),
            "Exact(String(\"Paris\"))"
        );
        assert!(expected(&c.probes[0], "/n").unwrap().starts_with("Range"));
    }

    #[test]
    fn a_bad_cases_folder_is_named_with_the_fix() {
        for (files, says) in [
            (vec![], "holds no NAME.json request"),
            (
                vec![("a.json", "{}")],
                "every case needs what its answer must say",
            ),
            (
                vec![("a.json", "{}"), ("a.expect.json", "[1]")],
                "not a JSON object",
            ),
            (
                vec![("a.json", "{}"), ("a.expect.json", r#"{"answer": 1}"#)],
                "is not a JSON pointer",
            ),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let e = with_cases(dir.path(), &files).unwrap_err();
            assert!(
                e.key.starts_with("contracts.c.probes[0].cases"),
                "{}",
                e.key
            );
            assert!(e.to_string().contains(says), "{says}: {e}");
        }
        let dir = tempfile::tempdir().unwrap();
        let e = with_probe(dir.path(), "cases = \"cases\"", "").unwrap_err();
        assert_eq!(e.key, "contracts.c.probes[0].body");
        assert!(e.to_string().contains("not both"), "{e}");
    }
}
