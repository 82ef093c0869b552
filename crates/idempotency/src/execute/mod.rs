//! Running one attempt, in its own task (`docs/design.md`, §5).
//!
//! The task, not the client's request, owns the attempt: a client that hangs
//! up does not cancel it, and it still commits if the upstream answers late.
//! It does three things, each its own function:
//!
//! 1. `call`: sends the request and watches the clock. Silence past
//!    `first_byte_timeout` before the head, or past `stream_idle_timeout`
//!    between body chunks, makes the attempt `unknown` at once and tells
//!    the request so; the call goes on until `attempt_deadline` and may
//!    still commit (a cut stream does not). Cancelled because another
//!    attempt of the job won: `superseded`, and the call is dropped.
//! 2. `verdict`: decides, from the answer alone, what it means (pure):
//!    refused before sending → `failed`; broken after sending, or too large
//!    to record → `unknown`; a retryable status → `failed`, handed back
//!    uncommitted; a 2xx that breaks the route's contract → `rejected`;
//!    anything else → commit.
//! 3. `record`: writes the outcome. What the gateway learned is
//!    never dropped by a transient fault: the write is retried with backoff
//!    until the store takes it or the attempt's deadline passes, holding the
//!    attempt's lease meanwhile. The request is answered once the write is
//!    in, or after `PATIENCE` at most (then with `503` for an answer not yet
//!    committed: the client's retry is held until it is, and replays it).

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Request, Response};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::util::BoxCloneSyncService;
use tracing::Instrument;
use uuid::Uuid;

use super::keyed::Keyed;
use super::recording::join::Live;
use crate::error::GatewayError;
use crate::recording::Recording;
use crate::route::{Reconcile, Route, Silences};
use idemgate_domain::attempt::{Attempt, AttemptFailure, NewAttempt};
use idemgate_domain::id::AttemptId;
use idemgate_domain::response::StoredResponse;
use idemgate_proxy::budget::Charge;
use idemgate_proxy::http::{full, Body, ProvenClient, EVENTS_RECEIVED, IDEMPOTENCY_KEY};
use idemgate_proxy::upstream::UpstreamSettings;
use idemgate_proxy::upstream::{Target, UpstreamError};
use idemgate_store::fastpath::{FastPath, Tag};
use idemgate_store::{Doorbell, Store};
use idemgate_upkeep::lease::{LeaseGuard, Leases};

/// How long a request waits for its attempt's outcome to be recorded before
/// it is answered anyway (the write goes on in the background).
pub(super) const PATIENCE: Duration = Duration::from_secs(2);

mod adopt;
mod call;
mod reconcile;
mod record;
mod verdict;

use call::Call;
use reconcile::{Ask, Reconciler, Sent};
use verdict::{classify, Verdict};

/// The upstream side of the layer, boxed at this boundary so that attempt
/// tasks need no generic parameters.
pub type UpstreamService = BoxCloneSyncService<Request<Body>, Response<Body>, UpstreamError>;

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
pub(crate) struct Runner {
    config: Config,
    store: Arc<dyn Store>,
    leases: Arc<Leases>,
    doorbell: Arc<Doorbell>,
    fastpath: Option<Arc<FastPath>>,
    live: Arc<Live>,
    /// This gateway instance, recorded on the attempts it runs.
    instance: Uuid,
    /// The attempts a task here asks its upstream about.
    asking: Arc<reconcile::Asking>,
}

impl Runner {
    /// Runs attempts for gateway `instance`, recording them in `store`.
    pub(crate) fn new(
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
            asking: Arc::default(),
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
        let deadline = Instant::now() + self.config.deadline;
        let reconciler = request
            .route
            .reconcile
            .as_ref()
            .map(|how| self.reconciler(&upstream, request, target, &attempt, how, &forwarded));
        let forwarded = Request::from_parts(forwarded.parts, full(forwarded.body));
        let task = Task {
            lease: Arc::new(self.leases.hold(attempt.id)),
            deadline,
            // The route's silences over the upstream's (docs/design.md §11).
            silences: request.route.silences(target),
            reconciler: std::sync::Mutex::new(reconciler),
            route: request.route.clone(),
            runner: self.clone(),
            attempt: attempt.clone(),
            // Only a fast path needs it: no digest per attempt without one.
            tag: self
                .fastpath
                .as_ref()
                .map(|_| Tag::of(&request.owner, &request.key)),
            reply: Some(tx),
            // The attempt may outlive the client: what it holds stays
            // counted until it ends (docs/design.md §18).
            charge: request.charge.clone(),
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
    ) -> Sent {
        let mut parts = request.parts.clone();
        parts.headers.remove(IDEMPOTENCY_KEY);
        // The gateway's own (a resume point of 0 is none: the request runs).
        parts.headers.remove(EVENTS_RECEIVED);
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
        Sent {
            parts,
            body: request.body.clone(),
        }
    }

    /// What asks `target` about `attempt` once it is unknown, the route's
    /// way: a lookup, or the request `sent` again (kept only then).
    fn reconciler(
        &self,
        upstream: &UpstreamService,
        request: &Keyed,
        target: &UpstreamSettings,
        attempt: &Attempt,
        how: &Reconcile,
        sent: &Sent,
    ) -> Reconciler {
        let ask = match how.lookup_path(&attempt.job_id.to_string()) {
            Some(path) => Ask::Lookup(path),
            None => Ask::Resend(Box::new(Sent {
                parts: sent.parts.clone(),
                body: sent.body.clone(),
            })),
        };
        let proven = request.parts.extensions.get::<ProvenClient>().cloned();
        self.asking_about(upstream, &request.route, target, attempt, ask, proven)
    }

    /// The task that asks `target` about `attempt` of `route` by `ask`; the
    /// one constructor of [`Reconciler`], for attempts started here and
    /// attempts adopted from the store alike.
    fn asking_about(
        &self,
        upstream: &UpstreamService,
        route: &Arc<Route>,
        target: &UpstreamSettings,
        attempt: &Attempt,
        ask: Ask,
        proven: Option<ProvenClient>,
    ) -> Reconciler {
        Reconciler {
            store: self.store.clone(),
            upstream: upstream.clone(),
            target: target.id.clone(),
            route: route.clone(),
            ask,
            job: attempt.job_id,
            attempt: attempt.id,
            started_at: attempt.started_at,
            deadline: self.config.deadline,
            timeout: target.timeout,
            max_response_size: self.config.max_response_size,
            key_header: self.config.forward_key_header.clone(),
            proven,
            asking: self.asking.clone(),
        }
    }
}

struct Task {
    runner: Arc<Runner>,
    route: Arc<Route>,
    attempt: Attempt,
    /// Held until every write about the attempt is in.
    lease: Arc<LeaseGuard>,
    /// How long the upstream may be silent, before the head and after.
    silences: Silences,
    deadline: Instant,
    /// Where the fast path, if any, mirrors a streamed answer.
    tag: Option<Tag>,
    reply: Option<oneshot::Sender<Reply>>,
    /// The request's charge on the memory budget, which its answer grows.
    charge: Arc<Charge>,
    /// Looks the attempt up on its upstream once it is recorded `unknown`
    /// (taken then: one lookup task per attempt), on a route that
    /// reconciles.
    reconciler: std::sync::Mutex<Option<Reconciler>>,
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
                let deadline = self.runner.config.deadline;
                self.send(Reply::Unknown(UpstreamError::TimedOut(deadline).into()));
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

    fn send(&mut self, reply: Reply) {
        if let Some(tx) = self.reply.take() {
            // The client may have gone; the attempt's record is what matters.
            let _ = tx.send(reply);
        }
    }
}
