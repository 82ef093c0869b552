//! Where jobs and attempts are kept: PostgreSQL when `database_url` is
//! given, the embedded store in a local file otherwise.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::file::FileConfig;
use super::flags::Flags;
use idemgate_store::postgres::{PgSettings, PgUrl};
use idemgate_store::StoreSettings;

use super::libpq;
use super::{bad, positive, ConfigError};

/// `database_lock_timeout`'s default: far longer than any lock the gateway
/// itself holds (a batch, a change: milliseconds), short enough that a
/// transaction left open on a job gives back the connections waiting on it.
const LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// The defaults for `database_url` = `url` (relative certificate paths
/// taken from the working folder): what tests and tools start from.
pub fn pg_settings(url: &str) -> Result<PgSettings, ConfigError> {
    Ok(PgSettings {
        url: postgres_url("database_url", url, Path::new(""))?,
        direct_url: None,
        pool_size: 16,
        connect_timeout: Duration::from_secs(2),
        lock_timeout: LOCK_TIMEOUT,
    })
}

/// PostgreSQL when a database URL is given, the embedded store otherwise.
pub(super) fn store_settings(
    file: &FileConfig,
    flags: &Flags,
) -> Result<StoreSettings, ConfigError> {
    // Checked with or without a URL, so a mistake is told now rather than
    // when database_url is added.
    let pool = pool(file)?;
    let direct_url = flags
        .database_direct_url
        .clone()
        .or_else(|| file.database_direct_url.clone());
    let Some(url) = flags
        .database_url
        .clone()
        .or_else(|| file.database_url.clone())
    else {
        if direct_url.is_some() {
            // Like a Redis TLS key without redis_url: it names a database
            // the gateway would never connect to, as its operator expects.
            return Err(bad(
                "database_direct_url",
                "no database_url is set, so jobs are kept in the embedded store and this \
                 database is never used: set database_url too, or remove this key",
            ));
        }
        let path = flags
            .embedded_path
            .clone()
            .or_else(|| file.embedded_path.clone())
            .unwrap_or_else(|| PathBuf::from("idemgate.db"));
        return Ok(StoreSettings::Embedded { path });
    };
    let url = postgres_url("database_url", &url, &file.base_dir)?;
    let direct_url = direct_url
        .map(|direct| postgres_url("database_direct_url", &direct, &file.base_dir))
        .transpose()?;
    Ok(StoreSettings::Postgres(Box::new(PgSettings {
        url,
        direct_url,
        pool_size: pool.size,
        connect_timeout: pool.connect_timeout,
        lock_timeout: pool.lock_timeout,
    })))
}

/// The PostgreSQL pool's keys.
struct Pool {
    size: usize,
    connect_timeout: Duration,
    lock_timeout: Duration,
}

fn pool(file: &FileConfig) -> Result<Pool, ConfigError> {
    let size = file.database_pool_size.unwrap_or(16);
    if size == 0 {
        return Err(bad("database_pool_size", "must be at least 1"));
    }
    let connect_timeout = positive(
        "database_timeout",
        file.database_timeout.unwrap_or(Duration::from_secs(2)),
    )?;
    let lock_timeout = positive(
        "database_lock_timeout",
        file.database_lock_timeout.unwrap_or(LOCK_TIMEOUT),
    )?;
    // PostgreSQL's own bound (an int of milliseconds) is 24 days.
    if lock_timeout > Duration::from_secs(24 * 3600) {
        return Err(bad(
            "database_lock_timeout",
            "must be at most 24h: it bounds a wait for a lock another transaction holds",
        ));
    }
    Ok(Pool {
        size,
        connect_timeout,
        lock_timeout,
    })
}

/// Reads a PostgreSQL URL given as `key`: its TLS (and the files that
/// names), then the rest as tokio-postgres will.
fn postgres_url(key: &'static str, url: &str, base: &Path) -> Result<PgUrl, ConfigError> {
    let url = libpq::parse(key, url, base)?;
    let parsed = url.url.parse::<tokio_postgres::Config>().map_err(|e| {
        bad(
            key,
            format!("not a PostgreSQL URL ({e}); use postgres://user@host:5432/dbname"),
        )
    })?;
    // With several hosts, the first that answers would do, standby or not:
    // after a failover every write would fail on a standby.
    if parsed.get_hosts().len() > 1
        && parsed.get_target_session_attrs()
            != tokio_postgres::config::TargetSessionAttrs::ReadWrite
    {
        return Err(bad(
            key,
            format!(
                "names {} hosts but not which one to use; add target_session_attrs=read-write \
                 (postgres://user@a:5432,b:5432/db?target_session_attrs=read-write) so the \
                 gateway always connects to the primary",
                parsed.get_hosts().len()
            ),
        ));
    }
    Ok(url)
}
