//! The main table's rows, by scenario: the reference servers, then
//! idemgate passing requests through, replaying finished keys, and taking
//! new keys. Their order is the table's.

use crate::gateways::Gateways;
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

pub struct Row {
    pub name: String,
    pub url: String,
    pub load: Load,
    /// Processes whose CPU time the row is charged.
    pub pids: Vec<u32>,
    /// Compared with nginx (true) or with the pgbench ceiling (false).
    pub vs_nginx: bool,
    pub rounds: Vec<Round>,
}

pub fn row(name: &str, url: &str, load: Load, pids: Vec<u32>, vs_nginx: bool) -> Row {
    Row {
        name: name.into(),
        url: url.into(),
        load,
        pids,
        vs_nginx,
        rounds: Vec::new(),
    }
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
    ]
}

/// idemgate passing keyless requests through: as deployed, on one worker
/// thread, at the default log level, and with the access log on.
pub fn pass_through(g: &Gateways) -> Vec<Row> {
    vec![
        row(
            "idemgate pass-through (no key; logs at warn: access log off)",
            &g.default.url,
            Load::Plain,
            vec![g.default.pid],
            true,
        ),
        row(
            "idemgate pass-through, one worker thread (access log off)",
            &g.one_thread.url,
            Load::Plain,
            vec![g.one_thread.pid],
            true,
        ),
        row(
            "idemgate pass-through, logs at info (the default level), access log off",
            &g.logging.url,
            Load::Plain,
            vec![g.logging.pid],
            true,
        ),
        row(
            "idemgate pass-through, access log on (logs at info, to a file)",
            &g.access_log.url,
            Load::Plain,
            vec![g.access_log.pid],
            true,
        ),
    ]
}

/// Replays of finished keys, from each place a replay can come from.
pub fn replays(g: &Gateways) -> Vec<Row> {
    vec![
        row(
            "idemgate replay, from memory (the default)",
            &g.default.url,
            Load::Replay { keys: 200 },
            vec![g.default.pid],
            true,
        ),
        row(
            "idemgate replay, from memory, one worker thread",
            &g.one_thread.url,
            Load::Replay { keys: 200 },
            vec![g.one_thread.pid],
            true,
        ),
        row(
            "idemgate replay, Redis (memory off)",
            &g.redis.url,
            Load::Replay { keys: 200 },
            vec![g.redis.pid],
            true,
        ),
        row(
            "idemgate replay, PostgreSQL alone (memory off)",
            &g.postgres.url,
            Load::Replay { keys: 200 },
            vec![g.postgres.pid],
            true,
        ),
        row(
            "idemgate replay, embedded store (memory off)",
            &g.embedded.url,
            Load::Replay { keys: 200 },
            vec![g.embedded.pid],
            true,
        ),
    ]
}

/// A new key per request, measured against the pgbench ceiling.
pub fn new_keys(g: &Gateways) -> Vec<Row> {
    vec![
        row(
            "idemgate new key, PostgreSQL + Redis",
            &g.default.url,
            Load::NewKey,
            vec![g.default.pid],
            false,
        ),
        row(
            "idemgate new key, PostgreSQL + Redis, one worker thread",
            &g.one_thread.url,
            Load::NewKey,
            vec![g.one_thread.pid],
            false,
        ),
        row(
            "idemgate new key, embedded store",
            &g.embedded.url,
            Load::NewKey,
            vec![g.embedded.pid],
            false,
        ),
    ]
}
