//! The main table's rows, by scenario: the reference servers, then
//! idemgate passing requests through, replaying finished keys, and taking
//! new keys. Their order is the table's.

use crate::gateways::{Baseline, Gateways};
use crate::harness::Gateway;
use crate::servers::{Floor, Nginx};

/// A wrk round's result.
#[derive(Debug, Clone, Default)]
pub struct Round {
    pub rps: f64,
    pub p50: f64,
    pub p99: f64,
    pub cpu_us: f64,
    pub errors: u64,
}

/// What a row loads, and how.
#[derive(Clone)]
pub enum Load {
    /// POST without a key.
    Plain,
    /// POST with one of `keys` fixed keys (replays).
    Replay { keys: usize },
    /// POST with a new key each time.
    NewKey,
}

/// What a row's req/s is compared with.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Versus {
    Nginx,
    /// pgbench running a new key's statements one by one (durable commits).
    NewKeyCeiling,
    /// nginx, and pgbench running the replay's read.
    ReplayCeiling,
}

pub struct Row {
    pub name: String,
    pub url: String,
    pub load: Load,
    /// Processes whose CPU time the row is charged.
    pub pids: Vec<u32>,
    pub versus: Versus,
    /// Its own number of connections (the low-load rows), or the run's.
    pub connections: Option<usize>,
    pub rounds: Vec<Round>,
}

pub fn row(name: &str, url: &str, load: Load, pids: Vec<u32>, versus: Versus) -> Row {
    Row {
        name: name.into(),
        url: url.into(),
        load,
        pids,
        versus,
        connections: None,
        rounds: Vec::new(),
    }
}

/// A row served by one idemgate process, charged its CPU.
fn served(name: &str, gateway: &Gateway, load: Load, versus: Versus) -> Row {
    row(name, &gateway.url, load, vec![gateway.pid], versus)
}

/// The upstream alone, nginx as the reference proxy (an A/A pair), and the
/// floor under idemgate.
pub fn references(
    upstream: &Nginx,
    nginx_a: &Nginx,
    nginx_b: &Nginx,
    floor_two: &Floor,
    floor_one: &Floor,
) -> Vec<Row> {
    vec![
        row(
            "upstream alone (nginx, fixed answer)",
            &upstream.url,
            Load::Plain,
            upstream.pids(),
            Versus::Nginx,
        ),
        row(
            "nginx proxy A",
            &nginx_a.url,
            Load::Plain,
            nginx_a.pids(),
            Versus::Nginx,
        ),
        row(
            "nginx proxy B (A/A: the run's noise)",
            &nginx_b.url,
            Load::Plain,
            nginx_b.pids(),
            Versus::Nginx,
        ),
        row(
            "floor: hyper server + the gateway's pool, no layers, two threads",
            &floor_two.url,
            Load::Plain,
            vec![floor_two.pid],
            Versus::Nginx,
        ),
        row(
            "floor: the same on one thread",
            &floor_one.url,
            Load::Plain,
            vec![floor_one.pid],
            Versus::Nginx,
        ),
    ]
}

/// idemgate passing keyless requests through: as deployed, on one worker
/// thread, at the default log level, and with the access log on.
pub fn pass_through(g: &Gateways) -> Vec<Row> {
    vec![
        served(
            "idemgate pass-through (no key; logs at warn: access log off)",
            &g.default,
            Load::Plain,
            Versus::Nginx,
        ),
        served(
            "idemgate pass-through, one worker thread (access log off)",
            &g.one_thread,
            Load::Plain,
            Versus::Nginx,
        ),
        served(
            "idemgate pass-through, logs at info (the default level), access log off",
            &g.logging,
            Load::Plain,
            Versus::Nginx,
        ),
        served(
            "idemgate pass-through, access log on (logs at info, to a file)",
            &g.access_log,
            Load::Plain,
            Versus::Nginx,
        ),
    ]
}

