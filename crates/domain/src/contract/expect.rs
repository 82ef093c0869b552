//! What a probe's answer must *say*, beyond its shape: golden values by JSON
//! pointer (`expect`), the provider's own count of the prompt
//! (`prompt_tokens`), and the verdict of a verification made of several
//! runs (`runs`, `same`). Pure: values in, findings out (docs/design.md §6,
//! "Proven providers").

use regex::Regex;
use serde_json::Value;

/// The prefix that makes a pointer address the envelope (the whole body)
/// even when the contract embeds a document.
pub const ENVELOPE_PREFIX: &str = "body:";

/// Which document a pointer addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The contract's embedded document when it has one, else the body.
    Document,
    /// The body, always (written `body:/…`).
    Envelope,
}

/// One golden value: where it is, and what it must be.
#[derive(Debug)]
pub struct Expectation {
    /// The key as written (`/answer`, `body:/model`): how reports name it.
    pub written: String,
    /// Which document the pointer addresses.
    pub target: Target,
    /// The JSON pointer, without its `body:` prefix.
    pub pointer: String,
    /// What the value must be.
    pub expected: Expected,
}

/// The forms an expected value takes.
#[derive(Debug)]
pub enum Expected {
    /// Exactly this JSON value (numbers compared by value: 1 equals 1.0).
    Exact(Value),
    /// A string the regular expression finds a match in (unanchored; write
    /// `^…$` for the whole string).
    Matches(Regex),
    /// Any of these values, each compared as [`Expected::Exact`].
    OneOf(Vec<Value>),
    /// A number within the bounds, both inclusive.
    Range {
        /// The least allowed.
        min: Option<f64>,
        /// The most allowed.
        max: Option<f64>,
    },
}

/// The window the provider's count of the prompt must fall in.
#[derive(Debug, Clone)]
pub struct TokenWindow {
    /// Where the count is in the body (APIs put `usage` in the envelope).
    pub pointer: String,
    /// The least allowed.
    pub min: Option<u64>,
    /// The most allowed.
    pub max: Option<u64>,
}

/// What one passing run of a probe saw.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    /// The values the `expect` pointers selected, in the probe's order.
    pub values: Vec<(String, Value)>,
    /// The provider's count of the prompt, when the probe asks for it.
    pub prompt_tokens: Option<u64>,
}

/// The verdict on one probe in one verification (all its runs together).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// Every run passed, alike where they had to be.
    Pass,
    /// Every run failed: the first run's reason.
    Fail(String),
    /// Some runs passed and others failed, or passing runs selected
    /// different values under `same`: what differed.
    Unstable(String),
}

impl Finding {
    /// How reports and metrics name it.
    pub fn as_str(&self) -> &'static str {
        match self {
            Finding::Pass => "pass",
            Finding::Fail(_) => "fail",
            Finding::Unstable(_) => "unstable",
        }
    }

    /// Why it did not pass.
    pub fn why(&self) -> Option<&str> {
        match self {
            Finding::Pass => None,
            Finding::Fail(why) | Finding::Unstable(why) => Some(why),
        }
    }
}

impl Expectation {
    /// Checks the value its pointer selects in `envelope`, or in `document`
    /// (the embedded one) when it addresses the document and there is one.
    /// Returns the selected value; the error says what differed.
    pub fn check(&self, envelope: &Value, document: Option<&Value>) -> Result<Value, String> {
        let within = match (self.target, document) {
            (Target::Document, Some(document)) => document,
            _ => envelope,
        };
        let Some(got) = within.pointer(&self.pointer) else {
            return Err(format!(
                "{}: missing, expected {}",
                self.written,
                self.expected.describe()
            ));
        };
        if self.expected.admits(got) {
            Ok(got.clone())
        } else {
            Err(format!(
                "{}: expected {}, got {got}",
                self.written,
                self.expected.describe()
            ))
        }
    }
}

impl Expected {
    fn admits(&self, got: &Value) -> bool {
        match self {
            Expected::Exact(want) => equal(want, got),
            Expected::Matches(re) => got.as_str().is_some_and(|s| re.is_match(s)),
            Expected::OneOf(wants) => wants.iter().any(|want| equal(want, got)),
            Expected::Range { min, max } => got
                .as_f64()
                .is_some_and(|n| min.is_none_or(|min| n >= min) && max.is_none_or(|max| n <= max)),
        }
    }

    fn describe(&self) -> String {
        match self {
            Expected::Exact(want) => want.to_string(),
            Expected::Matches(re) => format!("a string matching /{re}/"),
            Expected::OneOf(wants) => format!("one of {}", Value::Array(wants.clone())),
            Expected::Range { min, max } => window(*min, *max, "a number"),
        }
    }
}

