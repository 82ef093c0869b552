//! Running one attempt, in its own task.
//!
//! The task, not the client's request, owns the attempt: a client that hangs
//! up does not cancel it, and it still commits if the upstream answers late.
//!
//! - Silence for the upstream's timeout (no headers, no body bytes) makes the
//!   attempt and its job `unknown` at once and tells the request so; the call
//!   goes on until `attempt_deadline` and may still commit.
//! - Refused before sending → `failed` (safe).
//! - Broken after sending, or an answer too large to record → `unknown`.
//! - A configured retryable status → `failed` (safe); the answer is handed
//!   back, not stored.
//! - A 2xx answer that breaks the route's contract → `rejected` (safe); the
//!   answer is kept in the attempt's detail for inspection, never replayed.
//! - Any other answer is committed by CAS before it is handed back.
//! - Cancelled because another attempt of the job won → `superseded`; the
//!   upstream call is dropped.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Shared, UpstreamService};
use crate::attempt::{Attempt, AttemptFailure};
use crate::config::Route;
use crate::contract::excerpt;
use crate::error::GatewayError;
use crate::http::{full, Body};
use crate::job::StoredResponse;
use crate::replay;
use crate::store::{CommitOutcome, StoreError};
use crate::upstream::{self, Target, UpstreamError};

/// How an attempt ended, as far as the request that started it is concerned.
pub(super) enum Reply {
    /// Its answer is the job's result.
    Committed(StoredResponse),
    /// Another attempt won (or an operator resolved the job meanwhile).
    Superseded,
    /// Provably had no effect; what the client gets if nothing else is tried.
    Failed(Answer),
    /// Sent, and its outcome is unknown (or could not be recorded).
    Unknown(GatewayError),
}

/// A client-facing answer that is not the job's result.
pub(super) enum Answer {
    /// The upstream's own answer (a retryable status), passed on uncommitted.
    Response(Response<Body>),
    /// A problem answer.
    Error(GatewayError),
}

/// An attempt in flight.
pub(super) struct Running {
    /// The attempt.
    pub attempt: Attempt,
    /// Cancels it (another attempt won).
    pub cancel: CancellationToken,
    /// Its reply.
    pub reply: oneshot::Receiver<Reply>,
}

/// Starts the attempt's task against the upstream at `target`.
pub(super) fn start(
    shared: Arc<Shared>,
    upstream: UpstreamService,
    route: &Route,
    target: usize,
    attempt: Attempt,
    mut request: Request<Body>,
) -> Running {
    let (tx, rx) = oneshot::channel();
    let cancel = CancellationToken::new();
    request.extensions_mut().insert(Target(target));
    let task = Task {
        timeout: shared.settings.upstreams[target].timeout,
        retryable: route.retryable_statuses.clone(),
        contract: route.contract.clone(),
        shared,
        attempt: attempt.clone(),
        reply: Some(tx),
    };
    tokio::spawn(task.run(upstream, request, cancel.clone()));
    Running {
        attempt,
        cancel,
        reply: rx,
    }
}

struct Task {
    shared: Arc<Shared>,
    attempt: Attempt,
    timeout: Duration,
    retryable: Vec<u16>,
    contract: Option<Arc<crate::contract::Contract>>,
    reply: Option<oneshot::Sender<Reply>>,
}

