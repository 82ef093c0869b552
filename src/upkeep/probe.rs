//! Proving upstreams before trusting them: a contract's probes are run
//! against the upstreams of every route that names it, at start-up and
//! every `probe_interval`, and the [`ProbeBoard`] says which upstreams may be
//! failover or hedge targets. An upstream never probed, or whose last probe
//! run failed, is not eligible; the primary is always tried regardless.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use http::Request;
use tokio::sync::watch;

use crate::config::{Route, UpstreamId, UpstreamSettings};
use crate::domain::contract::{excerpt, Contract, Probe};
use crate::proxy::http::full;
use crate::proxy::upstream::{fetch, Upstream, Upstreams};
use crate::upkeep::supervise::Heartbeat;
use crate::BoxError;

/// One probe's result.
#[derive(Debug, Clone)]
pub struct ProbeResult {
    /// The upstream probed.
    pub upstream: String,
    /// The contract.
    pub contract: String,
    /// The probe.
    pub probe: String,
    /// Why it failed, if it did.
    pub failure: Option<String>,
}

/// The last verdict for one upstream under one contract.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// Every probe passed.
    pub passed: bool,
    /// When the probes ran.
    pub checked_at: SystemTime,
    /// The failed probes and why.
    pub failures: Vec<(String, String)>,
}

/// Who passed which contract's probes, last time they ran.
#[derive(Debug, Default)]
pub struct ProbeBoard {
    verdicts: RwLock<BTreeMap<(String, String), Verdict>>,
}

impl ProbeBoard {
    /// Whether `upstream` may be a failover or hedge target on a route with
    /// `contract` (any upstream may, on a route without one).
    pub fn eligible(&self, upstream: &str, contract: Option<&Contract>) -> bool {
        let Some(contract) = contract else {
            return true;
        };
        self.read()
            .get(&(upstream.to_owned(), contract.name.clone()))
            .is_some_and(|v| v.passed)
    }

    /// Every verdict, by (upstream, contract).
    pub fn snapshot(&self) -> BTreeMap<(String, String), Verdict> {
        self.read().clone()
    }

