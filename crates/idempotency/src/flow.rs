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
//! A request that owns a job (it began it, or claimed its next attempt)
//! hands it to [`dispatch`](super::dispatch), which runs the attempts.

use std::future::Future;
use std::time::{Duration, SystemTime};

use http::Response;

use super::dispatch::{joined, Begun, Driver, Joining};
use super::execute::UpstreamService;
use super::keyed::Keyed;
use super::replay;
use super::replay::tiers::Write;
use super::resume::resume;
use super::shared::Shared;
use crate::error::{ClientError, GatewayError};
use crate::mcp::MCP_SESSION_ID;
use crate::route::{InProgress, OnUnknown, Reconcile};
use idemgate_domain::attempt::AttemptState;
use idemgate_domain::id::JobId;
use idemgate_domain::job::{Job, JobState};
use idemgate_domain::reconcile;
use idemgate_proxy::budget::until_sent;
use idemgate_proxy::http::{Body, Outcome, IDEMPOTENCY_JOB, IDEMPOTENT_REPLAYED};
use idemgate_store::fastpath::Tag;
use idemgate_telemetry::Chain;
use std::sync::Arc;

/// How many times one request re-decides before giving up with 409; each
/// round follows a real state change, so this is never reached in practice.
const MAX_ROUNDS: usize = 16;

/// Where one round of meeting a job left the request.
enum Next {
    /// It has its answer.
    Answered(Response<Body>),
    /// The job changed (another request claimed it, or a hold ended): decide
    /// again on it as it is now.
    Reread(Job),
}

/// One opted-in request in flight, meeting its job.
struct Flow {
    driver: Arc<Driver>,
}

