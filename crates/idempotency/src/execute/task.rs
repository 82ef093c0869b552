//! One attempt's task, which owns the attempt (`docs/design.md` §5): it
//! calls the upstream and watches the clock ([`super::call`]), decides what
//! the answer means ([`super::verdict`]), and records how the attempt ended
//! ([`super::record`]): a client that hangs up does not cancel it, and it
//! still commits if the upstream answers late.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::Request;
use http_body_util::BodyExt;
use idemgate_domain::attempt::{Attempt, AttemptFailure, AttemptState};
use idemgate_domain::response::StoredResponse;
use idemgate_proxy::budget::Charge;
use idemgate_proxy::http::Body;
use idemgate_proxy::upstream;
use idemgate_proxy::upstream::{Fetched, Stopwatch, UpstreamError};
use idemgate_store::fastpath::Tag;
use idemgate_store::{at_least_until, CommitOutcome, StoreError, LAPSES};
use idemgate_telemetry::ends::By;
use idemgate_telemetry::Chain;
use idemgate_upkeep::lease::LeaseGuard;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::call::{Call, Clock, Relayed, Watched};
use super::ends::Ends;
use super::reconcile::Reconciler;
use super::reconnect::{self, Reconnect};
use super::verdict::{classify_reporting, judge_stream, InBand, StreamOutcome, Verdict};
use super::ANSWER_WEIGHT;
use super::{Reply, Runner, UpstreamService, PATIENCE};
use crate::error::GatewayError;
use crate::keyed::Intent;
use crate::recording::Recording;
use crate::replay;
use crate::replay::tiers::Write;
use crate::route::{Route, Silences};
use idemgate_store::retrying;

pub(super) struct Task {
    pub(super) runner: Arc<Runner>,
    pub(super) route: Arc<Route>,
    /// The request that started it: the answer it commits is kept for it.
    pub(super) intent: Arc<Intent>,
    /// When its job expires: how long a kept answer may be replayed.
    pub(super) expires_at: SystemTime,
    pub(super) attempt: Attempt,
    /// Held until every write about the attempt is in.
    pub(super) lease: Arc<LeaseGuard>,
    /// How long the upstream may be silent, before the head and after.
    pub(super) silences: Silences,
    pub(super) deadline: Instant,
    /// Where the fast path, if any, mirrors a streamed answer.
    pub(super) tag: Option<Tag>,
    pub(super) reply: Option<oneshot::Sender<Reply>>,
    /// The request's charge on the memory budget, which its answer grows.
    pub(super) charge: Arc<Charge>,
    /// Tells the attempt's reconciler, when the last holder drops it, that
    /// this process's call has ended ([`Reconciler::call`]): before an
    /// unknown outcome is recorded (its call failed, broke or ran out of
    /// time; the record starts the reconciler, whose first lookup then
    /// finds the call over), else once any answer of it is committed (a
    /// lookup's "no record" must not settle the attempt first): the commit
    /// holds it too, as long as it is retried, past the task's end.
    pub(super) calling: Option<Arc<tokio_util::sync::DropGuard>>,
    /// Looks the attempt up on its upstream once it is recorded `unknown`
    /// (taken then: one lookup task per attempt), on a route that
    /// reconciles.
    pub(super) reconciler: std::sync::Mutex<Option<Reconciler>>,
    /// How the attempt ended, counted and logged once per end.
    pub(super) ends: Arc<Ends>,
    /// Times the upstream call to its head; stopped by the silence that
    /// gives up on it (`idemgate_upstream_response_seconds{outcome}`).
    pub(super) stopwatch: Stopwatch,
    /// The JSON-RPC `id` of the MCP tool call it sends: only an answer
    /// that responds to it is the call's (`docs/design.md` §19).
    pub(super) call: Option<Vec<u8>>,
    /// The session that call is made in, if any.
    pub(super) session: Option<http::HeaderValue>,
    /// Marks that call at its server from here until the task ends: its
    /// agent's `notifications/cancelled` is held back meanwhile.
    pub(super) _at_server: Option<crate::mcp::AtServer>,
    /// Reconnects to that call's stream, should its server end it before
    /// the response (set as the call is sent).
    pub(super) reconnect: Option<Reconnect>,
    /// That call's mark in the store, for other replicas (set as the call
    /// is sent, taken off as the task ends).
    pub(super) marked: Option<crate::mcp::Marked>,
}

