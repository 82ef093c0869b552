//! Running one attempt, in its own task (`docs/design.md`, §5).
//!
//! The task, not the client's request, owns the attempt: a client that hangs
//! up does not cancel it, and it still commits if the upstream answers late.
//! It does three things, each its own function:
//!
//! 1. [`Task::call`]: sends the request and watches the clock. Silence for
//!    the upstream's timeout (no headers, no body bytes) makes the attempt
//!    `unknown` at once and tells the request so; the call goes on until
//!    `attempt_deadline` and may still commit. Cancelled because another
//!    attempt of the job won: `superseded`, and the call is dropped.
//! 2. [`classify`]: decides, from the answer alone, what it means (pure):
//!    refused before sending → `failed`; broken after sending, or too large
//!    to record → `unknown`; a retryable status → `failed`, handed back
//!    uncommitted; a 2xx that breaks the route's contract → `rejected`;
//!    anything else → commit.
//! 3. [`Task::record`]: writes the outcome. What the gateway learned is
//!    never dropped by a transient fault: the write is retried with backoff
//!    until the store takes it or the attempt's deadline passes, holding the
//!    attempt's lease meanwhile. The request is answered once the write is
//!    in, or after [`PATIENCE`] at most (then with `503` for an answer not yet
//!    committed: the client's retry is held until it is, and replays it).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Request, Response};
use http_body_util::BodyExt;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use super::layer::UpstreamService;
use super::opt_in::Keyed;
use super::recording::join::Live;
use crate::config::{Route, UpstreamSettings};
use crate::domain::attempt::{Attempt, AttemptFailure, AttemptState, NewAttempt};
use crate::domain::contract::excerpt;
use crate::domain::id::AttemptId;
use crate::domain::response::StoredResponse;
use crate::idempotency::fastpath::{FastPath, Tag};
use crate::idempotency::recording::Recording;
use crate::idempotency::replay;
use crate::proxy::error::GatewayError;
use crate::proxy::http::{full, Body, IDEMPOTENCY_KEY};
use crate::proxy::upstream::{self, Fetched, Target, UpstreamError, UpstreamErrorKind};
use crate::store::{CommitOutcome, Doorbell, Store, StoreError};
use crate::telemetry::Chain;
use crate::upkeep::lease::{LeaseGuard, Leases};

/// How long a request waits for its attempt's outcome to be recorded before
/// it is answered anyway (the write goes on in the background).
pub(super) const PATIENCE: Duration = Duration::from_secs(2);
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// How an attempt ended, as far as the request that started it is concerned.
#[derive(Debug)]
pub(super) enum Reply {
    /// Its answer is the job's result.
    Committed(StoredResponse),
    /// Another attempt won (or an operator resolved the job meanwhile).
    Superseded,
    /// Provably had no effect; what the client gets if nothing else is tried.
    Failed(Uncommitted),
    /// Sent, and its outcome is unknown (or not recorded yet).
    Unknown(GatewayError),
    /// Its answer streams: read it from the recording (the end comes once
    /// it is committed).
    Streaming(Arc<Recording>),
}

/// A client-facing answer that is not the job's result.
#[derive(Debug)]
pub(super) enum Uncommitted {
    /// The upstream's own answer (a retryable status), passed on uncommitted.
    Response(Response<Body>),
    /// A problem answer.
    Error(GatewayError),
}

