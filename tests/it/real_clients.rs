//! Clients nobody here wrote, against the real binary.

use std::path::PathBuf;
use std::time::Duration;

use crate::support::sse::SseUpstream;
use crate::support::{python, Gateway, TestStore};

const TOKENS: &[&str] = &["One", ", two", ", three", ", four", ", five."];

/// A Python with the `openai` package: the one `IDEMGATE_TEST_PYTHON` names,
/// or a throwaway virtualenv under `target/`.
fn python_with_openai() -> PathBuf {
    if let Ok(python) = std::env::var("IDEMGATE_TEST_PYTHON") {
        return PathBuf::from(python);
    }
    python::venv("test-venv", &["openai"], "import openai").join("python")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_streaming_twice_with_one_key_sees_one_execution() {
    let python = tokio::task::spawn_blocking(python_with_openai)
        .await
        .unwrap();
    let store = TestStore::postgres().await;
    let upstream = SseUpstream::openai(TOKENS, Duration::from_millis(150)).await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_stream.py");
    let base_url = gateway.path("/v1");
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(&python)
            .arg(&script)
            .arg(&base_url)
            .arg("sdk-stream-1")
            .output(),
    )
    .await
    .expect("the SDK script did not finish within 60 s")
    .unwrap();
    assert!(
        out.status.success(),
        "the SDK script failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let expected: Vec<&str> = TOKENS.to_vec();
    assert_eq!(seen["first"], serde_json::json!(expected));
    assert_eq!(seen["second"], seen["first"], "identical token sequences");
    assert_eq!(upstream.hits(), 1, "one upstream execution");
}
