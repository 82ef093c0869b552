//! The real `idemgate` binary, started on OS-assigned ports with a config
//! file of the test's making, and killed (SIGKILL) when the test is done.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use http::Method;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::{send, Reply, TestStore};

pub const ADMIN_TOKEN: &str = "test-admin-token";

/// What every gateway of the suite runs with, unless a test says otherwise:
/// one salt for owner digests (replicas on one PostgreSQL must share it),
/// one replay key for Redis entries (replicas on one Redis must share it;
/// `support::entries` reads and forges entries with it), and keyed requests
/// without credentials allowed (most tests send none; `owners_required`
/// turns that off, and `owners.rs` tests the default).
pub const SUITE_ENV: [(&str, &str); 3] = [
    (
        "IDEMGATE_OWNER_SALT",
        "dGhlIHRlc3Qgc3VpdGUncyBvd25lciBzYWx0",
    ),
    ("IDEMGATE_REPLAY_KEY", super::entries::SUITE_REPLAY_KEY),
    ("IDEMGATE_ALLOW_ANONYMOUS", "true"),
];

pub struct Gateway {
    child: Child,
    pub url: String,
    pub admin_url: String,
    _dir: tempfile::TempDir,
}

#[derive(Clone)]
pub struct Builder {
    settings: BTreeMap<String, String>,
    tables: String,
    env: Vec<(String, String)>,
    files_from: Option<std::path::PathBuf>,
    stderr_to: Option<std::path::PathBuf>,
}

impl Gateway {
    /// A gateway in front of `upstream` on the database at `db`, with short
    /// sweeps so lease tests run fast.
    pub fn builder(store: &TestStore, upstream: &str) -> Builder {
        let mut settings = BTreeMap::new();
        let (key, value) = store.setting();
        settings.insert(key.to_owned(), value);
        for (k, v) in [
            ("listen", "\"127.0.0.1:0\"".to_owned()),
            ("admin_listen", "\"127.0.0.1:0\"".to_owned()),
            ("admin_token", format!("{ADMIN_TOKEN:?}")),
            ("upstreams", format!("[{upstream:?}]")),
            ("sweep_interval", "\"200ms\"".to_owned()),
        ] {
            settings.insert(k.to_owned(), v);
        }
        Builder {
            settings,
            tables: String::new(),
            env: Vec::new(),
            files_from: None,
            stderr_to: None,
        }
    }

    pub async fn start(store: &TestStore, upstream: &str) -> Gateway {
        Self::builder(store, upstream).start().await
    }

