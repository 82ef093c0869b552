//! The scale-out table: replicas side by side on one database.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::args::Args;
use crate::client::{flush_redis, prime, send};
use crate::harness::{Gateway, Store};
use crate::rows::{row, Load, Row, Versus};
use crate::wrk::wrk_with;

/// Replicas side by side on one PostgreSQL and one Redis: new keys and
/// replays with each count of `args.replicas`, the load split evenly (one
/// wrk per replica, all started together, `args.connections` in all), and
/// the database connections they hold once loaded.
pub async fn scale_out(
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
                .map(|g| row(name, &g.url, load.clone(), vec![g.pid], Versus::Nginx))
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
