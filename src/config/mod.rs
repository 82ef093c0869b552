//! Settings: plain data, read once at start-up and validated as a whole.
//!
//! Sources, strongest first: command-line flags, `IDEMGATE_*` environment
//! variables (clap reads both, flag over variable), then the TOML file named
//! by `--config`, then the defaults below. Every problem is reported with the
//! key that caused it and how to fix it, before anything starts.
//!
//! - [`flags`]: the command line;
//! - [`file`](mod@file): the TOML format;
//! - [`upstreams`] and [`routes`]: where requests go and which opt in;
//! - [`contracts`]: response contracts, loaded from their files;
//! - [`redis`] and [`store`]: where the fast path and the jobs are kept;
//!   [`libpq`]: TLS as a PostgreSQL URL spells it; [`tls`]: the CA and
//!   client certificates of the gateway's own connections (§16);
//! - this module: the settings as a whole, their defaults and validation.

mod bounds;
pub mod contracts;
mod error;
pub mod file;
pub mod flags;
pub mod libpq;
pub mod limits;
pub mod redis;
pub mod replay;
pub mod routes;
mod secrets;
pub mod store;
pub mod summary;
pub mod tls;
pub mod trust;
pub mod upstreams;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};

use idemgate_domain::contract::Contract;

pub use error::ConfigError;
pub use file::FileConfig;
pub use flags::{Cli, Command, Flags};
use idemgate_idempotency::route::{self, Route};
use idemgate_proxy::server::{Limits, TrustedProxies};
use idemgate_proxy::upstream::UpstreamSettings;
use idemgate_store::fastpath::{RedisSettings, Topology};
use idemgate_store::StoreSettings;
use idemgate_trust::{Clients, OwnerRule};
pub use limits::{BudgetSource, MemoryBudget};
pub use replay::{ReplayKeySettings, ReplayKeySource};

use bounds::{at_most, DAY, DECADE, MONTH, WEEK};
use file::UpstreamFile;

fn bad(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::new(key, message)
}

/// The validated settings the gateway runs with.
#[derive(Clone)]
pub struct Settings {
    /// Proxy listener.
    pub listen: SocketAddr,
    /// Admin listener.
    pub admin_listen: SocketAddr,
    /// Admin bearer token; `None` turns the job endpoints off.
    pub admin_token: Option<String>,
    /// Whether the console's cookie is `Secure` and `__Host-` prefixed (the
    /// admin listener speaks plain HTTP: for HTTPS terminated in front).
    pub console_secure_cookie: bool,
    /// Whether every proxied request is logged, one line at `info` under
    /// the target `idemgate::access`, once its answer is sent
    /// (`docs/design.md` §12).
    pub access_log: bool,
    /// Upstreams in configured order; never empty. Requests on no route
    /// pass through to the first.
    pub upstreams: Vec<Arc<UpstreamSettings>>,
    /// Where jobs and attempts are kept.
    pub store: StoreSettings,
    /// The Redis fast path, when configured.
    pub redis: Option<RedisSettings>,
    /// The keys Redis replay entries are authenticated with (with Redis).
    pub replay_keys: Option<ReplayKeySettings>,
    /// Silence after which an attempt's outcome is unknown.
    pub upstream_timeout: Duration,
    /// After this long an attempt is abandoned, answer or not.
    pub attempt_deadline: Duration,
    /// How long a duplicate waits for a running job.
    pub hold_timeout: Duration,
    /// How long a key is remembered.
    pub key_ttl: Duration,
    /// Lease length; renewed every third of it.
    pub lease_ttl: Duration,
    /// How often lapsed leases and expired jobs are swept.
    pub sweep_interval: Duration,
    /// `Retry-After` on 409 answers.
    pub retry_after: Duration,
    /// How long open connections and running attempts may finish after
    /// SIGTERM; by default `attempt_deadline`, the longest an attempt runs.
    pub shutdown_grace: Duration,
    /// Where owners come from unless a route says otherwise (each route
    /// carries its own, resolved).
    pub owner: Arc<OwnerRule>,
    /// The secret owner digests are salted with.
    pub owner_salt: OwnerSaltSetting,
    /// Proxies whose forwarding headers are believed.
    pub trusted_proxies: TrustedProxies,
    /// The clients that may prove themselves with a client key.
    pub clients: Arc<Clients>,
    /// The header carrying the job id upstream.
    pub forward_key_header: HeaderName,
    /// The header carrying the attempt number upstream.
    pub forward_attempt_header: HeaderName,
    /// 409 (default) or 422 (the IETF draft) for a key reused with another request.
    pub mismatch_status: StatusCode,
    /// Largest upstream response that can be committed.
    pub max_response_size: usize,
    /// Bytes of committed answers kept in memory for replay; 0 keeps none.
    pub replay_cache_size: usize,
    /// Where a request answered `202` polls its job (`Prefer:
    /// respond-async`): `{respond_async_path}/{job}` on the proxy listener.
    pub respond_async_path: String,
    /// Opt-in routes, most specific prefix first (shared, not copied, by
    /// the requests that match them).
    pub routes: Vec<Arc<Route>>,
    /// Response contracts, by name.
    pub contracts: BTreeMap<String, Arc<Contract>>,
    /// How often upstreams are probed against the contracts of their routes.
    pub probe_interval: Duration,
    /// Keys sealing stored responses, when configured.
    pub encryption: Option<EncryptionSettings>,
    /// What each listener allows its clients.
    pub limits: Limits,
    /// Bytes requests may make the gateway hold (docs/design.md §18).
    pub memory_budget: MemoryBudget,
    /// Requests in progress at most; past it the gateway answers `503` at
    /// once, before it takes any job.
    pub max_in_flight: usize,
    /// Threads of the runtime serving requests; with 1 it is Tokio's
    /// current-thread runtime, with no scheduler between threads at all
    /// (docs/design.md §12).
    pub worker_threads: usize,
    /// How more than one worker thread share the work (docs/design.md §12,
    /// "Threads").
    pub worker_runtime: WorkerRuntime,
}

