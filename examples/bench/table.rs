//! The main table: each row's median over its rounds, beside nginx (or,
//! for new keys, beside the pgbench ceiling).

use crate::args::Args;
use crate::rows::{Round, Row};

/// Prints the main table of `rows`, their new keys measured against
/// `ceiling` (pgbench's transactions per second).
pub fn print(args: &Args, rows: &[Row], ceiling: f64) {
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
    for r in rows {
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
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
