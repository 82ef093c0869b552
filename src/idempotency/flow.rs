//! The decision for one opted-in request.
//!
//! A request either owns a new job or meets an existing one. An existing job
//! is decided on by its state, in a small loop because a held duplicate may
//! find the job open (its attempt failed safely) and claim the next attempt:
//!
//! | job state | answer |
//! |---|---|
//! | fingerprint differs | 409 (or 422) key mismatch |
//! | completed | replay the committed response |
//! | running | hold until it changes, then decide again |
//! | unknown | 409 attempt outcome unknown, `Retry-After` |
//! | open | claim the next attempt by CAS on version, run it |

use std::sync::Arc;

use http::{HeaderValue, Request, Response};
use tokio::time::Instant;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio_util::sync::CancellationToken;

use super::execute::{self, Answer, Reply};
use super::{Shared, UpstreamService};
use crate::attempt::{Attempt, AttemptId, NewAttempt};
use crate::config::Route;
use crate::error::{ClientError, GatewayError};
use crate::fastpath::Lookup;
use crate::fingerprint::{fingerprint, Fingerprint, RequestParts};
use crate::http::{collect_limited, full, Body, IDEMPOTENCY_KEY};
use crate::job::{Job, JobId, JobState, NewJob, StoredResponse};
use crate::key::{IdempotencyKey, Owner};
use crate::replay;
use crate::store::{Begin, StoreError};
use crate::upstream::Target;

/// How many times one request re-decides before giving up with 409; each
/// round follows a real state change, so this is never reached in practice.
const MAX_ROUNDS: usize = 16;

/// What a request turned out to be once its headers and body were read.
pub(super) enum Prepared {
    /// Not opted in: forward it untouched.
    PassThrough(Request<Body>),
    /// Opted in, but refused before touching the store.
    Refused(GatewayError),
    /// Opted in and ready for the store.
    Guarded(Box<Flow>),
}

/// One opted-in request, buffered and fingerprinted.
pub(super) struct Flow {
    shared: Arc<Shared>,
    route: Arc<Route>,
    owner: Owner,
    key: IdempotencyKey,
    fingerprint: Fingerprint,
    parts: http::request::Parts,
    body: bytes::Bytes,
}

impl Flow {
    /// Reads what the decision needs: route, key, owner, body, fingerprint.
    pub(super) async fn prepare(shared: &Arc<Shared>, req: Request<Body>) -> Prepared {
        let settings = &shared.settings;
        let Some(route) = settings.route_for(req.method(), req.uri().path()) else {
            return Prepared::PassThrough(req);
        };
        let key = match req.headers().get(IDEMPOTENCY_KEY) {
            None if route.require_key => return Prepared::Refused(ClientError::MissingKey.into()),
            None => {
                let primary = Target(route.upstreams[0]);
                let mut req = req;
                req.extensions_mut().insert(primary);
                return Prepared::PassThrough(req);
            }
            Some(raw) => match IdempotencyKey::parse(raw.as_bytes()) {
                Ok(key) => key,
                Err(e) => return Prepared::Refused(ClientError::from(e).into()),
            },
        };
        let route = route.clone();
        let owner = Owner::from_header(
            req.headers()
                .get(&settings.owner_header)
                .map(HeaderValue::as_bytes),
        );
        let (parts, body) = req.into_parts();
        let body = match collect_limited(body, route.body_limit).await {
            Ok(body) => body,
            Err(e) => return Prepared::Refused(ClientError::from(e).into()),
        };
        let path_and_query = parts
            .uri
            .path_and_query()
            .map(|pq| pq.as_str())
            .unwrap_or("/");
        let fingerprint = fingerprint(
            &RequestParts {
                method: parts.method.as_str(),
                path_and_query,
                headers: route
                    .significant_headers
                    .iter()
                    .map(|name| {
                        (
                            name.as_str(),
                            parts.headers.get(name).map(HeaderValue::as_bytes),
                        )
                    })
                    .collect(),
                body: &body,
            },
            &route.body,
        );
        Prepared::Guarded(Box::new(Flow {
            shared: shared.clone(),
            route,
            owner,
            key,
            fingerprint,
            parts,
            body,
        }))
    }

    /// Decides and answers; every answer names the job once it exists.
    pub(super) async fn run(self, upstream: UpstreamService) -> Response<Body> {
        let mut job_id = None;
        let result = self.decide(upstream, &mut job_id).await;
        let mut response = result.unwrap_or_else(|e| {
            metrics::counter!("idemgate_requests_refused_total", "problem" => e.metric_label())
                .increment(1);
            tracing::info!(error = %e, job = ?job_id.map(|j: JobId| j.to_string()), "request refused");
            e.into_response()
        });
        if let Some(job) = job_id {
            replay::set_job(&mut response, job);
        }
        response
    }

