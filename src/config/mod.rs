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
//! - this module: the settings as a whole, their defaults and validation.

pub mod contracts;
pub mod file;
pub mod flags;
pub mod redis;
pub mod routes;
pub mod store;
pub mod trust;
pub mod upstreams;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};

use crate::domain::contract::Contract;

pub use file::FileConfig;
pub use flags::{Cli, Command, Flags};
pub use redis::{RedisSettings, Topology};
pub use routes::Route;
pub use store::{PgSettings, StoreSettings};
pub use trust::{Clients, OwnerRule, OwnerSource, TrustedProxies};
pub use upstreams::{UpstreamId, UpstreamSettings};

use file::UpstreamFile;

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
    /// Whether the console's cookie is `Secure` and `__Host-` prefixed (the
    /// admin listener speaks plain HTTP: for HTTPS terminated in front).
    pub console_secure_cookie: bool,
    /// Upstreams in configured order; never empty. Requests on no route
    /// pass through to the first.
    pub upstreams: Vec<Arc<UpstreamSettings>>,
    /// Where jobs and attempts are kept.
    pub store: StoreSettings,
    /// The Redis fast path, when configured.
    pub redis: Option<RedisSettings>,
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
    /// Requests in progress at most; past it the gateway answers `503` at
    /// once, before it takes any job.
    pub max_in_flight: usize,
    /// Threads of the runtime serving requests; with 1 it is Tokio's
    /// current-thread runtime, with no scheduler between threads at all
    /// (docs/design.md §12).
    pub worker_threads: usize,
}

/// What a listener allows its clients.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Open connections at most.
    pub max_connections: usize,
    /// How long a client may take to send a request's headers (and how long
    /// a connection may sit idle between requests).
    pub header_read_timeout: Duration,
    /// Largest request header block, in bytes.
    pub max_header_size: usize,
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

/// Timings that are checked against one another.
struct Timings {
    upstream_timeout: Duration,
    attempt_deadline: Duration,
    lease_ttl: Duration,
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
        let timings = timings(&file, &flags)?;
        let trust = trust(&mut file, &flags, &store)?;
        let (upstreams, contracts, routes) =
            traffic(&mut file, &flags, timings.upstream_timeout, &trust)?;
        let loopback = |port| SocketAddr::from(([127, 0, 0, 1], port));
        Ok(Settings {
            listen: flags.listen.or(file.listen).unwrap_or(loopback(8080)),
            admin_listen: flags
                .admin_listen
                .or(file.admin_listen)
                .unwrap_or(loopback(9090)),
            admin_token: flags
                .admin_token
                .clone()
                .or(file.admin_token.clone())
                .filter(|t| !t.is_empty()),
            console_secure_cookie: file.console_secure_cookie.unwrap_or(false),
            upstreams,
            store,
            redis: redis_settings(&file, &flags)?,
            upstream_timeout: timings.upstream_timeout,
            attempt_deadline: timings.attempt_deadline,
            hold_timeout: positive(
                "hold_timeout",
                flags
                    .hold_timeout
                    .or(file.hold_timeout)
                    .unwrap_or(timings.upstream_timeout + Duration::from_secs(5)),
            )?,
            key_ttl: positive(
                "key_ttl",
                flags
                    .key_ttl
                    .or(file.key_ttl)
                    .unwrap_or(Duration::from_secs(24 * 3600)),
            )?,
            lease_ttl: timings.lease_ttl,
            sweep_interval: positive(
                "sweep_interval",
                file.sweep_interval.unwrap_or(Duration::from_secs(5)),
            )?,
            retry_after: file.retry_after.unwrap_or(Duration::from_secs(1)),
            shutdown_grace: file.shutdown_grace.unwrap_or(Duration::from_secs(10)),
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
            max_response_size: size("max_response_size", file.max_response_size, 10 << 20)?,
            // Zero is allowed: it turns the cache off.
            replay_cache_size: file
                .replay_cache_size
                .map_or(64 << 20, |b| b.as_u64() as usize),
            routes,
            contracts,
            probe_interval: positive(
                "probe_interval",
                file.probe_interval.unwrap_or(Duration::from_secs(60)),
            )?,
            encryption: file
                .encryption
                .as_ref()
                .map(|e| encryption(e, &file.base_dir))
                .transpose()?,
            limits: limits(&file)?,
            max_in_flight: at_least_one("max_in_flight", file.max_in_flight.unwrap_or(10_000))?,
            worker_threads: at_least_one(
                "worker_threads",
                flags
                    .worker_threads
                    .or(file.worker_threads)
                    .unwrap_or_else(|| {
                        std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
                    }),
            )?,
        })
    }

    /// The route an opted-in request falls under, if any.
    pub fn route_for(&self, method: &Method, path: &str) -> Option<&Arc<Route>> {
        routes::find(&self.routes, method, path)
    }
}

