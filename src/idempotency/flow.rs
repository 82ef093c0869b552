//! One opted-in request, from its headers to its answer (`docs/design.md`,
//! §2).
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
//!
//! A request that owns a job runs its attempts through the [`Dispatch`]
//! state machine; [`Flow::drive`] is the small driver that does its I/O.
//! Beginning a job and claiming an attempt each run in a task of their own
//! together with starting the attempt: once an attempt is recorded, it runs
//! whatever the client does (a hang-up cannot leave a key blocked by an
//! attempt that never left the gateway).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::SystemTime;

use futures_util::stream::{FuturesUnordered, StreamExt};
use http::{HeaderValue, Request, Response};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::dispatch::{Dispatch, Event, Joining, Step};
use super::execute::{self, Reply, Running};
use super::{Shared, UpstreamService};
use crate::config::{Route, UpstreamSettings};
use crate::domain::attempt::{Attempt, NewAttempt};
use crate::domain::fingerprint::{fingerprint, Fingerprint, RequestParts};
use crate::domain::id::AttemptId;
use crate::domain::id::JobId;
use crate::domain::job::{Job, JobState, NewJob};
use crate::domain::key::{IdempotencyKey, Owner};
use crate::domain::response::StoredResponse;
use crate::idempotency::fastpath::{Lookup, Tag};
use crate::idempotency::recording::{End, Recording};
use crate::idempotency::replay::{self, Answer, Framing};
use crate::proxy::error::{ClientError, GatewayError};
use crate::proxy::http::{collect_limited, full, Body, IDEMPOTENCY_JOB, IDEMPOTENCY_KEY};
use crate::proxy::upstream::Target;
use crate::store::{Begin, Observed, StoreError};
use crate::telemetry::Chain;

/// How many times one request re-decides before giving up with 409; each
/// round follows a real state change, so this is never reached in practice.
const MAX_ROUNDS: usize = 16;

/// What a request is, told from its head alone (no await, no allocation):
/// most traffic through a gateway does not opt in, and deciding that must
/// cost next to nothing.
pub(super) enum Classified {
    /// Not opted in: forward it untouched.
    PassThrough(Request<Body>),
    /// Opted in, but refused before touching the store.
    Refused(GatewayError),
    /// Opted in: its body is read and fingerprinted by [`Flow::prepare`].
    OptedIn(OptedIn),
}

/// An opted-in request whose key parsed.
pub(super) struct OptedIn {
    route: Arc<Route>,
    key: IdempotencyKey,
    req: Request<Body>,
}

/// What an opted-in request turned out to be once its body was read.
pub(super) enum Prepared {
    /// Refused before touching the store (the body was too large).
    Refused(GatewayError),
    /// Ready for the store.
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
    /// The request's span: its attempts' spans are children of it.
    span: tracing::Span,
}

impl Flow {
    /// Tells pass-through from opted-in by route and key header.
    pub(super) fn classify(settings: &crate::config::Settings, req: Request<Body>) -> Classified {
        let Some(route) = settings.route_for(req.method(), req.uri().path()) else {
            return Classified::PassThrough(req);
        };
        let key = match req.headers().get(IDEMPOTENCY_KEY) {
            None if route.require_key => {
                return Classified::Refused(ClientError::MissingKey.into())
            }
            None => {
                let primary = Target(route.primary.id.clone());
                let mut req = req;
                req.extensions_mut().insert(primary);
                return Classified::PassThrough(req);
            }
            Some(raw) => match IdempotencyKey::parse(raw.as_bytes()) {
                Ok(key) => key,
                Err(e) => return Classified::Refused(ClientError::from(e).into()),
            },
        };
        Classified::OptedIn(OptedIn {
            route: route.clone(),
            key,
            req,
        })
    }

