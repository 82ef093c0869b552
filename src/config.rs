//! Settings: plain data, read once at start-up and validated as a whole.
//!
//! Sources, strongest first: command-line flags, `IDEMGATE_*` environment
//! variables (clap reads both, flag over variable), then the TOML file named
//! by `--config`, then the defaults below. Every problem is reported with the
//! key that caused it and how to fix it, before anything starts.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use http::{HeaderName, Method, StatusCode, Uri};
use serde::Deserialize;

use crate::contract::{Contract, ContractFile};
use crate::fastpath::FastPathSettings;
use crate::fingerprint::BodyRule;
use crate::store::postgres::PgSettings;

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "idemgate",
    version,
    about = "A reverse proxy that makes retries safe"
)]
pub struct Cli {
    /// TOML configuration file (see config/idemgate.example.toml).
    #[arg(long, global = true, env = "IDEMGATE_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gateway (applies migrations first).
    Serve(Flags),
    /// Apply the database migrations and exit.
    Migrate(Flags),
    /// Run every contract's probes against every upstream, print a table,
    /// and exit non-zero if any fails.
    VerifyProviders(Flags),
}

/// The flags of DESIGN §7; each overrides the file and has an `IDEMGATE_*` twin.
#[derive(Debug, Default, Args)]
pub struct Flags {
    /// Address of the proxy listener.
    #[arg(long, env = "IDEMGATE_LISTEN", value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Address of the admin listener (jobs, resolution, health, metrics).
    #[arg(long, env = "IDEMGATE_ADMIN_LISTEN", value_name = "ADDR")]
    pub admin_listen: Option<SocketAddr>,
    /// Bearer token for the admin API; without one the job endpoints are off.
    #[arg(
        long,
        env = "IDEMGATE_ADMIN_TOKEN",
        value_name = "TOKEN",
        hide_env_values = true
    )]
    pub admin_token: Option<String>,
    /// Upstream base URL; repeat it (or separate with commas in the variable):
    /// the first is the primary, the rest are fallbacks in order.
    #[arg(
        long = "upstream",
        env = "IDEMGATE_UPSTREAM",
        value_name = "URL",
        value_delimiter = ','
    )]
    pub upstreams: Vec<String>,
    /// PostgreSQL URL, e.g. postgres://user@host/db.
    #[arg(
        long,
        env = "IDEMGATE_DATABASE_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    pub database_url: Option<String>,
    /// Embedded store file, used when no database URL is given.
    #[arg(long, env = "IDEMGATE_EMBEDDED_PATH", value_name = "FILE")]
    pub embedded_path: Option<PathBuf>,
    /// Redis URL for the replay fast path.
    #[arg(
        long,
        env = "IDEMGATE_REDIS_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    pub redis_url: Option<String>,
    /// Silence after which an attempt's outcome is unknown (e.g. 30s).
    #[arg(long, env = "IDEMGATE_UPSTREAM_TIMEOUT", value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub upstream_timeout: Option<Duration>,
    /// How long a duplicate of a running job is held before 409.
    #[arg(long, env = "IDEMGATE_HOLD_TIMEOUT", value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub hold_timeout: Option<Duration>,
    /// How long a key is remembered after its first request.
    #[arg(long, env = "IDEMGATE_KEY_TTL", value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub key_ttl: Option<Duration>,
}

/// The TOML file, as written. Every field is optional; see `Settings` for defaults.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    listen: Option<SocketAddr>,
    admin_listen: Option<SocketAddr>,
    admin_token: Option<String>,
    upstreams: Option<Vec<UpstreamFile>>,
    database_url: Option<String>,
    database_pool_size: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    database_timeout: Option<Duration>,
    embedded_path: Option<PathBuf>,
    redis_url: Option<String>,
    #[serde(default, with = "humantime_serde")]
    redis_timeout: Option<Duration>,
    redis_inline_max: Option<bytesize::ByteSize>,
    #[serde(default, with = "humantime_serde")]
    upstream_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    attempt_deadline: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    hold_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    key_ttl: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    lease_ttl: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    sweep_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    retry_after: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    shutdown_grace: Option<Duration>,
    owner_header: Option<String>,
    forward_key_header: Option<String>,
    forward_attempt_header: Option<String>,
    mismatch_status: Option<u16>,
    max_response_size: Option<bytesize::ByteSize>,
    #[serde(default, with = "humantime_serde")]
    probe_interval: Option<Duration>,
    #[serde(default)]
    routes: Vec<RouteFile>,
    #[serde(default)]
    contracts: BTreeMap<String, ContractFile>,
    /// The folder contract files are read from (the config file's own).
    #[serde(skip)]
    base_dir: PathBuf,
}

