//! Group commit: the operations waiting when the store's thread turns to its
//! queue share one transaction and one fsync, each in a savepoint of its own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use rusqlite::Connection;

use super::rows::map_sqlite;
use crate::StoreError;

/// An operation for the store's thread: it runs on the connection and
/// returns how to hand its result back once the batch's commit is known.
pub(super) type Op = Box<dyn FnOnce(&mut Connection) -> Deliver + Send>;
/// Hands an operation's result back, given how its batch's commit went.
pub(super) type Deliver = Box<dyn FnOnce(&Result<(), StoreError>) + Send>;

/// At most this many operations share one commit, so a long queue still
/// answers its first callers early.
pub(super) const MAX_BATCH: usize = 64;

/// The store's thread: takes what is queued, runs it in one transaction,
/// commits once, then answers every operation of the batch. Ends when the
/// last handle to the store is dropped.
pub(super) fn writer(mut conn: Connection, ops: mpsc::Receiver<Op>, batches: Arc<AtomicUsize>) {
    while let Ok(first) = ops.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match ops.try_recv() {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
        // Without the outer transaction (it could not begin) each operation
        // makes its own, as it would alone.
        let grouped = conn.execute_batch("BEGIN IMMEDIATE").is_ok();
        let deliveries: Vec<Deliver> = batch
            .into_iter()
            .filter_map(|op| {
                // A panicking operation drops its answer (its caller sees an
                // internal error) and its savepoint rolls back as it unwinds.
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op(&mut conn))).ok()
            })
            .collect();
        let committed = if grouped {
            conn.execute_batch("COMMIT").map_err(|e| {
                let _ = conn.execute_batch("ROLLBACK");
                map_sqlite(e)
            })
        } else {
            Ok(())
        };
        batches.fetch_add(1, Ordering::Relaxed);
        for deliver in deliveries {
            deliver(&committed);
        }
    }
}