/// `worker_runtime`: how worker threads share the requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerRuntime {
    /// `"shared"`: one runtime, whose threads take work from each other.
    Shared,
    /// `"per_thread"`: each thread a runtime of its own, serving the
    /// connections it accepted, with its own share of the database pool.
    PerThread,
}

impl WorkerRuntime {
    /// The value as it is written.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRuntime::Shared => "shared",
            WorkerRuntime::PerThread => "per_thread",
        }
    }
}

/// `worker_runtime`, `"shared"` unless set.
fn worker_runtime(file: &FileConfig, flags: &Flags) -> Result<WorkerRuntime, ConfigError> {
    match flags
        .worker_runtime
        .as_deref()
        .or(file.worker_runtime.as_deref())
    {
        None | Some("shared") => Ok(WorkerRuntime::Shared),
        Some("per_thread") => Ok(WorkerRuntime::PerThread),
        Some(other) => Err(bad(
            "worker_runtime",
            format!(
                "{other:?} is not a worker runtime; use \"shared\" (the default) or \"per_thread\""
            ),
        )),
    }
}

/// Keys sealing stored responses (`[encryption]`).
#[derive(Clone)]
pub struct EncryptionSettings {
    /// The key new responses are sealed with.
    pub active: String,
    /// Every key that may open a stored response, by id.
    pub keys: Vec<(String, [u8; 32])>,
}

impl std::fmt::Debug for EncryptionSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncryptionSettings")
            .field("active", &self.active)
            .field(
                "keys",
                &self.keys.iter().map(|(id, _)| id).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("listen", &self.listen)
            .field("admin_listen", &self.admin_listen)
            .field(
                "admin_token",
                &self.admin_token.as_ref().map(|_| "<redacted>"),
            )
            .field("upstreams", &self.upstreams)
            .field(
                "store",
                &match &self.store {
                    StoreSettings::Postgres(_) => "postgres <redacted>".to_owned(),
                    StoreSettings::Embedded { path } => format!("embedded {}", path.display()),
                },
            )
            .field("upstream_timeout", &self.upstream_timeout)
            .field("hold_timeout", &self.hold_timeout)
            .field("key_ttl", &self.key_ttl)
            .field("routes", &self.routes)
            .finish_non_exhaustive()
    }
}

/// Timings that are checked against one another, or follow one another.
struct Timings {
    upstream_timeout: Duration,
    attempt_deadline: Duration,
    lease_ttl: Duration,
    hold_timeout: Duration,
    key_ttl: Duration,
}

