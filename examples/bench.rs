//! The benchmark: idemgate beside nginx as a plain reverse proxy, in one run,
//! on one machine, against one fast upstream (nginx serving a fixed answer).
//!
//! Rows: the upstream alone; nginx proxying it (twice, an A/A pair that shows
//! the run's noise); the floor under idemgate (its listener and upstream
//! pool with no layers, on two threads and on one: examples/floor.rs);
//! idemgate passing requests through (as deployed, on one worker thread as
//! nginx has one worker, at the default log level, and with the access log
//! on: nginx runs with its own off); replays of finished
//! keys (Redis, PostgreSQL alone, the embedded store); a new key per request
//! (PostgreSQL + Redis, embedded); the pgbench ceiling for the statements a
//! new key needs; a duplicate storm (thousands of holders of one key); and
//! the first byte of streamed answers. Load comes from `wrk` (1 thread);
//! each row is the median of `--rounds` rounds of `--seconds`, rounds
//! alternating between rows. CPU µs per request is the serving processes'
//! user + system time over the requests answered.
//!
//! Loopback only, bounded in time, stops by itself. `scripts/bench.sh`
//! installs what is missing, builds, and runs it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::process::{Child, Command};
use tokio::sync::Notify;
use tokio::time::Instant;

mod harness;
use harness::{create_database, drop_database, Gateway, Store};