    async fn decide(
        &self,
        upstream: UpstreamService,
        job_id: &mut Option<JobId>,
    ) -> Result<Response<Body>, GatewayError> {
        if let Some(response) = self.fast_replay(job_id).await {
            return Ok(response);
        }
        let store = &self.shared.store;
        let mut job = match store
            .begin_job(self.new_job(), self.new_attempt(self.route.upstreams[0]))
            .await?
        {
            Begin::Created(job, attempt) => {
                *job_id = Some(job.id);
                metrics::counter!("idemgate_jobs_created_total").increment(1);
                return self.dispatch(upstream, attempt, job.expires_at).await;
            }
            Begin::Existing(job) => job,
        };
        *job_id = Some(job.id);
        if job.fingerprint != self.fingerprint {
            return Err(ClientError::KeyMismatch {
                status: self.shared.settings.mismatch_status,
            }
            .into());
        }
        for _ in 0..MAX_ROUNDS {
            match job.state {
                JobState::Completed => return self.replay(&job),
                JobState::Unknown => {
                    return Err(ClientError::OutcomeUnknown {
                        retry_after: self.shared.settings.retry_after,
                    }
                    .into())
                }
                JobState::Running => job = self.hold(job.id).await?,
                JobState::Open => {
                    match store
                        .claim_attempt(
                            job.id,
                            job.version,
                            self.new_attempt(self.route.upstreams[0]),
                        )
                        .await?
                    {
                        Some(attempt) => {
                            return self.dispatch(upstream, attempt, job.expires_at).await
                        }
                        None => job = self.reread(job.id).await?,
                    }
                }
            }
        }
        Err(self.in_progress())
    }

    /// A replay straight from the Redis fast path, when it has a valid entry
    /// for this very request. Anything else (a miss, Redis down, an entry with
    /// another fingerprint) goes on to the store, which is the arbiter.
    async fn fast_replay(&self, job_id: &mut Option<JobId>) -> Option<Response<Body>> {
        let fast = self.shared.fastpath.as_ref()?;
        let Lookup::Hit(entry) = fast.lookup(&self.owner, &self.key).await else {
            return None;
        };
        if entry.fingerprint != self.fingerprint {
            return None;
        }
        let stored = match entry.response {
            Some(stored) => stored,
            // Kept by reference: one read by primary key instead of the
            // insert-or-select; it must still be this request's job.
            None => match self.shared.store.job(entry.job).await {
                Ok(Some(job))
                    if job.owner == self.owner
                        && job.key == self.key
                        && job.fingerprint == self.fingerprint =>
                {
                    job.response?
                }
                _ => return None,
            },
        };
        *job_id = Some(entry.job);
        metrics::counter!("idemgate_replays_total", "source" => "redis").increment(1);
        Some(replay::response(&stored, entry.job, true))
    }

    /// Caches a committed response on the fast path, off the request path.
    fn remember(&self, job: JobId, expires_at: std::time::SystemTime, stored: &StoredResponse) {
        let Some(fast) = self.shared.fastpath.clone() else {
            return;
        };
        let (owner, key, fingerprint, stored) = (
            self.owner.clone(),
            self.key.clone(),
            self.fingerprint,
            stored.clone(),
        );
        tokio::spawn(async move {
            fast.remember(&owner, &key, job, fingerprint, expires_at, &stored)
                .await
        });
    }

    /// Waits until the job is no longer running, or the hold timeout passes.
    /// No polling: the doorbell rings on every state change, and the job is
    /// read again after each ring (and once after subscribing, so a change
    /// between the first read and the subscription is not missed).
    async fn hold(&self, job: JobId) -> Result<Job, GatewayError> {
        let bell = self.shared.doorbell.bell(job);
        let deadline = Instant::now() + self.shared.settings.hold_timeout;
        metrics::counter!("idemgate_requests_held_total").increment(1);
        let _held = HeldGauge::new();
        loop {
            let rung = bell.notified();
            tokio::pin!(rung);
            rung.as_mut().enable();
            let current = self.reread(job).await?;
            if current.state != JobState::Running {
                return Ok(current);
            }
            tokio::select! {
                () = &mut rung => {}
                () = tokio::time::sleep_until(deadline) => return Err(self.in_progress()),
            }
        }
    }

