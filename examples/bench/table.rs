//! The main table: each row's median over its rounds, beside nginx (or,
//! for the database rows, beside the pgbench ceilings of their statements).

use crate::args::Args;
use crate::pgbench::Ceilings;
use crate::rows::{Round, Row, Versus};

/// Prints the main table of `rows`, the database rows measured against
/// `ceilings` (each the median of the rounds').
pub fn print(args: &Args, rows: &[Row], ceilings: &Ceilings) {
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
        "wrk, 1 thread, {} connections (unless a row says otherwise), {} s rounds, median of {}; \
         one upstream (nginx, fixed JSON answer); nginx 1 worker as the reference proxy; \
         odd rounds run the rows backwards; the pgbench ceilings run in every round, after its rows",
        args.connections, args.seconds, args.rounds
    );
    println!();
    println!(
        "| scenario | req/s | p50 ms | p99 ms | vs nginx (or ceiling) | CPU µs/req | errors |"
    );
    println!("|---|--:|--:|--:|--:|--:|--:|");
    for r in rows {
        let rps = median(r.rounds.iter().map(|x| x.rps).collect());
        let ratio = match r.versus {
            Versus::Nginx => format!("{:.2}× nginx", rps / nginx_rps),
            Versus::NewKeyCeiling => format!(
                "{:.2}× ceiling ({:.2}× with cheap commits)",
                rps / ceilings.new_key.max(1.0),
                rps / ceilings.new_key_cheap_commits.max(1.0)
            ),
            Versus::ReplayCeiling => format!(
                "{:.2}× nginx, {:.2}× read ceiling",
                rps / nginx_rps,
                rps / ceilings.replay_read.max(1.0)
            ),
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
    let clients = args.connections;
    println!(
        "| pgbench ceiling: a new key's statements one by one (insert job, insert attempt, CAS commit), {clients} clients | {:.0} tx/s | | | 1.00× | | |",
        ceilings.new_key
    );
    println!(
        "| pgbench ceiling: the same, synchronous_commit = off (cheap commits), {clients} clients | {:.0} tx/s | | | | | |",
        ceilings.new_key_cheap_commits
    );
    println!(
        "| pgbench ceiling: a replay's read (a finished job's row by owner and key), {clients} clients | {:.0} tx/s | | | | | |",
        ceilings.replay_read
    );
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
