//! What `idemgate check` prints: the settings a gateway would run with, one
//! `key = value` line each, in the config file's words, with every secret
//! left out (a password in a URL, tokens, keys).

use std::fmt::{self, Display, Formatter};
use std::time::Duration;

use super::{Settings, StoreSettings, Topology};

mod route;

/// The settings, as `idemgate check` prints them.
pub struct Summary<'a>(pub &'a Settings);

impl Display for Summary<'_> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let s = self.0;
        writeln!(f, "listen = {}", s.listen)?;
        writeln!(f, "admin_listen = {}", s.admin_listen)?;
        let admin = if s.admin_token.is_some() {
            "on (a token is set)"
        } else {
            "off (no admin_token): /admin/v1 and the console answer 403, saying why; /healthz, /readyz and /metrics stay open"
        };
        writeln!(f, "admin_api = {admin}")?;
        let access = if s.access_log {
            "on (one line per request at info, target idemgate::access)"
        } else {
            "off"
        };
        writeln!(f, "access_log = {access}")?;
        writeln!(f, "owner = {}", route::owner(&s.owner))?;
        writeln!(f, "allow_anonymous = {}", s.owner.allow_anonymous)?;
        writeln!(f, "store = {}", store(&s.store))?;
        match &s.redis {
            Some(redis) => writeln!(f, "redis = {}", topology(&redis.topology))?,
            None => writeln!(f, "redis = none (every replay from the store)")?,
        }
        for (i, upstream) in s.upstreams.iter().enumerate() {
            let role = if i == 0 { "primary" } else { "fallback" };
            writeln!(
                f,
                "upstream.{} = {} ({role}, timeout {}, first_byte_timeout {}, stream_idle_timeout {})",
                upstream.name(),
                upstream.base,
                human(upstream.timeout),
                human(upstream.first_byte_timeout),
                human(upstream.stream_idle_timeout)
            )?;
        }
        for route in &s.routes {
            route::write(f, route)?;
        }
        timings(f, s)
    }
}

fn timings(f: &mut Formatter<'_>, s: &Settings) -> fmt::Result {
    for (key, value) in [
        ("upstream_timeout", s.upstream_timeout),
        ("attempt_deadline", s.attempt_deadline),
        ("hold_timeout", s.hold_timeout),
        ("key_ttl", s.key_ttl),
        ("lease_ttl", s.lease_ttl),
        ("shutdown_grace", s.shutdown_grace),
        ("header_read_timeout", s.limits.header_read_timeout),
        ("keepalive_timeout", s.limits.keepalive_timeout),
        ("body_read_timeout", s.limits.body_read_timeout),
        ("send_timeout", s.limits.send_timeout),
    ] {
        writeln!(f, "{key} = {}", human(value))?;
    }
    writeln!(f, "max_connections = {}", s.limits.max_connections)?;
    writeln!(f, "max_in_flight = {}", s.max_in_flight)?;
    writeln!(
        f,
        "memory_budget = {} ({:?})",
        bytesize::ByteSize(s.memory_budget.bytes as u64).to_string_as(true),
        s.memory_budget.from
    )?;
    writeln!(f, "worker_threads = {}", s.worker_threads)?;
    writeln!(f, "worker_runtime = {}", s.worker_runtime.as_str())
}

fn human(d: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(d)
}

/// The store without its password: the database, user and hosts, and TLS.
fn store(store: &StoreSettings) -> String {
    match store {
        StoreSettings::Embedded { path } => format!("embedded {}", path.display()),
        StoreSettings::Postgres(pg) => {
            let Ok(parsed) = pg.url.url.parse::<tokio_postgres::Config>() else {
                return "postgres".to_owned();
            };
            let hosts: Vec<String> = parsed
                .get_hosts()
                .iter()
                .map(|h| match h {
                    tokio_postgres::config::Host::Tcp(name) => name.clone(),
                    #[cfg(unix)]
                    tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
                })
                .collect();
            format!(
                "postgres database {} as {} on {} (pool {}; {})",
                parsed.get_dbname().unwrap_or("(default)"),
                parsed.get_user().unwrap_or("(default)"),
                hosts.join(","),
                pg.pool_size,
                pg.url.tls.describe()
            )
        }
    }
}

fn topology(topology: &Topology) -> String {
    let tls = if topology.is_tls() {
        "TLS"
    } else {
        "plaintext"
    };
    match topology {
        Topology::Node(info) => format!("node {} ({tls})", info.addr()),
        Topology::Cluster(seeds) => {
            let seeds: Vec<String> = seeds.iter().map(|s| s.addr().to_string()).collect();
            format!("cluster {} ({tls})", seeds.join(","))
        }
        Topology::Sentinel {
            sentinels, service, ..
        } => {
            let sentinels: Vec<String> = sentinels.iter().map(ToString::to_string).collect();
            format!("sentinel {} master {service} ({tls})", sentinels.join(","))
        }
    }
}