    /// Reads what the decision needs: owner, body, fingerprint.
    pub(super) async fn prepare(shared: &Arc<Shared>, opted: OptedIn) -> Prepared {
        let settings = &shared.settings;
        let OptedIn { route, key, req } = opted;
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
            span: tracing::Span::current(),
        }))
    }

    /// Decides and answers; every answer names the job once it exists.
    pub(super) async fn run(self, upstream: UpstreamService) -> Response<Body> {
        let flow = Arc::new(self);
        let mut job_id = None;
        let result = flow.decide(&upstream, &mut job_id).await;
        let mut response = result.unwrap_or_else(|e| {
            metrics::counter!("idemgate_requests_refused_total", "problem" => e.metric_label())
                .increment(1);
            tracing::info!(error = %Chain(&e), job = ?job_id.map(|j: JobId| j.to_string()), "request refused");
            e.into_response()
        });
        // Replays name their job already.
        if let Some(job) = job_id.filter(|_| !response.headers().contains_key(IDEMPOTENCY_JOB)) {
            replay::set_job(&mut response, job);
        }
        response
    }

    async fn decide(
        self: &Arc<Self>,
        upstream: &UpstreamService,
        job_id: &mut Option<JobId>,
    ) -> Result<Response<Body>, GatewayError> {
        if let Some(response) = self.cached_replay(job_id) {
            return Ok(response);
        }
        if let Some(response) = self.fast_replay(job_id).await {
            return Ok(response);
        }
        let mut job = match joined(self.begin(upstream)).await? {
            Begun::Created(first, expires_at) => {
                *job_id = Some(first.attempt.job_id);
                metrics::counter!("idemgate_jobs_created_total").increment(1);
                // Boxed: a held duplicate's future need not be as large as
                // one that runs attempts.
                return Box::pin(self.drive(upstream, first, expires_at)).await;
            }
            Begun::Existing(job) => job,
        };
        *job_id = Some(job.id);
        if job.fingerprint != self.fingerprint {
            return Err(ClientError::KeyMismatch {
                status: self.shared.settings.mismatch_status,
            }
            .into());
        }
        // Duplicates released together by one commit write its fast-path
        // entry once between them; any other replay from the store writes
        // it (which also repairs a lost or unusable entry).
        let mut entry = Entry::Write;
        for _ in 0..MAX_ROUNDS {
            match job.state {
                JobState::Completed => return self.replay(&job, entry),
                JobState::Unknown => return Err(self.outcome_unknown()),
                JobState::Running => {
                    if let Some(joined) = self.join(job.id).await {
                        return Ok(joined);
                    }
                    job = self.hold(job.id).await?;
                    entry = Entry::Once;
                }
                JobState::Open => {
                    let primary = self.route.primary.clone();
                    let claim = self.claim(upstream, job.id, job.version, &primary, Joining::Claim);
                    match joined(claim).await? {
                        Some(first) => {
                            return Box::pin(self.drive(upstream, first, job.expires_at)).await
                        }
                        None => job = self.reread(job.id).await?,
                    }
                }
            }
        }
        Err(self.in_progress())
    }

    /// Begins the job and, when it is new, starts its first attempt, in a
    /// task of its own (see the module docs).
    fn begin(
        self: &Arc<Self>,
        upstream: &UpstreamService,
    ) -> JoinHandle<Result<Begun, StoreError>> {
        let (flow, upstream) = (self.clone(), upstream.clone());
        tokio::spawn(async move {
            let primary = flow.route.primary.clone();
            let begun = flow
                .shared
                .store
                .begin_job(flow.new_job(), flow.new_attempt(&primary))
                .await?;
            Ok(match begun {
                Begin::Created(job, attempt) => {
                    Begun::Created(flow.start(&upstream, &primary, attempt), job.expires_at)
                }
                Begin::Existing(job) => Begun::Existing(job),
            })
        })
    }

    /// Claims (or hedges) the job's next attempt on `target` and starts it,
    /// in a task of its own (see the module docs); `None` when the job moved on.
    fn claim(
        self: &Arc<Self>,
        upstream: &UpstreamService,
        job: JobId,
        version: i64,
        target: &Arc<UpstreamSettings>,
        how: Joining,
    ) -> JoinHandle<Result<Option<Running>, StoreError>> {
        let (flow, upstream, target) = (self.clone(), upstream.clone(), target.clone());
        tokio::spawn(async move {
            let store = &flow.shared.store;
            let next = flow.new_attempt(&target);
            let claimed = match how {
                Joining::Claim => store.claim_attempt(job, version, next).await?,
                Joining::Hedge => store.hedge_attempt(job, version, next).await?,
            };
            Ok(claimed.map(|attempt| flow.start(&upstream, &target, attempt)))
        })
    }

    fn start(
        &self,
        upstream: &UpstreamService,
        target: &UpstreamSettings,
        attempt: Attempt,
    ) -> Running {
        let request = self.upstream_request(&attempt);
        execute::start(
            self.shared.clone(),
            upstream.clone(),
            self.route.clone(),
            target,
            attempt,
            request,
            // Only a fast path needs it: no digest per attempt without one.
            self.shared.fastpath.as_ref().map(|_| self.tag()),
            &self.span,
        )
    }

    /// Runs the request's attempts, starting with `first` on the route's
    /// primary, as [`Dispatch`] decides, and answers with the job's result.
    async fn drive(
        self: &Arc<Self>,
        upstream: &UpstreamService,
        first: Running,
        expires_at: SystemTime,
    ) -> Result<Response<Body>, GatewayError> {
        let job = first.attempt.job_id;
        let settings = &self.shared.settings;
        let mut dispatch = Dispatch::new(
            self.route.clone(),
            &first.attempt,
            Instant::now(),
            settings.retry_after,
        );
        let mut attempts = Attempts::default();
        attempts.watch(first);
        let mut claims = FuturesUnordered::new();
        let hedge = tokio::time::sleep(self.route.hedge_after.unwrap_or_default());
        tokio::pin!(hedge);
        let mut queued = VecDeque::new();
        let eligible = |u: &UpstreamSettings| {
            self.shared
                .probes
                .eligible(u.name(), self.route.contract.as_deref())
        };
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
                        let claim = self.claim(upstream, job, version, &target, how);
                        claims.push(async move { (how, target, joined(claim).await) });
                    }
                    Step::CancelAllBut(winner) => attempts.cancel_all_but(winner),
                    Step::Reread => queued.push_back(Event::Reread(self.reread(job).await)),
                    Step::Hold => queued.push_back(Event::Held(self.hold(job).await)),
                    Step::Committed(stored) => {
                        self.remember(job, expires_at, &stored, Entry::Write);
                        return Ok(replay::response(&stored, job, false, Framing::Whole));
                    }
                    Step::Stream(recording) => return Ok(recording.response(false)),
                    Step::Replay(current) => return self.replay(&current, Entry::Write),
                    Step::Answer(answer) => return answer,
                }
            }
        }
    }

    /// A replay from this replica's memory of committed answers, for this
    /// very request only (another fingerprint goes on to the store, which
    /// decides the mismatch).
    fn cached_replay(&self, job_id: &mut Option<JobId>) -> Option<Response<Body>> {
        let answer = self
            .shared
            .answers
            .get(&self.owner, &self.key, SystemTime::now())?;
        if answer.fingerprint != self.fingerprint {
            return None;
        }
        *job_id = Some(answer.job);
        metrics::counter!("idemgate_replays_total", "source" => "memory").increment(1);
        Some(answer.replay())
    }

    /// Keeps a committed answer in this replica's memory for replay.
    fn keep(&self, job: JobId, expires_at: SystemTime, stored: &StoredResponse) {
        self.shared.answers.insert(&self.owner, &self.key, job, || {
            Answer::new(
                job,
                self.fingerprint,
                expires_at,
                stored.clone(),
                Framing::of(&self.route, stored),
            )
        });
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
        self.keep(entry.job, entry.expires_at, &stored);
        Some(replay::response(
            &stored,
            entry.job,
            true,
            Framing::of(&self.route, &stored),
        ))
    }

    /// Caches a committed response on the fast path, off the request path.
    fn remember(&self, job: JobId, expires_at: SystemTime, stored: &StoredResponse, entry: Entry) {
        self.keep(job, expires_at, stored);
        let Some(fast) = self.shared.fastpath.clone() else {
            return;
        };
        if entry == Entry::Once && !fast.needs_entry(job) {
            return;
        }
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
        self.wait(job, Streams::Join).await
    }

    /// Waits until the job is no longer running (or, with
    /// [`Streams::Join`], until its answer streams), or the hold timeout.
    async fn wait(&self, job: JobId, streams: Streams) -> Result<Job, GatewayError> {
        let bell = self.shared.doorbell.bell(job);
        // Changes of a job are announced to other replicas only once
        // someone waits on it; the reads below follow the mark.
        let store = &self.shared.store;
        bell.watched(|| store.watch(job)).await?;
        let deadline = Instant::now() + self.shared.settings.hold_timeout;
        metrics::counter!("idemgate_requests_held_total").increment(1);
        let _held = HeldGauge::new();
        loop {
            let rung = bell.notified();
            tokio::pin!(rung);
            rung.as_mut().enable();
            // What another waiter read since the last ring serves here too.
            let since = bell.rings();
            let seen = bell.observe(since, || self.observe(job)).await?;
            // Finished, or streaming: the caller decides (and joins).
            if seen.job.state != JobState::Running || (streams == Streams::Join && seen.streaming) {
                return Ok(seen.job);
            }
            tokio::select! {
                () = &mut rung => {}
                () = tokio::time::sleep_until(deadline) => return Err(self.in_progress()),
            }
        }
    }

    /// Reads the job, and whether its answer streams (here or elsewhere).
    async fn observe(&self, job: JobId) -> Result<Observed, GatewayError> {
        let job = self.reread(job).await?;
        let streaming = job.state == JobState::Running && self.streaming(job.id).await;
        Ok(Observed { job, streaming })
    }

    /// Joins the job's answer while it streams: the recording on this
    /// replica, or (with Redis) a local copy of one another replica mirrors.
    async fn join(self: &Arc<Self>, job: JobId) -> Option<Response<Body>> {
        let recording = match self.shared.streams.live(job) {
            Some(recording) => recording,
            None => self.mirrored(job).await?,
        };
        metrics::counter!("idemgate_stream_joiners_total").increment(1);
        Some(recording.response(true))
    }

    /// Whether the job's answer streams here or, with Redis, elsewhere.
    async fn streaming(&self, job: JobId) -> bool {
        if self.shared.streams.live(job).is_some() {
            return true;
        }
        match &self.shared.fastpath {
            Some(fast) => fast.stream_head(&self.tag(), job).await.is_some(),
            None => false,
        }
    }

    /// A local recording fed from the Redis Stream another replica mirrors
    /// the job's answer on, shared by every duplicate here. If Redis fails
    /// or the stream stalls, the answer is completed from the store once it
    /// is committed (or cut, if it never is).
    async fn mirrored(self: &Arc<Self>, job: JobId) -> Option<Arc<Recording>> {
        let fast = self.shared.fastpath.clone()?;
        let tag = self.tag();
        let (status, headers) = fast.stream_head(&tag, job).await?;
        let recording = Recording::new(job, status, headers);
        self.shared.streams.insert(&recording);
        let (flow, copy) = (self.clone(), recording.clone());
        let stall = self.shared.settings.upstream_timeout + self.shared.settings.lease_ttl;
        tokio::spawn(async move {
            match fast.feed(&tag, &copy, stall).await {
                Ok(End::Committed) => copy.finish(),
                Ok(_) => copy.cut(),
                Err(e) => {
                    tracing::info!(%job, error = %Chain(e.as_ref()), "the mirrored stream failed; completing it from the store");
                    flow.complete_from_store(&copy).await;
                }
            }
        });
        Some(recording)
    }

    /// Where the fast path keeps this key's entries.
    fn tag(&self) -> Tag {
        Tag::of(&self.owner, &self.key)
    }

    /// Completes a copy of a stream from the job's committed answer.
    async fn complete_from_store(&self, copy: &Recording) {
        let committed = match self.wait(copy.job(), Streams::Wait).await {
            Ok(job) if job.state == JobState::Completed => job.response,
            _ => None,
        };
        let sent = copy.stored().body;
        match committed {
            Some(answer) if answer.body.starts_with(&sent) => {
                copy.push(answer.body.slice(sent.len()..));
                copy.finish();
            }
            _ => copy.cut(),
        }
    }

    async fn reread(&self, job: JobId) -> Result<Job, GatewayError> {
        // Purged under our feet (expired): the client may simply retry.
        self.shared
            .store
            .job(job)
            .await?
            .ok_or_else(|| self.in_progress())
    }

    fn in_progress(&self) -> GatewayError {
        ClientError::InProgress {
            retry_after: self.shared.settings.retry_after,
        }
        .into()
    }

    fn outcome_unknown(&self) -> GatewayError {
        ClientError::OutcomeUnknown {
            retry_after: self.shared.settings.retry_after,
        }
        .into()
    }

    fn replay(&self, job: &Job, entry: Entry) -> Result<Response<Body>, GatewayError> {
        let stored = job.response.as_ref().ok_or_else(|| {
            GatewayError::internal(format!("completed job {} has no response", job.id))
        })?;
        metrics::counter!("idemgate_replays_total", "source" => "store").increment(1);
        // Populates the fast path, and repairs an entry that was lost or unusable.
        self.remember(job.id, job.expires_at, stored, entry);
        Ok(replay::response(
            stored,
            job.id,
            true,
            Framing::of(&self.route, stored),
        ))
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

    fn new_attempt(&self, target: &UpstreamSettings) -> NewAttempt {
        let settings = &self.shared.settings;
        NewAttempt {
            id: AttemptId::new(),
            upstream: target.name().to_owned(),
            instance: self.shared.instance,
            lease: settings.lease_ttl,
            deadline: settings.attempt_deadline,
        }
    }
}

