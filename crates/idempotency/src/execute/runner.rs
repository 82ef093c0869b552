//! The runner: what every attempt task is started with, and the asking
//! about attempts of unknown outcome that outlive the request that started
//! them (`docs/design.md` §5, "Lookups outlive the process that asked"):
//! those the sweeper makes `unknown` (their gateway died), at once; and, on
//! every replica, every `sweep_interval`, those nobody asks about any more
//! (the replica that asked stopped or restarted). The asking itself is
//! [`super::reconcile`].

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderName, HeaderValue, Request};
use idemgate_domain::attempt::{Attempt, AttemptFailure, NewAttempt};
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::job::JobDetail;
use idemgate_domain::reconcile::{held_back, orphaned, CALL_OUT_GRACE};
use idemgate_domain::BoxError;
use idemgate_proxy::http::{full, ProvenClient, EVENTS_RECEIVED, IDEMPOTENCY_KEY};
use idemgate_proxy::upstream::{Stopwatch, Target, UpstreamSettings};
use idemgate_store::fastpath::Tag;
use idemgate_store::{Doorbell, Lapsed, Store, StoreError};
use idemgate_telemetry::ends::{self, By};
use idemgate_telemetry::Chain;
use idemgate_upkeep::lease::{Held, Leases};
use idemgate_upkeep::supervise::Heartbeat;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;
use uuid::Uuid;

use super::ends::Ends;
use super::reconcile::{Ask, Reconciler, Sent};
use super::task::Task;
use super::{reconcile, Config, Running, UpstreamService};
use crate::keyed::Keyed;
use crate::recording::join::Live;
use crate::replay::tiers::Replays;
use crate::route::{Reconcile, Route};

/// Most unknown attempts one scan reads.
const SCAN_LIMIT: u32 = 1000;

/// The detail of an attempt settled by [`Runner::never_sent`].
const NEVER_SENT: &str =
    "never sent upstream: its start was written, but the reply was lost and the request answered 503";

/// How long past an attempt's last ask the scan for orphaned lookups still
/// lists it, beyond two scans: time for a holder that went away to be
/// taken over.
const LAST_ASK_SLACK: Duration = Duration::from_secs(60);

/// The most an attempt's deadline moves from `attempt_deadline` to meet the
/// one its store recorded ([`Runner::time_left`]; half of a shorter
/// `attempt_deadline`): its begin's waits, never a clock far apart from the
/// store's.
const SKEW_AT_MOST: Duration = Duration::from_secs(5);

/// Runs attempts: the handles every attempt task needs.
pub(crate) struct Runner {
    pub(super) config: Config,
    pub(crate) store: Arc<dyn Store>,
    pub(super) leases: Arc<Leases>,
    pub(super) doorbell: Arc<Doorbell>,
    /// Where a committed answer is kept for replays, the attempt's own
    /// request's or not; and the fast path a streamed answer is mirrored on.
    pub(super) replays: Arc<Replays>,
    pub(super) live: Arc<Live>,
    /// This gateway instance, recorded on the attempts it runs.
    pub(crate) instance: Uuid,
    /// The attempts a task here asks its upstream about.
    pub(super) asking: Arc<reconcile::Asking>,
    /// The MCP tool calls whose attempts are at their server from here.
    pub(crate) calls: Arc<crate::mcp::Calls>,
    /// The never-sent records still being written, the begins and claims
    /// that may make one, and the reconcilers' asks in flight, for the
    /// drain to wait on ([`Runner::finish_writes`]).
    background: TaskTracker,
}

impl Runner {
    /// Runs attempts for gateway `instance`, recording them in `store`.
    pub(crate) fn new(
        config: Config,
        store: Arc<dyn Store>,
        leases: Arc<Leases>,
        doorbell: Arc<Doorbell>,
        replays: Arc<Replays>,
        live: Arc<Live>,
        instance: Uuid,
    ) -> Self {
        Runner {
            config,
            store,
            leases,
            doorbell,
            replays,
            live,
            instance,
            asking: Arc::default(),
            calls: Arc::default(),
            background: TaskTracker::new(),
        }
    }

    /// Spawns `task`, a begin or a claim (which may end in
    /// [`Runner::never_sent`]), where [`Runner::finish_writes`] waits for
    /// it: a client that hung up during the drain leaves its begin running,
    /// and the record it may spawn is waited for too.
    pub(crate) fn spawn_tracked<F>(&self, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.background.spawn(task)
    }

