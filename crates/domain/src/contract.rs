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
//!
//! A probe may also say what its answer must contain ([`expect`]): golden
//! values, the provider's count of the prompt, agreement across runs.

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method};
use serde_json::Value;

pub mod expect;

use expect::{Expectation, Observed, TokenWindow};

/// What an answer must look like: a JSON Schema for the body and, for a
/// document embedded as a string inside it, a pointer and a schema of its own.
pub struct Shape {
    /// The body's schema.
    pub schema: jsonschema::Validator,
    /// The document embedded as a string inside the body, if any.
    pub embedded: Option<Embedded>,
}

/// A JSON document embedded as a string inside the body (the `content` of a
/// JSON-mode chat answer).
pub struct Embedded {
    /// Where it is, as a JSON pointer into the body.
    pub pointer: String,
    /// Its schema.
    pub schema: jsonschema::Validator,
    /// Whether an answer without it (the pointer absent or `null`) breaks
    /// the contract. A chat answer that calls tools or refuses carries
    /// `content: null`; a contract that allows those sets this to false
    /// and leaves such answers to the envelope's schema.
    pub required: bool,
}

/// A loaded contract.
pub struct Contract {
    /// Its name, as routes refer to it.
    pub name: String,
    /// What every successful answer must look like.
    pub shape: Shape,
    /// What every event of a streamed answer must look like.
    pub events: Option<jsonschema::Validator>,
    /// The probes that prove an upstream honours it.
    pub probes: Vec<Probe>,
    /// Passing verifications in a row an upstream needs to be eligible
    /// again after failing one (docs/design.md §6).
    pub recover_after: u32,
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
    /// What its answer must look like.
    pub shape: Shape,
    /// The golden values its answer must hold, by JSON pointer.
    pub expect: Vec<Expectation>,
    /// The window the provider's count of the prompt must fall in.
    pub prompt_tokens: Option<TokenWindow>,
    /// How many times one verification sends it (at least 1).
    pub runs: u32,
    /// Whether the values `expect` selects must be identical across runs.
    pub same: bool,
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
    /// Checks a successful answer's body; the error says what broke.
    pub fn check(&self, body: &[u8]) -> Result<(), String> {
        self.shape.parse(body).map(drop)
    }

    /// Whether its probes check only the shape of answers: none says what
    /// an answer must contain (`expect`) or how the prompt rendered
    /// (`prompt_tokens`).
    pub fn proves_only_the_shape(&self) -> bool {
        self.probes
            .iter()
            .all(|p| p.expect.is_empty() && p.prompt_tokens.is_none())
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
    /// Checks one run's answer: a 2xx status, a body of the probe's shape,
    /// every expected value, and the prompt's count in its window. Returns
    /// what the run saw, for comparing runs; the error says what differed.
    pub fn check(&self, status: u16, body: &[u8]) -> Result<Observed, String> {
        if !(200..300).contains(&status) {
            return Err(format!("answered {status}"));
        }
        let (envelope, document) = self.shape.parse(body)?;
        let mut values = Vec::with_capacity(self.expect.len());
        let mut differed = Vec::new();
        for e in &self.expect {
            match e.check(&envelope, document.as_ref()) {
                Ok(value) => values.push((e.written.clone(), value)),
                Err(why) => differed.push(why),
            }
        }
        let prompt_tokens = match self.prompt_tokens.as_ref().map(|w| w.check(&envelope)) {
            None => None,
            Some(Ok(count)) => Some(count),
            Some(Err(why)) => {
                differed.push(why);
                None
            }
        };
        if differed.is_empty() {
            Ok(Observed {
                values,
                prompt_tokens,
            })
        } else {
            Err(differed.join("; "))
        }
    }
}

impl Shape {
    /// The body, checked, and the embedded document when there is one.
    fn parse(&self, body: &[u8]) -> Result<(Value, Option<Value>), String> {
        let value: Value =
            serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
        validate(&self.schema, &value, "")?;
        let document = match &self.embedded {
            Some(embedded) => embedded.parse(&value)?,
            None => None,
        };
        Ok((value, document))
    }
}

impl Embedded {
    /// The embedded document, checked; `None` when it may be absent and is.
    fn parse(&self, body: &Value) -> Result<Option<Value>, String> {
        let pointer = &self.pointer;
        let text = match body.pointer(pointer) {
            None | Some(Value::Null) if !self.required => return Ok(None),
            Some(Value::String(text)) => text,
            _ => return Err(format!("{pointer} is missing or not a string")),
        };
        let inner: Value = serde_json::from_str(text)
            .map_err(|e| format!("{pointer} is not JSON ({e}): {}", excerpt(text.as_bytes())))?;
        validate(&self.schema, &inner, pointer)?;
        Ok(Some(inner))
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