    fn record(&self, results: &[ProbeResult]) {
        let mut grouped: BTreeMap<(String, String), Vec<&ProbeResult>> = BTreeMap::new();
        for r in results {
            grouped
                .entry((r.upstream.clone(), r.contract.clone()))
                .or_default()
                .push(r);
        }
        let mut verdicts = self.verdicts.write().unwrap_or_else(|e| e.into_inner());
        for (pair, results) in grouped {
            let failures: Vec<(String, String)> = results
                .iter()
                .filter_map(|r| r.failure.clone().map(|f| (r.probe.clone(), f)))
                .collect();
            let passed = failures.is_empty();
            metrics::gauge!("idemgate_upstream_probes_passing",
                "upstream" => pair.0.clone(), "contract" => pair.1.clone())
            .set(f64::from(u8::from(passed)));
            let was = verdicts.get(&pair).map(|v| v.passed);
            if was != Some(passed) {
                if passed {
                    tracing::info!(upstream = %pair.0, contract = %pair.1, "upstream passes its contract's probes; eligible for failover");
                } else {
                    tracing::warn!(upstream = %pair.0, contract = %pair.1, failures = ?failures, "upstream fails its contract's probes; not a failover target");
                }
            }
            verdicts.insert(
                pair,
                Verdict {
                    passed,
                    checked_at: SystemTime::now(),
                    failures,
                },
            );
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<(String, String), Verdict>> {
        self.verdicts.read().unwrap_or_else(|e| e.into_inner())
    }
}

/// What the probe task checks, and how often.
#[derive(Debug, Clone)]
pub struct Config {
    /// How often every pair is probed.
    pub interval: Duration,
    /// The (upstream, contract) pairs the routes rely on, each once.
    pub pairs: Vec<(UpstreamId, Arc<Contract>)>,
}

impl Config {
    /// Probes every `interval` what `routes` rely on: each upstream a route
    /// may use, against the route's contract.
    pub fn of_routes(routes: &[Arc<Route>], interval: Duration) -> Config {
        let mut pairs: BTreeMap<(UpstreamId, String), Arc<Contract>> = BTreeMap::new();
        for route in routes {
            let Some(contract) = &route.contract else {
                continue;
            };
            for upstream in route.upstreams() {
                let pair = (upstream.id.clone(), contract.name.clone());
                pairs.entry(pair).or_insert_with(|| contract.clone());
            }
        }
        Config {
            interval,
            pairs: pairs.into_iter().map(|((id, _), c)| (id, c)).collect(),
        }
    }

    /// Whether any route relies on probes (otherwise there is nothing to run).
    pub fn needed(&self) -> bool {
        !self.pairs.is_empty()
    }
}

/// Runs every probe of `contract` against `upstream`.
pub async fn probe(upstream: &Upstream, contract: &Contract) -> Vec<ProbeResult> {
    let mut results = Vec::with_capacity(contract.probes.len());
    for probe in &contract.probes {
        results.push(ProbeResult {
            upstream: upstream.settings().name().to_owned(),
            contract: contract.name.clone(),
            probe: probe.name.clone(),
            failure: run_one(upstream, probe).await.err(),
        });
    }
    results
}

async fn run_one(upstream: &Upstream, probe: &Probe) -> Result<(), String> {
    let mut req = Request::builder()
        .method(probe.method.clone())
        .uri(&probe.path)
        .body(full(probe.body.clone()))
        .map_err(|e| e.to_string())?;
    for (name, value) in &probe.headers {
        req.headers_mut().insert(name.clone(), value.clone());
    }
    let (progress, _) = watch::channel(0);
    let timeout = upstream.settings().timeout;
    let fetched = tokio::time::timeout(timeout, fetch(upstream.clone(), req, 10 << 20, progress))
        .await
        .map_err(|_| format!("no answer within {}", humantime::format_duration(timeout)))?
        .map_err(|e| e.to_string())?;
    probe
        .check(fetched.parts.status.as_u16(), &fetched.body)
        .map_err(|why| format!("{why} (answer: {})", excerpt(&fetched.body)))
}

/// Probes every (upstream, contract) pair the routes rely on, records the
/// verdicts, and returns the results.
pub async fn probe_all(
    config: &Config,
    upstreams: &Upstreams,
    board: &ProbeBoard,
) -> Vec<ProbeResult> {
    let mut results = Vec::new();
    for (id, contract) in &config.pairs {
        if let Some(upstream) = upstreams.get(id) {
            results.extend(probe(upstream, contract).await);
        }
    }
    board.record(&results);
    results
}

/// Probes at once, then every `interval`, for as long as it runs (a
/// supervised task, stopped at shutdown).
pub async fn run(
    config: Arc<Config>,
    upstreams: Upstreams,
    board: Arc<ProbeBoard>,
    beat: Heartbeat,
) -> Result<(), BoxError> {
    let mut tick = tokio::time::interval(config.interval.max(Duration::from_millis(50)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        beat.beat();
        probe_all(&config, &upstreams, &board).await;
    }
}

/// `idemgate verify-providers`: every contract's probes against every
/// upstream, as a table. True when everything passed.
pub async fn verify(
    upstreams: &[Arc<UpstreamSettings>],
    contracts: &BTreeMap<String, Arc<Contract>>,
) -> bool {
    let Some(upstreams) = Upstreams::new(upstreams) else {
        println!("no upstreams configured: nothing to verify");
        return false;
    };
    if contracts.is_empty() {
        println!("no contracts configured: nothing to verify");
        return true;
    }
    let mut rows = Vec::new();
    for contract in contracts.values() {
        for upstream in upstreams.iter() {
            rows.extend(probe(upstream, contract).await);
        }
    }
    let width = |f: fn(&ProbeResult) -> &str, title: &str| {
        rows.iter()
            .map(|r| f(r).len())
            .chain([title.len()])
            .max()
            .unwrap_or(0)
    };
    let (wu, wc, wp) = (
        width(|r| &r.upstream, "upstream"),
        width(|r| &r.contract, "contract"),
        width(|r| &r.probe, "probe"),
    );
    println!(
        "{:wu$}  {:wc$}  {:wp$}  result  why",
        "upstream", "contract", "probe"
    );
    for r in &rows {
        let (result, why) = match &r.failure {
            None => ("pass", ""),
            Some(why) => ("FAIL", why.as_str()),
        };
        println!(
            "{:wu$}  {:wc$}  {:wp$}  {result:6}  {why}",
            r.upstream, r.contract, r.probe
        );
    }
    rows.iter().all(|r| r.failure.is_none())
}