/// What an upstream's answer means for its attempt.
#[derive(Debug)]
pub(super) enum Verdict {
    /// Commit it.
    Commit(StoredResponse),
    /// Provably no effect (refused, retryable status, contract broken).
    Fail(AttemptFailure, Uncommitted),
    /// It may have acted; nobody can tell how.
    Unknown(AttemptFailure, GatewayError),
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

/// What every attempt runs with.
#[derive(Debug, Clone)]
pub struct Config {
    /// After this long an attempt is abandoned, answer or not.
    pub deadline: Duration,
    /// Length of an attempt's lease; renewed every third of it.
    pub lease_ttl: Duration,
    /// Largest upstream answer that can be committed.
    pub max_response_size: usize,
    /// The header carrying the job id upstream.
    pub forward_key_header: HeaderName,
    /// The header carrying the attempt number upstream.
    pub forward_attempt_header: HeaderName,
}

/// Runs attempts: the handles every attempt task needs.
pub struct Runner {
    config: Config,
    store: Arc<dyn Store>,
    leases: Arc<Leases>,
    doorbell: Arc<Doorbell>,
    fastpath: Option<Arc<FastPath>>,
    live: Arc<Live>,
    /// This gateway instance, recorded on the attempts it runs.
    instance: Uuid,
}

impl Runner {
    /// Runs attempts for gateway `instance`, recording them in `store`.
    pub fn new(
        config: Config,
        store: Arc<dyn Store>,
        leases: Arc<Leases>,
        doorbell: Arc<Doorbell>,
        fastpath: Option<Arc<FastPath>>,
        live: Arc<Live>,
        instance: Uuid,
    ) -> Self {
        Runner {
            config,
            store,
            leases,
            doorbell,
            fastpath,
            live,
            instance,
        }
    }

    /// What the store is asked to record for a new attempt on `target`.
    pub(super) fn new_attempt(&self, target: &UpstreamSettings) -> NewAttempt {
        NewAttempt {
            id: AttemptId::new(),
            upstream: target.name().to_owned(),
            instance: self.instance,
            lease: self.config.lease_ttl,
            deadline: self.config.deadline,
        }
    }

    /// Starts `attempt` of `request`'s job against `target`, in a task of
    /// its own.
    pub(super) fn start(
        self: &Arc<Self>,
        upstream: UpstreamService,
        request: &Keyed,
        target: &UpstreamSettings,
        attempt: Attempt,
    ) -> Running {
        let (tx, rx) = oneshot::channel();
        let cancel = CancellationToken::new();
        let forwarded = self.upstream_request(request, target, &attempt);
        let task = Task {
            lease: Arc::new(self.leases.hold(attempt.id)),
            deadline: Instant::now() + self.config.deadline,
            timeout: target.timeout,
            route: request.route.clone(),
            runner: self.clone(),
            attempt: attempt.clone(),
            // Only a fast path needs it: no digest per attempt without one.
            tag: self.fastpath.as_ref().map(|_| request.tag()),
            reply: Some(tx),
        };
        // A child of the request's span, though it may outlive the request.
        let span = tracing::info_span!(
            parent: &request.span,
            "attempt",
            otel.kind = "client",
            job.id = %attempt.job_id,
            attempt.id = %attempt.id,
            attempt.number = attempt.number,
            upstream = %attempt.upstream,
            outcome = tracing::field::Empty,
        );
        tokio::spawn(
            task.run(upstream, forwarded, cancel.clone())
                .instrument(span),
        );
        Running {
            attempt,
            cancel,
            reply: rx,
        }
    }