/// An upstream: a bare URL, or a table with its own settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum UpstreamFile {
    Url(String),
    Table(UpstreamTable),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct UpstreamTable {
    name: Option<String>,
    url: String,
    #[serde(default, with = "humantime_serde")]
    timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    connect_timeout: Option<Duration>,
    ca_file: Option<PathBuf>,
    #[serde(default)]
    headers: BTreeMap<String, HeaderSource>,
}

/// A header an upstream gets on every request: a fixed value, or one read
/// from an environment variable at start-up (a provider's API key, which
/// clients then never hold), with an optional prefix such as `Bearer `.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct HeaderSource {
    value: Option<String>,
    env: Option<String>,
    #[serde(default)]
    prefix: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteFile {
    name: Option<String>,
    path_prefix: Option<String>,
    methods: Option<Vec<String>>,
    require_key: Option<bool>,
    body_limit: Option<bytesize::ByteSize>,
    significant_headers: Option<Vec<String>>,
    retryable_statuses: Option<Vec<u16>>,
    canonical_json: Option<bool>,
    ignore_fields: Option<Vec<String>>,
    upstreams: Option<Vec<String>>,
    max_attempts: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    failover_deadline: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    hedge_after: Option<Duration>,
    side_effect_free: Option<bool>,
    contract: Option<String>,
}

/// A start-up configuration problem, naming the key and the fix.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: `{key}`: {message}")]
pub struct ConfigError {
    /// The offending key (as written in the file; flags and variables named in the message).
    pub key: String,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl ConfigError {
    /// A problem with `key`, and how to fix it.
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            message: message.into(),
        }
    }
}

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
    /// Upstreams, the primary first.
    pub upstreams: Vec<UpstreamSettings>,
    /// Where jobs and attempts are kept.
    pub store: StoreSettings,
    /// The Redis fast path, when configured.
    pub fastpath: Option<FastPathSettings>,
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
    /// How long open connections may finish after SIGTERM.
    pub shutdown_grace: Duration,
    /// The request header the owner is derived from.
    pub owner_header: HeaderName,
    /// The header carrying the job id upstream.
    pub forward_key_header: HeaderName,
    /// The header carrying the attempt number upstream.
    pub forward_attempt_header: HeaderName,
    /// 409 (default) or 422 (the IETF draft) for a key reused with another request.
    pub mismatch_status: StatusCode,
    /// Largest upstream response that can be committed.
    pub max_response_size: usize,
    /// Opt-in routes, most specific prefix first (shared, not copied, by
    /// the requests that match them).
    pub routes: Vec<Arc<Route>>,
    /// Response contracts, by name.
    pub contracts: BTreeMap<String, Arc<Contract>>,
    /// How often upstreams are probed against the contracts of their routes.
    pub probe_interval: Duration,
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

/// Which store to use.
#[derive(Debug, Clone)]
pub enum StoreSettings {
    /// PostgreSQL: the production store, shared by any number of replicas.
    Postgres(PgSettings),
    /// SQLite in a local file: zero set-up, one gateway.
    Embedded {
        /// The database file.
        path: PathBuf,
    },
}

