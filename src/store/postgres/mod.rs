//! The PostgreSQL backend: the source of truth in production.
//!
//! The hot path is two single statements: `Backend::begin` (a read, then
//! `INSERT … ON CONFLICT DO NOTHING` of the job and its first attempt) and
//! `Backend::commit` (the CAS). Every other change locks the job row
//! (`FOR UPDATE`), reads its attempts, and writes what the domain decided,
//! in one transaction; all writers of a job take its row lock first, so
//! they never interleave.
//!
//! Job-state changes are announced with `NOTIFY` (a trigger, see
//! `migrations/postgres`), tagged with the instance that made them, so a
//! replica ignores its own announcements: it has already rung its doorbell.
//!
//! The files, by seam: this one (the type, its pool and its sessions),
//! `backend.rs` (the writes: begin, the CAS commit, locked changes, lease
//! expiry), `records.rs` (reads and upkeep), `sql.rs` (the statements'
//! columns and the begin statement), `rows.rs` (rows read back into the
//! domain), `write.rs` (a locked change written), `listen.rs` (`LISTEN`),
//! `migrate.rs`, `error.rs` (errors by what the caller can do), and what
//! the gateway checks of the server it reaches (`replication.rs`,
//! `budget.rs`, docs/design.md §13).

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;
use uuid::Uuid;

use super::StoreError;
use crate::config::PgSettings;

mod backend;
mod budget;
mod error;
mod listen;
mod migrate;
mod records;
mod replication;
mod rows;
mod sql;
mod write;

pub use budget::Budget;
pub use replication::Replication;

use error::map_pg;

/// The PostgreSQL [`Backend`](crate::store::Backend).
#[derive(Clone)]
pub struct Postgres {
    pool: Pool,
    /// For sessions of their own: LISTEN and migrations.
    direct: tokio_postgres::Config,
    instance: Uuid,
}

impl std::fmt::Debug for Postgres {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Postgres").finish_non_exhaustive()
    }
}

impl Postgres {
    /// Builds the pool for gateway `instance`. Connections are made lazily,
    /// so a database that is down at start-up makes requests answer 503
    /// rather than the gateway refuse to start.
    pub fn new(settings: &PgSettings, instance: Uuid) -> Result<Self, StoreError> {
        let config = session(&settings.url, settings, instance)?;
        let direct = match &settings.direct_url {
            Some(url) => session(url, settings, instance)?,
            None => config.clone(),
        };
        let manager = Manager::from_config(
            config.clone(),
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(settings.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(settings.connect_timeout))
            .create_timeout(Some(settings.connect_timeout))
            .recycle_timeout(Some(settings.connect_timeout))
            .pre_recycle(replication::fence())
            .build()
            .map_err(|e| StoreError::Internal(Box::new(e)))?;
        Ok(Postgres {
            pool,
            direct,
            instance,
        })
    }

    async fn client(&self) -> Result<deadpool_postgres::Client, StoreError> {
        self.pool
            .get()
            .await
            .map_err(|e| StoreError::Unavailable(Box::new(e)))
    }
}

/// The connection settings for `url`: the gateway's defaults where the URL
/// says nothing, and this instance's name for the NOTIFY trigger.
fn session(
    url: &str,
    settings: &PgSettings,
    instance: Uuid,
) -> Result<tokio_postgres::Config, StoreError> {
    let mut config: tokio_postgres::Config =
        url.parse().map_err(|e| StoreError::Internal(Box::new(e)))?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(settings.connect_timeout);
    }
    config.keepalives_idle(Duration::from_secs(10));
    if config.get_application_name().is_none() {
        config.application_name("idemgate");
    }
    // Read by the NOTIFY trigger, so announcements name their origin.
    let options = format!(
        "{} -c idemgate.instance={instance}",
        config.get_options().unwrap_or_default()
    );
    config.options(options.trim_start());
    Ok(config)
}
