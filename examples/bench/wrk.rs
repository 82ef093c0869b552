//! A round of load from `wrk`: its Lua scripts, the run, and its report
//! read back into a [`Round`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tokio::process::Command;

use crate::args::Args;
use crate::rows::{Load, Round, Row};
use crate::usage::cpu_us;

/// The wrk scripts: a POST without a key, with one of N keys, with a new
/// key each time (a prefix per round keeps rounds apart).
pub fn write_wrk_scripts(dir: &Path) -> BTreeMap<&'static str, PathBuf> {
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

/// One round of `row`'s load over its connections (the run's, unless it
/// has its own).
pub async fn wrk(args: &Args, scripts: &BTreeMap<&str, PathBuf>, row: &Row, round: usize) -> Round {
    let connections = row.connections.unwrap_or(args.connections);
    wrk_with(connections, args, scripts, row, round).await
}

/// One round of `row`'s load over `connections` connections, for
/// `args.seconds`, and the CPU time its processes spent per request.
pub async fn wrk_with(
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
