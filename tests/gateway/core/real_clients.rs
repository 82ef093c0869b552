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
    let out = crate::support::python::run_client(
        "SDK script",
        tokio::process::Command::new(&python)
            .arg(&script)
            .arg(&base_url)
            .arg("sdk-stream-1"),
    )
    .await;
    let seen: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let expected: Vec<&str> = TOKENS.to_vec();
    assert_eq!(seen["first"], serde_json::json!(expected));
    assert_eq!(seen["second"], seen["first"], "identical token sequences");
    assert_eq!(upstream.hits(), 1, "one upstream execution");
}

/// curl, twice with one key, then with the same key and another body: the
/// second is a replay (same body, `Idempotent-Replayed: true`), the third a
/// problem answer curl's `--fail-with-body` reports as an error.
#[tokio::test]
async fn curl_retrying_with_one_key_gets_the_recorded_answer_then_a_mismatch_problem() {
    let store = TestStore::postgres().await;
    let upstream = crate::support::FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let url = gateway.path("/v1/charges");
    let curl = |body: &'static str| {
        let url = url.clone();
        async move {
            tokio::process::Command::new("curl")
                .args(["--silent", "--show-error", "--include", "--fail-with-body"])
                .args([
                    "--max-time",
                    "20",
                    "-X",
                    "POST",
                    "-H",
                    "Idempotency-Key: curl-1",
                ])
                .args(["-H", "Content-Type: application/json", "--data", body, &url])
                .kill_on_drop(true)
                .output()
                .await
                .expect("curl is installed")
        }
    };
    let first = curl(r#"{"amount": 10}"#).await;
    let second = curl(r#"{"amount": 10}"#).await;
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert!(second.status.success());
    let (first, second) = (
        String::from_utf8(first.stdout).unwrap(),
        String::from_utf8(second.stdout).unwrap(),
    );
    let body = |s: &str| s.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    assert_eq!(body(&first), body(&second));
    assert!(!first
        .to_ascii_lowercase()
        .contains("idempotent-replayed: true"));
    assert!(
        second
            .to_ascii_lowercase()
            .contains("idempotent-replayed: true"),
        "{second}"
    );
    assert_eq!(upstream.hits(), 1);

    let changed = curl(r#"{"amount": 99}"#).await;
    assert!(
        !changed.status.success(),
        "a different body under the same key passed"
    );
    let said = String::from_utf8(changed.stdout).unwrap();
    assert!(said.starts_with("HTTP/1.1 409"), "{said}");
    assert!(said
        .to_ascii_lowercase()
        .contains("content-type: application/problem+json"));
    assert_eq!(
        upstream.hits(),
        1,
        "the mismatched body reached the upstream"
    );
}

/// curl speaking HTTP/2 with prior knowledge (no upgrade, the preface
/// first) and HTTP/1.1 to one gateway: each is answered in its own
/// protocol, and a retry over HTTP/2 of a key first sent over HTTP/1.1 is
/// a replay of the same answer.
#[tokio::test]
async fn curl_over_http2_with_prior_knowledge_and_over_http1_share_one_key() {
    let store = TestStore::embedded();
    let upstream = crate::support::FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let url = gateway.path("/v1/charges");
    let curl = |version: &'static str| {
        let url = url.clone();
        async move {
            let out = tokio::process::Command::new("curl")
                .args(["--silent", "--show-error", "--include", "--fail-with-body"])
                .args(["--max-time", "20", version, "-X", "POST"])
                .args(["-H", "Idempotency-Key: curl-h2", "--data", "{}", &url])
                .kill_on_drop(true)
                .output()
                .await
                .expect("curl is installed");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap().to_ascii_lowercase()
        }
    };
    let first = curl("--http1.1").await;
    let second = curl("--http2-prior-knowledge").await;
    assert!(first.starts_with("http/1.1 200"), "{first}");
    assert!(second.starts_with("http/2 200"), "{second}");
    assert!(second.contains("idempotent-replayed: true"), "{second}");
    let body = |s: &str| s.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    assert_eq!(body(&first), body(&second));
    assert_eq!(upstream.hits(), 1);
}

/// A TCP relay to `to` that breaks its first connection in the middle of
/// the answer's event number `events + 1` (after forwarding its first
/// bytes), as a flaky network would; later connections pass whole.
async fn flaky_network(to: std::net::SocketAddr, events: usize) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut first = true;
        while let Ok((client, _)) = listener.accept().await {
            let server = tokio::net::TcpStream::connect(to).await.unwrap();
            let (mut client_rx, mut client_tx) = client.into_split();
            let (mut server_rx, mut server_tx) = server.into_split();
            let up = tokio::spawn(async move {
                let _ = tokio::io::copy(&mut client_rx, &mut server_tx).await;
            });
            let cut_after = std::mem::take(&mut first).then_some(events + 1);
            tokio::spawn(async move {
                let (mut seen, mut buf) = (Vec::new(), vec![0u8; 16 * 1024]);
                while let Ok(n @ 1..) = server_rx.read(&mut buf).await {
                    let sent = seen.len();
                    seen.extend_from_slice(&buf[..n]);
                    let cut = cut_after.and_then(|k| {
                        let starts = seen.windows(6).enumerate().filter(|(_, w)| w == b"data: ");
                        starts.map(|(i, _)| i).nth(k - 1).map(|i| i + 10)
                    });
                    let end = cut.map_or(seen.len(), |c| c.min(seen.len()));
                    if client_tx.write_all(&seen[sent..end]).await.is_err() || cut.is_some() {
                        break;
                    }
                }
                // Dropping both halves resets the client's connection.
                up.abort();
            });
        }
    });
    addr
}