/// One upstream.
#[derive(Debug, Clone)]
pub struct UpstreamSettings {
    /// Its name in attempts and logs (`primary`, `fallback-1`, … unless named).
    pub name: String,
    /// Its base URL: scheme, authority and an optional path prefix.
    pub base: Uri,
    /// Silence after which an attempt on it is unknown.
    pub timeout: Duration,
    /// How long connecting may take (a safe failure: nothing was sent).
    pub connect_timeout: Duration,
    /// Headers set on every request to it (values may be secrets).
    pub headers: Vec<(HeaderName, http::HeaderValue)>,
    /// Certificate authorities trusted for `https://` besides the public
    /// web PKI roots (a private CA, a self-signed provider).
    pub extra_roots: Vec<rustls::pki_types::CertificateDer<'static>>,
}

/// Which requests opt in, and how they are treated.
#[derive(Debug, Clone)]
pub struct Route {
    /// Its name, recorded on jobs.
    pub name: String,
    /// Requests whose path starts with this match.
    pub path_prefix: String,
    /// Methods that opt in.
    pub methods: Vec<Method>,
    /// Whether a request without a key is refused (400) rather than passed through.
    pub require_key: bool,
    /// Largest request body accepted (413 past it).
    pub body_limit: usize,
    /// Headers that are part of the fingerprint.
    pub significant_headers: Vec<HeaderName>,
    /// Upstream statuses that mean "had no effect, safe to retry".
    pub retryable_statuses: Vec<u16>,
    /// How bodies are fingerprinted.
    pub body: BodyRule,
    /// The upstreams it may use, as indices into `Settings::upstreams`,
    /// primary first.
    pub upstreams: Vec<usize>,
    /// Most attempts the gateway makes within one client request (failover).
    pub max_attempts: usize,
    /// Overall time the gateway may spend on one client request's attempts.
    pub failover_deadline: Duration,
    /// Silence after which a second attempt races the first (side-effect-free routes only).
    pub hedge_after: Option<Duration>,
    /// The route's answers have no external side effects, so hedging is allowed.
    pub side_effect_free: bool,
    /// The contract every answer must honour.
    pub contract: Option<Arc<Contract>>,
}

impl Route {
    /// The default: POST and PATCH everywhere, key optional.
    pub fn default_route() -> Route {
        Route {
            name: "default".into(),
            path_prefix: "/".into(),
            methods: vec![Method::POST, Method::PATCH],
            require_key: false,
            body_limit: 10 * 1024 * 1024,
            significant_headers: vec![http::header::CONTENT_TYPE],
            retryable_statuses: vec![429, 502, 503],
            body: BodyRule::default(),
            upstreams: vec![0],
            max_attempts: 1,
            failover_deadline: Duration::from_secs(60),
            hedge_after: None,
            side_effect_free: false,
            contract: None,
        }
    }

    /// Whether this route matches a path.
    pub fn matches_path(&self, path: &str) -> bool {
        path.starts_with(&self.path_prefix)
    }
}

impl Settings {
    /// Reads the file (if any), lays the flags over it and validates the lot.
    pub fn load(config: Option<&Path>, flags: Flags) -> Result<Settings, ConfigError> {
        Self::from_sources(Self::read_file(config)?, flags)
    }

    /// Only the store settings, for `idemgate migrate`.
    pub fn load_store(config: Option<&Path>, flags: Flags) -> Result<StoreSettings, ConfigError> {
        store_settings(&Self::read_file(config)?, &flags)
    }

    /// The config file, parsed, remembering its folder (contract files are
    /// relative to it); no file is an empty one.
    fn read_file(config: Option<&Path>) -> Result<FileConfig, ConfigError> {
        let Some(path) = config else {
            return Ok(FileConfig::default());
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad("--config", format!("cannot read {}: {e}", path.display())))?;
        let mut file = Self::parse_file(&text)?;
        file.base_dir = path.parent().map(Path::to_owned).unwrap_or_default();
        Ok(file)
    }