    /// The request as `target` receives it: the client's, with the job id
    /// in place of the client's key and the attempt's number.
    fn upstream_request(
        &self,
        request: &Keyed,
        target: &UpstreamSettings,
        attempt: &Attempt,
    ) -> Request<Body> {
        let mut parts = request.parts.clone();
        parts.headers.remove(IDEMPOTENCY_KEY);
        if let Ok(v) = HeaderValue::from_str(&attempt.job_id.to_string()) {
            parts
                .headers
                .insert(self.config.forward_key_header.clone(), v);
        }
        parts.headers.insert(
            self.config.forward_attempt_header.clone(),
            HeaderValue::from(attempt.number),
        );
        parts.extensions.insert(Target(target.id.clone()));
        Request::from_parts(parts, full(request.body.clone()))
    }
}

/// Decides what an upstream's answer (or failure) means for its attempt.
pub(super) fn classify(result: Result<Fetched, UpstreamError>, route: &Route) -> Verdict {
    let fetched = match result {
        Ok(fetched) => fetched,
        Err(error) => {
            let detail = Chain(&error).to_string();
            return match error.kind() {
                UpstreamErrorKind::NotSent => Verdict::Fail(
                    AttemptFailure::Failed {
                        status: None,
                        detail,
                    },
                    Uncommitted::Error(error.into()),
                ),
                UpstreamErrorKind::MayHaveActed | UpstreamErrorKind::Unusable => {
                    Verdict::Unknown(AttemptFailure::Unknown { detail }, error.into())
                }
            };
        }
    };
    let status = fetched.parts.status.as_u16();
    if route.retryable_statuses.contains(&status) {
        let failure = AttemptFailure::Failed {
            status: Some(status),
            detail: format!("upstream answered {status}, configured as retryable"),
        };
        let response = Response::from_parts(fetched.parts, full(fetched.body));
        return Verdict::Fail(failure, Uncommitted::Response(response));
    }
    if let Some(contract) = route
        .contract
        .as_ref()
        .filter(|_| fetched.parts.status.is_success())
    {
        if let Err(why) = contract.check(&fetched.body) {
            let failure = AttemptFailure::Rejected {
                status,
                detail: format!(
                    "broke contract {}: {why}; answer: {}",
                    contract.name,
                    excerpt(&fetched.body)
                ),
            };
            let error = UpstreamError::ContractViolation(why);
            return Verdict::Fail(failure, Uncommitted::Error(error.into()));
        }
    }
    Verdict::Commit(replay::capture(&fetched))
}

/// How the upstream call ended.
enum Call {
    Answered(Result<Fetched, UpstreamError>),
    /// The head of an answer the route streams; its body is still coming.
    Streaming(http::response::Parts, Body),
    Cancelled,
    DeadlinePassed,
}

/// How a watched piece of the call ended.
enum Watched<T> {
    Done(T),
    Cancelled,
    DeadlinePassed,
}

/// The silence timer of one call, across its head and its body.
struct Clock {
    silence: std::pin::Pin<Box<tokio::time::Sleep>>,
    timed_out: bool,
}

struct Task {
    runner: Arc<Runner>,
    route: Arc<Route>,
    attempt: Attempt,
    /// Held until every write about the attempt is in.
    lease: Arc<LeaseGuard>,
    timeout: Duration,
    deadline: Instant,
    /// Where the fast path, if any, mirrors a streamed answer.
    tag: Option<Tag>,
    reply: Option<oneshot::Sender<Reply>>,
}

impl Task {
    async fn run(
        mut self,
        upstream: UpstreamService,
        request: Request<Body>,
        cancel: CancellationToken,
    ) {
        match self.call(upstream, request, &cancel).await {
            Call::Cancelled => {
                let failure = AttemptFailure::Superseded {
                    detail: "cancelled: another attempt of the job won".into(),
                };
                self.record(failure).await;
                self.send(Reply::Superseded);
            }
            Call::DeadlinePassed => {
                let failure = AttemptFailure::Unknown {
                    detail: "attempt deadline passed without an answer".into(),
                };
                self.record(failure).await;
                self.send(Reply::Unknown(UpstreamError::TimedOut(self.timeout).into()));
            }
            Call::Streaming(parts, body) => self.stream(parts, body, &cancel).await,
            Call::Answered(result) => match classify(result, &self.route) {
                Verdict::Commit(stored) => self.commit(stored).await,
                Verdict::Fail(failure, answer) => {
                    if matches!(failure, AttemptFailure::Rejected { .. }) {
                        metrics::counter!("idemgate_attempts_rejected_total").increment(1);
                    }
                    self.record(failure).await;
                    self.send(Reply::Failed(answer));
                }
                Verdict::Unknown(failure, error) => {
                    self.record(failure).await;
                    self.send(Reply::Unknown(error));
                }
            },
        }
    }