/// `docs/streaming.md`'s resume snippet, run as written with the official `openai`
/// package, its connection broken in the middle of the fourth chunk: it
/// resumes after the three it has and prints the whole answer, every token
/// once, from one upstream execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_resumes_a_dropped_stream_with_the_readme_snippet() {
    const EIGHT: &[&str] = &["A", " b", " c", " d", " e", " f", " g", " h."];
    let python = tokio::task::spawn_blocking(python_with_openai)
        .await
        .unwrap();
    let store = TestStore::postgres().await;
    let upstream = SseUpstream::openai(EIGHT, Duration::from_millis(100)).await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let gateway_addr = gateway
        .path("")
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    let flaky = flaky_network(gateway_addr, 3).await;
    let out = crate::support::python::run_client(
        "snippet",
        tokio::process::Command::new(&python)
            .args(["-c", &crate::support::docs::block("streaming-resume")])
            .env("OPENAI_BASE_URL", format!("http://{flaky}/v1"))
            .env("OPENAI_API_KEY", "not-a-real-key"),
    )
    .await;
    assert_eq!(String::from_utf8_lossy(&out).trim_end(), EIGHT.concat());
    assert_eq!(upstream.hits(), 1, "one upstream execution");
    let resumed = gateway.metric("idemgate_stream_resumes_total{result=\"resumed\"}");
    assert_eq!(resumed.await, 1.0, "the second try resumed after 3 events");
}

/// `docs/streaming.md`'s long-call snippet, run as written with the official
/// `openai` package in front of a completion that takes until the test
/// lets it: `202` at once, polled (the poll seen running before the
/// upstream may answer), then the completion, from one upstream call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_polls_a_long_completion_with_the_readme_snippet() {
    let python = tokio::task::spawn_blocking(python_with_openai)
        .await
        .unwrap();
    let store = TestStore::postgres().await;
    let gate = crate::support::Gate::new();
    let held = gate.clone();
    let upstream = crate::support::FakeUpstream::start(move |_| {
        let gate = held.clone();
        async move {
            gate.pass().await;
            crate::support::upstream::json_response(200, completion("The report."))
        }
    })
    .await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let snippet = tokio::process::Command::new(&python)
        .args(["-c", &crate::support::docs::block("long-call-openai")])
        .env("OPENAI_BASE_URL", gateway.path("/v1"))
        .env("OPENAI_API_KEY", "not-a-real-key")
        .kill_on_drop(true)
        .output();
    let snippet = tokio::spawn(snippet);
    upstream.arrival_within(Duration::from_secs(60)).await;
    crate::support::eventually(
        Duration::from_secs(20),
        "a poll of the running job",
        || async {
            gateway
                .metric("idemgate_polls_total{found=\"running\"}")
                .await
                >= 1.0
        },
    )
    .await;
    gate.open(1);
    let out = tokio::time::timeout(Duration::from_secs(60), snippet)
        .await
        .expect("the snippet did not finish within 60 s")
        .unwrap()
        .unwrap();
    assert!(
        out.status.success(),
        "the snippet failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim_end(),
        "The report."
    );
    assert_eq!(upstream.hits(), 1, "one upstream call");
}

