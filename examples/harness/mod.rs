//! What the benchmarks share: a database of their own on the benchmark's
//! PostgreSQL, and the gateway binary started on OS-assigned ports.

// Each benchmark uses part of it.
#![allow(dead_code)]

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A fresh database named for this process on `server`; its URL.
pub async fn create_database(server: &str) -> String {
    create_database_for(server, "").await
}

/// [`create_database`], its name ending in `suffix`: a second one.
#[allow(dead_code)] // not every example that shares the harness needs two
pub async fn create_database_for(server: &str, suffix: &str) -> String {
    let name = format!("idemgate_bench_{}{suffix}", std::process::id());
    let (client, conn) = tokio_postgres::connect(server, tokio_postgres::NoTls)
        .await
        .expect("PostgreSQL is not reachable; run scripts/bench.sh, which starts it");
    tokio::spawn(conn);
    for sql in [
        format!("DROP DATABASE IF EXISTS {name}"),
        format!("CREATE DATABASE {name}"),
    ] {
        client.batch_execute(&sql).await.expect("create database");
    }
    let mut config: tokio_postgres::Config = server.parse().expect("database URL");
    config.dbname(&name);
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".into(),
    };
    format!(
        "postgres://{}@{host}:{}/{name}",
        config.get_user().unwrap_or("postgres"),
        config.get_ports().first().copied().unwrap_or(5432)
    )
}

/// Drops the database `create_database` made.
pub async fn drop_database(server: &str, url: &str) {
    let name = url.rsplit('/').next().unwrap_or_default().to_owned();
    if let Ok((client, conn)) = tokio_postgres::connect(server, tokio_postgres::NoTls).await {
        tokio::spawn(conn);
        let _ = client
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await;
    }
}

/// Where a gateway keeps its jobs.
pub enum Store<'a> {
    Postgres(&'a str),
    Embedded(&'a Path),
}

/// A gateway process, killed when dropped.
pub struct Gateway {
    pub url: String,
    pub admin: String,
    pub pid: u32,
    _child: Child,
}

impl Gateway {
    /// Starts `binary` in front of `upstream` and waits for its listening line.
    pub async fn start(
        binary: &str,
        upstream: &str,
        store: Store<'_>,
        redis: Option<&str>,
        extra: &[&str],
    ) -> Gateway {
        Self::start_env(binary, upstream, store, redis, extra, &[]).await
    }

    /// [`Gateway::start`] with variables of its own (`RUST_LOG` among them:
    /// `warn` unless `env` says otherwise).
    pub async fn start_env(
        binary: &str,
        upstream: &str,
        store: Store<'_>,
        redis: Option<&str>,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Gateway {
        Self::start_logging(binary, upstream, store, redis, extra, env, None).await
    }

    /// [`Gateway::start_env`], its logs (stderr) written to `log` when
    /// given, as a deployment's go to a file or a collector's pipe, rather
    /// than to the benchmark's terminal.
    pub async fn start_logging(
        binary: &str,
        upstream: &str,
        store: Store<'_>,
        redis: Option<&str>,
        extra: &[&str],
        env: &[(&str, &str)],
        log: Option<&Path>,
    ) -> Gateway {
        let mut cmd = Command::new(binary);
        if let Some(log) = log {
            cmd.stderr(std::fs::File::create(log).expect("create the gateway's log file"));
        }
        cmd.args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .args(["--upstream", upstream])
        .args(extra)
        .env("RUST_LOG", "warn")
        // One owner salt for every replica on the same database, and one
        // replay key for every replica on the same Redis.
        .env(
            "IDEMGATE_OWNER_SALT",
            "dGhlIGJlbmNobWFyaydzIG93bmVyIHNhbHQ=",
        )
        .env(
            "IDEMGATE_REPLAY_KEY",
            "dGhlIGJlbmNobWFyaydzIHJlcGxheSBrZXksIDMyIGJ5dGVzIG9yIG1vcmU=",
        )
        .envs(env.iter().copied())
        .env_remove("IDEMGATE_REDIS_URL")
        .stdout(Stdio::piped())
        .kill_on_drop(true);
        match store {
            Store::Postgres(url) => cmd.args(["--database-url", url]),
            Store::Embedded(path) => cmd.arg("--embedded-path").arg(path),
        };
        if let Some(redis) = redis {
            cmd.args(["--redis-url", redis]);
        }
        let mut child = cmd
            .spawn()
            .expect("start idemgate (build it with --release first)");
        let pid = child.id().unwrap_or(0);
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("gateway start")
            .expect("stdout")
            .expect("listening line");
        let words: Vec<&str> = line.split_whitespace().collect();
        let url = words[3].to_owned();
        let admin = words[6].trim_end_matches(')').to_owned();
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Gateway {
            url,
            admin,
            pid,
            _child: child,
        }
    }

    /// A metric's value from `/metrics` (0 when absent).
    pub async fn metric(&self, name: &str) -> f64 {
        let c = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let Ok(r) = c
            .request(
                Request::get(format!("{}/metrics", self.admin))
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
            .await
        else {
            return 0.0;
        };
        let body = r
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        String::from_utf8_lossy(&body)
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0.0)
    }
}