    /// Sends the request and waits for the answer's head, then for its
    /// whole body, unless the route streams it; all the while watching for
    /// silence (then `unknown` at once, the call going on), cancellation and
    /// the attempt's deadline.
    async fn call(
        &mut self,
        upstream: UpstreamService,
        request: Request<Body>,
        cancel: &CancellationToken,
    ) -> Call {
        use tower::ServiceExt;
        let (progress_tx, mut progress) = watch::channel(0u64);
        let mut clock = Clock {
            silence: Box::pin(tokio::time::sleep(self.timeout)),
            timed_out: false,
        };
        let head = async {
            let head = upstream.oneshot(request).await;
            progress_tx.send_modify(|n| *n += 1);
            head
        };
        let response = match self.watch(head, &mut progress, &mut clock, cancel).await {
            Watched::Done(Ok(response)) => response,
            Watched::Done(Err(e)) => return Call::Answered(Err(e)),
            Watched::Cancelled => return Call::Cancelled,
            Watched::DeadlinePassed => return Call::DeadlinePassed,
        };
        let (parts, body) = response.into_parts();
        // A stream whose first client was already told "unknown" is read
        // whole like any late answer.
        let retryable = self
            .route
            .retryable_statuses
            .contains(&parts.status.as_u16());
        if !clock.timed_out && !retryable && self.route.streams(&parts.headers) {
            return Call::Streaming(parts, body);
        }
        let limit = self.runner.config.max_response_size;
        let rest = upstream::read_body(parts, body, limit, &progress_tx);
        match self.watch(rest, &mut progress, &mut clock, cancel).await {
            Watched::Done(result) => Call::Answered(result),
            Watched::Cancelled => Call::Cancelled,
            Watched::DeadlinePassed => Call::DeadlinePassed,
        }
    }

    /// Runs `work` while watching the clock: silence for the upstream's
    /// timeout records the attempt `unknown` and tells the request (the work
    /// goes on); cancellation and the deadline stop it.
    async fn watch<T>(
        &mut self,
        work: impl std::future::Future<Output = T>,
        progress: &mut watch::Receiver<u64>,
        clock: &mut Clock,
        cancel: &CancellationToken,
    ) -> Watched<T> {
        tokio::pin!(work);
        let mut live = true;
        loop {
            tokio::select! {
                done = &mut work => return Watched::Done(done),
                changed = progress.changed(), if live && !clock.timed_out => match changed {
                    Ok(()) => clock.silence.as_mut().reset(Instant::now() + self.timeout),
                    Err(_) => live = false,
                },
                () = &mut clock.silence, if !clock.timed_out => {
                    clock.timed_out = true;
                    let failure = AttemptFailure::Unknown {
                        detail: format!("no answer within {}", humantime::format_duration(self.timeout)),
                    };
                    // The job is unknown before anyone is told so; the call
                    // goes on, and its late answer may still settle or
                    // commit the attempt.
                    self.record(failure).await;
                    self.send(Reply::Unknown(UpstreamError::TimedOut(self.timeout).into()));
                }
                () = cancel.cancelled() => return Watched::Cancelled,
                () = tokio::time::sleep_until(self.deadline) => return Watched::DeadlinePassed,
            }
        }
    }

