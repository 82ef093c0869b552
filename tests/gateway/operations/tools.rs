//! The operator's tools say the truth and never go silent (issue 38):
//! `verify-providers` tells each probe as it runs and gives up on a silent
//! provider when the route would; `check` prints each route whole, says
//! what a disabled admin API answers, tells every missing secret at once
//! and the nearest key to a misspelled one; every `--help` default is the
//! real one.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use http::Method;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::Command;

use crate::support::chat::{Drift, Provider, Timing};
use crate::support::gateway::SUITE_ENV;
use crate::support::{eventually, send, FakeUpstream, Gate, Gateway, TestStore};

const CHAT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/config/chat");

/// An upstream that takes every request and never answers (its gate never
/// opens): a provider gone silent.
async fn silent() -> FakeUpstream {
    let never = Gate::new();
    FakeUpstream::start(move |_| {
        let never = never.clone();
        async move {
            never.pass().await;
            http::Response::new(http_body_util::Full::new(bytes::Bytes::new()))
        }
    })
    .await
}

/// A config file in `dir`: upstreams `a` and `b` (each with the generic
/// 60 s timeout of the issue), the chat contract with two probes, and the
/// route `chat` relying on it with `route_extra`.
fn chat_config(dir: &Path, a: &str, b: &str, route_extra: &str) -> PathBuf {
    let toml = format!(
        r#"upstreams = [{{ name = "a", url = {a:?}, timeout = "60s" }}, {{ name = "b", url = {b:?}, timeout = "60s" }}]
embedded_path = {db:?}

[contracts.chat-json]
schema = "{CHAT}/response.schema.json"
[contracts.chat-json.embedded]
pointer = "/choices/0/message/content"
schema = "{CHAT}/answer.schema.json"
[[contracts.chat-json.probes]]
name = "capital"
path = "/v1/chat/completions"
body = "{CHAT}/probe-capital.json"
[[contracts.chat-json.probes]]
name = "capital-again"
path = "/v1/chat/completions"
body = "{CHAT}/probe-capital.json"

[[routes]]
name = "chat"
path_prefix = "/v1/chat"
upstreams = ["a", "b"]
contract = "chat-json"
{route_extra}
"#,
        db = dir.join("gateway.db").display().to_string(),
    );
    let path = dir.join("idemgate.toml");
    std::fs::write(&path, toml).unwrap();
    path
}

/// `idemgate --config CONFIG ARGS…`, as the suite's gateways run.
fn idemgate(config: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idemgate"));
    command
        .arg("--config")
        .arg(config)
        .args(args)
        .env_remove("IDEMGATE_DATABASE_URL")
        .env_remove("IDEMGATE_EMBEDDED_PATH")
        .env_remove("IDEMGATE_UPSTREAM")
        .env("RUST_LOG", "warn")
        .envs(SUITE_ENV)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    command
}

/// The position of the first line of `text` holding `what` (panics naming
/// it when there is none).
fn line_of(text: &str, what: &str) -> usize {
    text.lines()
        .position(|l| l.contains(what))
        .unwrap_or_else(|| panic!("no line with {what:?} in:\n{text}"))
}

#[tokio::test]
async fn verify_providers_tells_each_probe_while_a_silent_provider_still_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let a = Provider::start("a", Drift::None, Timing::Now).await;
    let b = silent().await;
    // A patience nothing in this test outlasts: the run is stopped while
    // it waits on b, so whatever it printed, it printed before its end.
    let config = chat_config(dir.path(), &a.url(), &b.url(), "");
    let mut child = idemgate(&config, &["verify-providers", "--json", "--timeout", "1h"])
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut told = Vec::new();
    while let Some(line) = stderr.next_line().await.unwrap() {
        let asking_b = line.starts_with("probing b ");
        told.push(line);
        if asking_b {
            break;
        }
    }
    eventually(Duration::from_secs(10), "b to hold the probe", || async {
        !b.recorded().is_empty()
    })
    .await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "still waiting on b: {told:#?}"
    );
    let told = told.join("\n");
    assert!(
        line_of(&told, "probing a with chat-json/capital ")
            < line_of(&told, "a chat-json/capital: pass")
    );
    assert!(line_of(&told, "a chat-json/capital-again: pass") < line_of(&told, "probing b "));
    assert!(told.contains("gives up after 1h"), "{told}");
    assert!(told.contains("--timeout"), "{told}");
    // The table or JSON is for the end: stdout has nothing yet.
    let _ = child.start_kill();
    let mut stdout = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .await
        .unwrap();
    assert!(stdout.is_empty(), "{stdout}");
}