/// The fewest characters an admin token may have: the token signs the
/// console in and resolves jobs (commits answers), and sign-ins are
/// throttled per address only, so a short one falls to a guesser with a
/// few addresses.
const MIN_ADMIN_TOKEN: usize = 16;

/// The admin API's bearer token, trimmed: none when unset or empty (the
/// job API is then off); a shorter one than [`MIN_ADMIN_TOKEN`] is
/// refused, never echoed in the message.
fn admin_token(file: &FileConfig, flags: &Flags) -> Result<Option<String>, ConfigError> {
    // Trimmed as every header value is on its way in (a token read from a
    // file ends in a newline): one with spaces around it could never match.
    let token = flags.admin_token.as_ref().or(file.admin_token.as_ref());
    let token = token.map(|t| t.trim().to_owned()).filter(|t| !t.is_empty());
    let length = token
        .as_deref()
        .map_or(MIN_ADMIN_TOKEN, |t| t.chars().count());
    if length < MIN_ADMIN_TOKEN {
        return Err(bad(
            "admin_token",
            format!("a token of {length} characters is soon guessed: use at least {MIN_ADMIN_TOKEN} (e.g. the output of `openssl rand -hex 16`), or leave it empty to turn the job API off"),
        ));
    }
    Ok(token)
}

/// Threads serving requests: by default one per CPU the process may use.
fn worker_threads(file: &FileConfig, flags: &Flags) -> Result<usize, ConfigError> {
    let cpus = || std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    at_least_one(
        "worker_threads",
        flags
            .worker_threads
            .or(file.worker_threads)
            .unwrap_or_else(cpus),
    )
}

impl Settings {
    /// Reads the file (if any), lays the flags over it and validates the lot.
    pub fn load(config: Option<&Path>, flags: Flags) -> Result<Settings, ConfigError> {
        Self::from_sources(FileConfig::read(config)?, flags)
    }

    /// Only the store settings, for `idemgate migrate`.
    pub fn load_store(config: Option<&Path>, flags: Flags) -> Result<StoreSettings, ConfigError> {
        store::store_settings(&FileConfig::read(config)?, &flags)
    }

    /// Parses TOML text; unknown keys are errors.
    pub fn parse_file(text: &str) -> Result<FileConfig, ConfigError> {
        FileConfig::parse(text)
    }

    /// Merges parsed sources, flags winning, and validates.
    pub fn from_sources(mut file: FileConfig, flags: Flags) -> Result<Settings, ConfigError> {
        let store = store::store_settings(&file, &flags)?;
        // Every missing secret at once, before any is read.
        secrets::all_present(&file, &flags, &store)?;
        let replay_keys = replay::settings(&file, &flags, &store)?;
        let timings = timings(&file, &flags)?;
        let trust = trust(&mut file, &flags, &store)?;
        let (upstreams, contracts, routes) = traffic(&mut file, &flags, &timings, &trust)?;
        let loopback = |port| SocketAddr::from(([127, 0, 0, 1], port));
        let container = limits::container_memory_limit();
        let memory_budget = limits::memory_budget(&file, &flags, &routes, container)?;
        Ok(Settings {
            listen: flags.listen.or(file.listen).unwrap_or(loopback(8080)),
            admin_listen: flags
                .admin_listen
                .or(file.admin_listen)
                .unwrap_or(loopback(9090)),
            admin_token: admin_token(&file, &flags)?,
            console_secure_cookie: file.console_secure_cookie.unwrap_or(false),
            // Off unless asked for: a line per request is a volume of log to
            // choose (docs/design.md §12, "Access log").
            access_log: flags.access_log.or(file.access_log).unwrap_or(false),
            upstreams,
            store,
            redis: redis_settings(&file, &flags)?,
            replay_keys,
            upstream_timeout: timings.upstream_timeout,
            attempt_deadline: timings.attempt_deadline,
            hold_timeout: timings.hold_timeout,
            key_ttl: timings.key_ttl,
            lease_ttl: timings.lease_ttl,
            sweep_interval: interval(
                "sweep_interval",
                file.sweep_interval.unwrap_or(Duration::from_secs(5)),
                "lapsed leases and expired keys wait for the sweep",
            )?,
            retry_after: file.retry_after.unwrap_or(Duration::from_secs(1)),
            // Long enough for every attempt running at SIGTERM to end by
            // its own deadline (docs/design.md §12, "Termination").
            shutdown_grace: at_most(
                "shutdown_grace",
                file.shutdown_grace.unwrap_or(timings.attempt_deadline),
                &MONTH,
                "the drain waits no longer than the longest attempt_deadline",
            )?,
            owner: trust.owner,
            owner_salt: trust.salt,
            trusted_proxies: trust.proxies,
            clients: trust.clients,
            forward_key_header: named(
                &file.forward_key_header,
                "forward_key_header",
                "idempotency-key",
            )?,
            forward_attempt_header: named(
                &file.forward_attempt_header,
                "forward_attempt_header",
                "idempotency-attempt",
            )?,
            mismatch_status: mismatch_status(file.mismatch_status)?,
            max_response_size: limits::max_response_size(&file, &memory_budget)?,
            // Zero is allowed: it turns the cache off.
            replay_cache_size: file
                .replay_cache_size
                .map_or(64 << 20, |b| b.as_u64() as usize),
            respond_async_path: respond_async_path(file.respond_async_path.as_deref(), &routes)?,
            routes,
            contracts,
            probe_interval: interval(
                "probe_interval",
                file.probe_interval.unwrap_or(Duration::from_secs(60)),
                "a fallback is trusted on a proof this old",
            )?,
            encryption: file
                .encryption
                .as_ref()
                .map(|e| encryption(e, &file.base_dir))
                .transpose()?,
            limits: limits::limits(&file)?,
            memory_budget,
            max_in_flight: at_least_one("max_in_flight", file.max_in_flight.unwrap_or(10_000))?,
            worker_threads: worker_threads(&file, &flags)?,
            worker_runtime: worker_runtime(&file, &flags)?,
        })
    }