/// Replays of finished keys, from each place a replay can come from.
pub fn replays(g: &Gateways) -> Vec<Row> {
    vec![
        served(
            "idemgate replay, from memory (the default)",
            &g.default,
            Load::Replay { keys: 200 },
            Versus::Nginx,
        ),
        served(
            "idemgate replay, from memory, one worker thread",
            &g.one_thread,
            Load::Replay { keys: 200 },
            Versus::Nginx,
        ),
        served(
            "idemgate replay, Redis (memory off)",
            &g.redis,
            Load::Replay { keys: 200 },
            Versus::Nginx,
        ),
        served(
            "idemgate replay, PostgreSQL alone (memory off)",
            &g.postgres,
            Load::Replay { keys: 200 },
            Versus::ReplayCeiling,
        ),
        served(
            "idemgate replay, PostgreSQL alone (memory off), one worker thread",
            &g.postgres_one_thread,
            Load::Replay { keys: 200 },
            Versus::ReplayCeiling,
        ),
        served(
            "idemgate replay, PostgreSQL alone (memory off), a runtime per thread",
            &g.postgres_per_thread,
            Load::Replay { keys: 200 },
            Versus::ReplayCeiling,
        ),
        served(
            "idemgate replay, embedded store (memory off)",
            &g.embedded,
            Load::Replay { keys: 200 },
            Versus::Nginx,
        ),
    ]
}

/// The `--baseline` build's replays from PostgreSQL alone, beside this
/// build's row of the same name (its own database, primed the same way).
pub fn baseline_replay(b: &Baseline) -> Row {
    served(
        "baseline replay, PostgreSQL alone (memory off)",
        &b.postgres,
        Load::Replay { keys: 200 },
        Versus::ReplayCeiling,
    )
}

/// A new key per request, measured against the pgbench ceiling: at the
/// run's load, and at a low one (8 connections), where batching must not
/// add latency; beside the low-load rows of a `--baseline` build, if given.
pub fn new_keys(g: &Gateways, baseline: Option<&Baseline>) -> Vec<Row> {
    let new_key = |name: &str, gateway: &Gateway, connections| Row {
        connections,
        ..served(name, gateway, Load::NewKey, Versus::NewKeyCeiling)
    };
    let mut rows = vec![
        new_key("idemgate new key, PostgreSQL + Redis", &g.default, None),
        new_key(
            "idemgate new key, PostgreSQL + Redis, one worker thread",
            &g.one_thread,
            None,
        ),
        new_key("idemgate new key, PostgreSQL alone", &g.postgres, None),
        new_key(
            "idemgate new key, PostgreSQL alone, one worker thread",
            &g.postgres_one_thread,
            None,
        ),
        new_key(
            "idemgate new key, PostgreSQL + Redis, a runtime per thread",
            &g.per_thread,
            None,
        ),
        new_key(
            "idemgate new key, PostgreSQL alone, a runtime per thread",
            &g.postgres_per_thread,
            None,
        ),
        new_key("idemgate new key, embedded store", &g.embedded, None),
        new_key(
            "idemgate new key, PostgreSQL + Redis, low load (8 connections)",
            &g.default,
            Some(8),
        ),
        new_key(
            "idemgate new key, PostgreSQL alone, low load (8 connections)",
            &g.postgres,
            Some(8),
        ),
        new_key(
            "idemgate new key, PostgreSQL + Redis, a runtime per thread, low load (8 connections)",
            &g.per_thread,
            Some(8),
        ),
    ];
    if let Some(b) = baseline {
        rows.extend([
            new_key(
                "baseline new key, PostgreSQL + Redis, low load (8 connections)",
                &b.redis,
                Some(8),
            ),
            new_key(
                "baseline new key, PostgreSQL alone, low load (8 connections)",
                &b.postgres,
                Some(8),
            ),
            // At full load too, beside this build's row of the same name.
            new_key("baseline new key, PostgreSQL alone", &b.postgres, None),
        ]);
    }
    rows
}

/// A new key per request whose first attempt fails (its primary answers
/// `503`) and whose second runs on the fallback: the path of the
/// non-batched changes, each in the transaction holding its job's lock
/// (`docs/performance.md`, item 36).
pub fn failover(gateway: &Gateway) -> Row {
    served(
        "idemgate new key, PostgreSQL alone, every key failing over (primary answers 503)",
        gateway,
        Load::NewKey,
        Versus::NewKeyCeiling,
    )
}
