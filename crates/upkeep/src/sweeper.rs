//! Background upkeep: lapsed leases become `unknown`, expired jobs are purged.
//!
//! Both run in bounded batches so one sweep never holds the database for
//! long; a batch that changed anything is followed at once by another, up
//! to a cap per tick. Not only a full one: a store's batch may count rows
//! it then did not change (a hedged job's two lapsed attempts make one
//! job; a job one of whose attempts another transaction holds is left),
//! so fewer than a batch does not mean none are left.

use std::sync::Arc;
use std::time::Duration;

use crate::supervise::Heartbeat;
use idemgate_domain::BoxError;
use idemgate_store::Store;
use idemgate_telemetry::Chain;

const BATCH: u32 = 500;
const BATCHES_PER_TICK: usize = 20;

/// Sweeps every `interval`, for as long as it runs (a supervised task,
/// stopped at shutdown).
pub async fn run(
    store: Arc<dyn Store>,
    interval: Duration,
    beat: Heartbeat,
) -> Result<(), BoxError> {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        beat.beat();
        sweep_once(store.as_ref()).await;
    }
}

/// The `idemgate_jobs_unknown` gauge stops counting here: past it, the
/// number matters less than that someone looks.
const UNKNOWN_CAP: u32 = 1000;

/// One sweep: expire lapsed leases, count unknown jobs, purge expired jobs.
pub async fn sweep_once(store: &dyn Store) {
    for _ in 0..BATCHES_PER_TICK {
        match store.expire_leases(BATCH).await {
            Ok(0) => break,
            Ok(_) => continue,
            Err(e) => {
                tracing::warn!(error = %Chain(&e), "sweeper could not expire leases");
                return;
            }
        }
    }
    // The operator's inbox, as a gauge (every replica reports the same
    // count: aggregate with max, not sum). Counted up to UNKNOWN_CAP.
    match store.unknown_jobs(None, UNKNOWN_CAP).await {
        Ok(jobs) => metrics::gauge!("idemgate_jobs_unknown").set(jobs.len() as f64),
        Err(e) => tracing::debug!(error = %Chain(&e), "sweeper could not count unknown jobs"),
    }
    for _ in 0..BATCHES_PER_TICK {
        match store.purge_expired(BATCH).await {
            Ok(n) => {
                if n > 0 {
                    metrics::counter!("idemgate_jobs_purged_total").increment(n);
                    tracing::debug!(purged = n, "purged expired jobs");
                }
                if n == 0 {
                    break;
                }
            }
            Err(e) => {
                tracing::warn!(error = %Chain(&e), "sweeper could not purge expired jobs");
                return;
            }
        }
    }
}