#[tokio::test]
async fn verify_providers_gives_up_on_a_silent_provider_when_the_route_would() {
    let dir = tempfile::tempdir().unwrap();
    let a = Provider::start("a", Drift::None, Timing::Now).await;
    let b = silent().await;
    let config = chat_config(
        dir.path(),
        &a.url(),
        &b.url(),
        "first_byte_timeout = \"2s\"",
    );
    let started = Instant::now();
    let out = idemgate(&config, &["verify-providers", "--json"])
        .output()
        .await
        .unwrap();
    // Well within b's own 60 s timeout, which the probes no longer wait.
    assert!(started.elapsed() < Duration::from_secs(30));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let rows: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON document");
    let of = |upstream: &str, probe: &str| {
        rows.as_array()
            .unwrap()
            .iter()
            .find(|r| r["upstream"] == upstream && r["probe"] == probe)
            .cloned()
            .unwrap_or_else(|| panic!("no row {upstream}/{probe} in {rows:#}"))
    };
    assert_eq!(of("a", "capital")["result"], "pass", "{rows:#}");
    let silent_row = of("b", "capital");
    assert_eq!(silent_row["result"], "fail");
    let why = silent_row["why"].as_str().unwrap();
    assert!(
        why.contains("silent for 2s before the answer's head")
            && why.contains("route chat's first_byte_timeout"),
        "{why}"
    );
    // One silence for the provider, not one per probe: the second probe is
    // not sent.
    let why = of("b", "capital-again")["why"].as_str().unwrap().to_owned();
    assert!(why.contains("not sent"), "{why}");
    assert_eq!(b.recorded().len(), 1);
    // The progress, in order, on stderr.
    let order = [
        "probing a with chat-json/capital ",
        "a chat-json/capital: pass",
        "probing b with chat-json/capital ",
        "b chat-json/capital: FAIL: silent for 2s",
        "b chat-json/capital-again: FAIL: not sent",
    ];
    let at: Vec<usize> = order.iter().map(|what| line_of(&stderr, what)).collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "{stderr}");

    // `--timeout` overrides the route's silence, and says so.
    let out = idemgate(&config, &["verify-providers", "--timeout", "1s"])
        .output()
        .await
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    let row = table
        .lines()
        .find(|l| l.starts_with("b "))
        .unwrap_or_default();
    assert!(
        row.contains("FAIL") && row.contains("silent for 1s before the answer's head (--timeout)"),
        "{table}"
    );
}

/// An upstream that answers every request's head and the start of its
/// body, then falls silent: a provider stalled mid-answer.
async fn stalled() -> (String, tokio::task::JoinHandle<()>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf).await;
            let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"id\":";
            let _ = stream.write_all(head.as_bytes()).await;
            held.push(stream);
        }
    });
    (url, task)
}

#[tokio::test]
async fn verify_providers_gives_up_on_a_stalled_answer_after_the_routes_stream_idle_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let a = Provider::start("a", Drift::None, Timing::Now).await;
    let (b, server) = stalled().await;
    let config = chat_config(
        dir.path(),
        &a.url(),
        &b,
        "first_byte_timeout = \"4m\"\nstream_idle_timeout = \"1s\"",
    );
    let out = idemgate(&config, &["verify-providers"])
        .output()
        .await
        .unwrap();
    server.abort();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{table}");
    let row = table
        .lines()
        .find(|l| l.starts_with("b "))
        .unwrap_or_default();
    assert!(
        row.contains("FAIL")
            && row.contains(
                "silent for 1s before the answer's next chunk (route chat's stream_idle_timeout)"
            ),
        "{table}"
    );
}

