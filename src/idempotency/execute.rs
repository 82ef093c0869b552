//! Running one attempt, in its own task.
//!
//! The task, not the client's request, owns the attempt: a client that hangs
//! up does not cancel it, and it still commits if the upstream answers late.
//!
//! - Silence for `upstream_timeout` (no headers, no body bytes) makes the
//!   attempt and its job `unknown` at once, and the waiting client gets 504;
//!   the call goes on until `attempt_deadline` and may still commit.
//! - Refused before sending → `failed`, the job reopens (502 to the client).
//! - Broken after sending, or an answer too large to record → `unknown`.
//! - A configured retryable status → `failed`; the answer is passed to the
//!   client but not stored.
//! - Any other answer is committed by CAS before it is sent.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use super::{Shared, UpstreamService};
use crate::attempt::{Attempt, AttemptFailure};
use crate::config::Route;
use crate::error::GatewayError;
use crate::http::{full, Body};
use crate::job::StoredResponse;
use crate::replay;
use crate::store::{CommitOutcome, StoreError};
use crate::upstream::{self, UpstreamError};

/// What the waiting client is told.
pub(super) enum Reply {
    /// This attempt's answer is the job's result.
    Committed(StoredResponse),
    /// An answer that is not the job's result (a retryable status), as is.
    Uncommitted(Response<Body>),
    /// Another attempt won; the client gets the job's result instead.
    Superseded,
}

/// Starts the attempt's task and waits for what the client should get.
pub(super) async fn spawn(
    shared: Arc<Shared>,
    upstream: UpstreamService,
    route: &Route,
    attempt: Attempt,
    request: Request<Body>,
) -> Result<Reply, GatewayError> {
    let (tx, rx) = oneshot::channel();
    let retryable = route.retryable_statuses.clone();
    tokio::spawn(run(shared, upstream, retryable, attempt, request, tx));
    rx.await.unwrap_or_else(|_| {
        Err(GatewayError::Internal(
            "the attempt task ended without an answer".into(),
        ))
    })
}

type ReplyTx = oneshot::Sender<Result<Reply, GatewayError>>;

async fn run(
    shared: Arc<Shared>,
    upstream: UpstreamService,
    retryable: Vec<u16>,
    attempt: Attempt,
    request: Request<Body>,
    reply: ReplyTx,
) {
    let _lease = shared.leases.hold(attempt.id);
    let settings = shared.settings.clone();
    let mut reply = Some(reply);
    let deadline = Instant::now() + settings.attempt_deadline;
    let (progress_tx, mut progress) = watch::channel(0u64);
    let fetch = upstream::fetch(upstream, request, settings.max_response_size, progress_tx);
    tokio::pin!(fetch);
    let silence = tokio::time::sleep(settings.upstream_timeout);
    tokio::pin!(silence);
    let mut timed_out = false;
    let mut live = true;

    let fetched = loop {
        tokio::select! {
            result = &mut fetch => break Some(result),
            changed = progress.changed(), if live && !timed_out => match changed {
                Ok(()) => silence.as_mut().reset(Instant::now() + settings.upstream_timeout),
                Err(_) => live = false,
            },
            () = &mut silence, if !timed_out => {
                timed_out = true;
                let failure = AttemptFailure::Unknown {
                    detail: format!("no answer within upstream_timeout ({})", humantime::format_duration(settings.upstream_timeout)),
                };
                settle(&shared, &attempt, failure).await;
                send(&mut reply, Err(UpstreamError::TimedOut(settings.upstream_timeout).into()));
            }
            () = tokio::time::sleep_until(deadline) => break None,
        }
    };

    let Some(fetched) = fetched else {
        // Abandoned at the deadline; dropping the call cancels it upstream.
        let failure = AttemptFailure::Unknown {
            detail: "attempt deadline passed without an answer".into(),
        };
        settle(&shared, &attempt, failure).await;
        send(
            &mut reply,
            Err(UpstreamError::TimedOut(settings.upstream_timeout).into()),
        );
        return;
    };

    let fetched = match fetched {
        Ok(fetched) => fetched,
        Err(error) => {
            let failure = match &error {
                UpstreamError::Refused(detail) => AttemptFailure::Failed {
                    status: None,
                    detail: detail.clone(),
                },
                other => AttemptFailure::Unknown {
                    detail: other.to_string(),
                },
            };
            settle(&shared, &attempt, failure).await;
            send(&mut reply, Err(error.into()));
            return;
        }
    };

    let status = fetched.parts.status.as_u16();
    if retryable.contains(&status) {
        let failure = AttemptFailure::Failed {
            status: Some(status),
            detail: format!("upstream answered {status}, configured as retryable"),
        };
        settle(&shared, &attempt, failure).await;
        let response = Response::from_parts(fetched.parts, full(fetched.body));
        send(&mut reply, Ok(Reply::Uncommitted(response)));
        return;
    }

    let stored = replay::capture(&fetched);
    match commit(&shared, &attempt, &stored).await {
        Ok(CommitOutcome::Committed) => {
            metrics::counter!("idemgate_commits_total").increment(1);
            send(&mut reply, Ok(Reply::Committed(stored)));
        }
        Ok(CommitOutcome::Superseded) => {
            metrics::counter!("idemgate_commits_superseded_total").increment(1);
            tracing::warn!(
                attempt = %attempt.id, job = %attempt.job_id, number = attempt.number,
                "attempt lost the commit race (or the job was resolved meanwhile); its response is discarded"
            );
            send(&mut reply, Ok(Reply::Superseded));
        }
        Err(e) => {
            // Not recorded, so not sent. The attempt stays started and its
            // lease lapses into `unknown`: the upstream did act.
            tracing::error!(error = %e, attempt = %attempt.id, "could not commit an upstream answer");
            send(&mut reply, Err(e.into()));
        }
    }
}

/// Commits, retrying briefly when the store is unreachable: the upstream has
/// already acted, and a lost commit leaves the job blocked until resolved.
async fn commit(
    shared: &Shared,
    attempt: &Attempt,
    stored: &StoredResponse,
) -> Result<CommitOutcome, StoreError> {
    let mut backoff = Duration::from_millis(50);
    let mut tries = 0;
    loop {
        match shared.store.commit(attempt, stored).await {
            Err(StoreError::Unavailable(e)) if tries < 5 => {
                tracing::warn!(error = %e, attempt = %attempt.id, "commit failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff *= 2;
                tries += 1;
            }
            other => return other,
        }
    }
}

async fn settle(shared: &Shared, attempt: &Attempt, failure: AttemptFailure) {
    metrics::counter!("idemgate_attempts_ended_total", "state" => failure.state().as_str())
        .increment(1);
    tracing::info!(attempt = %attempt.id, job = %attempt.job_id, state = %failure.state(), detail = failure.detail(), "attempt ended without a result");
    if let Err(e) = shared.store.fail_attempt(attempt.id, failure).await {
        // The lease will lapse and the sweeper records the attempt as unknown.
        tracing::error!(error = %e, attempt = %attempt.id, "could not record the attempt's end");
    }
}

fn send(reply: &mut Option<ReplyTx>, message: Result<Reply, GatewayError>) {
    if let Some(tx) = reply.take() {
        // The client may have gone; the attempt's record is what matters.
        let _ = tx.send(message);
    }
}