    /// Parses TOML text; unknown keys are errors.
    pub fn parse_file(text: &str) -> Result<FileConfig, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let message = e.message().to_owned();
            // Unknown keys are named in the message; bad values by the
            // line their span points at.
            let key = message
                .split('`')
                .nth(1)
                .map(str::to_owned)
                .or_else(|| e.span().and_then(|span| key_at(text, span.start)))
                .unwrap_or_else(|| "config file".to_owned());
            bad(
                key,
                format!("{message} (see config/idemgate.example.toml for every key)"),
            )
        })
    }

    /// Merges parsed sources, flags winning, and validates.
    pub fn from_sources(file: FileConfig, flags: Flags) -> Result<Settings, ConfigError> {
        let upstream_files = if flags.upstreams.is_empty() {
            file.upstreams.clone().unwrap_or_default()
        } else {
            flags
                .upstreams
                .iter()
                .cloned()
                .map(UpstreamFile::Url)
                .collect()
        };
        if upstream_files.is_empty() {
            return Err(bad(
                "upstreams",
                "no upstream configured; pass --upstream http://host:port, set IDEMGATE_UPSTREAM, \
                 or list `upstreams = [\"http://host:port\"]` in the config file",
            ));
        }
        let store = store_settings(&file, &flags)?;

        let upstream_timeout = positive(
            "upstream_timeout",
            flags
                .upstream_timeout
                .or(file.upstream_timeout)
                .unwrap_or(Duration::from_secs(30)),
        )?;
        let upstreams = upstream_files
            .iter()
            .enumerate()
            .map(|(i, u)| parse_upstream(i, u, upstream_timeout, &file.base_dir))
            .collect::<Result<Vec<_>, _>>()?;
        for (i, u) in upstreams.iter().enumerate() {
            if upstreams[..i].iter().any(|other| other.name == u.name) {
                return Err(bad(
                    format!("upstreams[{i}].name"),
                    format!("{:?} is used twice; upstream names must be unique", u.name),
                ));
            }
        }
        let mut loaded = BTreeMap::new();
        for (name, contract_file) in file.contracts {
            let contract = Contract::load(&name, contract_file, &file.base_dir)?;
            loaded.insert(name, Arc::new(contract));
        }
        let attempt_deadline = positive(
            "attempt_deadline",
            file.attempt_deadline.unwrap_or(upstream_timeout * 10),
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
        let lease_ttl = positive(
            "lease_ttl",
            file.lease_ttl.unwrap_or(Duration::from_secs(30)),
        )?;
        if lease_ttl < Duration::from_millis(300) {
            return Err(bad(
                "lease_ttl",
                "must be at least 300ms: leases are renewed every third of it",
            ));
        }
        let mismatch_status = match file.mismatch_status.unwrap_or(409) {
            409 => StatusCode::CONFLICT,
            422 => StatusCode::UNPROCESSABLE_ENTITY,
            other => {
                return Err(bad(
                    "mismatch_status",
                    format!("{other} is not allowed; use 409 (default) or 422 (IETF draft)"),
                ))
            }
        };

        let mut routes = if file.routes.is_empty() {
            vec![Route {
                upstreams: (0..upstreams.len()).collect(),
                max_attempts: upstreams.len(),
                ..Route::default_route()
            }]
        } else {
            file.routes
                .into_iter()
                .enumerate()
                .map(|(i, r)| parse_route(i, r, &upstreams, &loaded))
                .collect::<Result<Vec<_>, _>>()?
        };
        // Longest prefix first, so the most specific route wins.
        routes.sort_by_key(|r| std::cmp::Reverse(r.path_prefix.len()));
        let routes = routes.into_iter().map(Arc::new).collect();

        let settings = Settings {
            listen: flags
                .listen
                .or(file.listen)
                .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 8080))),
            admin_listen: flags
                .admin_listen
                .or(file.admin_listen)
                .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 9090))),
            admin_token: flags
                .admin_token
                .or(file.admin_token)
                .filter(|t| !t.is_empty()),
            upstreams,
            store,
            fastpath: match flags.redis_url.clone().or(file.redis_url.clone()) {
                None => None,
                Some(url) => {
                    redis::Client::open(url.as_str()).map_err(|e| {
                        bad(
                            "redis_url",
                            format!("not a Redis URL ({e}); use redis://host:6379/0"),
                        )
                    })?;
                    Some(FastPathSettings {
                        url,
                        timeout: positive(
                            "redis_timeout",
                            file.redis_timeout.unwrap_or(Duration::from_millis(50)),
                        )?,
                        inline_max: file
                            .redis_inline_max
                            .map(|b| b.as_u64() as usize)
                            .unwrap_or(64 * 1024),
                    })
                }
            },
            upstream_timeout,
            attempt_deadline,
            hold_timeout: positive(
                "hold_timeout",
                flags
                    .hold_timeout
                    .or(file.hold_timeout)
                    .unwrap_or(upstream_timeout + Duration::from_secs(5)),
            )?,
            key_ttl: positive(
                "key_ttl",
                flags
                    .key_ttl
                    .or(file.key_ttl)
                    .unwrap_or(Duration::from_secs(24 * 3600)),
            )?,
            lease_ttl,
            sweep_interval: positive(
                "sweep_interval",
                file.sweep_interval.unwrap_or(Duration::from_secs(5)),
            )?,
            retry_after: file.retry_after.unwrap_or(Duration::from_secs(1)),
            shutdown_grace: file.shutdown_grace.unwrap_or(Duration::from_secs(10)),
            owner_header: header_name(
                "owner_header",
                file.owner_header.as_deref().unwrap_or("authorization"),
            )?,
            forward_key_header: header_name(
                "forward_key_header",
                file.forward_key_header
                    .as_deref()
                    .unwrap_or("idempotency-key"),
            )?,
            forward_attempt_header: header_name(
                "forward_attempt_header",
                file.forward_attempt_header
                    .as_deref()
                    .unwrap_or("idempotency-attempt"),
            )?,
            mismatch_status,
            contracts: loaded,
            probe_interval: positive(
                "probe_interval",
                file.probe_interval.unwrap_or(Duration::from_secs(60)),
            )?,
            max_response_size: file
                .max_response_size
                .map(|b| b.as_u64() as usize)
                .unwrap_or(10 * 1024 * 1024),
            routes,
        };
        if settings.max_response_size == 0 {
            return Err(bad("max_response_size", "must be greater than zero"));
        }
        Ok(settings)
    }

    /// The route an opted-in request falls under, if any.
    pub fn route_for(&self, method: &Method, path: &str) -> Option<&Arc<Route>> {
        self.routes
            .iter()
            .find(|r| r.matches_path(path) && r.methods.contains(method))
    }
}

