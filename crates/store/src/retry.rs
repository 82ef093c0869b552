//! Writes of what the gateway learned about an attempt (its end, its
//! commit, that it was never sent; `docs/design.md` §5): never dropped by a
//! transient fault. Each write is retried with backoff until the store takes
//! it or its bound passes: the attempt's deadline, and for the outcome of
//! an attempt [`WRITE_AT_LEAST`] after it was learned if that is later
//! ([`at_least_until`]); the attempt's lease is held meanwhile by whoever
//! runs it.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::StoreError;
use idemgate_domain::id::AttemptId;
pub use idemgate_domain::reconcile::WRITE_AT_LEAST;
use idemgate_telemetry::Chain;

const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// The deadline to retry an attempt's outcome to: the attempt's
/// `deadline`, or [`WRITE_AT_LEAST`] from now if that is later.
pub fn at_least_until(deadline: Instant) -> Instant {
    deadline.max(Instant::now() + WRITE_AT_LEAST)
}

/// A lost write's consequence, for its log line, where the attempt is left
/// `started` (its end, its commit, that it was never sent).
pub const LAPSES: &str = "its lease will lapse into unknown";

/// Runs `write` until it succeeds, fails for good, or `deadline` passes,
/// backing off while the store is unreachable. A write that never got in
/// is logged as an error, saying what follows (`if_lost`: [`LAPSES`] for
/// an attempt left `started`).
pub async fn retrying<T, F, Fut>(
    (what, if_lost): (&'static str, &'static str),
    attempt: AttemptId,
    deadline: Instant,
    mut write: F,
) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut backoff = FIRST_BACKOFF;
    let mut failures = 0u32;
    loop {
        match write().await {
            Ok(value) => {
                if failures > 0 {
                    tracing::info!(%attempt, failures, "recorded after the store came back: {what} the attempt");
                }
                return Ok(value);
            }
            Err(e) if e.is_transient() && Instant::now() + backoff < deadline => {
                if failures == 0 {
                    tracing::warn!(error = %Chain(&e), %attempt, "could not {what} the attempt; retrying until the store answers");
                }
                failures += 1;
                metrics::counter!("idemgate_record_retries_total").increment(1);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
            Err(e) => {
                tracing::error!(error = %Chain(&e), %attempt, failures, "could not {what} the attempt in the time it is given; {if_lost}");
                return Err(e);
            }
        }
    }
}