struct Args {
    binary: String,
    /// The floor example (examples/floor.rs): the gateway's listener and
    /// upstream pool with no layers.
    floor: String,
    database: String,
    redis: String,
    seconds: u64,
    rounds: usize,
    connections: usize,
    storm: usize,
    /// Replica counts for the scale-out table (empty: skipped).
    replicas: Vec<usize>,
    only: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        binary: "target/release/idemgate".into(),
        floor: "target/release/examples/floor".into(),
        database: "postgres://postgres@127.0.0.1:5432/postgres".into(),
        redis: "redis://127.0.0.1:6379/15".into(),
        seconds: 10,
        rounds: 3,
        connections: 32,
        storm: 10_000,
        replicas: vec![1, 2, 4],
        only: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_default();
        match flag.as_str() {
            "--binary" => a.binary = value,
            "--floor" => a.floor = value,
            "--database" => a.database = value,
            "--redis" => a.redis = value,
            "--seconds" => a.seconds = value.parse().expect("--seconds N"),
            "--rounds" => a.rounds = value.parse().expect("--rounds N"),
            "--connections" => a.connections = value.parse().expect("--connections N"),
            "--storm" => a.storm = value.parse().expect("--storm N"),
            "--replicas" => {
                a.replicas = value
                    .split(',')
                    .filter(|v| !v.is_empty() && *v != "0")
                    .map(|v| v.parse().expect("--replicas 1,2,4"))
                    .collect()
            }
            "--only" => a.only = Some(value),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// A wrk round's result.
#[derive(Debug, Clone, Default)]
struct Round {
    rps: f64,
    p50: f64,
    p99: f64,
    cpu_us: f64,
    errors: u64,
}

/// What a row loads, and how.
#[derive(Clone)]
enum Load {
    /// POST without a key.
    Plain,
    /// POST with one of `keys` fixed keys (replays).
    Replay { keys: usize },
    /// POST with a new key each time.
    NewKey,
}

struct Row {
    name: String,
    url: String,
    load: Load,
    /// Processes whose CPU time the row is charged.
    pids: Vec<u32>,
    /// Compared with nginx (true) or with the pgbench ceiling (false).
    vs_nginx: bool,
    rounds: Vec<Round>,
}

#[tokio::main]
async fn main() {
    let args = args();
    let scratch = std::env::temp_dir().join(format!("idemgate-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let scripts = write_wrk_scripts(&scratch);

    let upstream = Nginx::upstream(&scratch.join("upstream")).await;
    let nginx_a = Nginx::proxy(&scratch.join("nginx-a"), &upstream.url).await;
    let nginx_b = Nginx::proxy(&scratch.join("nginx-b"), &upstream.url).await;
    let db = create_database(&args.database).await;
    flush_redis(&args.redis).await;
    // The gateway as deployed (PostgreSQL + Redis, the defaults), and one
    // per store with the replay cache off, so their replay rows measure
    // Redis, PostgreSQL and the embedded store themselves.
    let memory_off = scratch.join("memory-off.toml");
    std::fs::write(&memory_off, "replay_cache_size = 0\n").unwrap();
    let memory_off = memory_off.display().to_string();
    let off = ["--config", memory_off.as_str()];
    let default = Gateway::start(
        &args.binary,
        &upstream.url,
        Store::Postgres(&db),
        Some(&args.redis),
        &[],
    )
    .await;
    let redis = Gateway::start(
        &args.binary,
        &upstream.url,
        Store::Postgres(&db),
        Some(&args.redis),
        &off,
    )
    .await;
    let postgres = Gateway::start(
        &args.binary,
        &upstream.url,
        Store::Postgres(&db),
        None,
        &off,
    )
    .await;
    let embedded = Gateway::start(
        &args.binary,
        &upstream.url,
        Store::Embedded(&scratch.join("bench.db")),
        None,
        &off,
    )
    .await;
    // The default gateway on one thread (nginx's reference runs one worker
    // too), and at the default log level (`info`; the others run at `warn`).
    let one_thread = Gateway::start(
        &args.binary,
        &upstream.url,
        Store::Postgres(&db),
        Some(&args.redis),
        &["--worker-threads", "1"],
    )
    .await;
    // The access log (on by default) writes a line per request at `info`:
    // off in the row that measures the level alone, on in the row that
    // measures it, its lines to a file as a deployment's go to a file or a
    // collector. The other gateways run at `warn`, which filters it out.
    let logging = Gateway::start_env(
        &args.binary,
        &upstream.url,
        Store::Postgres(&db),
        Some(&args.redis),
        &["--access-log", "false"],
        &[("RUST_LOG", "info")],
    )
    .await;
    let access_log = Gateway::start_logging(
        &args.binary,
        &upstream.url,
        Store::Postgres(&db),
        Some(&args.redis),
        &["--access-log", "true"],
        &[("RUST_LOG", "info")],
        Some(&scratch.join("access.log")),
    )
    .await;
    let floor_two = Floor::start(&args.floor, "mt2", &upstream.url).await;
    let floor_one = Floor::start(&args.floor, "ct", &upstream.url).await;
    for g in [&redis, &postgres, &embedded] {
        prime(&g.url, 200).await;
    }
    // Every key replayed once fills Redis, and the default gateways' memory.
    for k in 0..200 {
        let _ = send(&redis.url, Some(&format!("replay-{k}"))).await;
        let _ = send(&default.url, Some(&format!("replay-{k}"))).await;
        let _ = send(&one_thread.url, Some(&format!("replay-{k}"))).await;
    }

    let mut rows = vec![
        row(
            "upstream alone (nginx, fixed answer)",
            &upstream.url,
            Load::Plain,
            upstream.pids(),
            true,
        ),
        row(
            "nginx proxy A",
            &nginx_a.url,
            Load::Plain,
            nginx_a.pids(),
            true,
        ),
        row(
            "nginx proxy B (A/A: the run's noise)",
            &nginx_b.url,
            Load::Plain,
            nginx_b.pids(),
            true,
        ),
        row(
            "floor: hyper server + the gateway's pool, no layers, two threads",
            &floor_two.url,
            Load::Plain,
            vec![floor_two.pid],
            true,
        ),
        row(
            "floor: the same on one thread",
            &floor_one.url,
            Load::Plain,
            vec![floor_one.pid],
            true,
        ),
        row(
            "idemgate pass-through (no key; logs at warn: access log off)",
            &default.url,
            Load::Plain,
            vec![default.pid],
            true,
        ),
        row(
            "idemgate pass-through, one worker thread (access log off)",
            &one_thread.url,
            Load::Plain,
            vec![one_thread.pid],
            true,
        ),
        row(
            "idemgate pass-through, logs at info (the default level), access log off",
            &logging.url,
            Load::Plain,
            vec![logging.pid],
            true,
        ),
        row(
            "idemgate pass-through, access log on (logs at info, to a file)",
            &access_log.url,
            Load::Plain,
            vec![access_log.pid],
            true,
        ),
        row(
            "idemgate replay, from memory (the default)",
            &default.url,
            Load::Replay { keys: 200 },
            vec![default.pid],
            true,
        ),
        row(
            "idemgate replay, from memory, one worker thread",
            &one_thread.url,
            Load::Replay { keys: 200 },
            vec![one_thread.pid],
            true,
        ),
        row(
            "idemgate replay, Redis (memory off)",
            &redis.url,
            Load::Replay { keys: 200 },
            vec![redis.pid],
            true,
        ),
        row(
            "idemgate replay, PostgreSQL alone (memory off)",
            &postgres.url,
            Load::Replay { keys: 200 },
            vec![postgres.pid],
            true,
        ),
        row(
            "idemgate replay, embedded store (memory off)",
            &embedded.url,
            Load::Replay { keys: 200 },
            vec![embedded.pid],
            true,
        ),
        row(
            "idemgate new key, PostgreSQL + Redis",
            &default.url,
            Load::NewKey,
            vec![default.pid],
            false,
        ),
        row(
            "idemgate new key, PostgreSQL + Redis, one worker thread",
            &one_thread.url,
            Load::NewKey,
            vec![one_thread.pid],
            false,
        ),
        row(
            "idemgate new key, embedded store",
            &embedded.url,
            Load::NewKey,
            vec![embedded.pid],
            false,
        ),
    ];
    if let Some(only) = &args.only {
        rows.retain(|r| r.name.contains(only.as_str()) || r.name.starts_with("nginx"));
    }
    for round in 0..args.rounds {
        for (i, r) in rows.iter_mut().enumerate() {
            let result = wrk(&args, &scripts, r, round * 100 + i).await;
            r.rounds.push(result);
        }
    }
    let ceiling = pgbench_ceiling(&args, &db).await;

    let nginx = |f: fn(&Round) -> f64| {
        let proxies: Vec<f64> = rows
            .iter()
            .filter(|r| r.name.starts_with("nginx proxy"))
            .map(|r| median(r.rounds.iter().map(f).collect()))
            .collect();
        proxies.iter().sum::<f64>() / proxies.len().max(1) as f64
    };
    let nginx_rps = nginx(|r| r.rps);
    println!();
    println!(
        "wrk, 1 thread, {} connections, {} s rounds, median of {}; one upstream (nginx, fixed JSON answer); \
         nginx 1 worker as the reference proxy",
        args.connections, args.seconds, args.rounds
    );
    println!();
    println!(
        "| scenario | req/s | p50 ms | p99 ms | vs nginx (or ceiling) | CPU µs/req | errors |"
    );
    println!("|---|--:|--:|--:|--:|--:|--:|");
    for r in &rows {
        let rps = median(r.rounds.iter().map(|x| x.rps).collect());
        let ratio = if r.vs_nginx {
            format!("{:.2}× nginx", rps / nginx_rps)
        } else {
            format!("{:.0} % of ceiling", 100.0 * rps / ceiling.max(1.0))
        };
        println!(
            "| {} | {:.0} | {:.2} | {:.2} | {} | {:.0} | {} |",
            r.name,
            rps,
            median(r.rounds.iter().map(|x| x.p50).collect()),
            median(r.rounds.iter().map(|x| x.p99).collect()),
            ratio,
            median(r.rounds.iter().map(|x| x.cpu_us).collect()),
            r.rounds.iter().map(|x| x.errors).sum::<u64>(),
        );
    }
    println!(
        "| pgbench ceiling: the new-key statements (insert job, insert attempt, CAS commit), {} clients | {:.0} tx/s | | | 100 % | | |",
        args.connections, ceiling
    );

    if !args.replicas.is_empty() {
        let table = scale_out(&args, &scripts, &upstream.url, &db).await;
        println!();
        println!("{table}");
    }
    if args.storm > 0 {
        let storm = storm(&args, &scratch, &db).await;
        println!();
        println!("{storm}");
    }
    drop((
        default, one_thread, logging, redis, postgres, embedded, floor_two, floor_one, nginx_a,
        nginx_b, upstream,
    ));
    drop_database(&args.database, &db).await;
    let _ = std::fs::remove_dir_all(&scratch);
}

fn row(name: &str, url: &str, load: Load, pids: Vec<u32>, vs_nginx: bool) -> Row {
    Row {
        name: name.into(),
        url: url.into(),
        load,
        pids,
        vs_nginx,
        rounds: Vec::new(),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The wrk scripts: a POST without a key, with one of N keys, with a new
/// key each time (a prefix per round keeps rounds apart).
fn write_wrk_scripts(dir: &Path) -> BTreeMap<&'static str, PathBuf> {
    let body = r#"wrk.method = "POST"
wrk.body = '{"amount": 1000}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer bench-client"
"#;
    let scripts = [
        ("plain", format!("{body}wrk.path = \"/v1/charges\"\n")),
        (
            "replay",
            format!(
                "{body}local n = 0\nlocal keys = 200\ninit = function(args) keys = tonumber(args[1]) end\n\
                 request = function()\n  n = n + 1\n  wrk.headers[\"Idempotency-Key\"] = \"replay-\" .. (n % keys)\n  \
                 return wrk.format(nil, \"/v1/charges\")\nend\n"
            ),
        ),
        (
            "new",
            format!(
                "{body}local n = 0\nlocal prefix = \"k\"\ninit = function(args) prefix = args[1] end\n\
                 request = function()\n  n = n + 1\n  wrk.headers[\"Idempotency-Key\"] = prefix .. \"-\" .. n\n  \
                 return wrk.format(nil, \"/v1/charges\")\nend\n"
            ),
        ),
    ];
    scripts
        .into_iter()
        .map(|(name, text)| {
            let path = dir.join(format!("{name}.lua"));
            std::fs::write(&path, text).unwrap();
            (name, path)
        })
        .collect()
}

/// CPU time (user + system) of processes, in microseconds.
fn cpu_us(pids: &[u32]) -> f64 {
    let tick = 100.0; // USER_HZ on Linux
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .map(|stat| {
            // Fields after the command name, which is in parentheses.
            let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let utime: f64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0);
            let stime: f64 = fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
            (utime + stime) / tick * 1e6
        })
        .sum()
}

async fn wrk(args: &Args, scripts: &BTreeMap<&str, PathBuf>, row: &Row, round: usize) -> Round {
    wrk_with(args.connections, args, scripts, row, round).await
}

/// Replicas side by side on one PostgreSQL and one Redis: new keys and
/// replays with each count of `args.replicas`, the load split evenly (one
/// wrk per replica, all started together, `args.connections` in all), and
/// the database connections they hold once loaded.
async fn scale_out(
    args: &Args,
    scripts: &BTreeMap<&str, PathBuf>,
    upstream: &str,
    db: &str,
) -> String {
    let mut out = format!(
        "Replicas on one PostgreSQL and one Redis: {} connections in all, split evenly, one {} s round\n\n\
         | replicas | load | req/s (sum) | p99 ms (worst) | CPU µs/req (gateways) | PostgreSQL connections | errors |\n\
         |--:|---|--:|--:|--:|--:|--:|\n",
        args.connections, args.seconds
    );
    // Named apart from the other gateways of the run, to count theirs alone.
    let separator = if db.contains('?') { '&' } else { '?' };
    let named = format!("{db}{separator}application_name=idemgate-scale-out");
    for &n in &args.replicas {
        flush_redis(&args.redis).await;
        let mut replicas = Vec::new();
        for _ in 0..n {
            let store = Store::Postgres(&named);
            replicas
                .push(Gateway::start(&args.binary, upstream, store, Some(&args.redis), &[]).await);
        }
        prime(&replicas[0].url, 200).await;
        for g in &replicas {
            for k in 0..200 {
                let _ = send(&g.url, Some(&format!("replay-{k}"))).await;
            }
        }
        for (name, load) in [
            ("new key", Load::NewKey),
            ("replay", Load::Replay { keys: 200 }),
        ] {
            let rows: Vec<Row> = replicas
                .iter()
                .map(|g| row(name, &g.url, load.clone(), vec![g.pid], true))
                .collect();
            let each = (args.connections / n).max(1);
            let rounds = futures_util::future::join_all(
                rows.iter()
                    .enumerate()
                    .map(|(i, r)| wrk_with(each, args, scripts, r, 10_000 + n * 100 + i)),
            )
            .await;
            let rps: f64 = rounds.iter().map(|r| r.rps).sum();
            let cpu = rounds.iter().map(|r| r.cpu_us * r.rps).sum::<f64>() / rps.max(1.0);
            let p99 = rounds.iter().map(|r| r.p99).fold(0.0, f64::max);
            let errors: u64 = rounds.iter().map(|r| r.errors).sum();
            let connections = database_connections(&args.database).await;
            out.push_str(&format!(
                "| {n} | {name} | {rps:.0} | {p99:.2} | {cpu:.0} | {connections} | {errors} |\n"
            ));
        }
    }
    out
}

/// Connections the scale-out replicas hold on the benchmark's server.
async fn database_connections(server: &str) -> i64 {
    let (client, conn) = tokio_postgres::connect(server, tokio_postgres::NoTls)
        .await
        .expect("the benchmark's PostgreSQL");
    tokio::spawn(conn);
    client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'idemgate-scale-out'",
            &[],
        )
        .await
        .map(|row| row.get(0))
        .unwrap_or(-1)
}

async fn wrk_with(
    connections: usize,
    args: &Args,
    scripts: &BTreeMap<&str, PathBuf>,
    row: &Row,
    round: usize,
) -> Round {
    let (script, extra) = match &row.load {
        Load::Plain => (&scripts["plain"], vec![]),
        Load::Replay { keys } => (&scripts["replay"], vec![keys.to_string()]),
        Load::NewKey => (
            &scripts["new"],
            vec![format!("r{round}-{}", std::process::id())],
        ),
    };
    let cpu_before = cpu_us(&row.pids);
    let out = Command::new("wrk")
        .args([
            "-t1",
            &format!("-c{connections}"),
            &format!("-d{}s", args.seconds),
        ])
        .arg("--latency")
        .arg("-s")
        .arg(script)
        .arg(&row.url)
        .arg("--")
        .args(&extra)
        .output()
        .await
        .expect("wrk is not installed; run scripts/bench.sh, which installs it");
    let cpu = cpu_us(&row.pids) - cpu_before;
    let text = String::from_utf8_lossy(&out.stdout);
    let number = |after: &str| -> f64 {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(after))
            .and_then(|v| v.split_whitespace().next())
            .map(parse_latency_or_number)
            .unwrap_or(0.0)
    };
    let requests = text
        .lines()
        .find(|l| l.contains("requests in"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    let errors = text
        .lines()
        .filter(|l| l.contains("Non-2xx") || l.contains("Socket errors"))
        .flat_map(|l| {
            l.split(|c: char| !c.is_ascii_digit())
                .filter_map(|d| d.parse::<u64>().ok())
        })
        .sum();
    Round {
        rps: number("Requests/sec:"),
        p50: number("50%"),
        p99: number("99%"),
        cpu_us: if requests > 0.0 { cpu / requests } else { 0.0 },
        errors,
    }
}

/// wrk prints latencies like `1.23ms`, `850.00us`, `1.02s`; in ms.
fn parse_latency_or_number(v: &str) -> f64 {
    let (n, scale) = if let Some(n) = v.strip_suffix("us") {
        (n, 0.001)
    } else if let Some(n) = v.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1000.0)
    } else {
        (v, 1.0)
    };
    n.parse::<f64>().map(|x| x * scale).unwrap_or(0.0)
}

/// The ceiling for new keys: pgbench running the statements a new key
/// minimally needs (insert the job, insert attempt 1, the CAS commit: three
/// autocommit transactions), prepared, on a copy of the schema without the
/// notification trigger.
async fn pgbench_ceiling(args: &Args, db: &str) -> f64 {
    let (client, conn) = tokio_postgres::connect(db, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(
            "DROP TABLE IF EXISTS ceiling_attempts, ceiling_jobs; \
             CREATE TABLE ceiling_jobs (LIKE jobs INCLUDING ALL); \
             CREATE TABLE ceiling_attempts (LIKE attempts INCLUDING ALL);",
        )
        .await
        .unwrap();
    let script = std::env::temp_dir().join(format!("idemgate-ceiling-{}.sql", std::process::id()));
    std::fs::write(
        &script,
        "\\set n random(1, 4000000000000)\n\
         INSERT INTO ceiling_jobs (id, owner, key, fingerprint, route, state, version, attempt_count, expires_at) \
           VALUES (md5(:client_id || '-' || :n)::uuid, 'anonymous', 'c' || :client_id || '-' || :n, '\\x00', 'default', 'running', 1, 1, now() + interval '1 day') \
           ON CONFLICT (owner, key) DO NOTHING;\n\
         INSERT INTO ceiling_attempts (id, job_id, number, upstream, state, job_version, instance, lease_expires_at, deadline_at) \
           VALUES (md5('a' || :client_id || '-' || :n)::uuid, md5(:client_id || '-' || :n)::uuid, 1, 'primary', 'started', 1, md5('i')::uuid, now() + interval '30 seconds', now() + interval '5 minutes');\n\
         UPDATE ceiling_jobs SET state = 'completed', completed_by = md5('a' || :client_id || '-' || :n)::uuid, \
           response_status = 200, response_body = '\\x7b7d', version = version + 1 \
           WHERE id = md5(:client_id || '-' || :n)::uuid AND version = 1 AND completed_by IS NULL;\n",
    )
    .unwrap();
    let out = Command::new("pgbench")
        .args(["-n", "-M", "prepared", "-j", "2"])
        .arg(format!("-c{}", args.connections))
        .arg(format!("-T{}", args.seconds))
        .arg("-f")
        .arg(&script)
        .arg(db)
        .output()
        .await
        .expect("pgbench is not installed");
    let _ = std::fs::remove_file(&script);
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// The duplicate storm: `args.storm` clients hold one key while its only
/// attempt waits at a gated upstream; then it answers. Reports upstream
/// calls, how long after the answer the holders were released, and the
/// gateway's memory per held request.
async fn storm(args: &Args, scratch: &Path, db: &str) -> String {
    let gate = Arc::new(Notify::new());
    let (upstream, calls) = gated_upstream(gate.clone()).await;
    let mut out = String::from(
        "| duplicate storm | holders | upstream calls | release p50 ms | p99 ms | last ms | RSS per holder KiB | CPU ms during release: gateway / load generator |\n|---|--:|--:|--:|--:|--:|--:|--:|\n",
    );
    let stores = [
        (
            "PostgreSQL + Redis",
            Store::Postgres(db),
            Some(args.redis.as_str()),
        ),
        (
            "embedded store",
            Store::Embedded(&scratch.join("storm.db")),
            None,
        ),
    ];
    // Room for every holder: the defaults (10,000 requests in flight)
    // would shed the last one, and the storm would wait for it in vain.
    let limits = scratch.join("storm.toml");
    let room = args.storm + 100;
    std::fs::write(
        &limits,
        format!("max_in_flight = {room}\nmax_connections = {room}\n"),
    )
    .unwrap();
    let limits = limits.display().to_string();
    for (name, store, redis) in stores {
        calls.store(0, Ordering::SeqCst);
        let flags = ["--hold-timeout", "120s", "--config", &limits];
        let gateway = Gateway::start(&args.binary, &upstream, store, redis, &flags).await;
        let idle = rss_kib(gateway.pid);
        let key = format!("storm-{}-{}", name.len(), std::process::id());
        let first = tokio::spawn(timed(gateway.url.clone(), key.clone()));
        while calls.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut holders = Vec::with_capacity(args.storm);
        for i in 0..args.storm {
            holders.push(tokio::spawn(timed(gateway.url.clone(), key.clone())));
            if i % 500 == 499 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        while gateway.metric("idemgate_held_requests").await < args.storm as f64
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let held_rss = rss_kib(gateway.pid);
        let answered = Instant::now();
        let (gateway_cpu, client_cpu) = (cpu_us(&[gateway.pid]), cpu_us(&[std::process::id()]));
        gate.notify_one();
        let _ = first.await;
        let mut releases: Vec<f64> = Vec::new();
        let mut open = Vec::with_capacity(args.storm);
        for h in holders {
            if let Ok(Some((done, connection))) = h.await {
                releases.push(done.saturating_duration_since(answered).as_secs_f64() * 1000.0);
                open.push(connection);
            }
        }
        // For a profile of the release alone (`perf record -k CLOCK_MONOTONIC`,
        // then `perf script --time`): the window on the system's clock.
        eprintln!(
            "{name}: release window {:.2},{:.2} (seconds since boot)",
            uptime() - answered.elapsed().as_secs_f64(),
            uptime()
        );
        // Where the release's time goes: the gateway's CPU and this load
        // generator's, which share the machine's cores.
        let gateway_cpu = (cpu_us(&[gateway.pid]) - gateway_cpu) / 1000.0;
        let client_cpu = (cpu_us(&[std::process::id()]) - client_cpu) / 1000.0;
        drop(open);
        releases.sort_by(|a, b| a.total_cmp(b));
        let pct = |p: f64| {
            releases
                .get(((releases.len() as f64 * p) as usize).min(releases.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0.0)
        };
        out.push_str(&format!(
            "| {name} | {} answered of {} | {} | {:.0} | {:.0} | {:.0} | {:.1} | {gateway_cpu:.0} / {client_cpu:.0} |\n",
            releases.len(),
            args.storm,
            calls.load(Ordering::SeqCst),
            pct(0.5),
            pct(0.99),
            releases.last().copied().unwrap_or(0.0),
            (held_rss.saturating_sub(idle)) as f64 / args.storm as f64,
        ));
    }
    out
}

/// One keyed request; when it was answered (200), or `None`, and the
/// connection, still open. Written and read on a bare socket and kept
/// alive, as wrk does: the storm's load generator shares the cores with the
/// gateway, so the less it spends per holder the more the release measures
/// the gateway's answering (not the teardown of 10,000 connections, which
/// a client closing each at once would add to the window).
async fn timed(url: String, key: String) -> Option<(Instant, tokio::net::TcpStream)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = url.strip_prefix("http://")?;
    let body = "{\"amount\": 1000}";
    let request = format!(
        "POST /v1/charges HTTP/1.1\r\nhost: {addr}\r\nidempotency-key: {key}\r\n\
         authorization: Bearer bench-client\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut buf = Vec::with_capacity(1024);
        loop {
            if stream.read_buf(&mut buf).await.ok()? == 0 {
                return None;
            }
            let Some(head) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                continue;
            };
            let text = std::str::from_utf8(&buf[..head]).ok()?;
            let length: usize = text
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().ok())?
                })
                .unwrap_or(0);
            if buf.len() >= head + 4 + length {
                let ok = text.starts_with("HTTP/1.1 200");
                return ok.then(|| (Instant::now(), stream));
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(180), exchange)
        .await
        .ok()?
}

/// Seconds since boot, to 10 ms.
fn uptime() -> f64 {
    std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// An upstream whose answers wait for `gate`; counts its calls.
async fn gated_upstream(gate: Arc<Notify>) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (gate, calls) = (gate.clone(), counted.clone());
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |_req: Request<hyper::body::Incoming>| {
                        let (gate, calls) = (gate.clone(), calls.clone());
                        async move {
                            calls.fetch_add(1, Ordering::SeqCst);
                            gate.notified().await;
                            Ok::<_, std::convert::Infallible>(Response::new(Full::new(
                                Bytes::from_static(b"{\"charged\":true}"),
                            )))
                        }
                    });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (format!("http://{addr}"), calls)
}

async fn prime(url: &str, keys: usize) {
    for k in 0..keys {
        let status = send(url, Some(&format!("replay-{k}"))).await;
        assert_eq!(status, 200, "priming {url}");
    }
}

async fn send(url: &str, key: Option<&str>) -> u16 {
    let c = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut req = Request::post(format!("{url}/v1/charges"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer bench-client");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    let req = req
        .body(Full::new(Bytes::from_static(b"{\"amount\": 1000}")))
        .unwrap();
    match c.request(req).await {
        Ok(r) => {
            let status = r.status().as_u16();
            let _ = r.into_body().collect().await;
            status
        }
        Err(_) => 0,
    }
}

async fn flush_redis(url: &str) {
    let mut redis = redis::Client::open(url)
        .expect("Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("Redis is not reachable; run scripts/bench.sh, which starts it");
    redis::cmd("FLUSHDB")
        .query_async::<()>(&mut redis)
        .await
        .expect("flush");
}

/// An nginx of the bench's own, in a folder of its own, on a free port.
struct Nginx {
    url: String,
    child: Child,
}

/// The floor example serving on a free port, killed when dropped.
struct Floor {
    url: String,
    pid: u32,
    _child: Child,
}

impl Floor {
    async fn start(binary: &str, mode: &str, upstream: &str) -> Floor {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let child = Command::new(binary)
            .args([mode, &addr.to_string(), upstream])
            .kill_on_drop(true)
            .spawn()
            .expect("start the floor example (scripts/bench.sh builds it)");
        for _ in 0..200 {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        Floor {
            url: format!("http://{addr}"),
            pid: child.id().unwrap_or(0),
            _child: child,
        }
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // A fast shutdown of the master takes its workers with it (a kill
        // would orphan them).
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
    }
}

impl Nginx {
    async fn upstream(dir: &Path) -> Nginx {
        Self::start(
            dir,
            "location / { default_type application/json; return 200 '{\"charge\":1,\"status\":\"succeeded\",\"amount\":1000}'; }",
            "",
        )
        .await
    }

    async fn proxy(dir: &Path, upstream: &str) -> Nginx {
        Self::start(
            dir,
            "location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection \"\"; }",
            &format!(
                "upstream backend {{ server {}; keepalive 64; }}",
                upstream.trim_start_matches("http://")
            ),
        )
        .await
    }

    async fn start(dir: &Path, location: &str, http_extra: &str) -> Nginx {
        std::fs::create_dir_all(dir.join("logs")).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let conf = format!(
            "daemon off; worker_processes 1; pid {dir}/nginx.pid; error_log {dir}/logs/error.log warn;\n\
             events {{ worker_connections 20000; }}\n\
             http {{ access_log off; keepalive_requests 1000000; client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy;\n\
             {http_extra}\n\
             server {{ listen 127.0.0.1:{port}; {location} }} }}\n",
            dir = dir.display()
        );
        let path = dir.join("nginx.conf");
        std::fs::write(&path, conf).unwrap();
        let child = Command::new("nginx")
            .arg("-c")
            .arg(&path)
            .arg("-p")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nginx is not installed; run scripts/bench.sh, which installs it");
        let url = format!("http://127.0.0.1:{port}");
        for _ in 0..200 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        Nginx { url, child }
    }

    /// The master and its worker.
    fn pids(&self) -> Vec<u32> {
        let master = self.child.id().unwrap_or(0);
        let mut pids = vec![master];
        if let Ok(children) =
            std::fs::read_to_string(format!("/proc/{master}/task/{master}/children"))
        {
            pids.extend(
                children
                    .split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
        pids
    }
}