/// When a replay writes the job's fast-path entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    /// Always (a commit, a replay from the store that found none).
    Write,
    /// Unless another replay of the job wrote it within the last second (the
    /// duplicates one commit releases together).
    Once,
}

/// Whether a wait for a running job ends when its answer starts streaming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Streams {
    /// Yes: the waiter joins the stream.
    Join,
    /// No: the waiter wants the committed answer.
    Wait,
}

/// What beginning a job found.
enum Begun {
    /// A new job, its first attempt running; and when the job expires.
    Created(Running, SystemTime),
    /// The key was seen before.
    Existing(Job),
}

/// The attempts one request runs: their replies, and how to cancel them.
#[derive(Default)]
struct Attempts {
    replies: FuturesUnordered<futures_util::future::BoxFuture<'static, (AttemptId, Reply)>>,
    cancels: Vec<(AttemptId, CancellationToken)>,
}

impl Attempts {
    fn watch(&mut self, running: Running) {
        let id = running.attempt.id;
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
    fn started(
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
                }
                self.watch(running);
                attempt
            })
        })
    }

    /// Cancels every attempt but the winner.
    fn cancel_all_but(&self, winner: AttemptId) {
        for (id, cancel) in &self.cancels {
            if *id != winner && !cancel.is_cancelled() {
                tracing::info!(winner = %winner, loser = %id, "race decided; cancelling the losing attempt");
                cancel.cancel();
            }
        }
    }
}

/// The result of a task begun for this request.
async fn joined<T>(task: JoinHandle<Result<T, StoreError>>) -> Result<T, StoreError> {
    task.await
        .unwrap_or_else(|e| Err(StoreError::Internal(Box::new(e))))
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