    /// Waits until the never-sent records [`Runner::never_sent`] is still
    /// retrying have landed or given up, then for the store's own
    /// background writes ([`Store::finish_writes`]): the drain's last wait
    /// (`docs/design.md` §12, "Termination").
    pub(crate) async fn finish_writes(&self) {
        self.background.close();
        self.background.wait().await;
        self.store.finish_writes().await;
    }

    /// What the store is asked to record for a new attempt on `target`.
    pub(crate) fn new_attempt(&self, target: &UpstreamSettings) -> NewAttempt {
        NewAttempt {
            id: AttemptId::new(),
            upstream: target.name().to_owned(),
            instance: self.instance,
            lease: self.config.lease_ttl,
            deadline: self.config.deadline,
        }
    }

    /// Records, in the background, that `attempt` was never sent upstream:
    /// its begin or claim failed with its outcome unknown (the reply lost,
    /// perhaps after the commit) and the request was answered `503`. If
    /// the attempt was written after all, nobody runs it, and every retry
    /// of its key would be held on it until its lease lapsed into
    /// `unknown`. Settled `failed` (it provably took no effect), its job
    /// reopens and the next retry runs (`docs/design.md` §5, "A start whose
    /// reply was lost"). Written until the store takes it, up to the
    /// attempt's deadline; an attempt that was never written is left so.
    pub(crate) fn never_sent(&self, attempt: AttemptId) {
        let failure = AttemptFailure::Failed {
            status: None,
            detail: NEVER_SENT.into(),
        };
        let said = "an attempt whose start was written though its reply was lost is settled failed: it was never sent";
        self.settle_unsent(attempt, failure, said);
    }

    /// Settles `attempt`, claimed to race the request's others and never
    /// started because one of them had won meanwhile (`docs/design.md`
    /// §6), `superseded`, as a loser cancelled before its call.
    pub(crate) fn superseded_unsent(&self, attempt: AttemptId) {
        let failure = AttemptFailure::Superseded {
            detail: "never sent: another attempt of the job had already won".into(),
        };
        let said =
            "an attempt claimed as its race was decided is settled superseded: it was never sent";
        self.settle_unsent(attempt, failure, said);
    }

    /// Records how an attempt that was never sent ended, in the
    /// background, until the store takes it (up to an attempt's deadline).
    fn settle_unsent(&self, attempt: AttemptId, failure: AttemptFailure, said: &'static str) {
        let store = self.store.clone();
        let deadline = Instant::now() + self.config.deadline;
        self.background.spawn(async move {
            let write = || {
                let (store, failure) = (store.clone(), failure.clone());
                async move {
                    match store.fail_attempt(attempt, failure).await {
                        Err(StoreError::NotFound(_)) => Ok(false),
                        done => done,
                    }
                }
            };
            if let Ok(true) = idemgate_store::retrying(
                ("record", idemgate_store::LAPSES),
                attempt,
                deadline,
                write,
            )
            .await
            {
                tracing::info!(%attempt, "{said}");
            }
        });
    }

    /// Until when an attempt of `job` may still be running here, its call
    /// out though the attempt may be `unknown` already; `None` for none.
    pub(crate) fn calling(&self, job: JobId) -> Option<Instant> {
        self.leases.calling(job)
    }