    /// The route an opted-in request falls under, if any.
    pub fn route_for(&self, method: &Method, path: &str) -> Option<&Arc<Route>> {
        route::find(&self.routes, method, path)
    }
}

/// Where requests go: the upstreams (the flags' over the file's), the
/// contracts their answers must honour, and the routes that opt in.
#[allow(clippy::type_complexity)] // the three parts of one answer, named below
fn traffic(
    file: &mut FileConfig,
    flags: &Flags,
    timings: &Timings,
    trust: &Trust,
) -> Result<
    (
        Vec<Arc<UpstreamSettings>>,
        BTreeMap<String, Arc<Contract>>,
        Vec<Arc<Route>>,
    ),
    ConfigError,
> {
    let upstream_files = if flags.upstreams.is_empty() {
        file.upstreams.take().unwrap_or_default()
    } else {
        flags
            .upstreams
            .iter()
            .cloned()
            .map(UpstreamFile::Url)
            .collect()
    };
    // With clients, their key's header is the gateway's: no upstream gets it
    // (`docs/design.md` §15).
    let withheld = (!trust.clients.clients.is_empty()).then_some(&trust.clients.header);
    let upstreams = upstreams::parse_all(
        &upstream_files,
        timings.upstream_timeout,
        timings.attempt_deadline,
        &file.base_dir,
        withheld,
    )?;
    let mut contracts = BTreeMap::new();
    for (name, contract_file) in std::mem::take(&mut file.contracts) {
        let contract = contracts::load(&name, contract_file, &file.base_dir)?;
        contracts.insert(name, Arc::new(contract));
    }
    let cx = routes::Context {
        upstreams: &upstreams,
        contracts: &contracts,
        owner: &trust.owner,
        clients: &trust.clients,
        base_dir: &file.base_dir,
        attempt_deadline: timings.attempt_deadline,
    };
    let routes = routes::parse_all(std::mem::take(&mut file.routes), &cx)?;
    Ok((upstreams, contracts, routes))
}

/// Whom the gateway trusts (`docs/design.md` §15), read before the routes,
/// which inherit the owner rule and may require clients.
struct Trust {
    owner: Arc<OwnerRule>,
    salt: OwnerSaltSetting,
    proxies: TrustedProxies,
    clients: Arc<Clients>,
}