/// A port with nothing listening on it.
async fn closed_port() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
}

#[tokio::test]
async fn check_prints_each_route_whole() {
    let store = TestStore::embedded();
    let out = Gateway::builder(&store, "http://unused")
        .unset("upstreams")
        .files_from(Path::new(CHAT))
        .tables(&format!(
            r#"upstreams = [{{ name = "a", url = "http://127.0.0.1:1" }}, {{ name = "b", url = "http://127.0.0.1:2", first_byte_timeout = "9s" }}]
client_key_header = "x-client-key"
[[clients]]
name = "web"
key_sha256 = {{ value = "{zeros}" }}

[contracts.chat-json]
schema = "response.schema.json"
[[contracts.chat-json.probes]]
name = "capital"
path = "/v1/chat/completions"
body = "probe-capital.json"

[[routes]]
name = "chat"
path_prefix = "/v1/chat"
upstreams = ["a", "b"]
contract = "chat-json"
max_attempts = 2
side_effect_free = true
hedge_after = "750ms"
stream_idle_timeout = "45s"
require_client = true
on_unknown = "new_attempt"
in_progress = "conflict"
[routes.reconcile]
path = "/v1/lookups/{{job}}"
[routes.owner]
sources = [{{ client = true }}]

[[routes]]
name = "tools"
path_prefix = "/mcp"
protocol = "mcp"
keyed_tools = ["charge"]
reconcile = "resend"
"#,
            zeros = "0".repeat(64)
        ))
        .run("check")
        .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let chat = stdout
        .split("route.chat = ")
        .nth(1)
        .and_then(|rest| rest.split("\nroute.").next())
        .unwrap_or_else(|| panic!("no route.chat in:\n{stdout}"));
    for said in [
        "POST,PATCH /v1/chat -> a",
        "fallbacks [b], max_attempts 2",
        "hedge_after 750ms, side_effect_free true, contract chat-json (1 probes)",
        // Each upstream's silences on the route: the route's key over the
        // upstream's, the upstream's where the route sets none.
        "a: first_byte_timeout 30s (the upstream's), stream_idle_timeout 45s (the route's)",
        "b: first_byte_timeout 9s (the upstream's)",
        "owner from [client], allow_anonymous true, require_client true",
        "reconcile lookup GET /v1/lookups/{job}, on_unknown new_attempt, in_progress conflict",
        "protocol: http",
        "retryable_statuses [429, 502, 503, 529]",
        "stream_types [\"text/event-stream\"]",
    ] {
        assert!(chat.contains(said), "missing {said:?} in:\n{chat}");
    }
    for said in [
        "route.tools = ",
        "reconcile resend",
        "protocol: mcp (keyed_tools [\"charge\"]",
        "contract none",
    ] {
        assert!(stdout.contains(said), "missing {said:?} in:\n{stdout}");
    }
}

#[tokio::test]
async fn a_disabled_admin_api_answers_what_check_says() {
    let store = TestStore::embedded();
    let builder = Gateway::builder(&store, "http://127.0.0.1:1").unset("admin_token");
    let out = builder.clone().run("check").await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let said = stdout
        .lines()
        .find(|l| l.starts_with("admin_api = off"))
        .unwrap_or_else(|| panic!("no admin_api = off in:\n{stdout}"));
    let status: u16 = said
        .split("answer ")
        .nth(1)
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status in {said:?}"));
    let gateway = builder.start().await;
    for path in ["/admin/v1/jobs?state=unknown", "/console/"] {
        let reply = send(
            Method::GET,
            &format!("{}{path}", gateway.admin_url),
            &[],
            "",
        )
        .await;
        assert_eq!(reply.status, status, "{path}: {said}");
    }
    for open in ["/healthz", "/metrics"] {
        let reply = send(
            Method::GET,
            &format!("{}{open}", gateway.admin_url),
            &[],
            "",
        )
        .await;
        assert_eq!(reply.status, 200, "{open} stays open: {said}");
    }
}

