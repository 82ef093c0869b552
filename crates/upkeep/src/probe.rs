//! Proving upstreams before trusting them: a contract's probes are run
//! against the upstreams of every route that names it, at start-up and
//! every `probe_interval`, and the [`ProbeBoard`] says which upstreams may be
//! failover or hedge targets (docs/design.md §6, "Proven providers").
//!
//! One *verification* sends every probe of the contract `runs` times and
//! judges each probe (pass, fail, unstable). An upstream becomes eligible
//! on its first passing verification, loses it on any verification that
//! does not pass, and regains it only after the contract's `recover_after`
//! passing verifications in a row: a provider that flaps is kept out. The
//! primary is always tried regardless.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use http::Request;
use tokio::sync::watch;

use crate::supervise::Heartbeat;
use idemgate_domain::contract::expect::{judge, Finding, Observed};
use idemgate_domain::contract::{excerpt, Contract, Probe};
use idemgate_domain::BoxError;
use idemgate_proxy::http::full;
use idemgate_proxy::upstream::{fetch, Upstream, Upstreams};
use idemgate_proxy::upstream::{UpstreamId, UpstreamSettings};

/// Verdicts kept per upstream and contract.
pub const HISTORY: usize = 20;

/// One probe's finding in one verification.
#[derive(Debug, Clone)]
pub struct ProbeResult {
    /// The upstream probed.
    pub upstream: String,
    /// The contract.
    pub contract: String,
    /// The probe.
    pub probe: String,
    /// Its verdict over all its runs.
    pub finding: Finding,
    /// The provider's counts of the prompt its passing runs reported, when
    /// the probe asks for them (`prompt_tokens`).
    pub prompt_tokens: Vec<u64>,
}

/// A probe that did not pass in a verification, and what differed.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The probe.
    pub probe: String,
    /// `fail` or `unstable`.
    pub result: &'static str,
    /// What differed.
    pub why: String,
}

/// One verification of one upstream under one contract.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// `pass`, `fail` (some probe failed) or `unstable` (none failed, some
    /// answered differently from run to run).
    pub result: &'static str,
    /// When the probes ran.
    pub checked_at: SystemTime,
    /// The probes that did not pass, and why.
    pub failures: Vec<Failure>,
}

impl Verdict {
    /// The verdict on a verification's probe results.
    fn of(results: &[ProbeResult]) -> Verdict {
        let failures: Vec<Failure> = results
            .iter()
            .filter_map(|r| {
                r.finding.why().map(|why| Failure {
                    probe: r.probe.clone(),
                    result: r.finding.as_str(),
                    why: why.to_owned(),
                })
            })
            .collect();
        let result = if failures.iter().any(|f| f.result == "fail") {
            "fail"
        } else if failures.is_empty() {
            "pass"
        } else {
            "unstable"
        };
        Verdict {
            result,
            checked_at: SystemTime::now(),
            failures,
        }
    }

    /// Every probe passed.
    pub fn passed(&self) -> bool {
        self.result == "pass"
    }
}

/// An upstream's standing under one contract: whether it may be a target
/// now, and the verdicts that led there.
#[derive(Debug, Clone, Default)]
pub struct Standing {
    /// It may be a failover or hedge target.
    pub eligible: bool,
    /// Passing verifications still needed before it is eligible (0 when it is).
    pub needed: u32,
    /// Passing verifications in a row, up to now.
    pub passes_in_a_row: u32,
    /// It has failed a verification once: from then on it needs
    /// `recover_after` passes in a row, not one.
    pub has_failed: bool,
    /// The last verdicts, oldest first, at most [`HISTORY`].
    pub history: VecDeque<Verdict>,
}