/// An OpenAI chat completion answering `content`.
fn completion(content: &str) -> serde_json::Value {
    serde_json::json!({
        "id": "chatcmpl-1", "object": "chat.completion",
        "created": 1_700_000_000, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": content}}],
    })
}

/// Runs `snippet` with `python` twice, as written (no `OPENAI_*` from the
/// environment): what it printed each time.
async fn run_twice(python: &std::path::Path, snippet: &str) -> Vec<String> {
    let mut printed = Vec::new();
    for _ in 0..2 {
        let out = python::run_client(
            "snippet",
            tokio::process::Command::new(python)
                .args(["-c", snippet])
                .env_remove("OPENAI_API_KEY")
                .env_remove("OPENAI_BASE_URL"),
        )
        .await;
        printed.push(String::from_utf8_lossy(&out).trim_end().to_owned());
    }
    printed
}

/// A documented snippet with the quick start's `localhost:8080` pointed at
/// `gateway`, as a user running it against their own gateway would.
fn pointed_at(snippet: &str, gateway: &Gateway) -> String {
    let here = gateway.path("");
    let addr = here.trim_start_matches("http://");
    snippet.replace("localhost:8080", addr)
}

/// The README's client snippet, run as written with the official `openai`
/// package (its `api_key` the owner), twice: one completion upstream, the
/// same answer printed both times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_openai_snippet_runs_once_however_often_it_is_run() {
    let python = tokio::task::spawn_blocking(python_with_openai)
        .await
        .unwrap();
    let store = TestStore::postgres().await;
    let upstream = crate::support::FakeUpstream::start(|_| async {
        crate::support::upstream::json_response(200, completion("Hello."))
    })
    .await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let snippet = pointed_at(&crate::support::docs::block("clients-openai"), &gateway);
    for printed in run_twice(&python, &snippet).await {
        assert_eq!(printed, "Hello.");
    }
    assert_eq!(upstream.hits(), 1, "one upstream call for one key");
}

/// The same snippet against an upstream that compresses whenever it may,
/// as hosted APIs do: the SDK accepts `gzip`, yet a keyed request asks for
/// the answer uncompressed (`docs/design.md` §11), so what is recorded is
/// readable by any client. Had the SDK's `Accept-Encoding` gone on, it
/// would have been sent the upstream's compressed bytes (here not even
/// gzip, [`super::encodings::negotiated`]) to decode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_accepting_gzip_is_answered_from_an_uncompressed_record() {
    let python = tokio::task::spawn_blocking(python_with_openai)
        .await
        .unwrap();
    let store = TestStore::postgres().await;
    let upstream = crate::support::FakeUpstream::start(|r| {
        std::future::ready(super::encodings::negotiated(&r, &completion("Hello.")))
    })
    .await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let snippet = pointed_at(&crate::support::docs::block("clients-openai"), &gateway);
    for printed in run_twice(&python, &snippet).await {
        assert_eq!(printed, "Hello.");
    }
    let asked = upstream.recorded();
    assert_eq!(asked.len(), 1, "one upstream call for one key");
    assert_eq!(asked[0].header("accept-encoding"), Some("identity"));
}