#[tokio::test]
async fn every_missing_secret_is_told_at_once_with_its_key_and_fix() {
    let (pg, redis) = (closed_port().await, closed_port().await);
    let store = TestStore::external(format!("postgres://idemgate@127.0.0.1:{pg}/payments"));
    let out = Gateway::builder(&store, "http://unused")
        .unset("upstreams")
        .set("redis_url", &format!("\"redis://127.0.0.1:{redis}/0\""))
        // The suite's salt and replay key, taken away: a deployment on
        // PostgreSQL and Redis must be given both.
        .env("IDEMGATE_OWNER_SALT", "")
        .env("IDEMGATE_REPLAY_KEY", "")
        .tables(
            r#"upstreams = [{ name = "provider", url = "http://127.0.0.1:1", headers = { authorization = { env = "IDEMGATE_TEST_NEVER_SET_A", prefix = "Bearer " } } }]
[[clients]]
name = "web"
key_sha256 = { file = "no-such-client-key" }
[[routes]]
path_prefix = "/v1"
require_client = true
[routes.owner]
sources = [{ jwt = "sub", algorithms = ["HS256"], secret = { env = "IDEMGATE_TEST_NEVER_SET_B" } }]
"#,
        )
        .run("check")
        .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(out.stdout.is_empty(), "nothing summarised for a bad config");
    for (key, fix) in [
        (
            "`upstreams[0].headers.authorization`",
            "IDEMGATE_TEST_NEVER_SET_A is not set; export it",
        ),
        ("`clients[0].key_sha256`", "no-such-client-key"),
        (
            "`routes[0].owner.sources[0].secret`",
            "IDEMGATE_TEST_NEVER_SET_B is not set; export it",
        ),
        ("`owner.salt`", "set IDEMGATE_OWNER_SALT"),
        ("`replay_key`", "set IDEMGATE_REPLAY_KEY"),
    ] {
        let line = stderr
            .lines()
            .find(|l| l.contains(key))
            .unwrap_or_else(|| panic!("{key} not told in:\n{stderr}"));
        assert!(line.contains(fix), "{key}: no fix {fix:?} in {line:?}");
    }
    assert!(stderr.contains("5 problems"), "{stderr}");
}

#[tokio::test]
async fn a_misspelled_key_is_answered_with_the_nearest_not_every_key() {
    let store = TestStore::embedded();
    let cases = [
        ("upstream_timout = \"1s\"\n", Some("upstream_timeout")),
        (
            "[[routes]]\npath_prefix = \"/v1\"\nfirst_byte_timout = \"2s\"\n",
            Some("first_byte_timeout"),
        ),
        ("Hold_Timeout = \"1s\"\n", Some("hold_timeout")),
        (
            "[[routes]]\npath_prefix = \"/v1\"\n[routes.reconcile]\npth = \"/x\"\n",
            Some("path"),
        ),
        ("frobnicate = true\n", None),
    ];
    for (toml, meant) in cases {
        let out = Gateway::builder(&store, "http://127.0.0.1:1")
            .tables(toml)
            .run("check")
            .await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{toml}: {stderr}");
        match meant {
            Some(key) => assert!(
                stderr.contains(&format!("did you mean `{key}`?")),
                "{toml}: {stderr}"
            ),
            None => assert!(!stderr.contains("did you mean"), "{toml}: {stderr}"),
        }
        // Not the fifty keys of the top level.
        assert!(!stderr.contains("`admin_listen`"), "{toml}: {stderr}");
    }
}