impl Standing {
    /// The standing after `verdict`: the first verification passed makes
    /// it eligible; any other verdict takes that away until
    /// `recover_after` verifications in a row pass.
    pub fn after(&mut self, verdict: Verdict, recover_after: u32) {
        if verdict.passed() {
            self.passes_in_a_row = self.passes_in_a_row.saturating_add(1);
        } else {
            self.passes_in_a_row = 0;
            self.has_failed = true;
        }
        let required = if self.has_failed { recover_after } else { 1 };
        self.needed = required.saturating_sub(self.passes_in_a_row);
        self.eligible = self.needed == 0;
        self.history.push_back(verdict);
        while self.history.len() > HISTORY {
            self.history.pop_front();
        }
    }

    /// The newest verdict.
    pub fn last(&self) -> Option<&Verdict> {
        self.history.back()
    }
}

/// Every upstream's standing under every contract it is probed for.
#[derive(Debug, Default)]
pub struct ProbeBoard {
    standings: RwLock<BTreeMap<(String, String), Standing>>,
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
            .is_some_and(|s| s.eligible)
    }

    /// Every standing, by (upstream, contract).
    pub fn snapshot(&self) -> BTreeMap<(String, String), Standing> {
        self.read().clone()
    }

    /// Records one verification of `upstream` under `contract`.
    fn record(&self, upstream: &str, contract: &Contract, results: &[ProbeResult]) {
        for r in results {
            metrics::counter!("idemgate_probe_runs_total",
                "upstream" => upstream.to_owned(), "contract" => contract.name.clone(),
                "probe" => r.probe.clone(), "result" => r.finding.as_str())
            .increment(1);
        }
        let verdict = Verdict::of(results);
        let pair = (upstream.to_owned(), contract.name.clone());
        let mut standings = self.standings.write().unwrap_or_else(|e| e.into_inner());
        let standing = standings.entry(pair).or_default();
        let was = standing.eligible;
        let failures = verdict.failures.clone();
        metrics::gauge!("idemgate_upstream_probes_passing",
            "upstream" => upstream.to_owned(), "contract" => contract.name.clone())
        .set(f64::from(u8::from(verdict.passed())));
        standing.after(verdict, contract.recover_after);
        metrics::gauge!("idemgate_upstream_eligible",
            "upstream" => upstream.to_owned(), "contract" => contract.name.clone())
        .set(f64::from(u8::from(standing.eligible)));
        let contract = &contract.name;
        match (was, standing.eligible) {
            (false, true) => {
                tracing::info!(%upstream, %contract, "upstream passes its contract's probes; eligible for failover")
            }
            (true, false) => {
                tracing::warn!(%upstream, %contract, ?failures, "upstream fails its contract's probes; not a failover target")
            }
            (false, false) if failures.is_empty() => {
                tracing::info!(%upstream, %contract, needed = standing.needed, "upstream passes its contract's probes again; not yet a failover target")
            }
            _ => {}
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<(String, String), Standing>> {
        self.standings.read().unwrap_or_else(|e| e.into_inner())
    }
}

/// What the probe task checks, and how often.
#[derive(Debug, Clone)]
pub struct Config {
    /// How often every pair is probed.
    pub interval: Duration,
    /// The (upstream, contract) pairs the routes rely on, each once, with
    /// the patience of the most patient route relying on it.
    pub pairs: Vec<(UpstreamId, Arc<Contract>, Patience)>,
}

impl Config {
    /// Probes every `interval` what the routes rely on: each upstream a
    /// route may use against the route's contract, with the route's
    /// silences (`relied_on`), each pair once however many routes rely on
    /// it.
    pub fn new(
        interval: Duration,
        relied_on: impl IntoIterator<Item = (UpstreamId, Arc<Contract>, Patience)>,
    ) -> Config {
        let mut pairs: BTreeMap<(UpstreamId, String), (Arc<Contract>, Patience)> = BTreeMap::new();
        for (upstream, contract, patience) in relied_on {
            let pair = (upstream, contract.name.clone());
            match pairs.get_mut(&pair) {
                Some((_, kept)) => *kept = kept.clone().or_longer(patience),
                None => {
                    pairs.insert(pair, (contract, patience));
                }
            }
        }
        Config {
            interval,
            pairs: pairs
                .into_iter()
                .map(|((id, _), (c, p))| (id, c, p))
                .collect(),
        }
    }

    /// Whether any route relies on probes (otherwise there is nothing to run).
    pub fn needed(&self) -> bool {
        !self.pairs.is_empty()
    }

    /// The contracts relied on whose probes check only the shape of
    /// answers: a provider answering valid JSON that says the wrong thing
    /// passes them.
    pub fn proving_only_the_shape(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .pairs
            .iter()
            .filter(|(_, c, _)| c.proves_only_the_shape())
            .map(|(_, c, _)| c.name.as_str())
            .collect();
        names.sort_unstable();
        names.dedup();
        names
    }
}

/// How long a probe waits on a silent upstream: the silences an attempt
/// of the route relying on the contract allows (`docs/design.md` §11), so
/// a probe gives up when a real request would, not on a longer timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Patience {
    /// Before the answer's head (`first_byte_timeout`).
    pub head: Silence,
    /// Between the answer's chunks once its head has come
    /// (`stream_idle_timeout`).
    pub between: Silence,
}