/// PostgreSQL when a database URL is given, the embedded store otherwise.
fn store_settings(file: &FileConfig, flags: &Flags) -> Result<StoreSettings, ConfigError> {
    let Some(url) = flags
        .database_url
        .clone()
        .or_else(|| file.database_url.clone())
    else {
        let path = flags
            .embedded_path
            .clone()
            .or_else(|| file.embedded_path.clone())
            .unwrap_or_else(|| PathBuf::from("idemgate.db"));
        return Ok(StoreSettings::Embedded { path });
    };
    url.parse::<tokio_postgres::Config>().map_err(|e| {
        bad(
            "database_url",
            format!("not a PostgreSQL URL ({e}); use postgres://user@host:5432/dbname"),
        )
    })?;
    let pool_size = file.database_pool_size.unwrap_or(16);
    if pool_size == 0 {
        return Err(bad("database_pool_size", "must be at least 1"));
    }
    let connect_timeout = positive(
        "database_timeout",
        file.database_timeout.unwrap_or(Duration::from_secs(2)),
    )?;
    Ok(StoreSettings::Postgres(PgSettings {
        url,
        pool_size,
        connect_timeout,
    }))
}

/// The key written on the line holding byte `at`, if that line is `key = …`.
fn key_at(text: &str, at: usize) -> Option<String> {
    let start = text[..at.min(text.len())].rfind('\n').map_or(0, |i| i + 1);
    let line = text[start..].lines().next()?;
    let (key, _) = line.split_once('=')?;
    let key = key.trim();
    (!key.is_empty() && !key.starts_with('[')).then(|| key.to_owned())
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

fn header_name(key: &str, name: &str) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| bad(key, format!("{name:?} is not a valid HTTP header name")))
}

