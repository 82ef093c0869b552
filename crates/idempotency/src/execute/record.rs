//! Recording how an attempt ended (`docs/design.md` §5). What the gateway
//! learned is never dropped by a transient fault: each write is retried with
//! backoff until the store takes it or the attempt's deadline passes,
//! holding the attempt's lease meanwhile. The request is answered once the
//! write is in, or after [`PATIENCE`] at most (then with `503` for an answer
//! not yet committed: the client's retry is held until it is, and replays it).

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::{Reply, Task, PATIENCE};
use crate::error::GatewayError;
use idemgate_domain::attempt::{AttemptFailure, AttemptState};
use idemgate_domain::id::AttemptId;
use idemgate_domain::response::StoredResponse;
use idemgate_store::{CommitOutcome, StoreError};
use idemgate_telemetry::Chain;

const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

impl Task {
    /// Commits `stored`, retrying while the store is unreachable (in a task
    /// of its own, holding the lease), until the attempt's deadline.
    fn spawn_commit(
        &self,
        stored: StoredResponse,
    ) -> tokio::task::JoinHandle<Result<CommitOutcome, StoreError>> {
        let (store, attempt) = (self.runner.store.clone(), self.attempt.clone());
        let response = stored;
        // The answer stays counted against the memory budget while the
        // write goes on, which may outlast the attempt (docs/design.md §18).
        let (lease, charge) = (self.lease.clone(), self.charge.clone());
        tokio::spawn(retrying("commit", attempt.id, self.deadline, move || {
            let (store, attempt, response, _lease, _charge) = (
                store.clone(),
                attempt.clone(),
                response.clone(),
                lease.clone(),
                charge.clone(),
            );
            async move { store.commit(&attempt, &response).await }
        }))
    }

    /// Commits a streamed answer, waiting as long as it takes: its readers
    /// are waiting for the end, which only the commit releases.
    pub(super) async fn write_commit(
        &self,
        stored: StoredResponse,
    ) -> Result<CommitOutcome, StoreError> {
        self.spawn_commit(stored)
            .await
            .unwrap_or_else(|e| Err(StoreError::Internal(Box::new(e))))
    }

    /// Commits the answer, then tells the request how that went.
    pub(super) async fn commit(&mut self, stored: StoredResponse) {
        let mut write = self.spawn_commit(stored.clone());
        let reply = match tokio::time::timeout(PATIENCE, &mut write).await {
            Ok(Ok(Ok(CommitOutcome::Committed))) => {
                metrics::counter!("idemgate_commits_total").increment(1);
                outcome(AttemptState::Succeeded);
                Reply::Committed(stored)
            }
            Ok(Ok(Ok(CommitOutcome::Superseded))) => {
                metrics::counter!("idemgate_commits_superseded_total").increment(1);
                outcome(AttemptState::Superseded);
                Reply::Superseded
            }
            Ok(Ok(Err(e))) => Reply::Unknown(e.into()),
            Ok(Err(e)) => Reply::Unknown(GatewayError::Internal(Box::new(e))),
            // Not recorded yet, so not sent: the write goes on, and the
            // client's retry is held until it lands, then replays it.
            Err(_) => {
                tracing::warn!(attempt = %self.attempt.id, "the upstream answered but the store is not taking the commit yet; still trying");
                Reply::Unknown(GatewayError::Unrecorded(StoreError::Unavailable(
                    "the commit is still being retried".into(),
                )))
            }
        };
        self.send(reply);
    }

    /// Records how the attempt ended without a result, waiting at most
    /// [`PATIENCE`] for the write (which goes on after that).
    pub(super) async fn record(&self, failure: AttemptFailure) {
        self.log_end(&failure);
        let write = self.spawn_write(failure);
        let _ = tokio::time::timeout(PATIENCE, write).await;
    }

    fn log_end(&self, failure: &AttemptFailure) {
        outcome(failure.state());
        metrics::counter!("idemgate_attempts_ended_total", "state" => failure.state().as_str())
            .increment(1);
        // A rejected answer's detail quotes the answer: it is kept for the
        // operator in the store, never logged.
        let detail = match failure {
            AttemptFailure::Rejected { .. } => "broke the route's contract",
            other => other.detail(),
        };
        tracing::info!(
            attempt = %self.attempt.id, job = %self.attempt.job_id, upstream = %self.attempt.upstream,
            state = %failure.state(), detail, "attempt ended without a result"
        );
    }

    /// Writes `failure` in the background, retrying while the store is
    /// unreachable, holding the lease until it is in.
    ///
    /// Once an `unknown` outcome is in, on a route that reconciles, the
    /// attempt is looked up on its upstream in a task of its own
    /// (`reconcile.rs`), whatever the request does meanwhile.
    fn spawn_write(
        &self,
        failure: AttemptFailure,
    ) -> tokio::task::JoinHandle<Result<(), StoreError>> {
        let (store, attempt, lease) = (
            self.runner.store.clone(),
            self.attempt.id,
            self.lease.clone(),
        );
        let reconciler = match failure {
            AttemptFailure::Unknown { .. } => self
                .reconciler
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
            _ => None,
        };
        let write = retrying("record the end of", attempt, self.deadline, move || {
            let (store, failure, _lease) = (store.clone(), failure.clone(), lease.clone());
            async move { store.fail_attempt(attempt, failure).await }
        });
        tokio::spawn(async move {
            let written = write.await;
            if let (Ok(()), Some(reconciler)) = (&written, reconciler) {
                reconciler.spawn();
            }
            written
        })
    }
}

/// Records how the attempt ended on its span (a trace attribute).
pub(super) fn outcome(state: AttemptState) {
    tracing::Span::current().record("outcome", state.as_str());
}

/// Runs `write` until it succeeds, fails for good, or `deadline` passes,
/// backing off while the store is unreachable. A write that never got in
/// is logged as an error: the attempt's lease will lapse into `unknown`.
async fn retrying<T, F, Fut>(
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
