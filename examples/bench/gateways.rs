//! The idemgate processes the main table loads, one per configuration it
//! measures, all in front of the same upstream and on the same database.

use std::path::Path;

use crate::args::Args;
use crate::client::{prime, send};
use crate::harness::{Gateway, Store};

/// The gateways of the main table, killed when dropped.
pub struct Gateways {
    pub default: Gateway,
    pub one_thread: Gateway,
    pub logging: Gateway,
    pub redis: Gateway,
    pub postgres: Gateway,
    /// PostgreSQL alone on one worker thread: where the replay from the
    /// database is measured without the hand-offs between threads.
    pub postgres_one_thread: Gateway,
    /// PostgreSQL alone, each worker thread a runtime of its own
    /// (`worker_runtime = "per_thread"`).
    pub postgres_per_thread: Gateway,
    /// The deployed gateway (PostgreSQL + Redis), a runtime per thread.
    pub per_thread: Gateway,
    pub embedded: Gateway,
    pub access_log: Gateway,
}

impl Gateways {
    /// Starts them in front of `upstream`, on the database `db`, their files
    /// in `scratch`.
    pub async fn start(args: &Args, upstream: &str, db: &str, scratch: &Path) -> Gateways {
        let [default, redis, postgres, postgres_one_thread, postgres_per_thread, embedded] =
            per_store(args, upstream, db, scratch).await;
        let [one_thread, per_thread, logging, access_log] =
            per_setting(args, upstream, db, scratch).await;
        Gateways {
            default,
            one_thread,
            logging,
            redis,
            postgres,
            postgres_one_thread,
            postgres_per_thread,
            per_thread,
            embedded,
            access_log,
        }
    }

    /// Primes the replayed keys, so that the replay rows find them finished.
    pub async fn fill(&self) {
        for g in [&self.redis, &self.postgres, &self.embedded] {
            prime(&g.url, 200).await;
        }
        // Every key replayed once fills Redis, and the default gateways' memory.
        for k in 0..200 {
            let _ = send(&self.redis.url, Some(&format!("replay-{k}"))).await;
            let _ = send(&self.default.url, Some(&format!("replay-{k}"))).await;
            let _ = send(&self.one_thread.url, Some(&format!("replay-{k}"))).await;
        }
    }
}

/// The gateway as deployed, then one per store with the replay cache off.
async fn per_store(args: &Args, upstream: &str, db: &str, scratch: &Path) -> [Gateway; 6] {
    // The gateway as deployed (PostgreSQL + Redis, the defaults), and one
    // per store with the replay cache off, so their replay rows measure
    // Redis, PostgreSQL and the embedded store themselves.
    let memory_off = scratch.join("memory-off.toml");
    std::fs::write(&memory_off, "replay_cache_size = 0\n").unwrap();
    let memory_off = memory_off.display().to_string();
    let off = ["--config", memory_off.as_str()];
    let default = Gateway::start(
        &args.binary,
        upstream,
        Store::Postgres(db),
        Some(&args.redis),
        &[],
    )
    .await;
    let redis = Gateway::start(
        &args.binary,
        upstream,
        Store::Postgres(db),
        Some(&args.redis),
        &off,
    )
    .await;
    let postgres = Gateway::start(&args.binary, upstream, Store::Postgres(db), None, &off).await;
    let off_one_thread = [off[0], off[1], "--worker-threads", "1"];
    let postgres_one_thread = Gateway::start(
        &args.binary,
        upstream,
        Store::Postgres(db),
        None,
        &off_one_thread,
    )
    .await;
    let embedded = Gateway::start(
        &args.binary,
        upstream,
        Store::Embedded(&scratch.join("bench.db")),
        None,
        &off,
    )
    .await;
    let off_per_thread = [off[0], off[1], "--worker-runtime", "per_thread"];
    let postgres_per_thread = Gateway::start(
        &args.binary,
        upstream,
        Store::Postgres(db),
        None,
        &off_per_thread,
    )
    .await;
    [
        default,
        redis,
        postgres,
        postgres_one_thread,
        postgres_per_thread,
        embedded,
    ]
}

/// The deployed gateway on one worker thread, at the default log level, and
/// with the access log on.
async fn per_setting(args: &Args, upstream: &str, db: &str, scratch: &Path) -> [Gateway; 4] {
    // The default gateway on one thread (nginx's reference runs one worker
    // too), and at the default log level (`info`; the others run at `warn`).
    let one_thread = Gateway::start(
        &args.binary,
        upstream,
        Store::Postgres(db),
        Some(&args.redis),
        &["--worker-threads", "1"],
    )
    .await;
    // The default gateway with a runtime per worker thread.
    let per_thread = Gateway::start(
        &args.binary,
        upstream,
        Store::Postgres(db),
        Some(&args.redis),
        &["--worker-runtime", "per_thread"],
    )
    .await;
    // The access log (off by default) writes a line per request at `info`:
    // off in the row that measures the level alone, on in the row that
    // measures it, its lines to a file as a deployment's go to a file or a
    // collector. The other gateways run at `warn`, which filters it out.
    let logging = Gateway::start_env(
        &args.binary,
        upstream,
        Store::Postgres(db),
        Some(&args.redis),
        &["--access-log", "false"],
        &[("RUST_LOG", "info")],
    )
    .await;
    let access_log = Gateway::start_logging(
        &args.binary,
        upstream,
        Store::Postgres(db),
        Some(&args.redis),
        &["--access-log", "true"],
        &[("RUST_LOG", "info")],
        Some(&scratch.join("access.log")),
    )
    .await;
    [one_thread, per_thread, logging, access_log]
}

/// The gateways of another build (`--baseline`): as deployed, with
/// PostgreSQL and Redis, and on PostgreSQL alone, killed when dropped.
/// They serve the low-load rows, one new-key row and the replay row from
/// PostgreSQL alone. Their pools (the default size) open connections as
/// load needs them, a few for a batch or two on their way, within the
/// run's own PostgreSQL (`scripts/bench.sh` starts it with
/// `max_connections = 300`).
pub struct Baseline {
    pub redis: Gateway,
    pub postgres: Gateway,
    /// Its database, apart from this build's.
    pub db: String,
}

impl Baseline {
    pub async fn start(
        binary: &str,
        args: &Args,
        upstream: &str,
        db: &str,
        scratch: &Path,
    ) -> Baseline {
        let memory_off = scratch.join("baseline-memory-off.toml");
        std::fs::write(&memory_off, "replay_cache_size = 0\n").unwrap();
        let memory_off = memory_off.display().to_string();
        let off = ["--config", memory_off.as_str()];
        Baseline {
            redis: Gateway::start(
                binary,
                upstream,
                Store::Postgres(db),
                Some(&args.redis),
                &[],
            )
            .await,
            postgres: Gateway::start(binary, upstream, Store::Postgres(db), None, &off).await,
            db: db.to_owned(),
        }
    }
}
