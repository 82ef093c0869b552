//! The driver of one request that owns its job: it begins the job, claims
//! and starts attempts, and carries out what the [machine](super::machine)
//! decides until the job has an answer (`docs/design.md` §6).
//!
//! Beginning a job and claiming an attempt each run in a task of their own
//! together with starting the attempt: once an attempt is recorded, it runs
//! whatever the client does (a hang-up cannot leave a key blocked by an
//! attempt that never left the gateway; `docs/design.md` §3).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::SystemTime;

use futures_util::stream::{FuturesUnordered, StreamExt};
use http::Response;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::attempts::{joined, Attempts, Race};
use super::machine::{Dispatch, Event, Joining, Step};
use crate::error::GatewayError;
use crate::execute::{Runner, Running, UpstreamService};
use crate::keyed::Keyed;
use crate::replay::tiers::Write;
use crate::replay::{self, Framing};
use crate::shared::Shared;
use idemgate_domain::attempt::Attempt;
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::job::{Job, NewJob};
use idemgate_proxy::http::{AnsweredBy, Body};
use idemgate_proxy::upstream::UpstreamSettings;
use idemgate_store::fastpath::Tag;
use idemgate_store::{Begin, StoreError};

/// What beginning a job found.
pub(crate) enum Begun {
    /// A new job, its first attempt running; and when the job expires.
    Created(Running, SystemTime),
    /// The key was seen before.
    Existing(Job),
}

/// One keyed request in flight: the layer's shared parts, the request, and
/// the upstream its attempts go to.
pub(crate) struct Driver {
    pub(crate) shared: Arc<Shared>,
    pub(crate) request: Keyed,
    upstream: UpstreamService,
    /// The attempt a problem answer is about (an unknown outcome's), for
    /// the access log (`docs/design.md` §12).
    answered_by: std::sync::Mutex<Option<AnsweredBy>>,
    /// Its attempts' race, shared with its claims still out.
    race: std::sync::Mutex<Race>,
}

impl Driver {
    /// The request, on the heap: a held duplicate's future then carries a
    /// pointer, not the request.
    pub(crate) fn new(shared: Arc<Shared>, request: Keyed, upstream: UpstreamService) -> Arc<Self> {
        Arc::new(Driver {
            shared,
            request,
            upstream,
            answered_by: std::sync::Mutex::new(None),
            race: std::sync::Mutex::default(),
        })
    }

