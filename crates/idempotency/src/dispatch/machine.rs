//! The decisions of one request that runs attempts, as a state machine
//! (`docs/design.md`, §6).
//!
//! A request that owns a job (it created it, or claimed its next attempt)
//! runs attempts until one produces the job's result or nothing more may be
//! tried. `Dispatch` decides; it does no I/O. The driver beside it
//! ([`super::drive`]) feeds it `Event`s (an attempt replied, the hedge timer
//! fired, a claim came back from the store, the job was read) and carries
//! out the `Step`s it returns.
//!
//! - After a safe failure (refused before send, retryable status, contract
//!   broken) the next eligible upstream gets the next attempt, claimed by
//!   CAS, up to `max_attempts` and `failover_deadline`; each upstream at most
//!   once per request.
//! - On side-effect-free routes, after `hedge_after` without an answer, a
//!   second attempt races the first under the same version; the first to
//!   commit wins and the others are cancelled and `superseded`. Only there
//!   may an unknown outcome be followed by another attempt.
//! - A store error while claiming never abandons attempts still running: the
//!   request goes on waiting for them, and answers with their outcome.
//! - Once an attempt's answer starts streaming to the client, every other
//!   attempt is cancelled: no other upstream is tried after the first byte.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{ClientError, GatewayError};
use crate::execute::{Reply, Uncommitted};
use crate::recording::Recording;
use crate::route::Route;
use idemgate_domain::attempt::Attempt;
use idemgate_domain::id::AttemptId;
use idemgate_domain::job::{Job, JobState};
use idemgate_domain::response::StoredResponse;
use idemgate_proxy::upstream::UpstreamSettings;
use idemgate_store::StoreError;
use idemgate_telemetry::Chain;

/// How a new attempt joins the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Joining {
    /// The next try of an `open` job (moves the version).
    Claim,
    /// Beside a running or unknown attempt (keeps the version).
    Hedge,
    /// Beside an unknown attempt, none running, on a retry (keeps the
    /// version; a route with `on_unknown = "new_attempt"`).
    MoveOn,
}

/// What happened.
#[derive(Debug)]
pub(crate) enum Event {
    /// An attempt of this request replied.
    Replied(AttemptId, Reply),
    /// `hedge_after` passed since the first attempt started.
    HedgeDue,
    /// A claim or hedge asked for by [`Step::Claim`] came back.
    Claimed(
        Joining,
        Arc<UpstreamSettings>,
        Result<Option<Attempt>, StoreError>,
    ),
    /// The job, read as asked by [`Step::Reread`].
    Reread(Result<Job, GatewayError>),
    /// The job, once no longer running, after [`Step::Hold`].
    Held(Result<Job, GatewayError>),
}

/// What to do next.
#[derive(Debug)]
pub(crate) enum Step {
    /// Ask the store for a new attempt on `target` and start it; the result
    /// comes back as [`Event::Claimed`].
    Claim {
        /// Where the attempt goes.
        target: Arc<UpstreamSettings>,
        /// How it joins the job.
        how: Joining,
        /// The version the store must still be at.
        version: i64,
    },
    /// Cancel every attempt of this request but this one.
    CancelAllBut(AttemptId),
    /// Read the job (an attempt lost the race; who won?).
    Reread,
    /// Someone else moved the job on: wait for it like any duplicate; the
    /// job comes back as [`Event::Held`].
    Hold,
    /// Answer with this attempt's committed response.
    Committed(StoredResponse),
    /// Answer with this attempt's streamed answer, read from its recording.
    Stream(Arc<Recording>),
    /// Answer with the job's committed response, as a replay.
    Replay(Job),
    /// Join the stream of another request's attempt, as a duplicate does;
    /// the job comes back as [`Event::Held`] if there is none to join.
    Join(Job),
    /// Answer without a result.
    Answer(Result<http::Response<idemgate_proxy::http::Body>, GatewayError>),
}