/// Where requests go: the upstreams (the flags' over the file's), the
/// contracts their answers must honour, and the routes that opt in.
#[allow(clippy::type_complexity)] // the three parts of one answer, named below
fn traffic(
    file: &mut FileConfig,
    flags: &Flags,
    upstream_timeout: Duration,
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
    let upstreams = upstreams::parse_all(&upstream_files, upstream_timeout, &file.base_dir)?;
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
    let text = match (&flags.owner_salt, written) {
        (Some(text), _) => text.clone(),
        (None, Some(secret)) => secret.read("owner.salt", base)?,
        (None, None) => {
            return match store {
                StoreSettings::Embedded { path } => {
                    let mut beside = path.clone().into_os_string();
                    beside.push(".owner-salt");
                    Ok(OwnerSaltSetting::BesideStore(beside.into()))
                }
                StoreSettings::Postgres(_) => Err(bad(
                    "owner.salt",
                    "every replica sharing PostgreSQL must salt owner digests with one secret kept outside the database: \
                     set IDEMGATE_OWNER_SALT (or [owner] salt = { env = \"…\" }) to `openssl rand -base64 32`",
                )),
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

/// The upstream timeout and the timings that must agree with it.
fn timings(file: &FileConfig, flags: &Flags) -> Result<Timings, ConfigError> {
    let upstream_timeout = positive(
        "upstream_timeout",
        flags
            .upstream_timeout
            .or(file.upstream_timeout)
            .unwrap_or(Duration::from_secs(30)),
    )?;
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
    Ok(Timings {
        upstream_timeout,
        attempt_deadline,
        lease_ttl,
    })
}

/// The Redis fast path, when a Redis URL is given.
fn redis_settings(file: &FileConfig, flags: &Flags) -> Result<Option<RedisSettings>, ConfigError> {
    let Some(url) = flags.redis_url.clone().or(file.redis_url.clone()) else {
        return Ok(None);
    };
    let topology = Topology::parse(&url).map_err(|e| {
        bad(
            "redis_url",
            format!("not a Redis this gateway can reach: {e}"),
        )
    })?;
    Ok(Some(RedisSettings {
        topology,
        timeout: positive(
            "redis_timeout",
            file.redis_timeout.unwrap_or(Duration::from_millis(50)),
        )?,
        inline_max: file
            .redis_inline_max
            .map_or(64 * 1024, |b| b.as_u64() as usize),
    }))
}

/// What each listener allows its clients.
fn limits(file: &FileConfig) -> Result<Limits, ConfigError> {
    let max_header_size = size("max_header_size", file.max_header_size, 64 * 1024)?;
    if max_header_size < 8192 {
        return Err(bad(
            "max_header_size",
            "must be at least 8KiB (the smallest header buffer the HTTP server takes)",
        ));
    }
    Ok(Limits {
        max_connections: at_least_one("max_connections", file.max_connections.unwrap_or(10_000))?,
        header_read_timeout: positive(
            "header_read_timeout",
            file.header_read_timeout.unwrap_or(Duration::from_secs(10)),
        )?,
        max_header_size,
    })
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
        let err = Settings::from_sources(
            Settings::parse_file("redis_url = \"redis+sentinel://s:26379\"").unwrap(),
            flags_with_upstream(),
        )
        .unwrap_err();
        assert_eq!(err.key, "redis_url");
        assert!(err.to_string().contains("mymaster"), "{err}");
        let err = Settings::from_sources(
            Settings::parse_file("database_url = \"postgres://u@a:5432,b:5432/db\"").unwrap(),
            flags_with_upstream(),
        )
        .unwrap_err();
        assert_eq!(err.key, "database_url");
        assert!(
            err.to_string().contains("target_session_attrs=read-write"),
            "{err}"
        );
        let primary =
            "database_url = \"postgres://u@a:5432,b:5432/db?target_session_attrs=read-write\"";
        let err = Settings::from_sources(
            Settings::parse_file(primary).unwrap(),
            flags_with_upstream(),
        )
        .unwrap_err();
        assert_eq!(
            err.key, "owner.salt",
            "replicas on PostgreSQL need one salt"
        );
        Settings::from_sources(
            Settings::parse_file(primary).unwrap(),
            Flags {
                owner_salt: Some("c2FsdCBvZiB0ZXN0cywgbm90IGEgc2VjcmV0".into()),
                ..flags_with_upstream()
            },
        )
        .expect("a multi-host URL that asks for the primary");
    }

    #[test]
    fn the_chat_example_is_valid() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/chat");
        let mut file =
            Settings::parse_file(&std::fs::read_to_string(dir.join("idemgate.toml")).unwrap())
                .unwrap();
        file.base_dir = dir;
        // Credentials come from the environment; stand in fixed values here.
        for client in &mut file.clients {
            client.key_sha256.env = None;
            client.key_sha256.value = Some(hex::encode([7u8; 32]));
        }
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
        assert_eq!(
            chat.upstreams().map(|u| u.id.index()).collect::<Vec<_>>(),
            vec![0, 1]
        );
        assert!(chat.side_effect_free && chat.hedge_after.is_some());
        assert_eq!(chat.contract.as_ref().unwrap().probes.len(), 1);
        assert!(chat.require_client && s.clients.clients.len() == 1);
    }

    /// The three owner configurations of docs/design.md §15 load as
    /// written (their secrets stood in for), and say what they promise.
    #[test]
    fn the_owner_examples_are_valid() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/owners");
        let load = |name: &str| {
            let text = std::fs::read_to_string(dir.join(name)).unwrap();
            let mut file = Settings::parse_file(&text).unwrap();
            for client in &mut file.clients {
                client.key_sha256 = trust::SecretFile {
                    value: Some(hex::encode([7u8; 32])),
                    ..Default::default()
                };
            }
            for u in file.upstreams.iter_mut().flatten() {
                if let UpstreamFile::Table(t) = u {
                    for source in t.headers.values_mut() {
                        (source.value, source.env) = (Some("sk-test".into()), None);
                    }
                }
            }
            Settings::from_sources(file.relative_to(&dir), Flags::default()).unwrap()
        };
        let bearer = load("bearer-api.toml");
        assert!(!bearer.routes[0].owner.allow_anonymous);
        assert!(matches!(bearer.routes[0].owner.sources[..], [OwnerSource::Header(ref h)] if h == "authorization"));
        let cookie = load("cookie-app.toml");
        assert!(matches!(cookie.routes[0].owner.sources[..], [OwnerSource::Cookie(ref c)] if c == "session_id"));
        let ai = load("ai-gateway.toml");
        let chat = &ai.routes[0];
        assert!(chat.require_client && chat.primary.credentials);
        assert!(ai.trusted_proxies.contains("10.1.2.3".parse().unwrap()));
        assert!(!ai.trusted_proxies.contains("192.0.2.1".parse().unwrap()));
        assert!(matches!(chat.owner.sources[..], [OwnerSource::All(_), OwnerSource::Client]));
    }

    #[test]
    fn the_example_file_is_valid() {
        let text = include_str!("../../config/idemgate.example.toml");
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

    #[test]
    fn routes_match_whole_path_segments() {
        let file = Settings::parse_file(
            "[[routes]]\nname = \"chat\"\npath_prefix = \"/v1/chat\"\n\
             [[routes]]\nname = \"slash\"\npath_prefix = \"/v2/jobs/\"\n",
        )
        .unwrap();
        let s = Settings::from_sources(file, flags_with_upstream()).unwrap();
        let name = |path| s.route_for(&Method::POST, path).map(|r| r.name.as_str());
        assert_eq!(name("/v1/chat"), Some("chat"));
        assert_eq!(name("/v1/chat/completions"), Some("chat"));
        assert_eq!(
            name("/v1/chatty"),
            None,
            "a prefix matches whole segments only"
        );
        assert_eq!(name("/v1/chat-old/x"), None);
        assert_eq!(
            name("/v2/jobs"),
            Some("slash"),
            "a trailing slash is not required"
        );
        assert_eq!(name("/v2/jobs/7"), Some("slash"));
        assert_eq!(name("/v2/jobsx"), None);
    }

    #[test]
    fn routes_match_paths_in_any_ascii_case() {
        let file =
            Settings::parse_file("[[routes]]\nname = \"charges\"\npath_prefix = \"/v1/charges\"\n")
                .unwrap();
        let s = Settings::from_sources(file, flags_with_upstream()).unwrap();
        let name = |path| s.route_for(&Method::POST, path).map(|r| r.name.as_str());
        assert_eq!(name("/V1/Charges"), Some("charges"));
        assert_eq!(name("/v1/CHARGES/ch_1"), Some("charges"));
        assert_eq!(name("/v1/chargesX"), None);
        assert_eq!(name("/v1/charg"), None);
    }

    /// Request paths are normalised before routing (`docs/design.md` §2),
    /// so a prefix spelled any other way would never match: refused at
    /// start-up, naming the normal spelling or the ambiguity.
    #[test]
    fn a_path_prefix_not_in_normal_form_is_refused() {
        for (prefix, says) in [
            ("/v1//charges", "write \"/v1/charges\""),
            ("/v1/./charges", "write \"/v1/charges\""),
            ("/v1/%63harges", "write \"/v1/charges\""),
            ("/caf%c3%a9", "write \"/caf%C3%A9\""),
            ("/v1/charges;x", "`;`"),
            ("/v1%2Fcharges", "`%2F`"),
            ("/..", "climb above"),
        ] {
            let text = format!("[[routes]]\npath_prefix = {prefix:?}\n");
            let file = Settings::parse_file(&text).unwrap();
            let e = Settings::from_sources(file, flags_with_upstream()).unwrap_err();
            assert_eq!(e.key, "routes[0].path_prefix", "{prefix}");
            assert!(e.to_string().contains(says), "{prefix}: {e}");
        }
    }

    #[test]
    fn a_probeless_contract_on_a_route_with_fallbacks_is_refused() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/chat");
        let text = "upstreams = [\"http://a:1\", \"http://b:1\"]\n\
                    [contracts.bare]\nschema = \"response.schema.json\"\n\
                    [[routes]]\npath_prefix = \"/v1\"\ncontract = \"bare\"\n";
        let mut file = Settings::parse_file(text).unwrap();
        file.base_dir = dir.clone();
        let err = Settings::from_sources(file, Flags::default()).unwrap_err();
        assert_eq!(err.key, "routes[0].contract");
        assert!(err.message.contains("no probes"), "{}", err.message);
        // With a single upstream there is nothing to fail over to: allowed.
        let mut file = Settings::parse_file(&text.replace(", \"http://b:1\"", "")).unwrap();
        file.base_dir = dir;
        assert!(Settings::from_sources(file, Flags::default()).is_ok());
    }

    mod props {
        use super::super::*;
        use proptest::prelude::*;

        /// Values of every TOML shape, many of them wrong for their key.
        fn value() -> impl Strategy<Value = String> {
            prop_oneof![
                any::<i64>().prop_map(|n| n.to_string()),
                "[a-z0-9:/. ]{0,12}".prop_map(|s| format!("{s:?}")),
                prop_oneof![
                    Just("0s"),
                    Just("250ms"),
                    Just("10s"),
                    Just("24h"),
                    Just("-1s"),
                    Just("soon")
                ]
                .prop_map(|d| format!("{d:?}")),
                Just("true".to_owned()),
                Just("[\"http://127.0.0.1:1\"]".to_owned()),
                Just("[]".to_owned()),
                Just("{}".to_owned()),
            ]
        }

        fn key() -> impl Strategy<Value = &'static str> {
            prop::sample::select(vec![
                "listen",
                "admin_listen",
                "admin_token",
                "upstreams",
                "database_url",
                "database_direct_url",
                "database_pool_size",
                "database_timeout",
                "redis_url",
                "redis_timeout",
                "redis_inline_max",
                "upstream_timeout",
                "attempt_deadline",
                "hold_timeout",
                "key_ttl",
                "lease_ttl",
                "sweep_interval",
                "retry_after",
                "owner_header",
                "forward_key_header",
                "mismatch_status",
                "max_response_size",
                "probe_interval",
                "no_such_key",
            ])
        }

        proptest! {
            #[test]
            fn any_text_parses_or_names_a_key(text in "(?s).{0,200}") {
                if let Err(e) = Settings::parse_file(&text) {
                    prop_assert!(!e.key.is_empty());
                }
            }

            #[test]
            fn any_settings_validate_or_name_a_key(
                pairs in proptest::collection::btree_map(key(), value(), 0..8),
                route in proptest::option::of(proptest::collection::btree_map(
                    prop::sample::select(vec!["path_prefix", "methods", "body_limit", "max_attempts", "hedge_after", "upstreams", "contract"]),
                    value(),
                    0..4,
                )),
            ) {
                let mut text: String = pairs.iter().map(|(k, v)| format!("{k} = {v}\n")).collect();
                if let Some(route) = route {
                    text.push_str("[[routes]]\n");
                    text.extend(route.iter().map(|(k, v)| format!("{k} = {v}\n")));
                }
                let outcome = Settings::parse_file(&text).and_then(|f| {
                    Settings::from_sources(f, Flags { upstreams: vec!["http://127.0.0.1:1".into()], ..Flags::default() })
                });
                if let Err(e) = outcome {
                    prop_assert!(!e.key.is_empty() && !e.message.is_empty(), "{:?}", e);
                }
            }
        }
    }
}
