//! One opted-in request, from its prepared head and body to its answer:
//! deciding and driving (`docs/design.md` §2).
//!
//! A request either owns a new job or meets an existing one. An existing job
//! is decided on by its state, in a small loop because a held duplicate may
//! find the job open (its attempt failed safely) and claim the next attempt:
//!
//! | job state | answer |
//! |---|---|
//! | fingerprint differs | 409 (or 422) key mismatch |
//! | completed | replay the committed response |
//! | running | join its stream, or [hold](super::hold) until it changes, then decide again; on a route with `in_progress = "conflict"`, 409 request in progress, `Retry-After` |
//! | unknown | 409 attempt outcome unknown, `Retry-After` |
//! | open | claim the next attempt by CAS on version, run it |
//!
//! A request that names a resume point (`docs/design.md` §10, "Resume")
//! only ever meets a job: its answer (replayed or joined) is cut to what
//! follows the point, and where it would start a job or an attempt there
//! is nothing to resume, so it is refused with `416` and nothing is run.
//!
//! A request that owns a job runs its attempts through the `Dispatch`
//! state machine; `drive` is the small driver that does its I/O. Beginning
//! a job and claiming an attempt each run in a task of their own together
//! with starting the attempt: once an attempt is recorded, it runs whatever
//! the client does (a hang-up cannot leave a key blocked by an attempt that
//! never left the gateway).

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::stream::{FuturesUnordered, StreamExt};
use http::Response;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::attempts::{joined, Attempts};
use super::dispatch::{Dispatch, Event, Joining, Step};
use super::execute::Running;
use super::execute::UpstreamService;
use super::keyed::Keyed;
use super::replay::tiers::Write;
use super::replay::{self, Framing};
use super::resume::resume;
use super::shared::Shared;
use crate::error::{ClientError, GatewayError};
use crate::route::{InProgress, OnUnknown};
use idemgate_domain::attempt::{Attempt, AttemptState};
use idemgate_domain::id::JobId;
use idemgate_domain::job::{Job, JobState, NewJob};
use idemgate_domain::reconcile;
use idemgate_proxy::budget::until_sent;
use idemgate_proxy::http::{Body, Outcome, IDEMPOTENCY_JOB};
use idemgate_proxy::upstream::UpstreamSettings;
use idemgate_store::fastpath::Tag;
use idemgate_store::{Begin, StoreError};
use idemgate_telemetry::Chain;

/// How many times one request re-decides before giving up with 409; each
/// round follows a real state change, so this is never reached in practice.
const MAX_ROUNDS: usize = 16;

/// One opted-in request in flight.
struct Flow {
    shared: Arc<Shared>,
    request: Keyed,
    upstream: UpstreamService,
}

/// Decides and answers; every answer names the job once it exists. The
/// request is moved to the heap before the first await, so a held
/// duplicate's future carries a pointer, not the request.
pub(crate) fn run(
    shared: Arc<Shared>,
    request: Keyed,
    upstream: UpstreamService,
) -> impl Future<Output = Response<Body>> + Send {
    let flow = Arc::new(Flow {
        shared,
        request,
        upstream,
    });
    async move {
        let mut job_id = None;
        let result = match (flow.decide(&mut job_id).await, &flow.request.resume) {
            (Ok(replay), Some(point)) => {
                let retry_after = flow.shared.config.retry_after;
                resume(replay, point, retry_after)
                    .await
                    .map_err(GatewayError::from)
            }
            (result, _) => result,
        };
        let response = result.unwrap_or_else(|e| {
            metrics::counter!("idemgate_requests_refused_total", "problem" => e.metric_label())
                .increment(1);
            tracing::info!(error = %Chain(&e), job = ?job_id.map(|j: JobId| j.to_string()), "request refused");
            e.into_response()
        });
        // Whatever the request holds stays counted until its answer is sent.
        let charge = flow.request.charge.clone();
        finish(response, job_id).map(|body| until_sent(body, charge))
    }
}