    /// Kills the process at once (SIGKILL): no drain, no clean-up.
    pub async fn kill(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    /// Asks the process to stop (SIGTERM) and waits until it has exited.
    pub async fn terminate(&mut self) -> std::process::ExitStatus {
        self.ask_to_stop().await;
        self.exited().await
    }

    /// Sends SIGTERM and returns at once: the drain begins.
    pub async fn ask_to_stop(&self) {
        let pid = self.child.id().expect("running").to_string();
        let sent = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .await
            .unwrap();
        assert!(sent.success());
    }

    /// Sends SIGTERM and waits (10 s at most) until the listener is gone:
    /// the drain has begun, and no new request gets in.
    pub async fn stop_listening(&self) {
        self.ask_to_stop().await;
        let listen = self.url.trim_start_matches("http://").to_owned();
        super::eventually(Duration::from_secs(10), "the listener to close", || async {
            tokio::net::TcpStream::connect(&listen).await.is_err()
        })
        .await;
    }

    /// Whether the process is still running (not exited).
    pub fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Waits until the process has exited, at most 30 s.
    pub async fn exited(&mut self) -> std::process::ExitStatus {
        tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("the gateway did not stop within 30 s of SIGTERM")
            .unwrap()
    }

    /// The process id, to signal it (SIGSTOP, SIGCONT).
    pub fn pid(&self) -> u32 {
        self.child.id().expect("running")
    }

    pub fn path(&self, path: &str) -> String {
        format!("{}{}", self.url, path)
    }

    pub async fn admin(&self, method: Method, path: &str, body: &str) -> Reply {
        let auth = format!("Bearer {ADMIN_TOKEN}");
        send(
            method,
            &format!("{}{}", self.admin_url, path),
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            body.to_owned(),
        )
        .await
    }

    /// The admin view of a job, by id.
    pub async fn job(&self, id: &str) -> Value {
        let reply = self
            .admin(Method::GET, &format!("/admin/v1/jobs/{id}"), "")
            .await;
        assert_eq!(
            reply.status,
            200,
            "job {id}: {:?}",
            String::from_utf8_lossy(&reply.body)
        );
        reply.json()
    }

    /// Resolves an attempt through the admin API.
    pub async fn resolve(&self, attempt: &str, body: &str) -> Reply {
        self.admin(
            Method::POST,
            &format!("/admin/v1/attempts/{attempt}/resolve"),
            body,
        )
        .await
    }

    /// A metric's value from `/metrics` (0 when not yet recorded).
    pub async fn metric(&self, name: &str) -> f64 {
        let reply = send(Method::GET, &format!("{}/metrics", self.admin_url), &[], "").await;
        let text = String::from_utf8_lossy(&reply.body).into_owned();
        text.lines()
            .find_map(|line| {
                let (key, value) = line.split_once(' ')?;
                (key == name).then(|| value.trim().parse().ok())?
            })
            .unwrap_or(0.0)
    }

    /// The sum of every series of `name`, whatever its labels (0 when
    /// there is none).
    pub async fn metric_sum(&self, name: &str) -> f64 {
        self.metric_labelled(name, &[]).await
    }

    /// The sum of the series of `name` that carry every one of `labels`
    /// (each as exposed: `by="deadline"`), 0 when there is none.
    pub async fn metric_labelled(&self, name: &str, labels: &[&str]) -> f64 {
        let reply = send(Method::GET, &format!("{}/metrics", self.admin_url), &[], "").await;
        let text = String::from_utf8_lossy(&reply.body).into_owned();
        text.lines()
            .filter(|line| line.split(['{', ' ']).next() == Some(name))
            .filter(|line| labels.iter().all(|label| line.contains(label)))
            .filter_map(|line| line.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
            .sum()
    }
}

impl Builder {
    /// Sets a top-level key; `value` is TOML (`"\"300ms\""`, `422`).
    pub fn set(mut self, key: &str, value: &str) -> Self {
        self.settings.insert(key.to_owned(), value.to_owned());
        self
    }

    pub fn unset(mut self, key: &str) -> Self {
        self.settings.remove(key);
        self
    }

    /// Replays from the Redis at `redis_url` (200 ms per command): the
    /// gateway's own memory of answers is off, so a replay tests the fast
    /// path.
    pub fn replaying_from_redis(self, redis_url: &str) -> Self {
        self.set("replay_cache_size", "0")
            .set("redis_url", &format!("{redis_url:?}"))
            .set("redis_timeout", "\"200ms\"")
    }

    /// Appends tables (`[[routes]]`, `[[upstreams]]`, `[contracts.x]`).
    pub fn tables(mut self, toml: &str) -> Self {
        self.tables.push_str(toml);
        self.tables.push('\n');
        self
    }

    /// Keyed requests without an owner are refused, as by default (the
    /// suite's gateways otherwise let them share the owner `anonymous`).
    pub fn owners_required(self) -> Self {
        self.env("IDEMGATE_ALLOW_ANONYMOUS", "false")
    }

    /// Sets an environment variable for the gateway process.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Copies every file of `dir` beside the config (contract schemas,
    /// probe bodies), so relative paths in the config resolve.
    pub fn files_from(mut self, dir: &std::path::Path) -> Self {
        self.files_from = Some(dir.to_owned());
        self
    }

    /// Writes the gateway's logs (stderr) to `path` instead of the test's.
    pub fn stderr_to(mut self, path: &std::path::Path) -> Self {
        self.stderr_to = Some(path.to_owned());
        self
    }

    /// Starts the gateway and expects it to refuse: returns its stderr.
    pub async fn start_and_fail(self) -> String {
        let out = self.run("serve").await;
        assert!(
            !out.status.success(),
            "the gateway was expected to refuse to start"
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    /// Runs another subcommand (`verify-providers`, `migrate`) on this
    /// configuration, to completion (30 s at most).
    pub async fn run(self, subcommand: &str) -> std::process::Output {
        self.run_with(subcommand, &[]).await
    }

    /// [`Builder::run`], with arguments after the subcommand.
    pub async fn run_with(self, subcommand: &str, args: &[&str]) -> std::process::Output {
        let (dir, path) = self.write();
        let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .arg("--config")
            .arg(&path)
            .arg(subcommand)
            .args(args)
            .env_remove("IDEMGATE_DATABASE_URL")
            .env_remove("IDEMGATE_EMBEDDED_PATH")
            .envs(SUITE_ENV)
            .envs(self.env.iter().cloned())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(30), out)
            .await
            .unwrap_or_else(|_| panic!("`idemgate {subcommand}` did not finish within 30 s"))
            .unwrap();
        drop(dir);
        out
    }

    fn write(&self) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        if let Some(from) = &self.files_from {
            copy_folder(from, dir.path());
        }
        let mut toml = String::new();
        for (k, v) in &self.settings {
            toml.push_str(&format!("{k} = {v}\n"));
        }
        toml.push_str(&self.tables);
        let path = dir.path().join("idemgate.toml");
        std::fs::write(&path, toml).unwrap();
        (dir, path)
    }

    pub async fn start(self) -> Gateway {
        let (dir, path) = self.write();
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .arg("--config")
            .arg(&path)
            .arg("serve")
            .env(
                "RUST_LOG",
                std::env::var("IDEMGATE_TEST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .env_remove("IDEMGATE_DATABASE_URL")
            .env_remove("IDEMGATE_EMBEDDED_PATH")
            .env_remove("IDEMGATE_UPSTREAM")
            .envs(SUITE_ENV)
            .envs(self.env.iter().cloned())
            .stdout(Stdio::piped())
            .stderr(match &self.stderr_to {
                None => Stdio::inherit(),
                Some(path) => Stdio::from(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(path)
                        .unwrap(),
                ),
            })
            .kill_on_drop(true)
            .spawn()
            .expect("start the idemgate binary");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the gateway did not report its address within 30 s")
            .unwrap()
            .expect("the gateway exited before listening");
        // "idemgate listening on http://A (admin on http://B)"
        let url = line
            .split_whitespace()
            .nth(3)
            .expect("listening line")
            .to_owned();
        let admin_url = line
            .rsplit(' ')
            .next()
            .unwrap()
            .trim_end_matches(')')
            .to_owned();
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Gateway {
            child,
            url,
            admin_url,
            _dir: dir,
        }
    }
}

/// Copies `from` into `to`, folders (a contract's `cases`) included.
fn copy_folder(from: &std::path::Path, to: &std::path::Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&target).unwrap();
            copy_folder(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}