    /// Streams the answer through its recording: every client of the job
    /// reads it as it comes; the end is released once it is committed. A
    /// stream cut before its end is `unknown` (the upstream acted) and every
    /// reader's body fails.
    async fn stream(
        &mut self,
        parts: http::response::Parts,
        mut body: Body,
        cancel: &CancellationToken,
    ) {
        let job = self.attempt.job_id;
        let recording = Recording::new(
            job,
            parts.status.as_u16(),
            replay::capture_headers(&parts.headers),
        );
        self.runner.live.insert(&recording);
        // Duplicates held on the job here look again, and join; with Redis,
        // the stream is mirrored there and other replicas are told once its
        // head is.
        self.runner.doorbell.ring_local(job);
        if let (Some(fast), Some(tag)) = (&self.runner.fastpath, &self.tag) {
            let ttl = self.runner.config.deadline + Duration::from_secs(60);
            fast.mirror(tag, &recording, ttl, self.runner.doorbell.clone());
        }
        self.send(Reply::Streaming(recording.clone()));
        let limit = self.runner.config.max_response_size;
        let silence = tokio::time::sleep(self.timeout);
        tokio::pin!(silence);
        let mut received = 0usize;
        let ended = loop {
            tokio::select! {
                frame = body.frame() => match frame {
                    None => break Ok(()),
                    Some(Ok(frame)) => {
                        let Ok(data) = frame.into_data() else { continue };
                        received += data.len();
                        if received > limit {
                            break Err(format!("the stream grew past {limit} bytes and cannot be recorded"));
                        }
                        recording.push(data);
                        silence.as_mut().reset(Instant::now() + self.timeout);
                    }
                    Some(Err(e)) => break Err(format!("the stream broke after {received} bytes: {}", Chain(&e))),
                },
                () = &mut silence => {
                    break Err(format!("the stream went silent for {}", humantime::format_duration(self.timeout)));
                }
                () = cancel.cancelled() => {
                    self.record(AttemptFailure::Superseded { detail: "cancelled: another attempt of the job won".into() }).await;
                    recording.cut();
                    return;
                }
                () = tokio::time::sleep_until(self.deadline) => break Err("attempt deadline passed mid-stream".to_owned()),
            }
        };
        // Recorded before any reader hears of the cut, like any outcome.
        if let Err(detail) = ended {
            self.record(AttemptFailure::Unknown { detail }).await;
            recording.cut();
            return;
        }
        let stored = recording.stored();
        // The whole stream against the contract's events, before its end is
        // released: a breach is a safe failure, and every copy is cut.
        if let Some(contract) = &self.route.contract {
            if let Some(Err(why)) = contract.check_stream(&stored.body) {
                metrics::counter!("idemgate_attempts_rejected_total").increment(1);
                let detail = format!(
                    "broke contract {}: {why}; answer: {}",
                    contract.name,
                    excerpt(&stored.body)
                );
                self.record(AttemptFailure::Rejected {
                    status: stored.status,
                    detail,
                })
                .await;
                recording.cut();
                return;
            }
        }
        // The end is the commit: readers get the end of the body only once
        // the whole answer is recorded (retried as long as the attempt lives).
        match self.write_commit(stored).await {
            Ok(CommitOutcome::Committed) => {
                metrics::counter!("idemgate_commits_total").increment(1);
                outcome(AttemptState::Succeeded);
                recording.finish();
            }
            Ok(CommitOutcome::Superseded) => {
                metrics::counter!("idemgate_commits_superseded_total").increment(1);
                outcome(AttemptState::Superseded);
                recording.cut();
            }
            Err(_) => recording.cut(),
        }
    }

    /// Commits `stored`, retrying while the store is unreachable (in a task
    /// of its own, holding the lease), until the attempt's deadline.
    fn spawn_commit(
        &self,
        stored: StoredResponse,
    ) -> tokio::task::JoinHandle<Result<CommitOutcome, StoreError>> {
        let (store, attempt) = (self.runner.store.clone(), self.attempt.clone());
        let response = stored;
        let lease = self.lease.clone();
        tokio::spawn(retrying("commit", attempt.id, self.deadline, move || {
            let (store, attempt, response, _lease) = (
                store.clone(),
                attempt.clone(),
                response.clone(),
                lease.clone(),
            );
            async move { store.commit(&attempt, &response).await }
        }))
    }

    /// Commits a streamed answer, waiting as long as it takes: its readers
    /// are waiting for the end, which only the commit releases.
    async fn write_commit(&self, stored: StoredResponse) -> Result<CommitOutcome, StoreError> {
        self.spawn_commit(stored)
            .await
            .unwrap_or_else(|e| Err(StoreError::Internal(Box::new(e))))
    }