/// Names the job on every answer once it exists, and says how the request
/// was answered ([`Outcome`]) to the stack's logs and metrics.
fn finish(mut response: Response<Body>, job_id: Option<JobId>) -> Response<Body> {
    if let Some(job) = job_id {
        // Replays name their job already.
        if !response.headers().contains_key(IDEMPOTENCY_JOB) {
            replay::set_job(&mut response, job);
        }
        response.extensions_mut().insert(job);
    }
    let extensions = response.extensions_mut();
    if extensions.get::<Outcome>().is_none() {
        extensions.insert(Outcome::Executed);
    }
    response
}

/// What beginning a job found.
enum Begun {
    /// A new job, its first attempt running; and when the job expires.
    Created(Running, SystemTime),
    /// The key was seen before.
    Existing(Job),
}

impl Flow {
    async fn decide(
        self: &Arc<Self>,
        job_id: &mut Option<JobId>,
    ) -> Result<Response<Body>, GatewayError> {
        let replays = &self.shared.replays;
        if let Some((job, response)) = replays.in_memory(&self.request) {
            *job_id = Some(job);
            return Ok(response);
        }
        if let Some((job, response)) = replays.in_redis(&self.request).await {
            *job_id = Some(job);
            return Ok(response);
        }
        let job = if self.request.resume.is_some() {
            self.to_resume().await?
        } else {
            match joined(self.begin()).await? {
                Begun::Created(first, expires_at) => {
                    *job_id = Some(first.attempt.job_id);
                    metrics::counter!("idemgate_jobs_created_total").increment(1);
                    // Boxed: a held duplicate's future need not be as large
                    // as one that runs attempts.
                    return Box::pin(self.drive(first, expires_at)).await;
                }
                Begun::Existing(job) => job,
            }
        };
        *job_id = Some(job.id);
        if job.fingerprint != self.request.fingerprint {
            return Err(ClientError::KeyMismatch {
                status: self.shared.config.mismatch_status,
            }
            .into());
        }
        // Boxed: only a duplicate (or a retry after a failure) needs it.
        Box::pin(self.meet(job)).await
    }

    /// The job a request that resumes a stream meets: never a new one.
    async fn to_resume(&self) -> Result<Job, GatewayError> {
        let (owner, key) = (&self.request.owner, &self.request.key);
        let found = self.shared.store.find_job(owner, key).await?;
        match found.map(|detail| detail.job) {
            Some(job) if job.expires_at > SystemTime::now() => Ok(job),
            _ => Err(nothing_to_resume(
                "no job has this Idempotency-Key (it never ran here, or it expired)",
            )),
        }
    }

    /// Answers a request whose key names an existing job of the same intent,
    /// as the job's state says.
    async fn meet(self: &Arc<Self>, mut job: Job) -> Result<Response<Body>, GatewayError> {
        // Duplicates released together by one commit write its fast-path
        // entry once between them; any other replay from the store writes
        // it (which also repairs a lost or unusable entry).
        let mut write = Write::Always;
        // A duplicate waits for evidence about an unknown job once at most.
        let mut waited = false;
        for _ in 0..MAX_ROUNDS {
            match job.state {
                JobState::Completed => {
                    return self.shared.replays.of_job(&self.request, &job, write)
                }
                // A resume continues an answer; it never starts another.
                JobState::Open if self.request.resume.is_some() => {
                    return Err(nothing_to_resume(
                        "the job's last attempt failed without an answer",
                    ))
                }
                JobState::Unknown
                    if self.request.route.on_unknown == OnUnknown::NewAttempt
                        && self.request.resume.is_some() =>
                {
                    return Err(nothing_to_resume(
                        "the stream was cut and its outcome is unknown",
                    ))
                }
                JobState::Unknown if self.request.route.on_unknown == OnUnknown::NewAttempt => {
                    // Side-effect-free: a second call, never a second effect
                    // (docs/design.md §5). Of simultaneous retries one moves
                    // on; the others find the job running and are held.
                    let primary = self.request.route.primary.clone();
                    let next = self.claim(job.id, job.version, &primary, Joining::MoveOn);
                    match joined(next).await? {
                        Some(first) => {
                            tracing::info!(job = %job.id, attempt = %first.attempt.id, number = first.attempt.number, "a retry moves on from an unknown attempt (on_unknown = \"new_attempt\")");
                            return Box::pin(self.drive(first, job.expires_at)).await;
                        }
                        None => job = self.shared.holds.reread(job.id).await?,
                    }
                }
                // A lookup due soon may settle it: wait for that, as for a
                // running attempt, rather than answer 409 (docs/design.md §5).
                JobState::Unknown if !waited => {
                    waited = true;
                    let Some(limit) = self.evidence_due(job.id).await else {
                        return Err(self.outcome_unknown(job.id).await);
                    };
                    match self.hold_for_evidence(job.id, limit).await? {
                        Some(settled) => (job, write) = (settled, Write::Once),
                        None => return Err(self.outcome_unknown(job.id).await),
                    }
                }
                JobState::Unknown => return Err(self.outcome_unknown(job.id).await),
                JobState::Running => {
                    // The IETF draft's answer, on routes that ask for it:
                    // no hold, no joining a stream (design §11).
                    if self.request.route.in_progress == InProgress::Conflict {
                        return Err(self.shared.holds.in_progress());
                    }
                    let tag = Tag::of(&self.request.owner, &self.request.key);
                    if let Some(joined) = self.shared.live.join(&tag, job.id).await {
                        return Ok(joined);
                    }
                    job = self.hold(job.id).await?;
                    write = Write::Once;
                }
                JobState::Open => {
                    let primary = self.request.route.primary.clone();
                    let claim = self.claim(job.id, job.version, &primary, Joining::Claim);
                    match joined(claim).await? {
                        Some(first) => return Box::pin(self.drive(first, job.expires_at)).await,
                        None => job = self.shared.holds.reread(job.id).await?,
                    }
                }
            }
        }
        Err(self.shared.holds.in_progress())
    }