impl Task {
    async fn run(
        mut self,
        upstream: UpstreamService,
        request: Request<Body>,
        cancel: CancellationToken,
    ) {
        let _lease = self.shared.leases.hold(self.attempt.id);
        let settings = self.shared.settings.clone();
        let deadline = Instant::now() + settings.attempt_deadline;
        let (progress_tx, mut progress) = watch::channel(0u64);
        let fetch = upstream::fetch(upstream, request, settings.max_response_size, progress_tx);
        tokio::pin!(fetch);
        let silence = tokio::time::sleep(self.timeout);
        tokio::pin!(silence);
        let mut timed_out = false;
        let mut live = true;

        let fetched = loop {
            tokio::select! {
                result = &mut fetch => break Some(result),
                changed = progress.changed(), if live && !timed_out => match changed {
                    Ok(()) => silence.as_mut().reset(Instant::now() + self.timeout),
                    Err(_) => live = false,
                },
                () = &mut silence, if !timed_out => {
                    timed_out = true;
                    self.settle(AttemptFailure::Unknown {
                        detail: format!("no answer within {}", humantime::format_duration(self.timeout)),
                    })
                    .await;
                    self.send(Reply::Unknown(UpstreamError::TimedOut(self.timeout).into()));
                }
                () = cancel.cancelled() => {
                    // Dropping the call below cancels it upstream.
                    self.settle(AttemptFailure::Superseded {
                        detail: "cancelled: another attempt of the job won".into(),
                    })
                    .await;
                    self.send(Reply::Superseded);
                    return;
                }
                () = tokio::time::sleep_until(deadline) => break None,
            }
        };

        let Some(fetched) = fetched else {
            self.settle(AttemptFailure::Unknown {
                detail: "attempt deadline passed without an answer".into(),
            })
            .await;
            self.send(Reply::Unknown(UpstreamError::TimedOut(self.timeout).into()));
            return;
        };

        let fetched = match fetched {
            Ok(fetched) => fetched,
            Err(UpstreamError::Refused(detail)) => {
                self.settle(AttemptFailure::Failed {
                    status: None,
                    detail: detail.clone(),
                })
                .await;
                self.send(Reply::Failed(Answer::Error(
                    UpstreamError::Refused(detail).into(),
                )));
                return;
            }
            Err(error) => {
                self.settle(AttemptFailure::Unknown {
                    detail: error.to_string(),
                })
                .await;
                self.send(Reply::Unknown(error.into()));
                return;
            }
        };

        let status = fetched.parts.status.as_u16();
        if self.retryable.contains(&status) {
            self.settle(AttemptFailure::Failed {
                status: Some(status),
                detail: format!("upstream answered {status}, configured as retryable"),
            })
            .await;
            let response = Response::from_parts(fetched.parts, full(fetched.body));
            self.send(Reply::Failed(Answer::Response(response)));
            return;
        }

        if let Some(contract) = &self.contract {
            if fetched.parts.status.is_success() {
                if let Err(why) = contract.check(&fetched.body) {
                    metrics::counter!("idemgate_attempts_rejected_total").increment(1);
                    self.settle(AttemptFailure::Rejected {
                        status,
                        detail: format!(
                            "broke contract {}: {why}; answer: {}",
                            contract.name,
                            excerpt(&fetched.body)
                        ),
                    })
                    .await;
                    let error = UpstreamError::ContractViolation(why);
                    self.send(Reply::Failed(Answer::Error(error.into())));
                    return;
                }
            }
        }

        let stored = replay::capture(&fetched);
        match self.commit(&stored).await {
            Ok(CommitOutcome::Committed) => {
                metrics::counter!("idemgate_commits_total").increment(1);
                self.send(Reply::Committed(stored));
            }
            Ok(CommitOutcome::Superseded) => {
                metrics::counter!("idemgate_commits_superseded_total").increment(1);
                self.send(Reply::Superseded);
            }
            Err(e) => {
                // Not recorded, so not sent. The attempt stays started and its
                // lease lapses into `unknown`: the upstream did act.
                tracing::error!(error = %e, attempt = %self.attempt.id, "could not commit an upstream answer");
                self.send(Reply::Unknown(e.into()));
            }
        }
    }

    /// Commits, retrying briefly when the store is unreachable: the upstream
    /// has already acted, and a lost commit leaves the job blocked until resolved.
    async fn commit(&self, stored: &StoredResponse) -> Result<CommitOutcome, StoreError> {
        let mut backoff = Duration::from_millis(50);
        let mut tries = 0;
        loop {
            match self.shared.store.commit(&self.attempt, stored).await {
                Err(StoreError::Unavailable(e)) if tries < 5 => {
                    tracing::warn!(error = %e, attempt = %self.attempt.id, "commit failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                    tries += 1;
                }
                other => return other,
            }
        }
    }

    async fn settle(&self, failure: AttemptFailure) {
        metrics::counter!("idemgate_attempts_ended_total", "state" => failure.state().as_str())
            .increment(1);
        tracing::info!(
            attempt = %self.attempt.id, job = %self.attempt.job_id, upstream = %self.attempt.upstream,
            state = %failure.state(), detail = failure.detail(), "attempt ended without a result"
        );
        if let Err(e) = self
            .shared
            .store
            .fail_attempt(self.attempt.id, failure)
            .await
        {
            // The lease will lapse and the sweeper records the attempt as unknown.
            tracing::error!(error = %e, attempt = %self.attempt.id, "could not record the attempt's end");
        }
    }

    fn send(&mut self, reply: Reply) {
        if let Some(tx) = self.reply.take() {
            // The client may have gone; the attempt's record is what matters.
            let _ = tx.send(reply);
        }
    }
}
