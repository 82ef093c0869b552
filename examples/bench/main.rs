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
//! (PostgreSQL + Redis, PostgreSQL alone, embedded; at the run's load and
//! at a low one), beside a `--baseline` build's if given; the pgbench
//! ceilings of the statements a new key needs (durable, and with cheap
//! commits) and of a replay's read, run in every round; a duplicate storm (thousands of holders of one key); and
//! the first byte of streamed answers. Load comes from `wrk` (1 thread);
//! each row is the median of `--rounds` rounds of `--seconds`, rounds
//! alternating between rows (odd rounds run them backwards). CPU µs per
//! request is the serving processes' user + system time over the requests
//! answered.
//!
//! Loopback only, bounded in time, stops by itself. `scripts/bench.sh`
//! installs what is missing, builds, and runs it.
//!
//! The parts: `args` (the flags), `servers` (nginx and the floor, the
//! reference servers), `gateways` (the idemgate processes the main table
//! loads), `rows` (its rows, by scenario), `wrk` (a round of load),
//! `pgbench` (the ceilings), `table` (the main table), `scale_out`
//! and `storm` (the two tables after it), `usage` (CPU and memory, from
//! /proc), and `client` (priming keys, emptying Redis).

#[path = "../harness/mod.rs"]
mod harness;

mod args;
mod client;
mod gateways;
mod pgbench;
mod rows;
mod scale_out;
mod servers;
mod storm;
mod table;
mod usage;
mod wrk;

use client::{flush_redis, prime};
use gateways::{Baseline, Gateways};
use harness::{create_database, create_database_for, drop_database, Gateway, Store};
use servers::{Floor, Nginx};

#[tokio::main]
async fn main() {
    let args = args::args();
    let scratch = std::env::temp_dir().join(format!("idemgate-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let scripts = wrk::write_wrk_scripts(&scratch);

    let upstream = Nginx::upstream(&scratch.join("upstream")).await;
    let nginx_a = Nginx::proxy(&scratch.join("nginx-a"), &upstream.url).await;
    let nginx_b = Nginx::proxy(&scratch.join("nginx-b"), &upstream.url).await;
    let db = create_database(&args.database).await;
    flush_redis(&args.redis).await;
    let gateways = Gateways::start(&args, &upstream.url, &db, &scratch).await;
    let floor_two = Floor::start(&args.floor, "mt2", &upstream.url).await;
    let floor_one = Floor::start(&args.floor, "ct", &upstream.url).await;
    gateways.fill().await;

    let mut rows = rows::references(&upstream, &nginx_a, &nginx_b, &floor_two, &floor_one);
    rows.extend(rows::pass_through(&gateways));
    rows.extend(rows::replays(&gateways));
    // A database of its own: another build may know other migrations.
    let baseline = match &args.baseline {
        Some(binary) => {
            let db = create_database_for(&args.database, "_baseline").await;
            Some(Baseline::start(binary, &args, &upstream.url, &db, &scratch).await)
        }
        None => None,
    };
    if let Some(b) = &baseline {
        prime(&b.postgres.url, 200).await;
        rows.push(rows::baseline_replay(b));
    }
    rows.extend(rows::new_keys(&gateways, baseline.as_ref()));
    let busy = Nginx::busy(&scratch.join("nginx-busy")).await;
    let failover = Gateway::start(
        &args.binary,
        &busy.url,
        Store::Postgres(&db),
        None,
        &["--upstream", upstream.url.as_str()],
    )
    .await;
    rows.push(rows::failover(&failover));
    if let Some(only) = &args.only {
        rows.retain(|r| r.name.contains(only.as_str()) || r.name.starts_with("nginx"));
    }
    let against_ceilings = rows.iter().any(|r| r.versus != rows::Versus::Nginx);
    let mut ceilings = Vec::new();
    for round in 0..args.rounds {
        // Alternating: odd rounds run the rows backwards, so no row always
        // runs first, or always right after the ceilings' writes (and the
        // autovacuum they set off), and rows compared side by side (a
        // build and its baseline) trade places.
        let mut order: Vec<usize> = (0..rows.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let r = &mut rows[i];
            let result = wrk::wrk(&args, &scripts, r, round * 100 + i).await;
            r.rounds.push(result);
        }
        if against_ceilings {
            ceilings.push(pgbench::ceilings(&args, &db).await);
        }
    }
    table::print(&args, &rows, &pgbench::median(&ceilings));

    if !args.replicas.is_empty() {
        let table = scale_out::scale_out(&args, &scripts, &upstream.url, &db).await;
        println!();
        println!("{table}");
    }
    if args.storm > 0 {
        let storm = storm::storm(&args, &scratch, &db).await;
        println!();
        println!("{storm}");
    }
    let baseline_db = baseline.as_ref().map(|b| b.db.clone());
    drop((
        gateways, baseline, failover, busy, floor_two, floor_one, nginx_a, nginx_b, upstream,
    ));
    drop_database(&args.database, &db).await;
    if let Some(db) = baseline_db {
        drop_database(&args.database, &db).await;
    }
    let _ = std::fs::remove_dir_all(&scratch);
}