    /// Holds a duplicate until the job settles or its answer streams.
    async fn hold(&self, job: JobId) -> Result<Job, GatewayError> {
        let tag = Tag::of(&self.request.owner, &self.request.key);
        let live = &self.shared.live;
        self.shared
            .holds
            .wait(job, |job| live.streaming(&tag, job))
            .await
    }

    /// Begins the job and, when it is new, starts its first attempt, in a
    /// task of its own (see the module docs).
    fn begin(self: &Arc<Self>) -> JoinHandle<Result<Begun, StoreError>> {
        let flow = self.clone();
        tokio::spawn(async move {
            let primary = flow.request.route.primary.clone();
            let runner = &flow.shared.runner;
            let begun = flow
                .shared
                .store
                .begin_job(flow.new_job(), runner.new_attempt(&primary))
                .await?;
            Ok(match begun {
                Begin::Created(job, attempt) => {
                    Begun::Created(flow.start(&primary, attempt), job.expires_at)
                }
                Begin::Existing(job) => Begun::Existing(job),
            })
        })
    }

    /// Claims (hedges, or moves on to) the job's next attempt on `target` and starts it,
    /// in a task of its own (see the module docs); `None` when the job moved on.
    fn claim(
        self: &Arc<Self>,
        job: JobId,
        version: i64,
        target: &Arc<UpstreamSettings>,
        how: Joining,
    ) -> JoinHandle<Result<Option<Running>, StoreError>> {
        let (flow, target) = (self.clone(), target.clone());
        tokio::spawn(async move {
            let store = &flow.shared.store;
            let next = flow.shared.runner.new_attempt(&target);
            let claimed = match how {
                Joining::Claim => store.claim_attempt(job, version, next).await?,
                Joining::Hedge => store.hedge_attempt(job, version, next).await?,
                Joining::MoveOn => store.move_on_attempt(job, version, next).await?,
            };
            Ok(claimed.map(|attempt| flow.start(&target, attempt)))
        })
    }

    fn start(&self, target: &UpstreamSettings, attempt: Attempt) -> Running {
        let upstream = self.upstream.clone();
        self.shared
            .runner
            .start(upstream, &self.request, target, attempt)
    }