/// The official `anthropic` SDK, retrying on its own: the provider is
/// overloaded (HTTP `529`, its `overloaded_error`, with `retry-after-ms`)
/// once. `529` is retryable by default, so nothing is stored, the SDK's
/// retry runs the call again and gets the message, and the app's next run
/// with the key replays it. Had the `529` been committed, every retry of
/// the key would have been answered that `529`, and the SDK raised.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_anthropic_sdk_retrying_an_overloaded_529_gets_the_message() {
    let python = tokio::task::spawn_blocking(|| {
        python::venv("anthropic-venv", &["anthropic"], "import anthropic").join("python")
    })
    .await
    .unwrap();
    let store = TestStore::postgres().await;
    let upstream = crate::support::FakeUpstream::start(|r| async move {
        if r.hit > 1 {
            return crate::support::upstream::json_response(200, anthropic_message("Hello!"));
        }
        let overloaded = serde_json::json!({"type": "error",
            "error": {"type": "overloaded_error", "message": "Overloaded"}});
        let mut answer = crate::support::upstream::json_response(529, overloaded);
        let headers = answer.headers_mut();
        headers.insert("x-should-retry", http::HeaderValue::from_static("true"));
        headers.insert("retry-after-ms", http::HeaderValue::from_static("10"));
        answer
    })
    .await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    for seen in script_twice(&python, "anthropic_529.py", &gateway.url, "sdk-529").await {
        assert_eq!(seen["text"], "Hello!", "{seen}");
    }
    assert_eq!(upstream.hits(), 2, "run again once, then replayed");
}

/// The official `openai` SDK uploading a file, retrying on its own after
/// a `503` (nothing stored, the job open): it encodes the multipart body
/// again under a new random boundary, and the retry is the same request
/// all the same (`docs/design.md` §11, "A multipart boundary is
/// framing"), run as the job's second attempt; the app's next run with the
/// key replays the upload. Before, the retry's boundary made it another
/// request: `409 …/idempotency-key-mismatch`, and the SDK raised.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_retrying_a_file_upload_is_the_same_request() {
    let python = tokio::task::spawn_blocking(python_with_openai)
        .await
        .unwrap();
    let store = TestStore::postgres().await;
    let upstream = crate::support::FakeUpstream::start(|r| async move {
        if r.hit == 1 {
            let mut busy = crate::support::upstream::json_response(
                503,
                serde_json::json!({"error": {"message": "busy"}}),
            );
            let headers = busy.headers_mut();
            headers.insert("retry-after-ms", http::HeaderValue::from_static("10"));
            return busy;
        }
        crate::support::upstream::json_response(
            200,
            serde_json::json!({"id": "file-1", "object": "file", "bytes": 17,
                "created_at": 1_700_000_000, "filename": "train.jsonl",
                "purpose": "fine-tune", "status": "processed"}),
        )
    })
    .await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let base_url = gateway.path("/v1");
    for seen in script_twice(&python, "openai_file_upload.py", &base_url, "upload-1").await {
        assert_eq!(seen["id"], "file-1", "{seen}");
    }
    let sent = upstream.recorded();
    assert_eq!(sent.len(), 2, "the 503, then the upload; then replayed");
    let boundaries: Vec<_> = sent.iter().map(|r| r.header("content-type")).collect();
    assert_ne!(
        boundaries[0], boundaries[1],
        "each try under its own boundary"
    );
}