/// `idemgate ARGS…` with no configuration at all: no file, no `IDEMGATE_*`
/// variable, in an empty folder. Its stdout.
async fn bare(args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(args)
        .env_clear()
        .current_dir(dir.path())
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{args:?}: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Each `--flag` of a help text with its whole description.
fn flags_of(help: &str) -> Vec<(String, String)> {
    let mut flags: Vec<(String, String)> = Vec::new();
    for line in help.lines().map(str::trim_start) {
        let named = line.strip_prefix("--").or_else(|| {
            line.split_once(", --")
                .map(|(_, rest)| rest)
                .filter(|_| line.starts_with('-'))
        });
        match (named, flags.last_mut()) {
            (Some(rest), _) => {
                let name = rest
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                    .next()
                    .unwrap_or_default();
                flags.push((name.replace('-', "_"), line.to_owned()));
            }
            (None, Some((_, text))) if !line.is_empty() => {
                text.push(' ');
                text.push_str(line);
            }
            _ => {}
        }
    }
    flags
}

/// Whether two spellings of a setting's value are the same value: as
/// durations, switches, sizes, or else as written.
fn same_value(a: &str, b: &str) -> bool {
    let switch = |v: &str| match v {
        "true" | "on" => Some(true),
        "false" | "off" => Some(false),
        _ => None,
    };
    if let (Ok(a), Ok(b)) = (humantime::parse_duration(a), humantime::parse_duration(b)) {
        return a == b;
    }
    if let (Some(a), Some(b)) = (switch(a), switch(b)) {
        return a == b;
    }
    if let (Ok(a), Ok(b)) = (
        a.parse::<bytesize::ByteSize>(),
        b.parse::<bytesize::ByteSize>(),
    ) {
        return a == b;
    }
    a == b
}

#[tokio::test]
async fn every_default_the_help_states_is_the_default_check_reports() {
    let help = bare(&["serve", "--help"]).await;
    let checked = bare(&["check", "--upstream", "http://127.0.0.1:1"]).await;
    // `key = value (why)` lines, the value without its why.
    let reported = |key: &str| -> String {
        let line = checked
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key} = ")))
            .unwrap_or_else(|| panic!("check does not report {key}:\n{checked}"));
        line.split(" (").next().unwrap().to_owned()
    };
    let mut compared = Vec::new();
    for (key, text) in flags_of(&help) {
        let Some(stated) = text
            .split("[default: ")
            .nth(1)
            .and_then(|rest| rest.split(']').next())
        else {
            assert!(
                !text.to_lowercase().contains("default"),
                "--{key} speaks of a default without stating it as [default: …]: {text}"
            );
            continue;
        };
        let (expected, actual) = match (key.as_str(), stated) {
            ("embedded_path", _) => (
                stated.to_owned(),
                reported("store").replace("embedded ", ""),
            ),
            (_, "one per CPU") => {
                let cpus = std::thread::available_parallelism().unwrap().get();
                (cpus.to_string(), reported(&key))
            }
            ("memory_budget", _) => {
                let line = checked
                    .lines()
                    .find(|l| l.starts_with("memory_budget = "))
                    .unwrap();
                let fallback = stated.rsplit("else ").next().unwrap();
                match line.split("(Container(").nth(1) {
                    Some(limit) => {
                        let limit: u64 = limit.trim_end_matches("))").parse().unwrap();
                        ((limit / 2).to_string() + " B", reported(&key))
                    }
                    None => (fallback.to_owned(), reported(&key)),
                }
            }
            (_, _) if stated.contains(" + ") => {
                let (base, plus) = stated.split_once(" + ").unwrap();
                let sum = humantime::parse_duration(&reported(base)).unwrap()
                    + humantime::parse_duration(plus).unwrap();
                (humantime::format_duration(sum).to_string(), reported(&key))
            }
            _ => (stated.to_owned(), reported(&key)),
        };
        assert!(
            same_value(&expected, &actual),
            "--{key}: the help says [default: {stated}], check reports {actual}"
        );
        compared.push(key);
    }
    for key in [
        "listen",
        "admin_listen",
        "access_log",
        "upstream_timeout",
        "hold_timeout",
        "key_ttl",
        "allow_anonymous",
    ] {
        assert!(
            compared.iter().any(|k| k == key),
            "--{key} not compared: {compared:?}"
        );
    }

    // `jobs` finds the admin listener where a gateway puts it by default.
    let jobs = bare(&["jobs", "--help"]).await;
    let (_, url) = flags_of(&jobs)
        .into_iter()
        .find(|(key, _)| key == "admin_url")
        .expect("jobs --admin-url");
    let stated = url
        .split("[default: ")
        .nth(1)
        .and_then(|r| r.split(']').next());
    assert_eq!(
        stated,
        Some(format!("http://{}", reported("admin_listen")).as_str())
    );
}
