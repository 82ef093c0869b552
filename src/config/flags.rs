//! The command line and its `IDEMGATE_*` environment twins (clap reads
//! both, the flag winning over the variable).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use idemgate_operations::cli::JobsCommand;

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
    /// Run every contract's probes against every upstream, each waiting on
    /// silence as its route would, telling each probe on stderr as it runs;
    /// print a table (or JSON), and exit non-zero unless every probe passes.
    VerifyProviders(VerifyFlags),
    /// Read and validate the whole configuration (file, environment, flags,
    /// contracts, secrets) without connecting to anything; print what the
    /// gateway would run with, or name the bad key (every missing secret at
    /// once) with its fix and exit 2.
    Check(Flags),
    /// List, show and resolve jobs through a running gateway's admin API.
    Jobs(JobsCommand),
}

/// `idemgate verify-providers`: the gateway's flags, and how to print.
#[derive(Debug, Args)]
pub struct VerifyFlags {
    /// The configuration, as for `serve`.
    #[command(flatten)]
    pub flags: Flags,
    /// Print one JSON array of results (upstream, contract, probe, result,
    /// why, prompt_tokens) instead of the table; the progress lines go to
    /// stderr either way.
    #[arg(long)]
    pub json: bool,
    /// How long each probe waits on a silent upstream, before the answer's
    /// head and between its chunks (e.g. 10s). [default: the silences of
    /// the route naming the contract (`first_byte_timeout`,
    /// `stream_idle_timeout`), else the upstream's]
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub timeout: Option<Duration>,
}

/// The flags of `docs/configuration.md`'s table; each overrides the file
/// and has an `IDEMGATE_*` twin.
#[derive(Debug, Default, Args)]
pub struct Flags {
    /// Address of the proxy listener. [default: 127.0.0.1:8080]
    #[arg(long, env = "IDEMGATE_LISTEN", value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Address of the admin listener (jobs, resolution, health, metrics).
    /// [default: 127.0.0.1:9090]
    #[arg(long, env = "IDEMGATE_ADMIN_LISTEN", value_name = "ADDR")]
    pub admin_listen: Option<SocketAddr>,
    /// Bearer token for the admin API; without one the job endpoints and the
    /// console are off (they answer 403).
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
    /// A direct PostgreSQL URL for what needs a session of its own (LISTEN,
    /// migrations), when `database_url` goes through a transaction pooler.
    #[arg(
        long,
        env = "IDEMGATE_DATABASE_DIRECT_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    pub database_direct_url: Option<String>,
    /// Embedded store file, used when no database URL is given.
    /// [default: idemgate.db]
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
    /// The CA a `rediss://` Redis's certificate is checked against (PEM);
    /// without it, the system roots (`SSL_CERT_FILE`, `SSL_CERT_DIR`).
    #[arg(long, env = "IDEMGATE_REDIS_CA_FILE", value_name = "FILE")]
    pub redis_ca_file: Option<PathBuf>,
    /// The certificate the gateway shows a `rediss://` Redis that asks for
    /// one (PEM, with `--redis-client-key`).
    #[arg(long, env = "IDEMGATE_REDIS_CLIENT_CERT", value_name = "FILE")]
    pub redis_client_cert: Option<PathBuf>,
    /// The private key of `--redis-client-cert` (PEM).
    #[arg(long, env = "IDEMGATE_REDIS_CLIENT_KEY", value_name = "FILE")]
    pub redis_client_key: Option<PathBuf>,
    /// The secret replay entries in Redis are authenticated with (base64,
    /// 32 bytes or more; every replica the same): `openssl rand -base64 32`.
    #[arg(
        long,
        env = "IDEMGATE_REPLAY_KEY",
        value_name = "BASE64",
        hide_env_values = true
    )]
    pub replay_key: Option<String>,
    /// Earlier replay keys that still verify entries they wrote (rotation);
    /// repeat it (or separate with commas in the variable).
    #[arg(
        long = "replay-previous-key",
        env = "IDEMGATE_REPLAY_PREVIOUS_KEYS",
        value_name = "BASE64",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub replay_previous_keys: Vec<String>,
    /// Silence after which an attempt's outcome is unknown (e.g. 30s).
    /// [default: 30s]
    #[arg(long, env = "IDEMGATE_UPSTREAM_TIMEOUT", value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub upstream_timeout: Option<Duration>,
    /// How long a duplicate of a running job is held before 409.
    /// [default: upstream_timeout + 5s]
    #[arg(long, env = "IDEMGATE_HOLD_TIMEOUT", value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub hold_timeout: Option<Duration>,
    /// How long a key is remembered after its first request. [default: 24h]
    #[arg(long, env = "IDEMGATE_KEY_TTL", value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub key_ttl: Option<Duration>,
    /// Threads serving requests; 1 runs everything on one thread (a sidecar
    /// on one CPU). [default: one per CPU]
    #[arg(long, env = "IDEMGATE_WORKER_THREADS", value_name = "N")]
    pub worker_threads: Option<usize>,
    /// How worker threads share requests: "shared" (one runtime, threads
    /// take work from each other) or "per_thread" (a runtime each, serving
    /// the connections it accepted). [default: shared]
    #[arg(long, env = "IDEMGATE_WORKER_RUNTIME", value_name = "RUNTIME")]
    pub worker_runtime: Option<String>,
    /// Bytes of request bodies, answers being recorded and replays being
    /// copied the gateway holds before it refuses new keyed requests (e.g.
    /// "256MiB"). [default: half the container's memory limit, else 256MiB]
    #[arg(long, env = "IDEMGATE_MEMORY_BUDGET", value_name = "BYTES")]
    pub memory_budget: Option<bytesize::ByteSize>,
    /// The secret owner digests are salted with (base64, 16 bytes or more;
    /// every replica the same): `openssl rand -base64 32`.
    #[arg(
        long,
        env = "IDEMGATE_OWNER_SALT",
        value_name = "BASE64",
        hide_env_values = true
    )]
    pub owner_salt: Option<String>,
    /// Let keyed requests without an owner share the owner `anonymous`
    /// (for a trial; see `[owner]`). [default: false]
    #[arg(long, env = "IDEMGATE_ALLOW_ANONYMOUS")]
    pub allow_anonymous: bool,
    /// One line per proxied request at `info` (`true` or `false`): method,
    /// route, path, status, outcome, job, attempt, upstream, duration and
    /// bytes; off, as a line per request is a volume of log to choose (it
    /// costs a request about 2 µs of CPU). [default: false]
    #[arg(long, env = "IDEMGATE_ACCESS_LOG", value_name = "BOOL")]
    pub access_log: Option<bool>,
}
