//! The chat example's contract (config/chat/idemgate.toml, as written)
//! against answers of the OpenAI chat completions API built from the types
//! the official `openai` package ships: every real answer the contract means
//! to accept commits and replays; a truncated or non-JSON answer is refused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use serde_json::Value;

use crate::support::upstream::json_response;
use crate::support::{post, python, FakeUpstream, Gateway, TestStore};

fn chat_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("config/chat")
}

/// The example's `[contracts]` tables, exactly as the file writes them.
fn example_contracts() -> String {
    let text = std::fs::read_to_string(chat_dir().join("idemgate.toml")).unwrap();
    let doc: toml::Table = text.parse().unwrap();
    let mut only = toml::Table::new();
    only.insert("contracts".into(), doc["contracts"].clone());
    toml::to_string(&only).unwrap()
}

/// Answers by case name, from tests/clients/openai_answers.py.
fn openai_answers() -> BTreeMap<String, Value> {
    let python = python::venv("test-venv", &["openai"], "import openai").join("python");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_answers.py");
    let out = Command::new(python).arg(script).output().unwrap();
    assert!(
        out.status.success(),
        "openai_answers.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test]
async fn the_chat_contract_accepts_what_the_openai_api_answers() {
    let answers = Arc::new(openai_answers());
    let upstream = FakeUpstream::start({
        let answers = answers.clone();
        move |req| {
            let answers = answers.clone();
            async move {
                let asked: Value = serde_json::from_slice(&req.body).unwrap_or_default();
                let case = asked["case"].as_str().unwrap_or("json-mode");
                json_response(200, answers[case].clone())
            }
        }
    })
    .await;
    let store = TestStore::embedded();
    let gateway = Gateway::builder(&store, &upstream.url())
        .files_from(&chat_dir())
        .tables(&example_contracts())
        .tables(
            "[[routes]]\nname = \"chat\"\npath_prefix = \"/v1/chat\"\ncontract = \"chat-json\"\n",
        )
        .start()
        .await;
    let expected = [
        ("json-mode", true),
        ("tool-calls", true),
        ("refusal", true),
        ("truncated", false),
        ("not-json", false),
    ];
    assert_eq!(answers.len(), expected.len(), "one verdict per case");
    for (case, accepted) in expected {
        let body = format!(r#"{{"model": "gpt-4o", "case": "{case}"}}"#);
        let url = gateway.path("/v1/chat/completions");
        let reply = post(&url, &format!("chat-example-{case}"), &body).await;
        if accepted {
            assert_eq!(reply.status, 200, "{case}: {:?}", reply.body);
            assert_eq!(
                reply.json(),
                answers[case],
                "{case} is passed through as sent"
            );
            let again = post(&url, &format!("chat-example-{case}"), &body).await;
            assert_eq!(again.body, reply.body, "{case} is committed and replayed");
        } else {
            assert_eq!(
                reply.status, 502,
                "{case} breaks the contract: {:?}",
                reply.body
            );
            let problem = reply.json();
            assert!(
                problem["detail"]
                    .as_str()
                    .unwrap_or("")
                    .contains("/choices/0/message/content"),
                "{case}: the refusal names the embedded answer: {problem}"
            );
        }
    }
}

/// `docs/providers.md`'s probe is the worked example's (whose probes the
/// tests above run against drifting providers): every key it shows, with
/// the value it shows.
#[test]
fn the_providers_guides_probe_is_the_worked_examples() {
    let excerpt: toml::Value =
        toml::from_str(&crate::support::docs::block("contract-probe-excerpt")).unwrap();
    let example: toml::Value =
        toml::from_str(&std::fs::read_to_string(chat_dir().join("idemgate.toml")).unwrap())
            .unwrap();
    let probes = |v: &toml::Value| {
        v["contracts"]["chat-json"]["probes"]
            .as_array()
            .unwrap()
            .clone()
    };
    let shown = &probes(&excerpt)[0];
    let name = shown["name"].as_str().unwrap();
    let there = probes(&example)
        .into_iter()
        .find(|p| p["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("the example has no probe {name}"));
    for (key, value) in shown.as_table().unwrap() {
        assert_eq!(Some(value), there.get(key), "{name}.{key}");
    }
}
