//! The attempts one request runs (`docs/design.md` §6): the replies of
//! those it started or claimed, and how to cancel the losers of a race.

use std::sync::Arc;

use futures_util::stream::FuturesUnordered;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::machine::Joining;
use crate::error::GatewayError;
use crate::execute::{Reply, Running};
use idemgate_domain::attempt::Attempt;
use idemgate_domain::id::AttemptId;
use idemgate_proxy::http::AnsweredBy;
use idemgate_store::StoreError;

/// The attempts one request runs: their replies, and how to cancel them.
#[derive(Default)]
pub(crate) struct Attempts {
    pub(crate) replies:
        FuturesUnordered<futures_util::future::BoxFuture<'static, (AttemptId, Reply)>>,
    cancels: Vec<(AttemptId, CancellationToken)>,
    /// Who each attempt is, for the answer's [`AnsweredBy`].
    started: Vec<(AttemptId, i32, Arc<str>)>,
}

impl Attempts {
    pub(crate) fn watch(&mut self, running: Running) {
        let id = running.attempt.id;
        let attempt = &running.attempt;
        self.started
            .push((id, attempt.number, Arc::from(attempt.upstream.as_str())));
        self.cancels.push((id, running.cancel));
        let reply = running.reply;
        self.replies.push(Box::pin(async move {
            let reply = reply.await.unwrap_or_else(|_| {
                Reply::Unknown(GatewayError::internal(
                    "the attempt task ended without an answer",
                ))
            });
            (id, reply)
        }));
    }

    /// Watches an attempt a claim started; hands the attempt to the dispatch.
    pub(crate) fn started(
        &mut self,
        how: Joining,
        claimed: Result<Option<Running>, StoreError>,
    ) -> Result<Option<Attempt>, StoreError> {
        claimed.map(|running| {
            running.map(|running| {
                let attempt = running.attempt.clone();
                match how {
                    Joining::Claim => {
                        metrics::counter!("idemgate_failovers_total").increment(1);
                        tracing::info!(job = %attempt.job_id, attempt = %attempt.id, number = attempt.number, upstream = %attempt.upstream, "failing over to the next upstream");
                    }
                    Joining::Hedge => {
                        metrics::counter!("idemgate_hedges_total").increment(1);
                        tracing::info!(job = %attempt.job_id, attempt = %attempt.id, number = attempt.number, upstream = %attempt.upstream, "hedging: another attempt races the first");
                    }
                    // A retry's, in flow.rs, never a request's own dispatch.
                    Joining::MoveOn => {}
                }
                self.watch(running);
                attempt
            })
        })
    }

    /// `response`, marked as `by`'s answer for the access log
    /// (`docs/design.md` §12).
    pub(crate) fn mark<B>(
        &self,
        by: Option<AttemptId>,
        mut response: http::Response<B>,
    ) -> http::Response<B> {
        if let Some(by) = self.answered_by(by) {
            response.extensions_mut().insert(by);
        }
        response
    }

    /// Who attempt `by` is, when this request started it.
    pub(crate) fn answered_by(&self, by: Option<AttemptId>) -> Option<AnsweredBy> {
        let found = by.and_then(|by| self.started.iter().find(|(id, ..)| *id == by));
        found.map(|(attempt, number, upstream)| AnsweredBy {
            attempt: *attempt,
            number: *number,
            upstream: upstream.clone(),
        })
    }

    /// Cancels every attempt but the winner.
    pub(crate) fn cancel_all_but(&self, winner: AttemptId) {
        for (id, cancel) in &self.cancels {
            if *id != winner && !cancel.is_cancelled() {
                tracing::info!(winner = %winner, loser = %id, "race decided; cancelling the losing attempt");
                cancel.cancel();
            }
        }
    }
}

/// The result of a task begun for this request.
pub(crate) async fn joined<T>(task: JoinHandle<Result<T, StoreError>>) -> Result<T, StoreError> {
    task.await
        .unwrap_or_else(|e| Err(StoreError::Internal(Box::new(e))))
}