impl Task {
    pub(super) async fn run(
        mut self,
        upstream: UpstreamService,
        request: Request<Body>,
        cancel: CancellationToken,
    ) {
        if let Some(id) = &self.call {
            self.reconnect = Some(Reconnect::of(&upstream, &request));
            let (store, by) = (&self.runner.store, (self.attempt.id, self.runner.instance));
            let at = (self.route.name.as_str(), self.session.as_ref());
            let good = (self.deadline, self.runner.config.lease_ttl);
            self.marked = crate::mcp::mark(store, by, at, id, good).await;
        }
        match self.call(upstream, request, &cancel).await {
            // Another attempt's answer won: it ended this one.
            Call::Cancelled => {
                let failure = AttemptFailure::Superseded {
                    detail: "cancelled: another attempt of the job won".into(),
                };
                self.record(failure, By::Upstream).await;
                self.send(Reply::Superseded);
            }
            Call::DeadlinePassed => {
                self.stopwatch.timed_out();
                let failure = AttemptFailure::Unknown {
                    detail: "attempt deadline passed without an answer".into(),
                };
                self.calling = None;
                self.record(failure, By::Deadline).await;
                let deadline = self.runner.config.deadline;
                self.send(Reply::Unknown(UpstreamError::TimedOut(deadline).into()));
            }
            Call::Streaming(parts, body) => self.stream(parts, body, &cancel).await,
            Call::Answered(result) => match self.classify(result) {
                Verdict::Commit(stored) => self.commit(stored).await,
                Verdict::Fail(failure, answer) => {
                    self.record(failure, By::Upstream).await;
                    self.send(Reply::Failed(answer));
                }
                Verdict::Unknown(failure, error) => {
                    self.calling = None;
                    self.record(failure, By::Upstream).await;
                    self.send(Reply::Unknown(error));
                }
            },
        }
        self.ends.write_outcome();
    }

    fn send(&mut self, reply: Reply) {
        if let Some(tx) = self.reply.take() {
            // The client may have gone; the attempt's record is what matters.
            let _ = tx.send(reply);
        }
    }

    /// Commits `stored`, retrying while the store is unreachable (in a task
    /// of its own, holding the lease and the call), until the attempt's
    /// deadline and for a minute after the answer at least. Once
    /// the store takes it, the answer is kept for replays (memory, then
    /// Redis): this is the one place a commit is made known to the replay
    /// tiers, whole answer or stream, whether or not its client still
    /// waits (`docs/design.md` §11, "Replay cache").
    fn spawn_commit(
        &self,
        stored: StoredResponse,
    ) -> tokio::task::JoinHandle<Result<CommitOutcome, StoreError>> {
        let (store, attempt) = (self.runner.store.clone(), self.attempt.clone());
        let (replays, intent, expires_at) = (
            self.runner.replays.clone(),
            self.intent.clone(),
            self.expires_at,
        );
        // The answer stays counted against the memory budget while the
        // write goes on, which may outlast the attempt (docs/design.md §18).
        let (lease, charge) = (self.lease.clone(), self.charge.clone());
        // The call is not over for the attempt's reconciler while its
        // answer may still commit.
        let calling = self.calling.clone();
        let (id, deadline, ends) = (attempt.id, self.deadline, self.ends.clone());
        tokio::spawn(async move {
            let write = || {
                let (store, attempt, response) = (store.clone(), attempt.clone(), stored.clone());
                let (_lease, _charge) = (lease.clone(), charge.clone());
                async move { store.commit(&attempt, &response).await }
            };
            let outcome = retrying(("commit", LAPSES), id, at_least_until(deadline), write).await;
            match &outcome {
                Ok(_) => drop(calling),
                // An answer that could not be recorded still proves that the
                // call took effect: a lookup's "no record" must never undo
                // it, so the reconciler here takes the call as out for good
                // and the attempt waits for an operator (docs/design.md §5,
                // "Not while the call is out").
                Err(_) => {
                    tracing::error!(attempt = %id, status = stored.status, "the upstream answered but its answer could not be recorded; the attempt waits for an operator");
                    std::mem::forget(calling);
                }
            }
            // Counted once the store decided, however long the request
            // waited for it (docs/design.md §12, "Metrics").
            match outcome {
                Ok(CommitOutcome::Committed) => {
                    ends.committed();
                    replays.remember(&intent, attempt.job_id, expires_at, &stored, Write::Always);
                }
                Ok(CommitOutcome::Superseded) => {
                    ends.lost(store.as_ref()).await;
                    metrics::counter!("idemgate_commits_superseded_total").increment(1);
                }
                Err(_) => {}
            }
            outcome
        })
    }