impl TokenWindow {
    /// The count at the pointer, when it is a whole number in the window.
    pub fn check(&self, envelope: &Value) -> Result<u64, String> {
        let pointer = &self.pointer;
        let Some(count) = envelope.pointer(pointer).and_then(Value::as_u64) else {
            return Err(format!(
                "prompt_tokens: {pointer} is missing or not a whole number"
            ));
        };
        let inside =
            self.min.is_none_or(|min| count >= min) && self.max.is_none_or(|max| count <= max);
        if inside {
            Ok(count)
        } else {
            let want = window(
                self.min.map(|n| n as f64),
                self.max.map(|n| n as f64),
                "a count",
            );
            Err(format!(
                "prompt_tokens: {pointer} is {count}, expected {want} (the prompt did not render as intended)"
            ))
        }
    }
}

/// The verdict on a probe's runs in one verification: every run must pass,
/// and with `same` the values the `expect` pointers selected must be the
/// same in every run. A provider right only some of the time is unstable,
/// not failing: both keep it from being a failover target.
pub fn judge(runs: &[Result<Observed, String>], same: bool) -> Finding {
    let total = runs.len();
    let failed: Vec<(usize, &String)> = runs
        .iter()
        .enumerate()
        .filter_map(|(n, r)| r.as_ref().err().map(|why| (n + 1, why)))
        .collect();
    match failed.first() {
        Some((_, why)) if failed.len() == total => {
            return Finding::Fail(if total > 1 {
                format!("every run of {total} failed; run 1: {why}")
            } else {
                (*why).clone()
            });
        }
        Some((n, why)) => {
            return Finding::Unstable(format!(
                "{} of {total} runs failed; run {n}: {why}",
                failed.len()
            ))
        }
        None => {}
    }
    if same {
        if let Some(why) = differing(runs) {
            return Finding::Unstable(why);
        }
    }
    Finding::Pass
}

/// The first value that differs between the first run and a later one.
fn differing(runs: &[Result<Observed, String>]) -> Option<String> {
    let mut seen = runs.iter().filter_map(|r| r.as_ref().ok()).enumerate();
    let (_, first) = seen.next()?;
    for (n, later) in seen {
        for ((key, a), (_, b)) in first.values.iter().zip(&later.values) {
            if !equal(a, b) {
                return Some(format!(
                    "{key}: run 1 answered {a}, run {} answered {b} (runs must agree)",
                    n + 1
                ));
            }
        }
    }
    None
}

/// JSON equality, numbers by value (a TOML `1` equals an answer's `1.0`).
fn equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_i64(), y.as_i64()) {
            (Some(x), Some(y)) => x == y,
            _ => x.as_f64() == y.as_f64(),
        },
        _ => a == b,
    }
}