/// The official `openai` SDK streaming a Responses API call whose
/// provider ran a remote MCP tool, then failed with a transient
/// `server_error`: the SDK yields the events as sent, and the app's next
/// run with the key gets them replayed, the tool's call not run again
/// (`docs/design.md` §10, "A tool the provider ran"). Before, the error's
/// type made the retry run the call, and the tool, a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_streaming_a_failure_after_a_tool_ran_runs_it_once() {
    let python = tokio::task::spawn_blocking(python_with_openai)
        .await
        .unwrap();
    let store = TestStore::postgres().await;
    let upstream = crate::support::FakeUpstream::start(|_| async move {
        let event =
            |name: &str, data: serde_json::Value| format!("event: {name}\ndata: {data}\n\n");
        let body = [
            event(
                "response.created",
                serde_json::json!({"type": "response.created",
                "sequence_number": 0, "response": {"id": "resp_1", "status": "in_progress"}}),
            ),
            event(
                "response.mcp_call.in_progress",
                serde_json::json!({
                "type": "response.mcp_call.in_progress", "sequence_number": 1,
                "item_id": "mcp_1", "output_index": 0}),
            ),
            event(
                "response.mcp_call.completed",
                serde_json::json!({
                "type": "response.mcp_call.completed", "sequence_number": 2,
                "item_id": "mcp_1", "output_index": 0}),
            ),
            event(
                "response.failed",
                serde_json::json!({"type": "response.failed",
                "sequence_number": 3, "response": {"id": "resp_1", "status": "failed",
                "error": {"code": "server_error", "message": "boom"}}}),
            ),
        ]
        .concat();
        http::Response::builder()
            .header("content-type", "text/event-stream")
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .unwrap()
    })
    .await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let base_url = gateway.path("/v1");
    let runs = script_twice(&python, "openai_responses_tool.py", &base_url, "tool-1").await;
    let types = serde_json::json!([
        "response.created",
        "response.mcp_call.in_progress",
        "response.mcp_call.completed",
        "response.failed"
    ]);
    for seen in runs {
        assert_eq!(seen["types"], types, "{seen}");
    }
    assert_eq!(
        upstream.hits(),
        1,
        "the tool's call run once, then replayed"
    );
}

/// Runs `tests/clients/<script>` with `python` twice, against `base_url`
/// with the key `key`: the JSON it printed each time.
async fn script_twice(
    python: &std::path::Path,
    script: &str,
    base_url: &str,
    key: &str,
) -> Vec<serde_json::Value> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/clients")
        .join(script);
    let mut printed = Vec::new();
    for _ in 0..2 {
        let out = python::run_client(
            "SDK script",
            tokio::process::Command::new(python)
                .arg(&script)
                .arg(base_url)
                .arg(key),
        )
        .await;
        printed.push(serde_json::from_slice(&out).unwrap());
    }
    printed
}

/// A whole Anthropic message of `text`, not streamed.
fn anthropic_message(text: &str) -> serde_json::Value {
    serde_json::json!({
        "id": "msg_fake", "type": "message", "role": "assistant", "model": "claude-fake",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn", "stop_sequence": null,
        "usage": {"input_tokens": 10, "output_tokens": 2}
    })
}

/// `docs/streaming.md`'s SDK snippet, run as written twice: every token
/// printed both times, from one upstream execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_streaming_guides_openai_snippet_streams_once() {
    let python = tokio::task::spawn_blocking(python_with_openai)
        .await
        .unwrap();
    let store = TestStore::postgres().await;
    let upstream = SseUpstream::openai(TOKENS, Duration::from_millis(20)).await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let snippet = pointed_at(&crate::support::docs::block("streaming-openai"), &gateway);
    for printed in run_twice(&python, &snippet).await {
        assert_eq!(printed, TOKENS.concat());
    }
    assert_eq!(upstream.hits(), 1, "one upstream execution");
}

/// `docs/streaming.md`'s curl command, run as written twice: the events
/// as the upstream sent them, the second time replayed from the record.
#[tokio::test]
async fn the_streaming_guides_curl_command_streams_once() {
    let store = TestStore::postgres().await;
    let upstream = SseUpstream::openai(TOKENS, Duration::from_millis(20)).await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let command = pointed_at(&crate::support::docs::block("streaming-curl"), &gateway);
    let mut seen = Vec::new();
    for _ in 0..2 {
        let out = tokio::process::Command::new("bash")
            .args(["-euo", "pipefail", "-c", &command])
            .kill_on_drop(true)
            .output()
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for token in TOKENS {
            assert!(
                text.contains(&format!("\"content\":\"{token}\"")),
                "{token}: {text}"
            );
        }
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        seen.push(text);
    }
    assert_eq!(seen[0], seen[1], "the replay is the stream, byte for byte");
    assert_eq!(upstream.hits(), 1, "one upstream execution");
}