/// Where the secret owner digests are salted with comes from.
#[derive(Clone)]
pub enum OwnerSaltSetting {
    /// Configured (`[owner] salt`, `--owner-salt`, `IDEMGATE_OWNER_SALT`).
    Given(Vec<u8>),
    /// Not configured, with the embedded store: a random salt kept in this
    /// file beside the database, made on first start.
    BesideStore(PathBuf),
}

impl std::fmt::Debug for OwnerSaltSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OwnerSaltSetting::Given(_) => f.write_str("Given(<redacted>)"),
            OwnerSaltSetting::BesideStore(path) => write!(f, "BesideStore({})", path.display()),
        }
    }
}

fn trust(
    file: &mut FileConfig,
    flags: &Flags,
    store: &StoreSettings,
) -> Result<Trust, ConfigError> {
    let owner_file = file.owner.take().unwrap_or_default();
    let header = named(&file.owner_header, "owner_header", "authorization")?;
    if file.owner_header.is_some() && owner_file.sources.is_some() {
        return Err(bad(
            "owner_header",
            "give the owner's sources once: drop owner_header and keep [owner] sources",
        ));
    }
    let mut owner = trust::owner_rule(
        "owner",
        &owner_file,
        &trust::default_owner_rule(header),
        &file.base_dir,
    )?;
    owner.allow_anonymous |= flags.allow_anonymous;
    let salt = owner_salt(flags, owner_file.salt.as_ref(), store, &file.base_dir)?;
    Ok(Trust {
        owner: Arc::new(owner),
        salt,
        proxies: trust::trusted_proxies(file.trusted_proxies.as_deref().unwrap_or_default())?,
        clients: Arc::new(trust::clients(
            &file.clients,
            file.client_key_header.as_deref(),
            &file.base_dir,
        )?),
    })
}

/// The owner salt: configured, or (embedded store only) a file beside the
/// database. Replicas sharing PostgreSQL must share one salt, and a salt
/// kept in the database would not protect what is in it: there it must be
/// configured.
fn owner_salt(
    flags: &Flags,
    written: Option<&trust::SecretFile>,
    store: &StoreSettings,
    base: &Path,
) -> Result<OwnerSaltSetting, ConfigError> {
    // An empty variable is an unset one (a Secret left empty).
    let flag = flags.owner_salt.as_ref().filter(|text| !text.is_empty());
    let text = match (flag, written) {
        (Some(text), _) => text.clone(),
        (None, Some(secret)) => secret.read("owner.salt", base)?,
        (None, None) => {
            return match store {
                StoreSettings::Embedded { path } => {
                    let mut beside = path.clone().into_os_string();
                    beside.push(".owner-salt");
                    Ok(OwnerSaltSetting::BesideStore(beside.into()))
                }
                StoreSettings::Postgres(_) => Err(bad("owner.salt", secrets::OWNER_SALT_NEEDED)),
            };
        }
    };
    use base64::Engine;
    match base64::engine::general_purpose::STANDARD.decode(text.trim()) {
        Ok(bytes) if bytes.len() >= 16 => Ok(OwnerSaltSetting::Given(bytes)),
        _ => Err(bad(
            "owner.salt",
            "not 16 bytes or more of base64; make one with `openssl rand -base64 32`",
        )),
    }
}

/// The upstream timeout and the timings that must agree with it, each
/// bounded before anything is computed from it.
fn timings(file: &FileConfig, flags: &Flags) -> Result<Timings, ConfigError> {
    let upstream_timeout = at_most(
        "upstream_timeout",
        positive(
            "upstream_timeout",
            flags
                .upstream_timeout
                .or(file.upstream_timeout)
                .unwrap_or(Duration::from_secs(30)),
        )?,
        &DAY,
        "a longer silence is an upstream gone, not a slow one",
    )?;
    let attempt_deadline = attempt_deadline(file, upstream_timeout)?;
    let lease_ttl = interval(
        "lease_ttl",
        file.lease_ttl.unwrap_or(Duration::from_secs(30)),
        "the attempts of a replica that died are taken for running this long",
    )?;
    if lease_ttl < Duration::from_millis(300) {
        return Err(bad(
            "lease_ttl",
            "must be at least 300ms: leases are renewed every third of it",
        ));
    }
    let hold_timeout = flags.hold_timeout.or(file.hold_timeout);
    // Its default is within the bound: upstream_timeout is at most a day.
    let hold_timeout =
        hold_timeout.unwrap_or(upstream_timeout.saturating_add(Duration::from_secs(5)));
    let key_ttl = flags.key_ttl.or(file.key_ttl);
    Ok(Timings {
        upstream_timeout,
        attempt_deadline,
        lease_ttl,
        hold_timeout: at_most(
            "hold_timeout",
            positive("hold_timeout", hold_timeout)?,
            &WEEK,
            "a duplicate's client is kept waiting this long, its connection open",
        )?,
        key_ttl: at_most(
            "key_ttl",
            positive("key_ttl", key_ttl.unwrap_or(Duration::from_secs(24 * 3600)))?,
            &DECADE,
            "each key's expiry must be a PostgreSQL timestamp",
        )?,
    })
}

