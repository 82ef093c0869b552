use super::*;
use idemgate_domain::contract::expect::{Expected, Target};
use idemgate_domain::contract::Probe;

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