    fn race(&self) -> std::sync::MutexGuard<'_, Race> {
        self.race.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The attempt a problem answer of [`Driver::drive`] is about.
    pub(crate) fn answered_by(&self) -> Option<AnsweredBy> {
        self.answered_by
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Holds a duplicate until the job settles or its answer streams.
    pub(crate) async fn hold(&self, job: JobId) -> Result<Job, GatewayError> {
        let tag = self.tag();
        let live = &self.shared.live;
        self.shared
            .holds
            .wait(job, |job, attempt| live.streaming(&tag, job, attempt))
            .await
    }

    /// The stream of `job`'s running attempt, joined as a duplicate joins
    /// it; `None` when there is none (any more).
    async fn join(&self, job: &Job) -> Option<Response<Body>> {
        Box::pin(self.shared.live.join(&self.tag(), job)).await
    }

    /// What the request's owner and key are told by in Redis.
    fn tag(&self) -> Tag {
        Tag::of(&self.request.intent.owner, &self.request.intent.key)
    }

    /// Begins the job and, when it is new, starts its first attempt, in a
    /// task of its own (see the module docs).
    pub(crate) fn begin(self: &Arc<Self>) -> JoinHandle<Result<Begun, StoreError>> {
        let driver = self.clone();
        self.shared.runner.spawn_tracked(async move {
            let primary = driver.request.intent.route.primary.clone();
            let runner = &driver.shared.runner;
            let first = runner.new_attempt(&primary);
            let id = first.id;
            let begun = driver
                .shared
                .store
                .begin_job(driver.new_job(), first)
                .await
                .inspect_err(|e| unsent(runner, id, e))?;
            Ok(match begun {
                Begin::Created(job, attempt) => Begun::Created(
                    driver.start(&primary, attempt, job.expires_at),
                    job.expires_at,
                ),
                Begin::Existing(job) => Begun::Existing(job),
            })
        })
    }

    /// Claims (hedges, or moves on to) the next attempt of `job` (which
    /// expires at `expires_at`) on `target` and starts it, in a task of its
    /// own (see the module docs); `None` when the job moved on, or when
    /// the request's race was decided while the claim was out: that
    /// attempt is then settled `superseded`, never sent.
    pub(crate) fn claim(
        self: &Arc<Self>,
        (job, expires_at): (JobId, SystemTime),
        version: i64,
        target: &Arc<UpstreamSettings>,
        how: Joining,
    ) -> JoinHandle<Result<Option<Running>, StoreError>> {
        let (driver, target) = (self.clone(), target.clone());
        self.shared.runner.spawn_tracked(async move {
            let store = &driver.shared.store;
            let next = driver.shared.runner.new_attempt(&target);
            let id = next.id;
            let claimed = match how {
                Joining::Claim => store.claim_attempt(job, version, next).await,
                Joining::Hedge => store.hedge_attempt(job, version, next).await,
                Joining::MoveOn => store.move_on_attempt(job, version, next).await,
            }
            .inspect_err(|e| unsent(&driver.shared.runner, id, e))?;
            let Some(attempt) = claimed else {
                return Ok(None);
            };
            let started = driver
                .race()
                .start(|| driver.start(&target, attempt, expires_at));
            if started.is_none() {
                driver.shared.runner.superseded_unsent(id);
            }
            Ok(started)
        })
    }

    fn start(
        &self,
        target: &UpstreamSettings,
        attempt: Attempt,
        expires_at: SystemTime,
    ) -> Running {
        let upstream = self.upstream.clone();
        let runner = &self.shared.runner;
        runner.start(upstream, &self.request, target, attempt, expires_at)
    }

    /// Runs the request's attempts, starting with `first` on the route's
    /// primary, as [`Dispatch`] decides, and answers with the job's result.
    pub(crate) async fn drive(
        self: &Arc<Self>,
        first: Running,
        expires_at: SystemTime,
    ) -> Result<Response<Body>, GatewayError> {
        let (job, route) = (first.attempt.job_id, &self.request.intent.route);
        self.request.waits_on(job);
        let retry_after = self.shared.config.retry_after;
        let mut dispatch =
            Dispatch::new(route.clone(), &first.attempt, Instant::now(), retry_after);
        let mut attempts = Attempts::default();
        self.race().enter(first.attempt.id, &first.cancel);
        attempts.watch(first);
        // The attempt whose answer won the race, once one has.
        let mut winner = None;
        let mut claims = FuturesUnordered::new();
        let hedge = tokio::time::sleep(route.hedge_after.unwrap_or_default());
        tokio::pin!(hedge);
        let mut queued = VecDeque::new();
        let probes = &self.shared.probes;
        let eligible = |u: &UpstreamSettings| probes.eligible(u.name(), route.contract.as_deref());
        loop {
            let event = match queued.pop_front() {
                Some(event) => event,
                None => tokio::select! {
                    Some((id, reply)) = attempts.replies.next() => Event::Replied(id, reply),
                    Some((how, target, claimed)) = claims.next() => {
                        Event::Claimed(how, target, attempts.started(how, claimed))
                    }
                    () = &mut hedge, if dispatch.hedge_armed() => Event::HedgeDue,
                },
            };
            for step in dispatch.on(event, Instant::now(), &eligible) {
                match step {
                    Step::Claim {
                        target,
                        how,
                        version,
                    } => {
                        let claim = self.claim((job, expires_at), version, &target, how);
                        claims.push(async move { (how, target, joined(claim).await) });
                    }
                    Step::CancelAllBut(won) => {
                        self.race().decide(won);
                        winner = Some(won);
                    }
                    Step::Reread => {
                        let job = self.shared.holds.reread(job).await;
                        queued.push_back(Event::Reread(job));
                    }
                    Step::Hold => queued.push_back(Event::Held(self.hold(job).await)),
                    // Kept for replays by the attempt that committed it.
                    Step::Committed(stored) => {
                        let response = replay::response(&stored, job, false, Framing::Whole);
                        return Ok(attempts.mark(winner, response));
                    }
                    Step::Stream(recording) => {
                        return Ok(attempts.mark(winner, recording.response(false)))
                    }
                    Step::Replay(current) => {
                        return self
                            .shared
                            .replays
                            .of_job(&self.request, &current, Write::Always)
                            .await
                    }
                    Step::Join(current) => match self.join(&current).await {
                        Some(joined) => return Ok(joined),
                        None => queued.push_back(Event::Held(self.hold(job).await)),
                    },
                    Step::Answer(answer) => return self.answer(answer, &attempts, &dispatch),
                }
            }
        }
    }

    /// The answer when no attempt of this request produced the job's
    /// result, marked with the attempt it is about. A problem answer (an
    /// unknown outcome, most often) is rendered by the flow, which names
    /// the attempt on it.
    fn answer(
        &self,
        answer: Result<Response<Body>, GatewayError>,
        attempts: &Attempts,
        dispatch: &Dispatch,
    ) -> Result<Response<Body>, GatewayError> {
        match answer {
            Ok(response) => Ok(attempts.mark(dispatch.failed_last(), response)),
            Err(e) => {
                let by = attempts.answered_by(dispatch.failed_last());
                *self.answered_by.lock().unwrap_or_else(|e| e.into_inner()) = by;
                Err(e)
            }
        }
    }

    fn new_job(&self) -> NewJob {
        NewJob {
            id: JobId::new(),
            owner: self.request.intent.owner.clone(),
            key: self.request.intent.key.clone(),
            fingerprint: self.request.intent.fingerprint,
            route: self.request.intent.route.name.clone(),
            ttl: self.shared.config.key_ttl,
        }
    }
}

/// A start that failed with its outcome unknown may have been written: its
/// attempt is settled as never sent, in the background
/// ([`Runner::never_sent`]). One that surely reached no database (a
/// duplicate that followed a failed begin) has nothing to settle: a
/// storm of them during an outage would otherwise start a retrying write
/// each, all waiting for the database and held for by the drain.
fn unsent(runner: &Runner, attempt: AttemptId, error: &StoreError) {
    if error.is_transient() && !error.surely_unwritten() {
        runner.never_sent(attempt);
    }
}