    async fn reread(&self, job: JobId) -> Result<Job, GatewayError> {
        self.shared.store.job(job).await?.ok_or_else(|| {
            // Purged under our feet (expired): the client may simply retry.
            GatewayError::Store(StoreError::Conflict("the job expired while in use".into()))
        })
    }

    fn in_progress(&self) -> GatewayError {
        ClientError::InProgress {
            retry_after: self.shared.settings.retry_after,
        }
        .into()
    }

    fn replay(&self, job: &Job) -> Result<Response<Body>, GatewayError> {
        let stored = job.response.as_ref().ok_or_else(|| {
            GatewayError::Internal(format!("completed job {} has no response", job.id))
        })?;
        metrics::counter!("idemgate_replays_total", "source" => "store").increment(1);
        // Populates the fast path, and repairs an entry that was lost or unusable.
        self.remember(job.id, job.expires_at, stored);
        Ok(replay::response(stored, job.id, true))
    }

    /// Runs the attempts one request may make, starting with `first` on the
    /// route's primary, and answers with the job's result.
    ///
    /// - After a safe failure (refused before send, retryable status,
    ///   contract broken) the next eligible upstream gets the next attempt,
    ///   claimed by CAS, up to `max_attempts` and `failover_deadline`; each
    ///   upstream at most once per request.
    /// - On side-effect-free routes, after `hedge_after` without an answer,
    ///   a second attempt races the first under the same version; the first
    ///   to commit wins and the others are cancelled and `superseded`. Only
    ///   there may an unknown outcome be followed by another attempt.
    /// - Eligible means: the route has no contract, or the upstream passes
    ///   its probes. The primary is always tried.
    async fn dispatch(
        &self,
        upstream: UpstreamService,
        first: Attempt,
        expires_at: std::time::SystemTime,
    ) -> Result<Response<Body>, GatewayError> {
        let route = &self.route;
        let job = first.job_id;
        let deadline = Instant::now() + route.failover_deadline;
        let mut version = first.job_version;
        let mut next_position = 1;
        let mut made = 1;
        let mut running = FuturesUnordered::new();
        let mut cancels = Vec::new();
        let start = |attempt: Attempt, target: usize, cancels: &mut Vec<_>| {
            let request = self.upstream_request(&attempt);
            let run = execute::start(
                self.shared.clone(),
                upstream.clone(),
                route,
                target,
                attempt,
                request,
            );
            cancels.push((run.attempt.id, run.cancel.clone()));
            let id = run.attempt.id;
            async move { (id, run.reply.await) }
        };
        running.push(start(first, route.upstreams[0], &mut cancels));
        let hedge = tokio::time::sleep(route.hedge_after.unwrap_or_default());
        tokio::pin!(hedge);
        let mut hedge_armed = route.hedge_after.is_some();
        let mut last: Option<Answer> = None;
        let mut unknown: Option<GatewayError> = None;

        loop {
            let (id, reply) = tokio::select! {
                Some(done) = running.next() => done,
                () = &mut hedge, if hedge_armed => {
                    hedge_armed = false;
                    if made < route.max_attempts && running.len() == 1 {
                        if let Some(target) = self.next_eligible(&mut next_position) {
                            let next = self.new_attempt(target);
                            if let Some(attempt) = self.shared.store.hedge_attempt(job, version, next).await? {
                                metrics::counter!("idemgate_hedges_total").increment(1);
                                tracing::info!(job = %job, attempt = %attempt.id, upstream = %attempt.upstream, "hedging: a second attempt races the first");
                                made += 1;
                                running.push(start(attempt, target, &mut cancels));
                            }
                        }
                    }
                    continue;
                }
            };
            let reply = reply.unwrap_or_else(|_| {
                Reply::Unknown(GatewayError::Internal(
                    "the attempt task ended without an answer".into(),
                ))
            });
            match reply {
                Reply::Committed(stored) => {
                    self.cancel_losers(&cancels, id);
                    self.remember(job, expires_at, &stored);
                    return Ok(replay::response(&stored, job, false));
                }
                Reply::Superseded => {
                    // Another attempt won: answer with the job's one result.
                    let current = self.reread(job).await?;
                    if let Some(winner) = current.completed_by {
                        tracing::warn!(%job, loser = %id, %winner, "attempt lost the commit race; its answer is discarded");
                        self.cancel_losers(&cancels, winner);
                        return self.replay(&current);
                    }
                    if running.is_empty() {
                        // Resolved by an operator meanwhile: decide afresh.
                        return Err(ClientError::OutcomeUnknown {
                            retry_after: self.shared.settings.retry_after,
                        }
                        .into());
                    }
                    continue;
                }
                Reply::Failed(answer) => last = Some(answer),
                Reply::Unknown(error) => unknown = Some(error),
            }
            if !running.is_empty() {
                continue;
            }
            // Nothing in flight. An unknown outcome blocks, unless the route
            // may hedge (its requests have no external side effects).
            let blocked = unknown.is_some() && !route.side_effect_free;
            if blocked || made >= route.max_attempts || Instant::now() >= deadline {
                return finish(last, unknown);
            }
            let Some(target) = self.next_eligible(&mut next_position) else {
                return finish(last, unknown);
            };
            let next = self.new_attempt(target);
            let claimed = if unknown.is_some() {
                self.shared.store.hedge_attempt(job, version, next).await?
            } else {
                self.shared.store.claim_attempt(job, version, next).await?
            };
            let Some(attempt) = claimed else {
                // Someone else (a retry, a held duplicate) moved the job on:
                // wait for it like any duplicate.
                let current = self.hold(job).await?;
                return match current.state {
                    JobState::Completed => self.replay(&current),
                    _ => finish(last, unknown),
                };
            };
            metrics::counter!("idemgate_failovers_total").increment(1);
            tracing::info!(%job, attempt = %attempt.id, number = attempt.number, upstream = %attempt.upstream, "failing over to the next upstream");
            version = attempt.job_version;
            made += 1;
            running.push(start(attempt, target, &mut cancels));
        }
    }