/// The state of one request's attempts.
pub(crate) struct Dispatch {
    route: Arc<Route>,
    retry_after: Duration,
    deadline: Instant,
    /// Fallbacks not tried yet, in order.
    untried: VecDeque<Arc<UpstreamSettings>>,
    /// The version claims must find.
    version: i64,
    made: usize,
    running: usize,
    claiming: bool,
    hedge_pending: bool,
    last: Option<Uncommitted>,
    /// The attempt `last` is the answer of.
    last_by: Option<AttemptId>,
    unknown: Option<GatewayError>,
    /// The attempt `unknown` is the outcome of.
    unknown_by: Option<AttemptId>,
    store_error: Option<StoreError>,
    /// Whether a stream of another's attempt was to be joined once already.
    joined: bool,
}

impl Dispatch {
    /// A request whose first attempt, on the route's primary, is `first`.
    pub(crate) fn new(
        route: Arc<Route>,
        first: &Attempt,
        now: Instant,
        retry_after: Duration,
    ) -> Self {
        Dispatch {
            retry_after,
            deadline: now + route.failover_deadline,
            untried: route.fallbacks.iter().cloned().collect(),
            version: first.job_version,
            made: 1,
            running: 1,
            claiming: false,
            hedge_pending: route.hedge_after.is_some(),
            last: None,
            last_by: None,
            unknown: None,
            unknown_by: None,
            store_error: None,
            joined: false,
            route,
        }
    }

    /// Whether the hedge timer still matters.
    pub(crate) fn hedge_armed(&self) -> bool {
        self.hedge_pending
    }

    /// Takes in one event and says what to do. `eligible` tells whether an
    /// upstream may take a failover or hedged attempt now (its probes pass).
    pub(crate) fn on(
        &mut self,
        event: Event,
        now: Instant,
        eligible: &dyn Fn(&UpstreamSettings) -> bool,
    ) -> Vec<Step> {
        match event {
            Event::Replied(id, reply) => self.replied(id, reply, now, eligible),
            Event::HedgeDue => {
                // One more attempt races the first, within the failover
                // deadline (docs/design.md §6): not once one already does.
                let armed = std::mem::replace(&mut self.hedge_pending, false);
                let spent = !armed || self.made >= self.route.max_attempts || now >= self.deadline;
                if spent || self.running != 1 || self.claiming {
                    return Vec::new();
                }
                self.claim(Joining::Hedge, eligible).into_iter().collect()
            }
            Event::Claimed(how, target, result) => self.claimed(how, target, result, now, eligible),
            Event::Reread(Ok(job)) | Event::Held(Ok(job)) if job.state == JobState::Completed => {
                vec![Step::Replay(job)]
            }
            // Resolved by an operator meanwhile: the client decides afresh.
            Event::Reread(Ok(_)) => vec![Step::Answer(Err(ClientError::OutcomeUnknown {
                retry_after: self.retry_after,
            }
            .into()))],
            // Held after another request moved the job on, whose attempt now
            // streams: its answer is the job's, and this request's own last
            // failure is stale (docs/design.md §6). Joined once: a stream
            // gone by then is committed or cut, which a hold tells.
            Event::Held(Ok(job)) if job.state == JobState::Running && !self.joined => {
                self.joined = true;
                vec![Step::Join(job)]
            }
            Event::Held(Ok(_)) => vec![Step::Answer(self.finish())],
            Event::Reread(Err(e)) | Event::Held(Err(e)) => vec![Step::Answer(Err(e))],
        }
    }

    fn replied(
        &mut self,
        id: AttemptId,
        reply: Reply,
        now: Instant,
        eligible: &dyn Fn(&UpstreamSettings) -> bool,
    ) -> Vec<Step> {
        self.running = self.running.saturating_sub(1);
        match reply {
            Reply::Committed(stored) => {
                return vec![Step::CancelAllBut(id), Step::Committed(stored)];
            }
            // Its bytes are going out: no other attempt may answer now.
            Reply::Streaming(recording) => {
                return vec![Step::CancelAllBut(id), Step::Stream(recording)];
            }
            // Another attempt won. If it is one of ours, its own reply says
            // so; with none of ours left, read who did.
            Reply::Superseded if self.running == 0 && !self.claiming => return vec![Step::Reread],
            Reply::Superseded => return Vec::new(),
            Reply::Failed(answer) => {
                self.last = Some(answer);
                self.last_by = Some(id);
            }
            Reply::Unknown(error) => {
                self.unknown = Some(error);
                self.unknown_by = Some(id);
            }
        }
        self.next(now, eligible)
    }

