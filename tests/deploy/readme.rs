//! What users copy must run: the README's commands and the guides' shell
//! examples, executed as written (taken by label: `crate::support::docs`),
//! with only their fixed ports swapped for free ones and `cargo run` for
//! the binaries this build made.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use http::Method;

use crate::support::docs;
use crate::support::process::ProcessGroup;
use crate::support::send;

/// The example binary `name`, built beside this test binary (or now).
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    if !path.exists() {
        let built = std::process::Command::new(env!("CARGO"))
            .args(["build", "--example", name])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .unwrap();
        assert!(built.success(), "cargo build --example {name}");
    }
    path
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A command of the README's, running; it and whatever it started are
/// killed when this is dropped.
struct Started {
    _group: ProcessGroup,
    _child: tokio::process::Child,
}

/// Starts `script` with bash, in a process group of its own; resolves once
/// a line of its output holds `ready` (20 s at most).
async fn started(
    script: &str,
    envs: &[(&str, String)],
    cwd: &std::path::Path,
    ready: &str,
) -> Started {
    // A one-line command replaces the shell; a script's last command runs
    // under it (the process group goes down with it either way).
    let script = match script.trim().contains('\n') {
        true => script.to_owned(),
        false => format!("exec {script}"),
    };
    let mut child = Command::new("bash")
        .args(["-c", &script])
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .current_dir(cwd)
        .stdout(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let group = ProcessGroup::of(&child);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let seen = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains(ready) {
                return;
            }
        }
        panic!("{script} ended before saying {ready:?}");
    })
    .await;
    assert!(seen.is_ok(), "{script} did not say {ready:?} within 20 s");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Started {
        _group: group,
        _child: child,
    }
}

#[tokio::test]
async fn the_quick_start_runs_as_written() {
    let blocks = [
        docs::block("quick-start-upstream"),
        docs::block("quick-start-gateway"),
        docs::block("quick-start-double-submit"),
    ];
    assert_eq!(
        docs::block("two-commands-gateway"),
        blocks[1],
        "the README's first command is the quick start's gateway"
    );
    let (api, proxy, admin) = (free_port(), free_port(), free_port());
    let dir = tempfile::tempdir().unwrap();
    let ports = |text: &str| {
        text.replace("localhost:8000", &format!("127.0.0.1:{api}"))
            .replace("127.0.0.1:8000", &format!("127.0.0.1:{api}"))
            .replace("localhost:8080", &format!("127.0.0.1:{proxy}"))
    };

    let upstream = blocks[0].trim().replace(
        "cargo run --release --example demo_upstream",
        example("demo_upstream").to_str().unwrap(),
    );
    let demo_env = [
        ("DEMO_LISTEN", format!("127.0.0.1:{api}")),
        ("DEMO_DELAY_MS", "500".to_owned()),
    ];
    let _upstream = started(&upstream, &demo_env, dir.path(), "demo upstream on").await;

    let gateway = ports(blocks[1].trim()).replace(
        "cargo run --release -- serve",
        &format!(
            "{} serve --listen 127.0.0.1:{proxy} --admin-listen 127.0.0.1:{admin}",
            env!("CARGO_BIN_EXE_idemgate")
        ),
    );
    // As on a fresh machine: the embedded store in the working folder, its
    // owner salt made beside it, none of the suite's own settings.
    let gateway_env = [("RUST_LOG", "warn".to_owned())];
    let _gateway = started(&gateway, &gateway_env, dir.path(), "idemgate listening on").await;
    assert!(dir.path().join("idemgate.db.owner-salt").exists());

    let out = Command::new("bash")
        .args(["-c", &ports(&blocks[2])])
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_lowercase();
    assert!(out.status.success(), "{text}");
    assert_eq!(
        text.matches("http/1.1 200 ok").count(),
        2,
        "two answers: {text}"
    );
    assert_eq!(
        text.matches("idempotent-replayed: true").count(),
        1,
        "{text}"
    );
    let jobs: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("idempotency-job: "))
        .map(str::trim)
        .collect();
    assert!(jobs.len() == 2 && jobs[0] == jobs[1], "one job: {jobs:?}");
    assert!(
        text.trim_end().ends_with(r#"{"charges":1}"#),
        "one charge: {text}"
    );
    the_quick_starts_files_are_ignored_by_git(dir.path());
}

