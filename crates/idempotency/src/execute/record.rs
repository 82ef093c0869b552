//! How an attempt's end is written (`Task::record`, `Task::commit`;
//! `docs/design.md` §5). What the gateway
//! learned is never dropped by a transient fault: each write is retried with
//! backoff until the store takes it or the attempt's deadline passes,
//! holding the attempt's lease meanwhile. The request is answered once the
//! write is in, or after [`PATIENCE`] at most (then with `503` for an answer
//! not yet committed: the client's retry is held until it is, and replays it).

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use idemgate_domain::id::AttemptId;
use idemgate_store::StoreError;
use idemgate_telemetry::Chain;

const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Runs `write` until it succeeds, fails for good, or `deadline` passes,
/// backing off while the store is unreachable. A write that never got in
/// is logged as an error: the attempt's lease will lapse into `unknown`.
pub(super) async fn retrying<T, F, Fut>(
    what: &'static str,
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
                tracing::error!(error = %Chain(&e), %attempt, failures, "could not {what} the attempt before its deadline; its lease will lapse into unknown");
                return Err(e);
            }
        }
    }
}