/// Decides and answers; every answer names the job once it exists. The
/// request is moved to the heap before the first await, so a held
/// duplicate's future carries a pointer, not the request.
pub(crate) fn run(
    shared: Arc<Shared>,
    request: Keyed,
    upstream: UpstreamService,
) -> impl Future<Output = Response<Body>> + Send {
    let flow = Flow {
        driver: Driver::new(shared, request, upstream),
    };
    async move {
        let mut job_id = None;
        let rpc_id = flow.driver.request.rpc_id.clone();
        let result = match (flow.decide(&mut job_id).await, &flow.driver.request.resume) {
            (Ok(replay), Some(point)) => {
                let retry_after = flow.driver.shared.config.retry_after;
                // Boxed, as every step a held duplicate never waits in
                // (`Flow::decide`).
                Box::pin(resume(replay, point, retry_after))
                    .await
                    .map_err(GatewayError::from)
            }
            (result, _) => result,
        };
        let response = result.unwrap_or_else(|e| {
            metrics::counter!("idemgate_requests_refused_total", "problem" => e.metric_label())
                .increment(1);
            tracing::info!(error = %Chain(&e), job = ?job_id.map(|j: JobId| j.to_string()), "request refused");
            let mut response = match &rpc_id {
                Some(id) if e.is_the_calls() => e.into_jsonrpc(id),
                _ => e.into_response(),
            };
            // The attempt whose outcome it is (an unknown one's), for the
            // access log.
            if let Some(by) = flow.driver.answered_by() {
                response.extensions_mut().insert(by);
            }
            response
        });
        // Cut first, if resumed: a resume point is a point of the stored
        // stream, which its caller may have been sent whole (docs/design.md
        // §10, "Resume").
        let response = flow.readdressed(response, rpc_id);
        // Whatever the request holds stays counted until its answer is sent.
        let charge = flow.driver.request.charge.clone();
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

impl Flow {
    /// An answer of the tool call `id` made by another call's attempt, as
    /// its own, in its own session (`docs/design.md` §19, "The answer");
    /// any other answer as it is.
    fn readdressed(&self, response: Response<Body>, id: Option<Vec<u8>>) -> Response<Body> {
        let Some(id) = id.filter(|_| response.headers().contains_key(IDEMPOTENT_REPLAYED)) else {
            return response;
        };
        let session = self.driver.request.parts.headers.get(MCP_SESSION_ID);
        crate::mcp::readdressed(response, id, session.cloned())
    }

    async fn decide(&self, job_id: &mut Option<JobId>) -> Result<Response<Body>, GatewayError> {
        let replays = &self.driver.shared.replays;
        if let Some((job, response)) = replays.in_memory(&self.driver.request) {
            *job_id = Some(job);
            return Ok(response);
        }
        // Boxed, as every step a held duplicate does not wait in: this
        // future waits for as long as the duplicate is held, and is as
        // large as the largest step it awaits (docs/performance.md, "Per
        // held duplicate").
        if let Some((job, response)) = Box::pin(replays.in_redis(&self.driver.request)).await {
            *job_id = Some(job);
            return Ok(response);
        }
        // The job met is moved into its meeting before the meeting is
        // awaited, in a block: a binding in scope across the await would
        // keep a second `Job` in this future for as long as a duplicate is
        // held.
        let meeting = {
            let job = if self.driver.request.resume.is_some() {
                self.to_resume().await?
            } else {
                let begun = joined(self.driver.begin()).await?;
                replays.found(
                    matches!(&begun, Begun::Existing(job) if job.state == JobState::Completed),
                );
                match begun {
                    Begun::Created(first, expires_at) => {
                        *job_id = Some(first.attempt.job_id);
                        metrics::counter!("idemgate_jobs_created_total").increment(1);
                        // Boxed: a held duplicate's future need not be as
                        // large as one that runs attempts.
                        return Box::pin(self.driver.drive(first, expires_at)).await;
                    }
                    Begun::Existing(job) => job,
                }
            };
            *job_id = Some(job.id);
            if job.fingerprint != self.driver.request.intent.fingerprint {
                return Err(ClientError::KeyMismatch {
                    status: self.driver.shared.config.mismatch_status,
                }
                .into());
            }
            // Boxed: only a duplicate (or a retry after a failure) needs it.
            Box::pin(self.meet(job))
        };
        meeting.await
    }

    /// The job a request that resumes a stream meets: never a new one.
    async fn to_resume(&self) -> Result<Job, GatewayError> {
        let (owner, key) = (
            &self.driver.request.intent.owner,
            &self.driver.request.intent.key,
        );
        let found = self.driver.shared.store.find_job(owner, key).await?;
        match found.map(|detail| detail.job) {
            Some(job) if !job.is_expired(SystemTime::now()) => Ok(job),
            _ => Err(nothing_to_resume(
                "no job has this Idempotency-Key (it never ran here, or it expired)",
            )),
        }
    }

    /// Answers a request whose key names an existing job of the same intent,
    /// as the job's state says.
    async fn meet(&self, mut job: Job) -> Result<Response<Body>, GatewayError> {
        let (request, shared) = (&self.driver.request, &self.driver.shared);
        let route = &request.intent.route;
        let (resuming, moves_on) = (
            request.resume.is_some(),
            route.on_unknown == OnUnknown::NewAttempt,
        );
        // Duplicates released together by one commit write its fast-path
        // entry once between them; any other replay from the store writes
        // it (which also repairs a lost or unusable entry).
        let mut write = Write::Always;
        // A duplicate waits for evidence about an unknown job once at most.
        let mut waited = false;
        for _ in 0..MAX_ROUNDS {
            match job.state {
                JobState::Completed => return shared.replays.of_job(request, &job, write).await,
                // A resume continues an answer; it never starts another.
                JobState::Open if resuming => {
                    return Err(nothing_to_resume(
                        "the job's last attempt failed without an answer",
                    ))
                }
                JobState::Unknown if moves_on && resuming => {
                    return Err(nothing_to_resume(
                        "the stream was cut and its outcome is unknown",
                    ))
                }
                // Side-effect-free: a second call, never a second effect
                // (docs/design.md §5). Of simultaneous retries one moves
                // on; the others find the job running and are held.
                JobState::Unknown if moves_on => match self.next(&job, Joining::MoveOn).await? {
                    Next::Answered(answer) => return Ok(answer),
                    Next::Reread(reread) => job = reread,
                },
                // A lookup due soon may settle it: wait for that, as for a
                // running attempt, rather than answer 409 (docs/design.md §5).
                JobState::Unknown if !waited => {
                    waited = true;
                    let Some(limit) = self.evidence_due(job.id).await else {
                        return Err(self.outcome_unknown(job.id).await);
                    };
                    // Not answered later (`Prefer: respond-async`): a
                    // poll of an unknown job is told `409`, where this hold
                    // gives the late answer (docs/design.md §10).
                    match self.hold_for_evidence(job.id, limit).await? {
                        Some(settled) => (job, write) = (settled, Write::Once),
                        None => return Err(self.outcome_unknown(job.id).await),
                    }
                }
                JobState::Unknown => return Err(self.outcome_unknown(job.id).await),
                JobState::Running => match self.running(&job).await? {
                    Next::Answered(answer) => return Ok(answer),
                    Next::Reread(held) => (job, write) = (held, Write::Once),
                },
                JobState::Open => match self.next(&job, Joining::Claim).await? {
                    Next::Answered(answer) => return Ok(answer),
                    Next::Reread(reread) => job = reread,
                },
            }
        }
        Err(shared.holds.in_progress())
    }

    /// A duplicate of a running job: `409` on a route that asks for it (the
    /// IETF draft's answer: no hold, no joining a stream, design §11);
    /// otherwise it joins the job's stream, or is held until the job changes.
    async fn running(&self, job: &Job) -> Result<Next, GatewayError> {
        let (request, shared) = (&self.driver.request, &self.driver.shared);
        if request.intent.route.in_progress == InProgress::Conflict {
            return Err(shared.holds.in_progress());
        }
        request.waits_on(job.id);
        let tag = Tag::of(&request.intent.owner, &request.intent.key);
        // Boxed: the hold below is what a duplicate waits in (`decide`).
        if let Some(joined) = Box::pin(shared.live.join(&tag, job)).await {
            return Ok(Next::Answered(joined));
        }
        Ok(Next::Reread(self.driver.hold(job.id).await?))
    }

    /// Claims the job's next attempt on the route's primary (`how`: the next
    /// try of an open job, or moving on from an unknown one) and drives it;
    /// the job as it is now when another request claimed it first.
    async fn next(&self, job: &Job, how: Joining) -> Result<Next, GatewayError> {
        let primary = self.driver.request.intent.route.primary.clone();
        let claim = self
            .driver
            .claim((job.id, job.expires_at), job.version, &primary, how);
        let Some(first) = joined(claim).await? else {
            return Ok(Next::Reread(self.driver.shared.holds.reread(job.id).await?));
        };
        if how == Joining::MoveOn {
            tracing::info!(job = %job.id, attempt = %first.attempt.id, number = first.attempt.number, "a retry moves on from an unknown attempt (on_unknown = \"new_attempt\")");
        }
        let answer = Box::pin(self.driver.drive(first, job.expires_at)).await?;
        Ok(Next::Answered(answer))
    }

    /// How long to wait for evidence to settle an unknown job
    /// (docs/design.md §11, "Silence, not total time"; §5, "Unknown
    /// attempts are looked up"):
    /// - never on a route that answers duplicates `409` at once
    ///   (`in_progress = "conflict"`, which holds nobody);
    /// - while its attempt's call is still out from this process (silent
    ///   past `first_byte_timeout`, as a call that does not stream is until
    ///   its answer is done, which commits whenever it comes): the hold
    ///   timeout, or less if the call's deadline comes first;
    /// - else, when the next lookup of its attempt is due within the hold
    ///   timeout: until then, plus the time the lookup or resend may take;
    /// - else `None` (a route that does not reconcile, no lookup due soon).
    async fn evidence_due(&self, job: JobId) -> Option<Duration> {
        let (shared, route) = (&self.driver.shared, &self.driver.request.intent.route);
        if route.in_progress == InProgress::Conflict {
            return None;
        }
        if let Some(deadline) = shared.runner.calling(job) {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            return Some(shared.config.hold.timeout.min(left));
        }
        route.reconcile.as_ref()?;
        let limit = self.next_lookup(job).await? + route.primary.timeout;
        (limit <= self.driver.shared.config.hold.timeout).then_some(limit)
    }

    /// Holds a duplicate of an unknown job until evidence settles it or
    /// `limit` passes (`None`: still unknown).
    async fn hold_for_evidence(
        &self,
        job: JobId,
        limit: Duration,
    ) -> Result<Option<Job>, GatewayError> {
        let tag = Tag::of(
            &self.driver.request.intent.owner,
            &self.driver.request.intent.key,
        );
        let live = &self.driver.shared.live;
        self.driver
            .shared
            .holds
            .wait_for_evidence(job, limit, |job, attempt| {
                live.streaming(&tag, job, attempt)
            })
            .await
    }

    /// `409` for a job whose outcome is unknown. On a route that looks
    /// unknown attempts up, `Retry-After` is the time until the next lookup
    /// (a retry sooner would only meet the same answer); otherwise, or once
    /// no lookup is left, the fixed `retry_after` (docs/design.md §5).
    async fn outcome_unknown(&self, job: JobId) -> GatewayError {
        let fixed = self.driver.shared.config.retry_after;
        let retry_after = match &self.driver.request.intent.route.reconcile {
            Some(_) => self.next_lookup(job).await.unwrap_or(fixed),
            None => fixed,
        };
        ClientError::OutcomeUnknown { retry_after }.into()
    }

    /// The soonest next lookup among the job's unknown attempts (a store
    /// that does not answer gives none: the fixed answer is still true).
    async fn next_lookup(&self, job: JobId) -> Option<Duration> {
        let detail = self.driver.shared.store.job_detail(job).await.ok()??;
        let (deadline, now) = (
            self.driver.shared.config.attempt.deadline,
            SystemTime::now(),
        );
        let how = self.driver.request.intent.route.reconcile.as_ref();
        let looks_up = matches!(how, Some(Reconcile::Lookup { .. }));
        detail
            .attempts
            .iter()
            .filter(|a| a.state == AttemptState::Unknown)
            .filter_map(|a| {
                let at = (a.started_at, a.deadline_at);
                reconcile::next_ask(&a.lookups, at, (deadline, looks_up), now)
            })
            .min()
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

#[cfg(test)]
#[allow(unreachable_code, unused_variables, clippy::diverging_sub_expression)]
mod held_size {
    use super::*;
    use crate::testing::size_of_output;

    /// A held duplicate waits in `decide` (for its boxed meeting) and in
    /// the hold: neither carries the reads it made before, nor a `Job`
    /// beside the one it is meeting (docs/performance.md, "Per held
    /// duplicate"; in a test build they were 1,456 and 1,160 bytes).
    #[test]
    fn a_held_duplicate_carries_neither_its_reads_nor_a_second_job() {
        let decide = size_of_output(&|| {
            let (flow, id): (&'static Flow, &'static mut Option<JobId>) = unreachable!();
            flow.decide(id)
        });
        let in_redis = size_of_output(&|| {
            let driver: &'static Driver = unreachable!();
            driver.shared.replays.in_redis(&driver.request)
        });
        let hold = size_of_output(&|| {
            let driver: &'static Driver = unreachable!();
            driver.hold(unreachable!())
        });
        let streaming = size_of_output(&|| {
            let (driver, tag): (&'static Driver, &'static Tag) = unreachable!();
            driver.shared.live.streaming(tag, unreachable!(), 0)
        });
        let job = std::mem::size_of::<Job>();
        assert!(
            decide < in_redis,
            "decide {decide} bytes, the Redis read {in_redis}"
        );
        assert!(
            hold < streaming + job,
            "the hold {hold} bytes, its read {streaming} and a Job {job}"
        );
    }
}