    fn claimed(
        &mut self,
        how: Joining,
        target: Arc<UpstreamSettings>,
        result: Result<Option<Attempt>, StoreError>,
        now: Instant,
        eligible: &dyn Fn(&UpstreamSettings) -> bool,
    ) -> Vec<Step> {
        self.claiming = false;
        match result {
            Ok(Some(attempt)) => {
                self.made += 1;
                self.running += 1;
                if how == Joining::Claim {
                    self.version = attempt.job_version;
                }
                // A hedge already races (past an unknown attempt): the
                // timer's one more attempt is spent, or a third would start.
                if how == Joining::Hedge {
                    self.hedge_pending = false;
                }
                Vec::new()
            }
            // A hedge the job no longer takes (the attempt it would race
            // has ended meanwhile): the target was not tried after all. Past
            // an unknown attempt with nothing running, though, the next
            // step would be the same hedge on the same version, refused
            // again and again: the job moved on (the unknown attempt's late
            // answer committed, or it was settled), so read it, below.
            Ok(None) if how == Joining::Hedge && (self.running > 0 || self.unknown.is_none()) => {
                self.untried.push_front(target);
                self.next(now, eligible)
            }
            Ok(None) if self.running > 0 => Vec::new(),
            // Someone else (a retry, a held duplicate) moved the job on.
            Ok(None) => vec![Step::Hold],
            Err(e) => {
                tracing::warn!(error = %Chain(&e), "could not start another attempt; waiting for the ones running");
                // Not tried: a failover after the running attempt fails
                // may still take it.
                if self.running > 0 {
                    self.untried.push_front(target);
                }
                self.store_error = Some(e);
                if self.running > 0 {
                    Vec::new()
                } else {
                    vec![Step::Answer(self.finish())]
                }
            }
        }
    }

    /// With nothing in flight: fail over, or answer.
    fn next(&mut self, now: Instant, eligible: &dyn Fn(&UpstreamSettings) -> bool) -> Vec<Step> {
        if self.running > 0 || self.claiming {
            return Vec::new();
        }
        // Every attempt of ours lost its commit (a hedge's claim was out
        // when the last did): someone else moved the job on, a winner or
        // an operator. Read who, as a lost race with no claim out does.
        if self.last.is_none() && self.unknown.is_none() {
            return vec![Step::Reread];
        }
        // An unknown outcome blocks, unless the route may hedge (its
        // requests have no external side effects).
        let blocked = self.unknown.is_some() && !self.route.side_effect_free;
        if blocked || self.made >= self.route.max_attempts || now >= self.deadline {
            return vec![Step::Answer(self.finish())];
        }
        let how = if self.unknown.is_some() {
            Joining::Hedge
        } else {
            Joining::Claim
        };
        match self.claim(how, eligible) {
            Some(step) => vec![step],
            None => vec![Step::Answer(self.finish())],
        }
    }

    fn claim(
        &mut self,
        how: Joining,
        eligible: &dyn Fn(&UpstreamSettings) -> bool,
    ) -> Option<Step> {
        while let Some(target) = self.untried.pop_front() {
            if eligible(&target) {
                self.claiming = true;
                return Some(Step::Claim {
                    target,
                    how,
                    version: self.version,
                });
            }
            tracing::debug!(upstream = %target.id, "skipping an upstream that does not pass its contract's probes");
        }
        None
    }

    /// The attempt whose failure an [`Step::Answer`] passes on, if any:
    /// the unknown one, whose outcome is the answer when there is one
    /// ([`Dispatch::finish`]), else the last that failed.
    pub(crate) fn failed_last(&self) -> Option<AttemptId> {
        self.unknown_by.or(self.last_by)
    }

    /// The answer when no attempt of this request produced the job's result.
    fn finish(&mut self) -> Result<http::Response<idemgate_proxy::http::Body>, GatewayError> {
        if let Some(error) = self.unknown.take() {
            return Err(error);
        }
        match self.last.take() {
            Some(Uncommitted::Response(response)) => Ok(response),
            Some(Uncommitted::Error(error)) => Err(error),
            None => Err(match self.store_error.take() {
                Some(e) => e.into(),
                None => GatewayError::internal("no attempt was made"),
            }),
        }
    }
}

#[cfg(test)]
mod tests;
