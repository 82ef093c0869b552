//! What a probe's answer must hold: its `expect` entries (a pointer and an
//! exact value or a form: `matches`, `one_of`, `min`/`max`) and its
//! `prompt_tokens` window, each mistake named by its pointer.

use serde::Deserialize;
use serde_json::Value;

use super::ConfigError;
use idemgate_domain::contract::expect::{
    Expectation, Expected, Target, TokenWindow, ENVELOPE_PREFIX,
};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TokensFile {
    pointer: String,
    min: Option<i64>,
    max: Option<i64>,
}

/// One `expect` entry: `pointer` (a JSON pointer, `body:` for the envelope)
/// and the value written for it.
pub(super) fn expectation(
    key: &str,
    pointer: &str,
    value: &Value,
) -> Result<Expectation, ConfigError> {
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
pub(super) fn token_window(key: &str, t: &TokensFile) -> Result<TokenWindow, ConfigError> {
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