    /// Commits a streamed answer, waiting as long as it takes: its readers
    /// are waiting for the end, which only the commit releases.
    pub(super) async fn write_commit(
        &self,
        stored: StoredResponse,
    ) -> Result<CommitOutcome, StoreError> {
        self.spawn_commit(stored)
            .await
            .unwrap_or_else(|e| Err(StoreError::Internal(Box::new(e))))
    }

    /// Commits the answer, then tells the request how that went.
    pub(super) async fn commit(&mut self, stored: StoredResponse) {
        let mut write = self.spawn_commit(stored.clone());
        let reply = match tokio::time::timeout(PATIENCE, &mut write).await {
            Ok(Ok(Ok(CommitOutcome::Committed))) => {
                self.ends.decide(AttemptState::Succeeded);
                Reply::Committed(stored)
            }
            Ok(Ok(Ok(CommitOutcome::Superseded))) => {
                self.ends.decide(AttemptState::Superseded);
                Reply::Superseded
            }
            // Proxied and answered: never `store-unavailable`, which says
            // nothing was proxied. A commit the store refused for good (the
            // only kind that ends within `PATIENCE`, retried for a minute
            // as it is) is the store's error, as any.
            Ok(Ok(Err(e))) if e.is_transient() => Reply::Unknown(GatewayError::Unrecorded(e)),
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

    /// Records how the attempt ended without a result (`by` what),
    /// waiting at most [`PATIENCE`] for the write (which goes on after
    /// that). A second `unknown` is not recorded: the attempt is unknown
    /// already.
    pub(super) async fn record(&self, failure: AttemptFailure, by: By) {
        if !self.ends.decide(failure.state()) {
            return;
        }
        let write = self.spawn_write(failure, by);
        let _ = tokio::time::timeout(PATIENCE, write).await;
    }

    /// Writes `failure` in the background, retrying while the store is
    /// unreachable, holding the lease until it is in.
    ///
    /// Once an `unknown` outcome is in, on a route that reconciles, the
    /// attempt is looked up on its upstream in a task of its own
    /// (`reconcile.rs`), whatever the request does meanwhile.
    fn spawn_write(
        &self,
        failure: AttemptFailure,
        by: By,
    ) -> tokio::task::JoinHandle<Result<(), StoreError>> {
        let (store, attempt, lease) = (
            self.runner.store.clone(),
            self.attempt.id,
            self.lease.clone(),
        );
        let reconciler = match failure {
            AttemptFailure::Unknown { .. } => self
                .reconciler
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
            _ => None,
        };
        let (ends, counted) = (self.ends.clone(), failure.clone());
        let deadline = at_least_until(self.deadline);
        let write = retrying(
            ("record the end of", LAPSES),
            attempt,
            deadline,
            move || {
                let (store, failure, _lease) = (store.clone(), failure.clone(), lease.clone());
                async move { store.fail_attempt(attempt, failure).await }
            },
        );
        tokio::spawn(async move {
            let written = write.await;
            // Counted and logged once the store took it; an attempt a
            // lookup or an operator settled meanwhile was counted by them.
            if let Ok(true) = written {
                ends.failed(&counted, by);
            }
            if let (Ok(_), Some(reconciler)) = (&written, reconciler) {
                reconciler.spawn();
            }
            written.map(|_| ())
        })
    }

    /// Sends the request and waits for the answer's head, then for its
    /// whole body, unless the route streams it; all the while watching for
    /// silence (then `unknown` at once, the call going on), cancellation and
    /// the attempt's deadline.
    pub(super) async fn call(
        &mut self,
        upstream: UpstreamService,
        mut request: Request<Body>,
        cancel: &CancellationToken,
    ) -> Call {
        use tower::ServiceExt;
        request.extensions_mut().insert(self.stopwatch.clone());
        let (progress_tx, mut progress) = watch::channel(0u64);
        let mut clock = Clock::new(self.silences);
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
        let (mut parts, body) = response.into_parts();
        // Its answer names the call's session if its server named none.
        crate::mcp::name_session(&mut parts.headers, self.session.clone());
        if !clock.timed_out {
            clock.took_head();
        }
        // A stream whose first client was already told "unknown" is read
        // whole like any late answer; a `101` (hyper hands it over with an
        // empty body) is no answer whatever its type says, and is judged
        // so there, never streamed into a commit.
        let retryable = self
            .route
            .retryable_statuses
            .contains(&parts.status.as_u16());
        let answer = !parts.status.is_informational();
        if !clock.timed_out && !retryable && answer && self.route.streams(&parts.headers) {
            return Call::Streaming(parts, body);
        }
        let limit = self.runner.config.max_response_size;
        let charge = self.charge.clone();
        let held = (&*charge, ANSWER_WEIGHT);
        let rest = upstream::read_body(parts, body, limit, &progress_tx, Some(held));
        match self.watch(rest, &mut progress, &mut clock, cancel).await {
            Watched::Done(result) => Call::Answered(result),
            Watched::Cancelled => Call::Cancelled,
            Watched::DeadlinePassed => Call::DeadlinePassed,
        }
    }

    /// Runs `work` while watching the clock: silence past what it allows
    /// records the attempt `unknown` and tells the request (the work goes
    /// on); cancellation and the deadline stop it.
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
                    Ok(()) => clock.restart(),
                    Err(_) => live = false,
                },
                () = &mut clock.silence, if !clock.timed_out => {
                    clock.timed_out = true;
                    let failure = AttemptFailure::Unknown { detail: clock.detail() };
                    // The job is unknown before anyone is told so; the call
                    // goes on, and its late answer may still settle or
                    // commit the attempt (its head, if it comes, is not
                    // timed again).
                    self.stopwatch.timed_out();
                    self.record(failure, By::Deadline).await;
                    self.send(Reply::Unknown(UpstreamError::TimedOut(clock.allowed()).into()));
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
    pub(super) async fn stream(
        &mut self,
        parts: http::response::Parts,
        body: Body,
        cancel: &CancellationToken,
    ) {
        let recording = self.open_recording(&parts);
        self.send(Reply::Streaming(recording.clone()));
        let mut relayed = self.relay(body, &recording, cancel, 0).await;
        for _ in 0..reconnect::TIMES {
            let Relayed::Ended = relayed else { break };
            let Some((body, recorded)) = self.reconnected(&recording, cancel).await else {
                break;
            };
            relayed = self.relay(body, &recording, cancel, recorded).await;
        }
        match relayed {
            Relayed::Ended => self.settle_stream(&recording).await,
            // Recorded before any reader hears of the cut, like any outcome.
            Relayed::Broke(detail, by) => {
                self.calling = None;
                self.record(AttemptFailure::Unknown { detail }, by).await;
                recording.cut();
            }
            Relayed::Cancelled => {
                let detail = "cancelled: another attempt of the job won".into();
                self.record(AttemptFailure::Superseded { detail }, By::Upstream)
                    .await;
                recording.cut();
            }
        }
    }

    /// The rest of a tool call's stream its server ended before the
    /// call's response, from after its last event id (after the pause the
    /// server asked for), when it has one and answers the reconnect
    /// ([`reconnect`]), with the bytes recorded before it; `None`
    /// otherwise, and on any other route.
    async fn reconnected(
        &self,
        recording: &Recording,
        cancel: &CancellationToken,
    ) -> Option<(Body, usize)> {
        let reconnect = self.reconnect.as_ref()?;
        let stored = recording.stored();
        if !super::verdict::unanswered(&self.route, &stored, self.call.as_deref()) {
            return None;
        }
        let (last_id, pause) = reconnect::resume_point(&stored)?;
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = cancel.cancelled() => return None,
            () = tokio::time::sleep_until(self.deadline) => return None,
        }
        tracing::info!(attempt = %self.attempt.id, last_id, "the MCP server ended the call's stream before its response; reconnecting");
        let patience = self.silences.first_byte;
        let until = self.deadline.saturating_duration_since(Instant::now());
        let body = reconnect.open(&last_id, patience.min(until)).await?;
        Some((body, stored.body.len()))
    }

    /// The answer's recording, joinable at once: duplicates held on the job
    /// here look again, and join; with Redis, the stream is mirrored there
    /// and other replicas are told once its head is.
    fn open_recording(&self, parts: &http::response::Parts) -> Arc<Recording> {
        let job = self.attempt.job_id;
        let headers = replay::capture_headers(&parts.headers);
        let status = parts.status.as_u16();
        let recording = Recording::new(job, status, headers.clone(), self.charge.clone());
        self.runner.live.insert(&recording);
        self.runner.doorbell.ring_local(job);
        if let (Some(fast), Some(tag)) = (self.runner.replays.fastpath(), &self.tag) {
            let ttl = self.runner.config.deadline + Duration::from_secs(60);
            let doorbell = self.runner.doorbell.clone();
            let head = (parts.status.as_u16(), &headers[..]);
            let of = (job, self.attempt.number);
            fast.mirror(tag, of, head, recording.follow(), ttl, doorbell);
        }
        recording
    }

    /// Copies the upstream's body into `recording` until it ends, breaks,
    /// goes silent past `stream_idle_timeout` (a pause between tokens may
    /// be long, but not endless: `docs/design.md` §10), outgrows what can
    /// be recorded (with the `recorded` bytes before it, on a reconnect),
    /// or the attempt is cancelled or out of time.
    async fn relay(
        &self,
        mut body: Body,
        recording: &Recording,
        cancel: &CancellationToken,
        recorded: usize,
    ) -> Relayed {
        let limit = self.runner.config.max_response_size;
        let idle = self.silences.stream_idle;
        let silence = tokio::time::sleep(idle);
        tokio::pin!(silence);
        // What a reconnect continues counts against the same limit.
        let mut received = recorded;
        loop {
            tokio::select! {
                frame = body.frame() => match frame {
                    None => return Relayed::Ended,
                    Some(Ok(frame)) => {
                        let Ok(data) = frame.into_data() else { continue };
                        received += data.len();
                        if received > limit {
                            return Relayed::Broke(format!("the stream grew past {limit} bytes and cannot be recorded"), By::Upstream);
                        }
                        recording.push(data);
                        silence.as_mut().reset(Instant::now() + idle);
                    }
                    Some(Err(e)) => return Relayed::Broke(format!("the stream broke after {received} bytes: {}", Chain(&e)), By::Upstream),
                },
                () = &mut silence => {
                    let idle = humantime::format_duration(idle);
                    return Relayed::Broke(format!("the stream went silent for {idle} (stream_idle_timeout)"), By::Deadline);
                }
                () = cancel.cancelled() => return Relayed::Cancelled,
                () = tokio::time::sleep_until(self.deadline) => return Relayed::Broke("attempt deadline passed mid-stream".to_owned(), By::Deadline),
            }
        }
    }

    /// What the answer read whole means ([`classify_reporting`]). An event
    /// stream read whole has its error in band counted, as a streamed one
    /// has in [`Task::settle_stream`].
    fn classify(&self, result: Result<Fetched, UpstreamError>) -> Verdict {
        let (verdict, in_band) = classify_reporting(result, &self.route, self.call.as_deref());
        if let Some(error) = in_band {
            self.count_stream_error(&error);
        }
        verdict
    }

    /// Counts an error a stream reported in band
    /// (`idemgate_stream_errors_total`), its type as a label only when it
    /// is spelled like one (it is the upstream's text).
    fn count_stream_error(&self, error: &InBand) {
        let InBand {
            kind,
            retryable,
            after_a_tool,
        } = error;
        let plain = kind.len() <= 64
            && kind
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
        let label = if plain {
            kind.to_owned()
        } else {
            "other".to_owned()
        };
        metrics::counter!(
            "idemgate_stream_errors_total",
            "route" => self.route.name.clone(),
            "upstream" => self.attempt.upstream.clone(),
            "type" => label,
            "retryable" => if *retryable { "true" } else { "false" },
        )
        .increment(1);
        // Why a type the route lists was not retried: the tool would run
        // again (docs/design.md §10, "A tool the provider ran").
        tracing::info!(
            attempt = %self.attempt.id, r#type = kind, retryable, after_a_tool,
            "the stream reported an error in band"
        );
    }

    /// A whole stream: what it says of itself read first (an error in
    /// band, an end short of the route's end events), then checked against
    /// the contract's events, then committed; only the commit releases its
    /// end to the readers. A breach is a safe failure, and every copy is cut.
    async fn settle_stream(&self, recording: &Recording) {
        let stored = recording.stored();
        // The whole answer, copied out of the chunks for the commit.
        self.charge.add(stored.body.len());
        let judged = judge_stream(&self.route, &stored, self.call.as_deref());
        if let Some(error) = &judged.error {
            self.count_stream_error(error);
        }
        match judged.outcome {
            StreamOutcome::Commit => {}
            StreamOutcome::NoEffect(failure) => {
                self.record(failure, By::Upstream).await;
                recording.end_uncommitted();
                return;
            }
            StreamOutcome::Unknown(detail) => {
                self.record(AttemptFailure::Unknown { detail }, By::Upstream)
                    .await;
                recording.cut();
                return;
            }
            StreamOutcome::Rejected(failure, _) => {
                self.record(failure, By::Upstream).await;
                recording.cut();
                return;
            }
        }
        // Retried as long as the attempt lives.
        match self.write_commit(stored).await {
            Ok(CommitOutcome::Committed) => {
                self.ends.decide(AttemptState::Succeeded);
                recording.finish();
            }
            Ok(CommitOutcome::Superseded) => {
                self.ends.decide(AttemptState::Superseded);
                recording.cut();
            }
            Err(_) => recording.cut(),
        }
    }
}
