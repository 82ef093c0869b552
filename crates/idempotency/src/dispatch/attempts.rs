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

/// The race of one request's attempts: how to cancel each, and its
/// winner once one answered. Shared by the request's drive and its claims
/// still out, under a lock: an attempt is started and entered here in one
/// step, and the winner decided in another, so a claim that lands after
/// the race was decided starts nothing, and one that started just before
/// is cancelled with the other losers (`docs/design.md` §6: once an
/// answer streams, no other upstream is tried).
#[derive(Default)]
pub(crate) struct Race {
    winner: Option<AttemptId>,
    cancels: Vec<(AttemptId, CancellationToken)>,
}

impl Race {
    /// Starts an attempt with `start` unless the race is decided, and
    /// enters it; `None` when it was decided (nothing was started).
    pub(crate) fn start(&mut self, start: impl FnOnce() -> Running) -> Option<Running> {
        if self.winner.is_some() {
            return None;
        }
        let running = start();
        self.enter(running.attempt.id, &running.cancel);
        Some(running)
    }

    /// Enters an attempt started before the race could be decided (the
    /// request's first); once.
    pub(crate) fn enter(&mut self, id: AttemptId, cancel: &CancellationToken) {
        if !self.cancels.iter().any(|(entered, _)| *entered == id) {
            self.cancels.push((id, cancel.clone()));
        }
    }

    /// `winner` won: every other attempt is cancelled, and none starts.
    pub(crate) fn decide(&mut self, winner: AttemptId) {
        self.winner = Some(winner);
        for (id, cancel) in &self.cancels {
            if *id != winner && !cancel.is_cancelled() {
                tracing::info!(winner = %winner, loser = %id, "race decided; cancelling the losing attempt");
                cancel.cancel();
            }
        }
    }
}

/// The attempts one request runs: their replies, and who each is.
#[derive(Default)]
pub(crate) struct Attempts {
    pub(crate) replies:
        FuturesUnordered<futures_util::future::BoxFuture<'static, (AttemptId, Reply)>>,
    /// Who each attempt is, for the answer's [`AnsweredBy`].
    started: Vec<(AttemptId, i32, Arc<str>)>,
}

impl Attempts {
    pub(crate) fn watch(&mut self, running: Running) {
        let id = running.attempt.id;
        let attempt = &running.attempt;
        self.started
            .push((id, attempt.number, Arc::from(attempt.upstream.as_str())));
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
}

/// The result of a task begun for this request.
pub(crate) async fn joined<T>(task: JoinHandle<Result<T, StoreError>>) -> Result<T, StoreError> {
    task.await
        .unwrap_or_else(|e| Err(StoreError::Internal(Box::new(e))))
}