/// `attempt_deadline`: ten times `upstream_timeout` unless set (computed
/// only then: a huge upstream_timeout is refused, not multiplied), at
/// least it, at most a month.
fn attempt_deadline(
    file: &FileConfig,
    upstream_timeout: Duration,
) -> Result<Duration, ConfigError> {
    let attempt_deadline = at_most(
        "attempt_deadline",
        positive(
            "attempt_deadline",
            file.attempt_deadline
                .unwrap_or_else(|| upstream_timeout.saturating_mul(10)),
        )?,
        &MONTH,
        "an unknown attempt is looked up and its job kept open until then",
    )?;
    if attempt_deadline < upstream_timeout {
        return Err(bad(
            "attempt_deadline",
            format!(
                "must be at least upstream_timeout ({}); it is how long a late answer may still commit",
                humantime::format_duration(upstream_timeout)
            ),
        ));
    }
    Ok(attempt_deadline)
}

/// A period something is done again after (`sweep_interval`,
/// `probe_interval`, `lease_ttl`): more than zero, at most a day, `why`.
fn interval(key: &str, d: Duration, why: &str) -> Result<Duration, ConfigError> {
    at_most(key, positive(key, d)?, &DAY, why)
}

/// The Redis fast path, when a Redis URL is given.
fn redis_settings(file: &FileConfig, flags: &Flags) -> Result<Option<RedisSettings>, ConfigError> {
    // Checked with or without a URL, so a mistake is told now rather than
    // when redis_url is added; the TLS keys, which would promise an
    // encryption that is not there, are refused without one.
    let timeout = positive(
        "redis_timeout",
        file.redis_timeout.unwrap_or(Duration::from_millis(50)),
    )?;
    let inline_max = file
        .redis_inline_max
        .map_or(64 * 1024, |b| b.as_u64() as usize);
    let key_prefix = key_prefix(file.redis_key_prefix.as_deref())?;
    let Some(url) = flags.redis_url.clone().or(file.redis_url.clone()) else {
        redis::read(file, flags, None)?; // refuses TLS keys without a URL
        return Ok(None);
    };
    let topology = Topology::parse(&url).map_err(|e| {
        bad(
            "redis_url",
            format!("not a Redis this gateway can reach: {e}"),
        )
    })?;
    let tls = redis::read(file, flags, Some(&topology))?;
    Ok(Some(RedisSettings {
        topology,
        timeout,
        inline_max,
        key_prefix,
        tls,
    }))
}

/// The Redis key prefix unless `redis_key_prefix` names another.
pub const DEFAULT_REDIS_KEY_PREFIX: &str = "idemgate:";

/// `redis_key_prefix`: `idemgate:` unless set; never braces, which would
/// move a key's Redis Cluster slot away from its hash tag.
fn key_prefix(configured: Option<&str>) -> Result<String, ConfigError> {
    let prefix = configured.unwrap_or(DEFAULT_REDIS_KEY_PREFIX);
    if prefix.is_empty() || prefix.contains(['{', '}']) || prefix.chars().any(char::is_whitespace) {
        return Err(bad(
            "redis_key_prefix",
            format!("{prefix:?} cannot start every Redis key: give a non-empty prefix without braces or spaces, such as \"payments:\""),
        ));
    }
    Ok(prefix.to_owned())
}

fn at_least_one(key: &str, n: usize) -> Result<usize, ConfigError> {
    if n == 0 {
        return Err(bad(key, "must be at least 1"));
    }
    Ok(n)
}