/// What the quick start leaves in the working folder (the store, its WAL,
/// its lock and the owner salt, a secret) is ignored by the repository's
/// `.gitignore`, so `git add -A` in a clone never commits it.
fn the_quick_starts_files_are_ignored_by_git(dir: &std::path::Path) {
    let made: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for name in ["idemgate.db", "idemgate.db.owner-salt", "idemgate.db.lock"] {
        assert!(made.iter().any(|m| m == name), "{name} in {made:?}");
    }
    for name in &made {
        let ignored = std::process::Command::new("git")
            .args(["check-ignore", "--no-index", "-q", name])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .unwrap();
        assert!(ignored.success(), "{name} is not ignored by .gitignore");
    }
}

#[tokio::test]
async fn the_configuration_check_runs_as_written_on_the_example_config() {
    let blocks = [docs::block("configuration-check")];
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_idemgate"));
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &blocks[0]])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("PATH", path)
        .env_remove("IDEMGATE_CONFIG")
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("upstream.primary = http://127.0.0.1:8000/ (primary"),
        "{stdout}"
    );
    assert!(stdout.ends_with("configuration ok\n"), "{stdout}");

    // What the check accepted, the gateway serves: the example file started
    // as it is, only its ports and store file moved out of the way.
    let dir = tempfile::tempdir().unwrap();
    let mut gateway = Command::new(&bin)
        .args(["--config", "config/idemgate.example.toml", "serve"])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .arg("--embedded-path")
        .arg(dir.path().join("example.db"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("IDEMGATE_CONFIG")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(gateway.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the example config's gateway did not start within 30 s")
        .unwrap()
        .expect("the example config's gateway exited before listening");
    assert!(line.starts_with("idemgate listening on"), "{line}");
    let _ = gateway.start_kill();
}

/// The guides' route tables (the `toml` blocks labelled `route-table…`), each checked by `idemgate check` as written, in a file
/// with an upstream: what `check` says of the route is what the block says.
#[tokio::test]
async fn the_readmes_route_tables_pass_the_check_as_written() {
    let blocks: Vec<String> = docs::blocks("route-table")
        .into_iter()
        .map(|(_, text)| text)
        .collect();
    let dir = tempfile::tempdir().unwrap();
    for block in &blocks {
        let file = dir.path().join("idemgate.toml");
        std::fs::write(
            &file,
            format!("upstreams = [\"http://127.0.0.1:1\"]\n{block}"),
        )
        .unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .arg("--config")
            .arg(&file)
            .arg("check")
            .env_remove("IDEMGATE_CONFIG")
            .kill_on_drop(true)
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{block}\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        if block.contains("stream_end_events") {
            assert!(stdout.contains("stream_end_events [\"[DONE]\""), "{stdout}");
        }
    }
}

/// The long-call example, as written, against the quick start's gateway
/// and stand-in API (each POST taking two seconds): `202` at once, polled
/// to the answer, one charge.
#[tokio::test]
async fn the_long_call_example_runs_as_written() {
    let blocks = [docs::block("long-call-curl")];
    let (api, proxy, admin) = (free_port(), free_port(), free_port());
    let dir = tempfile::tempdir().unwrap();
    let demo = example("demo_upstream");
    let demo_env = [
        ("DEMO_LISTEN", format!("127.0.0.1:{api}")),
        ("DEMO_DELAY_MS", "2000".to_owned()),
    ];
    let _upstream = started(
        demo.to_str().unwrap(),
        &demo_env,
        dir.path(),
        "demo upstream on",
    )
    .await;
    let gateway = format!(
        "{} serve --upstream http://127.0.0.1:{api} --listen 127.0.0.1:{proxy} --admin-listen 127.0.0.1:{admin}",
        env!("CARGO_BIN_EXE_idemgate")
    );
    let gateway_env = [("RUST_LOG", "warn".to_owned())];
    let _gateway = started(&gateway, &gateway_env, dir.path(), "idemgate listening on").await;
    let script = blocks[0].replace("localhost:8080", &format!("127.0.0.1:{proxy}"));
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        Command::new("bash")
            .args(["-euo", "pipefail", "-c", &script])
            .current_dir(dir.path())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the long-call example did not end within 30 s")
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.starts_with("polling /.well-known/idemgate/jobs/"),
        "{text}"
    );
    assert!(text.contains("\"charge\":1"), "the answer: {text}");
    let calls = send(
        Method::GET,
        &format!("http://127.0.0.1:{api}/calls"),
        &[],
        "",
    )
    .await;
    assert_eq!(calls.body.trim_ascii(), b"{\"charges\":1}", "one charge");
}

/// `PATH` with this build's `idemgate` first, as after the README's
/// "Install the binary".
fn path_with_the_binary() -> String {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_idemgate"));
    format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

/// The README's production command, as written but for its database (one
/// of the test's own) and ports: it starts on PostgreSQL and Redis with the
/// two secrets it makes, and a keyed request is answered and replayed.
/// Without the two `export` lines it refuses to start, naming the owner
/// salt, as the README says.
#[tokio::test]
async fn the_production_command_starts_on_postgres_and_redis_and_refuses_without_its_secrets() {
    let block = docs::block("production-postgres-redis");
    let db = crate::support::TestDb::new().await;
    let (api, proxy, admin) = (free_port(), free_port(), free_port());
    let script = block
        .replace("postgres://postgres@127.0.0.1:5432/postgres", &db.url)
        .replace("127.0.0.1:8000", &format!("127.0.0.1:{api}"))
        .replace(
            "idemgate serve",
            &format!("idemgate serve --listen 127.0.0.1:{proxy} --admin-listen 127.0.0.1:{admin}"),
        );
    let dir = tempfile::tempdir().unwrap();
    let env = [
        ("PATH", path_with_the_binary()),
        ("RUST_LOG", "warn".to_owned()),
    ];
    let without: String = script
        .lines()
        .filter(|l| !l.starts_with("export "))
        .collect::<Vec<_>>()
        .join("\n");
    let refused = Command::new("bash")
        .args(["-c", &without])
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env_remove("IDEMGATE_OWNER_SALT")
        .env_remove("IDEMGATE_REPLAY_KEY")
        .current_dir(dir.path())
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{said}");
    for secret in ["owner.salt", "replay_key"] {
        assert!(said.contains(secret), "both secrets named at once: {said}");
    }
    assert!(said.contains("openssl rand"), "and how to make one: {said}");

    let demo = example("demo_upstream");
    let demo_env = [
        ("DEMO_LISTEN", format!("127.0.0.1:{api}")),
        ("DEMO_DELAY_MS", "0".to_owned()),
    ];
    let _upstream = started(
        demo.to_str().unwrap(),
        &demo_env,
        dir.path(),
        "demo upstream on",
    )
    .await;
    let _gateway = started(&script, &env, dir.path(), "idemgate listening on").await;
    let url = format!("http://127.0.0.1:{proxy}/charges");
    let headers = [
        ("idempotency-key", "prod-1"),
        ("authorization", "Bearer alice"),
    ];
    let first = send(Method::POST, &url, &headers, "{}").await;
    let second = send(Method::POST, &url, &headers, "{}").await;
    assert_eq!(first.status, 200);
    assert_eq!(second.body, first.body, "replayed");
    assert_eq!(second.header("idempotent-replayed"), Some("true"));
    let ready = send(
        Method::GET,
        &format!("http://127.0.0.1:{admin}/readyz"),
        &[],
        "",
    )
    .await;
    let ready: serde_json::Value = serde_json::from_slice(&ready.body).unwrap();
    assert_ne!(ready["status"], "degraded", "{ready}");
    for dependency in ["store", "redis"] {
        assert!(ready["dependencies"][dependency].is_object(), "{ready}");
    }
}
