//! The database's errors as [`StoreError`]s, by what the caller can do.

use super::replication;
use crate::store::StoreError;

/// A database that cannot be reached, or that is read-only (a standby),
/// is `Unavailable` (503, nothing proxied); anything else the database
/// itself refused is `Internal`.
pub(super) fn map_pg(e: tokio_postgres::Error) -> StoreError {
    if let Some(db) = e.as_db_error() {
        let code = db.code().code();
        // The server is (or has become) a standby: retry on the primary.
        if code == "25006" {
            replication::saw_read_only();
            return StoreError::Unavailable(Box::new(e));
        }
        // Class 08 (connection), 57P0x (shutdown), 53 (resources), 40001/40P01
        // (serialisation, deadlock: try again) and 42P01 (no such table:
        // migrations not applied yet).
        if code.starts_with("08")
            || code.starts_with("57P")
            || code.starts_with("53")
            || code.starts_with("40")
            || code == "42P01"
        {
            return StoreError::Unavailable(Box::new(e));
        }
        return StoreError::Internal(Box::new(e));
    }
    StoreError::Unavailable(Box::new(e))
}