    /// Cancels every attempt of this request but the winner.
    fn cancel_losers(&self, cancels: &[(AttemptId, CancellationToken)], winner: AttemptId) {
        for (id, cancel) in cancels {
            if *id != winner && !cancel.is_cancelled() {
                tracing::info!(winner = %winner, loser = %id, "race decided; cancelling the losing attempt");
                cancel.cancel();
            }
        }
    }

    /// The next upstream of the route, in order, that may take an attempt.
    fn next_eligible(&self, position: &mut usize) -> Option<usize> {
        while let Some(&target) = self.route.upstreams.get(*position) {
            *position += 1;
            let name = &self.shared.settings.upstreams[target].name;
            if self
                .shared
                .probes
                .eligible(name, self.route.contract.as_deref())
            {
                return Some(target);
            }
            tracing::debug!(upstream = %name, "skipping an upstream that does not pass its contract's probes");
        }
        None
    }

    fn upstream_request(&self, attempt: &Attempt) -> Request<Body> {
        let mut parts = self.parts.clone();
        let settings = &self.shared.settings;
        parts.headers.remove(IDEMPOTENCY_KEY);
        if let Ok(v) = HeaderValue::from_str(&attempt.job_id.to_string()) {
            parts.headers.insert(settings.forward_key_header.clone(), v);
        }
        parts.headers.insert(
            settings.forward_attempt_header.clone(),
            HeaderValue::from(attempt.number),
        );
        Request::from_parts(parts, full(self.body.clone()))
    }

    fn new_job(&self) -> NewJob {
        NewJob {
            id: JobId::new(),
            owner: self.owner.clone(),
            key: self.key.clone(),
            fingerprint: self.fingerprint,
            route: self.route.name.clone(),
            ttl: self.shared.settings.key_ttl,
        }
    }

    fn new_attempt(&self, target: usize) -> NewAttempt {
        let settings = &self.shared.settings;
        NewAttempt {
            id: AttemptId::new(),
            upstream: settings.upstreams[target].name.clone(),
            instance: self.shared.instance,
            lease: settings.lease_ttl,
            deadline: settings.attempt_deadline,
        }
    }
}

/// The answer when no attempt of this request produced the job's result.
fn finish(
    last: Option<Answer>,
    unknown: Option<GatewayError>,
) -> Result<Response<Body>, GatewayError> {
    if let Some(error) = unknown {
        return Err(error);
    }
    match last {
        Some(Answer::Response(response)) => Ok(response),
        Some(Answer::Error(error)) => Err(error),
        None => Err(GatewayError::Internal("no attempt was made".into())),
    }
}

/// Counts the duplicates held right now (`idemgate_held_requests`).
struct HeldGauge;

impl HeldGauge {
    fn new() -> Self {
        metrics::gauge!("idemgate_held_requests").increment(1.0);
        HeldGauge
    }
}

impl Drop for HeldGauge {
    fn drop(&mut self) {
        metrics::gauge!("idemgate_held_requests").decrement(1.0);
    }
}