/// The encryption keys: each 32 bytes of base64, read from the environment
/// or a file, ids unique, the active one among them.
fn encryption(
    e: &file::EncryptionFile,
    base_dir: &Path,
) -> Result<EncryptionSettings, ConfigError> {
    use base64::Engine;
    let mut keys: Vec<(String, [u8; 32])> = Vec::with_capacity(e.keys.len());
    for (i, k) in e.keys.iter().enumerate() {
        let key = format!("encryption.keys[{i}]");
        if k.id.is_empty() || keys.iter().any(|(id, _)| *id == k.id) {
            return Err(bad(
                format!("{key}.id"),
                "give every key a unique, non-empty id",
            ));
        }
        let text = match (&k.env, &k.file) {
            (Some(var), None) => std::env::var(var).map_err(|_| {
                bad(&key, format!("environment variable {var} is not set; export the key (32 bytes, base64: `openssl rand -base64 32`)"))
            })?,
            (None, Some(path)) => std::fs::read_to_string(base_dir.join(path))
                .map_err(|err| bad(&key, format!("cannot read {}: {err}", path.display())))?,
            _ => return Err(bad(&key, "give exactly one of `env` or `file`")),
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .ok()
            .and_then(|b| <[u8; 32]>::try_from(b).ok())
            .ok_or_else(|| {
                bad(
                    &key,
                    "not 32 bytes of base64; make one with `openssl rand -base64 32`",
                )
            })?;
        keys.push((k.id.clone(), bytes));
    }
    if !keys.iter().any(|(id, _)| *id == e.active) {
        return Err(bad(
            "encryption.active",
            format!("{:?} is not the id of any [[encryption.keys]]", e.active),
        ));
    }
    Ok(EncryptionSettings {
        active: e.active.clone(),
        keys,
    })
}

fn mismatch_status(configured: Option<u16>) -> Result<StatusCode, ConfigError> {
    match configured.unwrap_or(409) {
        409 => Ok(StatusCode::CONFLICT),
        422 => Ok(StatusCode::UNPROCESSABLE_ENTITY),
        other => Err(bad(
            "mismatch_status",
            format!("{other} is not allowed; use 409 (default) or 422 (IETF draft)"),
        )),
    }
}

fn size(
    key: &str,
    configured: Option<bytesize::ByteSize>,
    default: usize,
) -> Result<usize, ConfigError> {
    let size = configured.map_or(default, |b| b.as_u64() as usize);
    if size == 0 {
        return Err(bad(key, "must be greater than zero"));
    }
    Ok(size)
}

fn positive(key: &str, d: Duration) -> Result<Duration, ConfigError> {
    if d.is_zero() {
        return Err(bad(
            key,
            "must be greater than zero (write it like `250ms`, `10s` or `24h`)",
        ));
    }
    Ok(d)
}

/// A header name from the file, or its default.
fn named(configured: &Option<String>, key: &str, default: &str) -> Result<HeaderName, ConfigError> {
    header_name(key, configured.as_deref().unwrap_or(default))
}

fn header_name(key: &str, name: &str) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| bad(key, format!("{name:?} is not a valid HTTP header name")))
}

#[cfg(test)]
mod tests;

/// `respond_async_path`: where a job answered `202` is polled, on the proxy
/// listener; a path of its own, in normal form, that no route takes (a poll
/// must never reach an upstream, nor a route's request be read as a poll).
fn respond_async_path(written: Option<&str>, routes: &[Arc<Route>]) -> Result<String, ConfigError> {
    let key = "respond_async_path";
    let path = written.unwrap_or("/.well-known/idemgate/jobs");
    let normal = idemgate_domain::path::normalize(path);
    if !path.starts_with('/')
        || path.ends_with('/')
        || !matches!(normal, Ok(std::borrow::Cow::Borrowed(_)))
    {
        return Err(bad(
            key,
            format!("{path:?} must be a path in normal form, starting with `/` and not ending with one, like \"/.well-known/idemgate/jobs\""),
        ));
    }
    match routes
        .iter()
        .find(|r| r.path_prefix != "/" && r.matches_path(path))
    {
        Some(route) => Err(bad(
            key,
            format!(
                "{path:?} is under route {:?} ({}): polls would be read as its requests; \
                 choose a path no route takes",
                route.name, route.path_prefix
            ),
        )),
        None => Ok(path.to_owned()),
    }
}