/// One silence a probe allows, and the setting it comes from (named in
/// the finding of a probe that waited it out).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Silence {
    /// How long.
    pub limit: Duration,
    /// Where it is set, in the operator's words ("route chat's
    /// first_byte_timeout").
    pub source: String,
}

impl Patience {
    /// The upstream's own silences, for a probe no route says more of.
    pub fn of_upstream(upstream: &UpstreamSettings) -> Patience {
        let name = upstream.name();
        Patience {
            head: Silence {
                limit: upstream.first_byte_timeout,
                source: format!("upstream {name}'s first_byte_timeout"),
            },
            between: Silence {
                limit: upstream.stream_idle_timeout,
                source: format!("upstream {name}'s stream_idle_timeout"),
            },
        }
    }

    /// Each silence the longer of the two: a pair two routes rely on is
    /// probed with the more patient's.
    pub fn or_longer(self, other: Patience) -> Patience {
        let longer = |a: Silence, b: Silence| if b.limit > a.limit { b } else { a };
        Patience {
            head: longer(self.head, other.head),
            between: longer(self.between, other.between),
        }
    }

    /// One silence for both, set by `source` (`--timeout`).
    pub fn uniform(limit: Duration, source: &str) -> Patience {
        let silence = Silence {
            limit,
            source: source.to_owned(),
        };
        Patience {
            head: silence.clone(),
            between: silence,
        }
    }
}