    /// Starts `attempt` of `request`'s job against `target`, in a task of
    /// its own.
    pub(crate) fn start(
        self: &Arc<Self>,
        upstream: UpstreamService,
        request: &Keyed,
        target: &UpstreamSettings,
        attempt: Attempt,
        expires_at: SystemTime,
    ) -> Running {
        let (tx, rx) = oneshot::channel();
        let cancel = CancellationToken::new();
        let forwarded = self.upstream_request(request, target, &attempt);
        let deadline = Instant::now() + self.time_left(&attempt);
        let mut reconciler = request
            .intent
            .route
            .reconcile
            .as_ref()
            .map(|how| self.reconciler(&upstream, request, target, &attempt, how, &forwarded));
        // Cancelled when the task, and any commit of its answer, ends: the
        // call it made is over.
        let calling = reconciler.as_mut().map(|r| {
            let call = CancellationToken::new();
            r.call = Some(call.clone());
            Arc::new(call.drop_guard())
        });
        let forwarded = Request::from_parts(forwarded.parts, full(forwarded.body));
        let route = &request.intent.route.name;
        let held = Held {
            deadline,
            job: attempt.job_id,
            route: route.clone(),
            upstream: attempt.upstream.clone(),
        };
        let ends = Ends::new(route, &attempt.upstream, attempt.id, attempt.job_id);
        // The session an MCP tool call is made in.
        let session = request.rpc_id.as_ref().and_then(|_| {
            let session = request.parts.headers.get(crate::mcp::MCP_SESSION_ID);
            session.cloned()
        });
        let task = Task {
            lease: Arc::new(self.leases.hold(attempt.id, held)),
            ends: Arc::new(ends),
            stopwatch: Stopwatch::default(),
            deadline,
            // The route's silences over the upstream's (docs/design.md §11).
            silences: request.intent.route.silences(target),
            reconciler: std::sync::Mutex::new(reconciler),
            route: request.intent.route.clone(),
            intent: request.intent.clone(),
            expires_at,
            runner: self.clone(),
            attempt: attempt.clone(),
            // Only a fast path needs it: no digest per attempt without one.
            tag: self
                .replays
                .fastpath()
                .map(|_| Tag::of(&request.intent.owner, &request.intent.key)),
            reply: Some(tx),
            // The attempt may outlive the client: what it holds stays
            // counted until it ends (docs/design.md §18).
            charge: request.charge.clone(),
            calling,
            call: request.rpc_id.clone(),
            session: session.clone(),
            _at_server: request.rpc_id.as_ref().and_then(|id| {
                self.calls
                    .start(&request.intent.route.name, session.as_ref(), id)
            }),
            reconnect: None,
            marked: None,
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

    /// How long `attempt`'s call may take: to its deadline as the store
    /// recorded it (its begin's waits counted), so that a replica that
    /// adopts the attempt knows when this call is given up (`docs/design.md`
    /// §5, "Not while the call is out"). A clock apart from the store's
    /// moves it by at most [`SKEW_AT_MOST`] from `attempt_deadline`.
    fn time_left(&self, attempt: &Attempt) -> Duration {
        let left = attempt.deadline_at.duration_since(SystemTime::now());
        let most = self.config.deadline;
        let least = most.saturating_sub(SKEW_AT_MOST.min(most / 2));
        left.unwrap_or_default().clamp(least, most)
    }

    /// The headers an attempt tells its upstream the job id and the
    /// attempt's number in: the gateway's own on its routes, in every
    /// spelling (`docs/design.md` §15, "Headers").
    pub(crate) fn forwarded_headers(&self) -> [HeaderName; 2] {
        [
            self.config.forward_key_header.clone(),
            self.config.forward_attempt_header.clone(),
        ]
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
        // The job id and the attempt's number are the gateway's to say: a
        // client's in another spelling (`Idempotency_Key`, which a CGI-style
        // server folds into the same variable) goes nowhere
        // (docs/design.md §15, "Headers").
        idemgate_proxy::http::spelling::remove_every_spelling(
            &mut parts.headers,
            &self.forwarded_headers(),
        );
        super::ask_uncompressed(&mut parts.headers);
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
        self.asking_about(
            upstream,
            &request.intent.route,
            target,
            attempt,
            ask,
            proven,
        )
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
        // A "no record" held back before this task (another process's, or
        // this one's before a restart) still gets its last ask; a resend's
        // `404` is none.
        let last = attempt.lookups.last.as_ref();
        let held_back = matches!(ask, Ask::Lookup(_)) && last.is_some_and(held_back);
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
            deadline_at: attempt.deadline_at,
            timeout: target.timeout,
            max_response_size: self.config.max_response_size,
            key_header: self.config.forward_key_header.clone(),
            proven,
            asking: self.asking.clone(),
            calls: self.calls.clone(),
            instance: self.instance,
            asks: self.background.clone(),
            call: None,
            held_back: held_back.into(),
        }
    }

    /// Counts the attempts the sweeper makes `unknown` (their gateway
    /// died: `by="deadline"`, `docs/design.md` §12, "Metrics"), and looks
    /// them up on their upstreams, on routes that look up; runs until
    /// `lapsed` closes. A route that resends cannot: the request died with
    /// its gateway (`docs/design.md` §5).
    pub(crate) async fn reconcile_lapsed(
        self: Arc<Self>,
        mut lapsed: tokio::sync::mpsc::UnboundedReceiver<Lapsed>,
        routes: Vec<Arc<Route>>,
        upstream: UpstreamService,
    ) {
        while let Some(l) = lapsed.recv().await {
            let detail = match self.store.job_detail(l.job).await {
                Ok(Some(detail)) => detail,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(attempt = %l.attempt, error = %Chain(&e), "could not read an attempt whose lease lapsed; it is neither counted nor looked up");
                    continue;
                }
            };
            if let Some(attempt) = detail.attempts.iter().find(|a| a.id == l.attempt) {
                let (route, upstream) = (&detail.job.route, &attempt.upstream);
                ends::ended(route, upstream, "unknown", By::Deadline);
            }
            if let Some(reconciler) = self.reconciler_for(l, &detail, &routes, &upstream) {
                reconciler.spawn();
            }
        }
    }