fn parse_upstream(
    i: usize,
    file: &UpstreamFile,
    default_timeout: Duration,
    base_dir: &Path,
) -> Result<UpstreamSettings, ConfigError> {
    let key = format!("upstreams[{i}]");
    let (url, table) = match file {
        UpstreamFile::Url(url) => (url.as_str(), None),
        UpstreamFile::Table(t) => (t.url.as_str(), Some(t)),
    };
    let base: Uri = url.parse().map_err(|e| {
        bad(
            &key,
            format!("{url:?} is not a URL ({e}); write it like http://127.0.0.1:8000"),
        )
    })?;
    match base.scheme_str() {
        Some("http" | "https") => {}
        Some(other) => {
            return Err(bad(
                &key,
                format!("scheme {other:?} is not supported; use http:// or https://"),
            ))
        }
        None => {
            return Err(bad(
                &key,
                format!("{url:?} has no scheme; write it like http://{url}"),
            ))
        }
    }
    if base.authority().is_none() {
        return Err(bad(&key, format!("{url:?} has no host")));
    }
    if base.query().is_some() {
        return Err(bad(&key, "an upstream base URL cannot carry a query"));
    }
    let default_name = if i == 0 {
        "primary".to_owned()
    } else {
        format!("fallback-{i}")
    };
    let timeout = table.and_then(|t| t.timeout).unwrap_or(default_timeout);
    let mut headers = Vec::new();
    for (name, source) in table.map(|t| &t.headers).into_iter().flatten() {
        let hkey = format!("{key}.headers.{name}");
        let name = header_name(&hkey, name)?;
        let raw = match (&source.value, &source.env) {
            (Some(v), None) => v.clone(),
            (None, Some(var)) => std::env::var(var).map_err(|_| {
                bad(
                    &hkey,
                    format!("environment variable {var} is not set; export it, it holds this upstream's credential"),
                )
            })?,
            _ => return Err(bad(&hkey, "give exactly one of `value` or `env`")),
        };
        let value = http::HeaderValue::from_str(&format!("{}{raw}", source.prefix))
            .map_err(|_| bad(&hkey, "not a valid header value"))?;
        headers.push((name, value));
    }
    let extra_roots = match table.and_then(|t| t.ca_file.as_ref()) {
        None => Vec::new(),
        Some(path) => {
            use rustls::pki_types::pem::PemObject;
            let full = base_dir.join(path);
            let ckey = format!("{key}.ca_file");
            let certs = rustls::pki_types::CertificateDer::pem_file_iter(&full)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| {
                    bad(
                        &ckey,
                        format!("cannot read PEM certificates from {}: {e}", full.display()),
                    )
                })?;
            if certs.is_empty() {
                return Err(bad(
                    &ckey,
                    format!("{} holds no certificate", full.display()),
                ));
            }
            certs
        }
    };
    Ok(UpstreamSettings {
        extra_roots,
        name: table.and_then(|t| t.name.clone()).unwrap_or(default_name),
        base,
        timeout: positive(&format!("{key}.timeout"), timeout)?,
        connect_timeout: positive(
            &format!("{key}.connect_timeout"),
            table
                .and_then(|t| t.connect_timeout)
                .unwrap_or(timeout.min(Duration::from_secs(10))),
        )?,
        headers,
    })
}