    /// Commits the answer, then tells the request how that went.
    async fn commit(&mut self, stored: StoredResponse) {
        let mut write = self.spawn_commit(stored.clone());
        let reply = match tokio::time::timeout(PATIENCE, &mut write).await {
            Ok(Ok(Ok(CommitOutcome::Committed))) => {
                metrics::counter!("idemgate_commits_total").increment(1);
                outcome(AttemptState::Succeeded);
                Reply::Committed(stored)
            }
            Ok(Ok(Ok(CommitOutcome::Superseded))) => {
                metrics::counter!("idemgate_commits_superseded_total").increment(1);
                outcome(AttemptState::Superseded);
                Reply::Superseded
            }
            Ok(Ok(Err(e))) => Reply::Unknown(e.into()),
            Ok(Err(e)) => Reply::Unknown(GatewayError::Internal(Box::new(e))),
            // Not recorded yet, so not sent: the write goes on, and the
            // client's retry is held until it lands, then replays it.
            Err(_) => {
                tracing::warn!(attempt = %self.attempt.id, "the upstream answered but the store is not taking the commit yet; still trying");
                Reply::Unknown(GatewayError::Unrecorded(StoreError::Unavailable(
                    "the commit is still being retried".into(),
                )))
            }
        };
        self.send(reply);
    }

    /// Records how the attempt ended without a result, waiting at most
    /// [`PATIENCE`] for the write (which goes on after that).
    async fn record(&self, failure: AttemptFailure) {
        self.log_end(&failure);
        let write = self.spawn_write(failure);
        let _ = tokio::time::timeout(PATIENCE, write).await;
    }

    fn log_end(&self, failure: &AttemptFailure) {
        outcome(failure.state());
        metrics::counter!("idemgate_attempts_ended_total", "state" => failure.state().as_str())
            .increment(1);
        // A rejected answer's detail quotes the answer: it is kept for the
        // operator in the store, never logged.
        let detail = match failure {
            AttemptFailure::Rejected { .. } => "broke the route's contract",
            other => other.detail(),
        };
        tracing::info!(
            attempt = %self.attempt.id, job = %self.attempt.job_id, upstream = %self.attempt.upstream,
            state = %failure.state(), detail, "attempt ended without a result"
        );
    }

    /// Writes `failure` in the background, retrying while the store is
    /// unreachable, holding the lease until it is in.
    fn spawn_write(
        &self,
        failure: AttemptFailure,
    ) -> tokio::task::JoinHandle<Result<(), StoreError>> {
        let (store, attempt, lease) = (
            self.runner.store.clone(),
            self.attempt.id,
            self.lease.clone(),
        );
        tokio::spawn(retrying(
            "record the end of",
            attempt,
            self.deadline,
            move || {
                let (store, failure, _lease) = (store.clone(), failure.clone(), lease.clone());
                async move { store.fail_attempt(attempt, failure).await }
            },
        ))
    }

    fn send(&mut self, reply: Reply) {
        if let Some(tx) = self.reply.take() {
            // The client may have gone; the attempt's record is what matters.
            let _ = tx.send(reply);
        }
    }
}

/// Records how the attempt ended on its span (a trace attribute).
fn outcome(state: AttemptState) {
    tracing::Span::current().record("outcome", state.as_str());
}

/// Runs `write` until it succeeds, fails for good, or `deadline` passes,
/// backing off while the store is unreachable. A write that never got in
/// is logged as an error: the attempt's lease will lapse into `unknown`.
async fn retrying<T, F, Fut>(
    what: &'static str,
    attempt: AttemptId,
    deadline: Instant,
    mut write: F,
) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut backoff = FIRST_BACKOFF;
    let mut failures = 0u32;
    loop {
        match write().await {
            Ok(value) => {
                if failures > 0 {
                    tracing::info!(%attempt, failures, "recorded after the store came back: {what} the attempt");
                }
                return Ok(value);
            }
            Err(e) if e.is_transient() && Instant::now() + backoff < deadline => {
                if failures == 0 {
                    tracing::warn!(error = %Chain(&e), %attempt, "could not {what} the attempt; retrying until the store answers");
                }
                failures += 1;
                metrics::counter!("idemgate_record_retries_total").increment(1);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
            Err(e) => {
                tracing::error!(error = %Chain(&e), %attempt, failures, "could not {what} the attempt before its deadline; its lease will lapse into unknown");
                return Err(e);
            }
        }
    }
}

#[cfg(test)]
mod tests;