    /// The lookup task for a lapsed attempt of `detail`'s job, when its
    /// route looks up and its upstream is still configured.
    fn reconciler_for(
        &self,
        lapsed: Lapsed,
        detail: &JobDetail,
        routes: &[Arc<Route>],
        upstream: &UpstreamService,
    ) -> Option<Reconciler> {
        let route = routes.iter().find(|r| r.name == detail.job.route)?;
        if route.reconcile == Some(Reconcile::Resend) {
            tracing::info!(attempt = %lapsed.attempt, job = %lapsed.job, "an attempt whose gateway died cannot be resent (its request died with it); it waits for an operator");
            return None;
        }
        self.reconciler_of(detail, lapsed.attempt, route, upstream)
    }

    /// The lookup task for `attempt` of `detail`'s job on `route`, when the
    /// route looks up and the attempt's upstream is still configured.
    fn reconciler_of(
        &self,
        detail: &JobDetail,
        attempt: AttemptId,
        route: &Arc<Route>,
        upstream: &UpstreamService,
    ) -> Option<Reconciler> {
        let attempt = detail.attempts.iter().find(|a| a.id == attempt)?;
        let path = route
            .reconcile
            .as_ref()?
            .lookup_path(&detail.job.id.to_string())?;
        let target = route.upstreams().find(|u| u.name() == attempt.upstream)?;
        // Only proven clients use a route whose upstream holds a
        // credential (docs/design.md §15): the attempt was sent with it.
        let proven = route
            .require_client
            .then(|| ProvenClient(Arc::from("reconcile")));
        let ask = Ask::Lookup(path);
        Some(self.asking_about(upstream, route, target, attempt, ask, proven))
    }

    /// Every `interval`, adopts the unknown attempts on routes that look
    /// up that nobody asks about any more (the replica that asked stopped,
    /// or restarted): read from the store, so any replica may (a
    /// supervised task, stopped at shutdown).
    pub(crate) async fn reconcile_orphans(
        self: Arc<Self>,
        routes: Vec<Arc<Route>>,
        upstream: UpstreamService,
        interval: Duration,
        beat: Heartbeat,
    ) -> Result<(), BoxError> {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut awaiting_first = HashSet::new();
        loop {
            tick.tick().await;
            beat.beat();
            awaiting_first = self
                .adopt_orphans(&routes, &upstream, interval, &awaiting_first)
                .await;
        }
    }

    /// One scan; returns the attempts found waiting for their first lookup
    /// (orphaned if still waiting at the next scan).
    async fn adopt_orphans(
        &self,
        routes: &[Arc<Route>],
        upstream: &UpstreamService,
        interval: Duration,
        awaited: &HashSet<AttemptId>,
    ) -> HashSet<AttemptId> {
        let now = SystemTime::now();
        // Past the deadline by the grace and a minute more: a "no record"
        // held back is asked once more then, by whoever holds it
        // (`Reconciler::run`), or adopts it a scan later, a slow or failed
        // scan or two notwithstanding (`orphaned` adopts nothing with
        // nothing left to ask).
        let window = self.config.deadline + CALL_OUT_GRACE + interval * 2 + LAST_ASK_SLACK;
        let since = now.checked_sub(window).unwrap_or(UNIX_EPOCH);
        let pending = match self.store.unknown_attempts(since, SCAN_LIMIT).await {
            Ok(pending) => pending,
            Err(e) => {
                tracing::debug!(error = %Chain(&e), "could not list unknown attempts to look up");
                return awaited.clone();
            }
        };
        let mut awaiting = HashSet::new();
        for (job, attempt) in pending {
            if self.asking.has(attempt) {
                continue;
            }
            let Ok(Some(detail)) = self.store.job_detail(job).await else {
                continue;
            };
            let Some(route) = routes.iter().find(|r| r.name == detail.job.route) else {
                continue;
            };
            let Some(record) = detail.attempts.iter().find(|a| a.id == attempt) else {
                continue;
            };
            if record.lookups.count == 0 {
                awaiting.insert(attempt);
            }
            let first_awaited = awaited.contains(&attempt);
            let by = (interval, record.deadline_at);
            if orphaned(&record.lookups, first_awaited, by, now) {
                if let Some(reconciler) = self.reconciler_of(&detail, attempt, route, upstream) {
                    tracing::info!(%attempt, %job, lookups = record.lookups.count, "adopting the lookups of an unknown attempt nobody asks about");
                    reconciler.spawn();
                }
            }
        }
        awaiting
    }
}