fn parse_route(
    i: usize,
    r: RouteFile,
    upstreams: &[UpstreamSettings],
    contracts: &BTreeMap<String, Arc<Contract>>,
) -> Result<Route, ConfigError> {
    let key = |field: &str| format!("routes[{i}].{field}");
    let default = Route::default_route();
    let path_prefix = r.path_prefix.unwrap_or_else(|| "/".into());
    if !path_prefix.starts_with('/') {
        return Err(bad(
            key("path_prefix"),
            format!("{path_prefix:?} must start with `/`"),
        ));
    }
    let methods = match r.methods {
        None => default.methods,
        Some(ms) if ms.is_empty() => {
            return Err(bad(key("methods"), "list at least one method, e.g. [\"POST\"]"))
        }
        Some(ms) => ms
            .iter()
            .map(|m| {
                let upper = m.to_ascii_uppercase();
                match upper.as_str() {
                    "GET" | "HEAD" | "OPTIONS" | "CONNECT" | "TRACE" => Err(bad(
                        key("methods"),
                        format!("{m} cannot opt in: only request methods with effects (POST, PUT, PATCH, DELETE) can"),
                    )),
                    _ => Method::from_bytes(upper.as_bytes())
                        .map_err(|_| bad(key("methods"), format!("{m:?} is not an HTTP method"))),
                }
            })
            .collect::<Result<Vec<_>, _>>()?,
    };
    let significant_headers = match r.significant_headers {
        None => default.significant_headers,
        Some(hs) => hs
            .iter()
            .map(|h| header_name(&key("significant_headers"), h))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let retryable_statuses = r.retryable_statuses.unwrap_or(default.retryable_statuses);
    if let Some(s) = retryable_statuses
        .iter()
        .find(|s| !(100..=599).contains(*s))
    {
        return Err(bad(
            key("retryable_statuses"),
            format!("{s} is not an HTTP status"),
        ));
    }
    let ignore = r.ignore_fields.unwrap_or_default();
    if let Some(p) = ignore.iter().find(|p| !p.starts_with('/')) {
        return Err(bad(
            key("ignore_fields"),
            format!("{p:?} is not a JSON pointer; write it like \"/metadata/sent_at\""),
        ));
    }
    let body_limit = r
        .body_limit
        .map(|b| b.as_u64() as usize)
        .unwrap_or(default.body_limit);
    if body_limit == 0 {
        return Err(bad(key("body_limit"), "must be greater than zero"));
    }
    let route_upstreams = match &r.upstreams {
        None => (0..upstreams.len()).collect::<Vec<_>>(),
        Some(names) if names.is_empty() => {
            return Err(bad(key("upstreams"), "list at least one upstream name"))
        }
        Some(names) => names
            .iter()
            .map(|n| {
                upstreams.iter().position(|u| &u.name == n).ok_or_else(|| {
                    bad(
                        key("upstreams"),
                        format!(
                            "no upstream is named {n:?}; known: {}",
                            upstreams
                                .iter()
                                .map(|u| u.name.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?,
    };
    let max_attempts = r.max_attempts.unwrap_or(route_upstreams.len());
    if max_attempts == 0 {
        return Err(bad(key("max_attempts"), "must be at least 1"));
    }
    let side_effect_free = r.side_effect_free.unwrap_or(false);
    if r.hedge_after.is_some() && !side_effect_free {
        return Err(bad(
            key("hedge_after"),
            "hedging sends the same request twice at once; allow it only on a route declared \
             `side_effect_free = true`",
        ));
    }
    if let Some(h) = r.hedge_after {
        positive(&key("hedge_after"), h)?;
    }
    let contract = match &r.contract {
        None => None,
        Some(name) => Some(contracts.get(name).cloned().ok_or_else(|| {
            bad(
                key("contract"),
                format!("no [contracts.{name}] section defines this contract"),
            )
        })?),
    };
    Ok(Route {
        upstreams: route_upstreams,
        max_attempts,
        failover_deadline: positive(
            &key("failover_deadline"),
            r.failover_deadline.unwrap_or(Duration::from_secs(60)),
        )?,
        hedge_after: r.hedge_after,
        side_effect_free,
        contract,
        name: r.name.unwrap_or_else(|| format!("route-{i}")),
        path_prefix,
        methods,
        require_key: r.require_key.unwrap_or(false),
        body_limit,
        significant_headers,
        retryable_statuses,
        body: BodyRule {
            canonical_json: r.canonical_json.unwrap_or(false),
            ignore,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags_with_upstream() -> Flags {
        Flags {
            upstreams: vec!["http://127.0.0.1:8000".into()],
            ..Flags::default()
        }
    }

    #[test]
    fn flags_override_the_file() {
        let file = Settings::parse_file(
            "upstream_timeout = \"5s\"\nhold_timeout = \"7s\"\nupstreams = [\"http://a:1\"]",
        )
        .unwrap();
        let flags = Flags {
            upstream_timeout: Some(Duration::from_secs(2)),
            ..flags_with_upstream()
        };
        let s = Settings::from_sources(file, flags).unwrap();
        assert_eq!(s.upstream_timeout, Duration::from_secs(2));
        assert_eq!(s.hold_timeout, Duration::from_secs(7));
        assert_eq!(s.upstreams[0].base, "http://127.0.0.1:8000");
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = Settings::parse_file("upstream_timout = \"5s\"").unwrap_err();
        assert_eq!(err.key, "upstream_timout");
    }

    #[test]
    fn unparsable_values_are_named() {
        let err = Settings::parse_file("listen = \"127.0.0.1:1\"\nhold_timeout = \"soon\"\n")
            .unwrap_err();
        assert_eq!(err.key, "hold_timeout");
    }

    #[test]
    fn bad_values_name_their_key() {
        let err = Settings::from_sources(
            Settings::parse_file("mismatch_status = 400").unwrap(),
            flags_with_upstream(),
        )
        .unwrap_err();
        assert_eq!(err.key, "mismatch_status");
        let err = Settings::from_sources(
            Settings::parse_file("[[routes]]\nmethods = [\"GET\"]").unwrap(),
            flags_with_upstream(),
        )
        .unwrap_err();
        assert_eq!(err.key, "routes[0].methods");
        let err = Settings::from_sources(FileConfig::default(), Flags::default()).unwrap_err();
        assert_eq!(err.key, "upstreams");
        let err = Settings::from_sources(
            FileConfig::default(),
            Flags {
                upstreams: vec!["ftp://x".into()],
                ..Flags::default()
            },
        )
        .unwrap_err();
        assert_eq!(err.key, "upstreams[0]");
    }

    #[test]
    fn the_chat_example_is_valid() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/chat");
        let mut file =
            Settings::parse_file(&std::fs::read_to_string(dir.join("idemgate.toml")).unwrap())
                .unwrap();
        file.base_dir = dir;
        // Credentials come from the environment; stand in fixed values here.
        for u in file.upstreams.iter_mut().flatten() {
            if let UpstreamFile::Table(t) = u {
                for source in t.headers.values_mut() {
                    source.value = Some("test".into());
                    source.env = None;
                }
            }
        }
        let s = Settings::from_sources(file, Flags::default()).unwrap();
        let chat = &s.routes[0];
        assert_eq!(chat.upstreams, vec![0, 1]);
        assert!(chat.side_effect_free && chat.hedge_after.is_some());
        assert_eq!(chat.contract.as_ref().unwrap().probes.len(), 1);
    }

    #[test]
    fn the_example_file_is_valid() {
        let text = include_str!("../config/idemgate.example.toml");
        let s =
            Settings::from_sources(Settings::parse_file(text).unwrap(), Flags::default()).unwrap();
        assert_eq!(s.routes.len(), 2);
        assert_eq!(s.routes[0].name, "chat", "most specific first");
    }

    #[test]
    fn default_route_opts_in_post_and_patch_everywhere() {
        let s = Settings::from_sources(FileConfig::default(), flags_with_upstream()).unwrap();
        assert!(s.route_for(&Method::POST, "/anything").is_some());
        assert!(s.route_for(&Method::PATCH, "/").is_some());
        assert!(s.route_for(&Method::PUT, "/anything").is_none());
        assert!(s.route_for(&Method::GET, "/anything").is_none());
    }

    #[test]
    fn most_specific_route_wins() {
        let file = Settings::parse_file(
            "[[routes]]\nname = \"all\"\npath_prefix = \"/\"\n\
             [[routes]]\nname = \"chat\"\npath_prefix = \"/v1/chat\"\nrequire_key = true\n",
        )
        .unwrap();
        let s = Settings::from_sources(file, flags_with_upstream()).unwrap();
        assert_eq!(
            s.route_for(&Method::POST, "/v1/chat/completions")
                .unwrap()
                .name,
            "chat"
        );
        assert_eq!(s.route_for(&Method::POST, "/v1/other").unwrap().name, "all");
    }
}