    /// Runs the request's attempts, starting with `first` on the route's
    /// primary, as [`Dispatch`] decides, and answers with the job's result.
    async fn drive(
        self: &Arc<Self>,
        first: Running,
        expires_at: SystemTime,
    ) -> Result<Response<Body>, GatewayError> {
        let (job, route) = (first.attempt.job_id, &self.request.route);
        let retry_after = self.shared.config.retry_after;
        let mut dispatch =
            Dispatch::new(route.clone(), &first.attempt, Instant::now(), retry_after);
        let mut attempts = Attempts::default();
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
                        let claim = self.claim(job, version, &target, how);
                        claims.push(async move { (how, target, joined(claim).await) });
                    }
                    Step::CancelAllBut(won) => {
                        attempts.cancel_all_but(won);
                        winner = Some(won);
                    }
                    Step::Reread => {
                        let job = self.shared.holds.reread(job).await;
                        queued.push_back(Event::Reread(job));
                    }
                    Step::Hold => queued.push_back(Event::Held(self.hold(job).await)),
                    Step::Committed(stored) => {
                        let replays = &self.shared.replays;
                        replays.remember(&self.request, job, expires_at, &stored, Write::Always);
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
                    }
                    Step::Answer(answer) => {
                        return answer.map(|r| attempts.mark(dispatch.failed_last(), r))
                    }
                }
            }
        }
    }

    /// How long to wait for the next lookup of an unknown job's attempt to
    /// settle it, when one is due within the hold timeout (its start, plus
    /// the time the lookup or resend may take); `None` on a route that does
    /// not reconcile, or when no lookup is due that soon.
    async fn evidence_due(&self, job: JobId) -> Option<Duration> {
        let route = &self.request.route;
        route.reconcile.as_ref()?;
        let limit = self.next_lookup(job).await? + route.primary.timeout;
        (limit <= self.shared.config.hold.timeout).then_some(limit)
    }

    /// Holds a duplicate of an unknown job until evidence settles it or
    /// `limit` passes (`None`: still unknown).
    async fn hold_for_evidence(
        &self,
        job: JobId,
        limit: Duration,
    ) -> Result<Option<Job>, GatewayError> {
        let tag = Tag::of(&self.request.owner, &self.request.key);
        let live = &self.shared.live;
        self.shared
            .holds
            .wait_for_evidence(job, limit, |job| live.streaming(&tag, job))
            .await
    }

    /// `409` for a job whose outcome is unknown. On a route that looks
    /// unknown attempts up, `Retry-After` is the time until the next lookup
    /// (a retry sooner would only meet the same answer); otherwise, or once
    /// no lookup is left, the fixed `retry_after` (docs/design.md §5).
    async fn outcome_unknown(&self, job: JobId) -> GatewayError {
        let fixed = self.shared.config.retry_after;
        let retry_after = match &self.request.route.reconcile {
            Some(_) => self.next_lookup(job).await.unwrap_or(fixed),
            None => fixed,
        };
        ClientError::OutcomeUnknown { retry_after }.into()
    }

    /// The soonest next lookup among the job's unknown attempts (a store
    /// that does not answer gives none: the fixed answer is still true).
    async fn next_lookup(&self, job: JobId) -> Option<Duration> {
        let detail = self.shared.store.job_detail(job).await.ok()??;
        let (deadline, now) = (self.shared.config.attempt.deadline, SystemTime::now());
        detail
            .attempts
            .iter()
            .filter(|a| a.state == AttemptState::Unknown)
            .filter_map(|a| reconcile::next_lookup(&a.lookups, a.started_at, deadline, now))
            .min()
    }

    fn new_job(&self) -> NewJob {
        NewJob {
            id: JobId::new(),
            owner: self.request.owner.clone(),
            key: self.request.key.clone(),
            fingerprint: self.request.fingerprint,
            route: self.request.route.name.clone(),
            ttl: self.shared.config.key_ttl,
        }
    }
}

/// `416` for a resume that would have to start a job or an attempt.
fn nothing_to_resume(why: &str) -> GatewayError {
    metrics::counter!("idemgate_stream_resumes_total", "result" => "refused").increment(1);
    ClientError::ResumeUnsatisfiable {
        why: format!(
            "{why}: there is no stream to resume; send the request without Last-Event-ID \
             or Idempotency-Events-Received to run it"
        ),
        events: None,
    }
    .into()
}