fn window(min: Option<f64>, max: Option<f64>, what: &str) -> String {
    match (min, max) {
        (Some(min), Some(max)) => format!("{what} between {min} and {max}"),
        (Some(min), None) => format!("{what} of at least {min}"),
        (None, Some(max)) => format!("{what} of at most {max}"),
        (None, None) => what.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn expectation(written: &str, expected: Expected) -> Expectation {
        let (target, pointer) = match written.strip_prefix(ENVELOPE_PREFIX) {
            Some(p) => (Target::Envelope, p),
            None => (Target::Document, written),
        };
        Expectation {
            written: written.to_owned(),
            target,
            pointer: pointer.to_owned(),
            expected,
        }
    }

    fn envelope() -> Value {
        json!({"model": "m-1", "answer": "envelope's own", "usage": {"prompt_tokens": 27}})
    }

    fn document() -> Value {
        json!({"answer": "Paris", "population": 2.1, "rank": 1, "tags": ["capital"]})
    }

    #[test]
    fn an_exact_value_matches_only_itself_numbers_by_value() {
        let (env, doc) = (envelope(), document());
        let paris = expectation("/answer", Expected::Exact(json!("Paris")));
        assert_eq!(paris.check(&env, Some(&doc)), Ok(json!("Paris")));
        let lyon = expectation("/answer", Expected::Exact(json!("Lyon")));
        let why = lyon.check(&env, Some(&doc)).unwrap_err();
        assert_eq!(why, r#"/answer: expected "Lyon", got "Paris""#);
        let rank = expectation("/rank", Expected::Exact(json!(1.0)));
        assert!(rank.check(&env, Some(&doc)).is_ok(), "1 equals 1.0");
        let tags = expectation("/tags", Expected::Exact(json!(["capital"])));
        assert!(tags.check(&env, Some(&doc)).is_ok());
        let missing = expectation("/city", Expected::Exact(json!("Paris")));
        let why = missing.check(&env, Some(&doc)).unwrap_err();
        assert!(why.contains("/city: missing"), "{why}");
    }

    #[test]
    fn a_regex_finds_a_match_in_strings_only() {
        let (env, doc) = (envelope(), document());
        let re = |r: &str| Expected::Matches(Regex::new(r).unwrap());
        assert!(expectation("/answer", re("^Par"))
            .check(&env, Some(&doc))
            .is_ok());
        assert!(expectation("/answer", re("ari"))
            .check(&env, Some(&doc))
            .is_ok());
        let anchored = expectation("/answer", re("^Par$")).check(&env, Some(&doc));
        assert!(anchored.unwrap_err().contains("matching /^Par$/"));
        assert!(
            expectation("/rank", re("1"))
                .check(&env, Some(&doc))
                .is_err(),
            "a number is not a string"
        );
    }

    #[test]
    fn one_of_admits_any_listed_value() {
        let (env, doc) = (envelope(), document());
        let either = Expected::OneOf(vec![json!("Paris"), json!("PARIS")]);
        assert!(expectation("/answer", either)
            .check(&env, Some(&doc))
            .is_ok());
        let neither = Expected::OneOf(vec![json!("Lyon"), json!("Nice")]);
        let why = expectation("/answer", neither)
            .check(&env, Some(&doc))
            .unwrap_err();
        assert!(why.contains(r#"one of ["Lyon","Nice"]"#), "{why}");
    }

    #[test]
    fn a_range_admits_numbers_within_inclusive_bounds() {
        let (env, doc) = (envelope(), document());
        let range = |min, max| Expected::Range { min, max };
        for (min, max, ok) in [
            (Some(2.0), Some(3.0), true),
            (Some(2.1), Some(2.1), true),
            (Some(2.2), None, false),
            (None, Some(2.0), false),
            (None, Some(5.0), true),
        ] {
            let checked = expectation("/population", range(min, max)).check(&env, Some(&doc));
            assert_eq!(checked.is_ok(), ok, "{min:?}..{max:?}: {checked:?}");
        }
        let text = expectation("/answer", range(Some(0.0), None)).check(&env, Some(&doc));
        assert!(text.unwrap_err().contains("a number of at least 0"));
    }

    #[test]
    fn pointers_address_the_document_then_the_body_and_body_prefix_the_envelope() {
        let (env, doc) = (envelope(), document());
        let plain = expectation("/answer", Expected::Exact(json!("Paris")));
        assert!(
            plain.check(&env, Some(&doc)).is_ok(),
            "the embedded document"
        );
        assert!(
            plain.check(&env, None).is_err(),
            "without one, the body: its /answer differs"
        );
        let own = expectation("/answer", Expected::Exact(json!("envelope's own")));
        assert!(own.check(&env, None).is_ok());
        let model = expectation("body:/model", Expected::Exact(json!("m-1")));
        assert!(
            model.check(&env, Some(&doc)).is_ok(),
            "body:/ is the envelope"
        );
        assert!(model.check(&env, None).is_ok());
        let wrong = expectation("body:/answer", Expected::Exact(json!("Paris")));
        assert!(wrong.check(&env, Some(&doc)).is_err());
    }

    #[test]
    fn the_prompt_token_count_must_fall_in_the_window() {
        let window = |min, max| TokenWindow {
            pointer: "/usage/prompt_tokens".into(),
            min,
            max,
        };
        assert_eq!(window(Some(20), Some(40)).check(&envelope()), Ok(27));
        let low = window(Some(30), Some(40)).check(&envelope()).unwrap_err();
        assert!(
            low.contains("is 27, expected a count between 30 and 40"),
            "{low}"
        );
        assert!(window(None, Some(26)).check(&envelope()).is_err());
        let absent = TokenWindow {
            pointer: "/usage/tokens".into(),
            min: None,
            max: None,
        };
        assert!(absent.check(&envelope()).unwrap_err().contains("missing"));
    }

    fn seen(answer: &str) -> Result<Observed, String> {
        Ok(Observed {
            values: vec![("/answer".into(), json!(answer))],
            prompt_tokens: Some(27),
        })
    }

    #[test]
    fn runs_pass_only_together_and_alike() {
        assert_eq!(judge(&[seen("Paris"), seen("Paris")], true), Finding::Pass);
        assert_eq!(judge(&[seen("Paris")], true), Finding::Pass);
        let differ = judge(&[seen("Paris"), seen("Paris"), seen("Paris.")], true);
        let Finding::Unstable(why) = &differ else {
            panic!("{differ:?}")
        };
        assert!(why.contains("run 3 answered \"Paris.\""), "{why}");
        assert_eq!(
            judge(&[seen("Paris"), seen("Paris.")], false),
            Finding::Pass,
            "same = false compares nothing"
        );
    }

    #[test]
    fn right_some_of_the_time_is_unstable_and_never_right_fails() {
        let wrong = || Err::<Observed, _>("/answer: expected \"Paris\", got \"Lyon\"".to_owned());
        let mixed = judge(&[seen("Paris"), wrong(), seen("Paris")], false);
        assert_eq!(mixed.as_str(), "unstable");
        assert!(mixed
            .why()
            .unwrap()
            .starts_with("1 of 3 runs failed; run 2: /answer"));
        let all = judge(&[wrong(), wrong()], true);
        assert_eq!(all.as_str(), "fail");
        assert!(all.why().unwrap().contains("every run of 2 failed"));
        assert_eq!(
            judge(&[wrong()], true),
            Finding::Fail("/answer: expected \"Paris\", got \"Lyon\"".into())
        );
    }
}
