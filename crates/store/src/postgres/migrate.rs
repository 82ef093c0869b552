//! The schema: the SQL migrations under `migrations/postgres`, applied once
//! however many replicas start together.

use super::{map_pg, Postgres};
use crate::StoreError;

mod embedded {
    refinery::embed_migrations!("../../migrations/postgres");
}

/// Serialises migrations when several replicas start at once.
const MIGRATION_LOCK: i64 = 0x1de6_6a7e;

impl Postgres {
    /// Applies the SQL migrations under `migrations/postgres`, holding an
    /// advisory lock so that replicas starting together apply them once.
    /// Connecting is the first thing start-up does with the database: a
    /// refusal only a setting can fix is a [`Refused`](super::Refused).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let (mut client, connection) = self.direct.connect().await?;
        let driver = tokio::spawn(connection);
        // Migrations are planned as PostgreSQL plans them: the gateway's
        // sessions keep to the indexes (`session`, design §13), which a
        // backfill over a whole table should not. And they wait for their
        // locks however long, the advisory lock first (another replica may
        // be migrating for minutes): a migration given up halfway through
        // start-up would only be tried again by the next start.
        client
            .batch_execute("SET enable_seqscan = on; SET lock_timeout = 0")
            .await
            .map_err(map_pg)?;
        client
            .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(map_pg)?;
        let report = embedded::migrations::runner()
            .set_abort_divergent(true)
            .run_async(&mut client)
            .await;
        let _ = client
            .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
            .await;
        drop(client);
        let _ = driver.await;
        let report = report.map_err(|e| StoreError::Internal(Box::new(e)))?;
        for m in report.applied_migrations() {
            tracing::info!(migration = %m, "applied migration");
        }
        Ok(())
    }
}