/// What a probing says as it goes, for whoever watches it run.
#[allow(missing_debug_implementations)] // `Probe` has none
pub enum Told<'a> {
    /// A probe is about to be sent.
    Asking(&'a Probe),
    /// A probe's finding.
    Found(&'a ProbeResult),
}

/// Runs every probe of `contract` against `upstream`, each `runs` times,
/// and judges each over its runs; `told` hears of each probe as it starts
/// and ends. An upstream silent past `patience` is a provider that is down,
/// not one that answers wrong: its remaining probes are not sent, so a
/// silent provider costs one silence, not one per probe and run.
pub async fn probe(
    upstream: &Upstream,
    contract: &Contract,
    patience: &Patience,
    told: &mut (dyn FnMut(Told<'_>) + Send),
) -> Vec<ProbeResult> {
    let mut results = Vec::with_capacity(contract.probes.len());
    let mut silent: Option<String> = None;
    for probe in &contract.probes {
        let result = |finding, prompt_tokens| ProbeResult {
            upstream: upstream.settings().name().to_owned(),
            contract: contract.name.clone(),
            probe: probe.name.clone(),
            finding,
            prompt_tokens,
        };
        if let Some(earlier) = &silent {
            let skipped = result(Finding::Fail(format!("not sent: {earlier}")), Vec::new());
            told(Told::Found(&skipped));
            results.push(skipped);
            continue;
        }
        told(Told::Asking(probe));
        let mut runs = Vec::with_capacity(probe.runs as usize);
        for _ in 0..probe.runs {
            match run_one(upstream, probe, patience).await {
                Err(Run::Silent(why)) => {
                    silent = Some(format!("the upstream was silent on probe {}", probe.name));
                    runs.push(Err(why));
                    break;
                }
                Err(Run::Failed(why)) => runs.push(Err(why)),
                Ok(observed) => runs.push(Ok(observed)),
            }
        }
        let found = result(
            judge(&runs, probe.same),
            runs.iter()
                .filter_map(|r| r.as_ref().ok()?.prompt_tokens)
                .collect(),
        );
        told(Told::Found(&found));
        results.push(found);
    }
    results
}

/// Why a run did not pass: the upstream stayed silent past the probe's
/// patience, or answered (or broke) in a way that fails the probe.
enum Run {
    Silent(String),
    Failed(String),
}

async fn run_one(upstream: &Upstream, probe: &Probe, patience: &Patience) -> Result<Observed, Run> {
    let mut req = Request::builder()
        .method(probe.method.clone())
        .uri(&probe.path)
        .body(full(probe.body.clone()))
        .map_err(|e| Run::Failed(e.to_string()))?;
    for (name, value) in &probe.headers {
        req.headers_mut().insert(name.clone(), value.clone());
    }
    let (progress, mut seen) = watch::channel(0);
    let fetched = fetch(upstream.clone(), req, 10 << 20, progress);
    tokio::pin!(fetched);
    // Every frame (the head first) moves `seen`: the silence allowed is
    // the head's until it comes, then the one between chunks.
    let fetched = loop {
        let (silence, before) = match *seen.borrow_and_update() {
            0 => (&patience.head, "the answer's head"),
            _ => (&patience.between, "the answer's next chunk"),
        };
        tokio::select! {
            biased;
            fetched = &mut fetched => break fetched.map_err(|e| Run::Failed(e.to_string()))?,
            moved = tokio::time::timeout(silence.limit, seen.changed()) => {
                if moved.is_err() {
                    return Err(Run::Silent(format!(
                        "silent for {} before {before} ({})",
                        humantime::format_duration(silence.limit),
                        silence.source
                    )));
                }
            }
        }
    };
    probe
        .check(fetched.parts.status.as_u16(), &fetched.body)
        .map_err(|why| Run::Failed(format!("{why} (answer: {})", excerpt(&fetched.body))))
}

/// Verifies every (upstream, contract) pair the routes rely on, records the
/// verdicts, and returns the results.
pub async fn probe_all(
    config: &Config,
    upstreams: &Upstreams,
    board: &ProbeBoard,
) -> Vec<ProbeResult> {
    let mut all = Vec::new();
    for (id, contract, patience) in &config.pairs {
        if let Some(upstream) = upstreams.get(id) {
            let results = probe(upstream, contract, patience, &mut |_| {}).await;
            board.record(upstream.settings().name(), contract, &results);
            all.extend(results);
        }
    }
    all
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

/// How `verify-providers` prints its results.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Print {
    /// A table for a person.
    Table,
    /// One JSON array, for a pipeline.
    Json,
}

/// `idemgate verify-providers`: every contract's probes against every
/// upstream, each waiting on a silent upstream as long as `patience` says
/// (the route's silences), printed as `print` says at the end, and each
/// probe told on stderr as it starts and ends (stdout keeps one table or
/// one JSON document). True when every probe passed.
pub async fn verify(
    upstreams: &[Arc<UpstreamSettings>],
    contracts: &BTreeMap<String, Arc<Contract>>,
    patience: &dyn Fn(&Contract, &UpstreamSettings) -> Patience,
    print: Print,
) -> bool {
    let Some(upstreams) = Upstreams::new(upstreams) else {
        eprintln!("no upstreams configured: nothing to verify");
        return false;
    };
    if contracts.is_empty() {
        eprintln!("no contracts configured: nothing to verify");
    }
    let mut rows = Vec::new();
    for contract in contracts.values() {
        for upstream in upstreams.iter() {
            let patience = patience(contract, upstream.settings());
            let name = upstream.settings().name();
            let mut told =
                |told: Told<'_>| eprintln!("{}", progress(name, contract, &patience, told));
            rows.extend(probe(upstream, contract, &patience, &mut told).await);
        }
    }
    match print {
        Print::Table => print!("{}", table(&rows)),
        Print::Json => println!("{}", json(&rows)),
    }
    rows.iter().all(|r| r.finding == Finding::Pass)
}

/// One line of `verify-providers`' progress: a probe starting (with how
/// long it waits on silence), or its finding.
fn progress(upstream: &str, contract: &Contract, patience: &Patience, told: Told<'_>) -> String {
    match told {
        Told::Asking(probe) => format!(
            "probing {upstream} with {}/{} ({} run{}; gives up after {} without the head ({}), {} between chunks)",
            contract.name,
            probe.name,
            probe.runs,
            if probe.runs == 1 { "" } else { "s" },
            humantime::format_duration(patience.head.limit),
            patience.head.source,
            humantime::format_duration(patience.between.limit),
        ),
        Told::Found(r) => match r.finding.why() {
            None => format!("  {upstream} {}/{}: {}", r.contract, r.probe, r.finding.as_str()),
            Some(why) => format!(
                "  {upstream} {}/{}: {}: {why}",
                r.contract,
                r.probe,
                r.finding.as_str().to_ascii_uppercase()
            ),
        },
    }
}

/// The prompt counts seen, as printed (`-` when the probe asks for none).
fn tokens(r: &ProbeResult) -> String {
    if r.prompt_tokens.is_empty() {
        return "-".into();
    }
    let seen: Vec<String> = r.prompt_tokens.iter().map(u64::to_string).collect();
    seen.join(",")
}

/// The results as a table: upstream × probe, the result (failures in
/// capitals, to be seen), the prompt tokens seen, and why.
fn table(rows: &[ProbeResult]) -> String {
    let width = |f: &dyn Fn(&ProbeResult) -> String, title: &str| {
        rows.iter()
            .map(|r| f(r).len())
            .chain([title.len()])
            .max()
            .unwrap_or(0)
    };
    let (wu, wc, wp, wt) = (
        width(&|r| r.upstream.clone(), "upstream"),
        width(&|r| r.contract.clone(), "contract"),
        width(&|r| r.probe.clone(), "probe"),
        width(&tokens, "prompt tokens"),
    );
    let mut out = format!(
        "{:wu$}  {:wc$}  {:wp$}  result    {:wt$}  why\n",
        "upstream", "contract", "probe", "prompt tokens"
    );
    for r in rows {
        let (name, why) = (r.finding.as_str(), r.finding.why().unwrap_or_default());
        let name = match r.finding {
            Finding::Pass => name.to_owned(),
            _ => name.to_ascii_uppercase(),
        };
        out.push_str(&format!(
            "{:wu$}  {:wc$}  {:wp$}  {name:8}  {:wt$}  {why}\n",
            r.upstream,
            r.contract,
            r.probe,
            tokens(r)
        ));
    }
    out
}

/// The results as one JSON array.
fn json(rows: &[ProbeResult]) -> serde_json::Value {
    rows.iter()
        .map(|r| {
            serde_json::json!({
                "upstream": r.upstream,
                "contract": r.contract,
                "probe": r.probe,
                "result": r.finding.as_str(),
                "why": r.finding.why(),
                "prompt_tokens": r.prompt_tokens,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
