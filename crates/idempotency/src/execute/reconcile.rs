//! Reconciling an attempt of unknown outcome by asking its upstream
//! (`docs/design.md` §5, "Unknown attempts are looked up").
//!
//! On a route with `reconcile`, once an attempt is recorded `unknown`, a
//! task of its own asks the attempt's upstream what became of it: at once,
//! then 1 s doubling to 30 s, until the attempt's deadline. How it asks is
//! the route's [`Reconcile`]:
//!
//! - a lookup (`[routes.reconcile] path`): `GET` the path, with the
//!   upstream's headers as the attempt had them; what the answer means is
//!   [`idemgate_domain::reconcile::verdict`]: `2xx` succeeded (its answer is
//!   the job's result), `404`/`410` no effect (the job reopens), anything
//!   else still unknown;
//! - a resend (`reconcile = "resend"`): the attempt's request again, byte
//!   for byte, with the same forwarded key, to an upstream that promised to
//!   deduplicate by it; an answer the route would commit settles the
//!   attempt `succeeded` with it; a retryable status, a broken contract or
//!   no answer leaves it unknown (a resend never proves "no effect").
//!
//! When to ask is read from the attempt's record (the lookups made and the
//! last one's time, [`next_lookup`]), not kept in the task, so that a task
//! started afresh (after a restart, by another replica) continues the same
//! backoff, and two tasks asking about one attempt share it. A finding is
//! applied by [`Store::reconcile_attempt`], the same CAS as an operator's
//! resolution, which wakes held duplicates. Every ask is recorded on the
//! attempt and counted in `idemgate_reconcile_lookups_total{route,by,result}`.
//! The task stops as soon as the attempt is settled some other way.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderName, HeaderValue, Method, Request};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use super::verdict::{classify, Verdict};
use super::UpstreamService;
use crate::replay;
use crate::route::{Protocol, Route};
use idemgate_domain::attempt::{AttemptFailure, AttemptState, Resolution};
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::job::JobDetail;
use idemgate_domain::jsonrpc;
use idemgate_domain::reconcile::{
    backoff, next_lookup, verdict, Lookup, LookupResult, Lookups, CALL_OUT_GRACE,
};
use idemgate_domain::response::StoredResponse;
use idemgate_domain::transition::Refusal;
use idemgate_proxy::http::{full, ProvenClient};
use idemgate_proxy::upstream::UpstreamId;
use idemgate_proxy::upstream::{self, Fetched, Stopwatch, Target, Timings, UpstreamError};
use idemgate_store::{at_least_until, Store, StoreError};
use idemgate_telemetry::ends::{self, By};
use idemgate_telemetry::Chain;

/// How the upstream is asked about an attempt.
pub(super) enum Ask {
    /// `GET` this path (the route's template, the job filled in).
    Lookup(String),
    /// The attempt's request, as it was sent.
    Resend(Box<Sent>),
}

impl Ask {
    fn name(&self) -> &'static str {
        match self {
            Ask::Lookup(_) => "lookup",
            Ask::Resend(_) => "resend",
        }
    }
}

/// A request as it went upstream, kept to be sent again.
pub(super) struct Sent {
    pub(super) parts: http::request::Parts,
    pub(super) body: bytes::Bytes,
}

/// The attempts a task of this process asks about: one task per attempt
/// here, and the scan adopts only attempts nobody here asks about.
#[derive(Default)]
pub(super) struct Asking(std::sync::Mutex<HashSet<AttemptId>>);

impl Asking {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<AttemptId>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn has(&self, attempt: AttemptId) -> bool {
        self.lock().contains(&attempt)
    }
}

/// Marks an attempt asked about here until the task ends.
struct Asked(Arc<Asking>, AttemptId);

impl Asked {
    fn claim(asking: &Arc<Asking>, attempt: AttemptId) -> Option<Asked> {
        asking
            .lock()
            .insert(attempt)
            .then(|| Asked(asking.clone(), attempt))
    }
}

impl Drop for Asked {
    fn drop(&mut self) {
        self.0.lock().remove(&self.1);
    }
}

/// Everything a reconciling task needs, gathered when the attempt starts
/// (or, for an attempt found unknown later, from its record).
pub(super) struct Reconciler {
    pub(super) store: Arc<dyn Store>,
    pub(super) upstream: UpstreamService,
    pub(super) target: UpstreamId,
    pub(super) route: Arc<Route>,
    pub(super) ask: Ask,
    pub(super) job: JobId,
    pub(super) attempt: AttemptId,
    /// When the attempt started: it is asked about until `deadline` after.
    pub(super) started_at: SystemTime,
    /// `attempt_deadline`.
    pub(super) deadline: Duration,
    /// When the attempt's call is given up, as its store recorded it.
    pub(super) deadline_at: SystemTime,
    /// How long one ask may take (the upstream's timeout).
    pub(super) timeout: Duration,
    pub(super) max_response_size: usize,
    /// The header the job id is forwarded in, as on the attempt.
    pub(super) key_header: HeaderName,
    /// The client's proof, when it gave one: an upstream holding the
    /// operator's credential gets them on a lookup as on the attempt.
    pub(super) proven: Option<ProvenClient>,
    /// This process's tasks, which this one joins.
    pub(super) asking: Arc<Asking>,
    /// The MCP tool calls at their server from here, and this process:
    /// a resend of a call is one while it is out ([`Reconciler::resend`]).
    pub(super) calls: Arc<crate::mcp::Calls>,
    pub(super) instance: uuid::Uuid,
    /// Where an ask in flight is counted, for the drain to wait on: what it
    /// learns (a resend's answer above all, which nothing asks for again)
    /// is written before the process exits (`docs/design.md` §12,
    /// "Termination").
    pub(super) asks: TaskTracker,
    /// Cancelled once this process's call of the attempt has ended; `None`
    /// for an attempt adopted from the store, whose call is taken to be
    /// out until its deadline ([`Out::Elsewhere`]). While the call is out,
    /// the upstream may still be acting on it: a lookup's `404` says only
    /// "not yet" (`docs/design.md` §5, "Not while the call is out").
    pub(super) call: Option<CancellationToken>,
    /// Whether a lookup's "no record" was held back while the call was out
    /// ([`Reconciler::judged`]): once the call ends, it is asked again at
    /// once, even past the attempt's deadline (the call ends at it too).
    pub(super) held_back: std::sync::atomic::AtomicBool,
}

/// How long a finding is retried into a store that does not answer, at
/// least.
const SETTLE_AT_LEAST: Duration = Duration::from_secs(60);

/// How many times more, past the lookups' schedule, the ask owed to a
/// held-back "no record" is made when it errs (no answer, or one that
/// neither settles nor says "no record" again): each after the lookups'
/// backoff, so for a few minutes at most (`docs/design.md` §5).
const LAST_ASK_RETRIES: u32 = 5;

/// Where a call of the attempt may still be out, so that a lookup's "no
/// record" proves nothing yet (`docs/design.md` §5, "Not while the call
/// is out").
enum Out<'a> {
    /// This process's call, until it ends.
    Here(&'a CancellationToken),
    /// The call of the replica that started the attempt, adopted here (its
    /// lease lapsed, or its lookups stopped): nothing here can tell that it
    /// ended (a replica cut off from the database goes on calling), but it
    /// ends by the attempt's recorded deadline, which this is (with
    /// [`CALL_OUT_GRACE`]).
    Elsewhere(SystemTime),
    /// No call of it is out.
    Over,
}

/// What became of the attempt after one ask.
enum Next {
    /// Settled (by this ask, or by someone else meanwhile): stop.
    Stop,
    /// Still unknown: ask again.
    Again,
}

/// The attempt as its record says, before an ask.
enum Pending {
    /// Still unknown, with the asks recorded so far.
    Unknown(Lookups),
    /// Settled (or gone): nothing to ask.
    Settled,
    /// The store did not answer: decide by this task's own clock.
    Unread,
}

impl Reconciler {
    /// Runs [`Reconciler::run`] in a task of its own, in a span of its own,
    /// unless a task here already asks about the attempt.
    pub(super) fn spawn(self) {
        let Some(asked) = Asked::claim(&self.asking, self.attempt) else {
            return;
        };
        let span = tracing::info_span!(
            "reconcile",
            attempt.id = %self.attempt,
            job.id = %self.job,
            by = self.ask.name()
        );
        tokio::spawn(
            async move {
                let _asked = asked;
                self.run().await;
            }
            .instrument(span),
        );
    }

    /// Asks until the attempt is settled or its deadline passes, when the
    /// record says the next ask is due.
    pub(super) async fn run(self) {
        let (mut asked, mut not_before) = (0u32, Instant::now());
        // The last ask owed past the schedule, when it erred: again then.
        let (mut last_retries, mut last_again) = (0u32, None::<Instant>);
        loop {
            let now = SystemTime::now();
            let due = match self.pending().await {
                Pending::Settled => return,
                Pending::Unknown(lookups) => {
                    next_lookup(&lookups, self.started_at, self.deadline, now)
                }
                Pending::Unread => {
                    (now < self.started_at + self.deadline).then_some(Duration::ZERO)
                }
            };
            // The call has ended since a "no record" was held back for it:
            // asked again at once, even past the deadline (or, that ask
            // having erred, after a backoff).
            let after_call =
                matches!(self.out(now), Out::Over) && self.held_back.load(Ordering::Relaxed);
            let due = if after_call {
                Some(Duration::ZERO)
            } else {
                due
            };
            let Some(due) = due else {
                // Past the deadline, the call still out (it ends at the
                // deadline too): waited for, then asked once more.
                if self.held_back.load(Ordering::Relaxed) {
                    match self.out(now) {
                        Out::Here(call) => call.cancelled().await,
                        Out::Elsewhere(until) => {
                            let left = until.duration_since(now).unwrap_or_default();
                            tokio::time::sleep(left).await;
                        }
                        Out::Over => break,
                    }
                    continue;
                }
                break;
            };
            // Not sooner than this task's own backoff either: an ask whose
            // record did not get in must not be repeated at once.
            let wait = match (after_call, last_again) {
                (true, None) => Duration::ZERO,
                (true, Some(at)) => at.saturating_duration_since(Instant::now()),
                (false, _) => due.max(not_before.saturating_duration_since(Instant::now())),
            };
            if !wait.is_zero() {
                // Then read again: another task may have asked, or the
                // attempt settled, meanwhile; the call's end wakes it.
                match self.out(now) {
                    Out::Here(call) => {
                        tokio::select! {
                            () = tokio::time::sleep(wait) => {}
                            () = call.cancelled() => {}
                        }
                    }
                    Out::Elsewhere(_) | Out::Over => tokio::time::sleep(wait).await,
                }
                continue;
            }
            // The drain waits for the asks in flight, not for new ones:
            // once it began, what is still unknown waits for another
            // replica's scan, or an operator.
            if self.asks.is_closed() {
                return;
            }
            if after_call {
                // Owed no more: `judged` holds a new "no record" back again.
                self.held_back.store(false, Ordering::Relaxed);
            }
            asked += 1;
            if let Next::Stop = self.asks.track_future(self.ask()).await {
                return;
            }
            not_before = Instant::now() + backoff(asked);
            // The ask owed as the call ended neither settled the attempt
            // nor found "no record" again (it erred, or answered anything
            // else): owed once more, after the backoff. Counted once the
            // schedule has no ask left that would make it.
            let erred = after_call && !self.held_back.load(Ordering::Relaxed);
            let schedule_over =
                SystemTime::now() + backoff(asked) >= self.started_at + self.deadline;
            if erred && (!schedule_over || last_retries < LAST_ASK_RETRIES) {
                last_retries += u32::from(schedule_over);
                last_again = Some(not_before);
                self.held_back.store(true, Ordering::Relaxed);
            }
        }
        tracing::info!(attempt = %self.attempt, job = %self.job, asked, "attempt deadline passed with its outcome still unknown; it waits for an operator");
    }

    async fn pending(&self) -> Pending {
        match self.store.job_detail(self.job).await {
            Ok(Some(detail)) => detail
                .attempts
                .into_iter()
                .find(|a| a.id == self.attempt && a.state == AttemptState::Unknown)
                .map_or(Pending::Settled, |a| Pending::Unknown(a.lookups)),
            Ok(None) => Pending::Settled,
            Err(_) => Pending::Unread,
        }
    }

    /// One ask: sends it, records it, and applies what it found.
    async fn ask(&self) -> Next {
        let (result, status, found) = match &self.ask {
            Ask::Lookup(path) => {
                // Whether a call may be out is read as the lookup is sent:
                // the upstream's "no record" is of that moment.
                let out = self.out(SystemTime::now());
                let answer = self.lookup(path).await;
                let status = answer.as_ref().ok().map(|s| s.status);
                if let Err(why) = &answer {
                    tracing::warn!(attempt = %self.attempt, error = %why, "could not look up the attempt's outcome; asking again");
                }
                (self.judged(verdict(status), out), status, answer.ok())
            }
            Ask::Resend(sent) => {
                // Only the call's own response answers it (docs/design.md §19).
                let call = match &self.route.protocol {
                    Protocol::Mcp(_) => match jsonrpc::request(&sent.body) {
                        jsonrpc::Request::ToolCall(call) => Some(call.id),
                        _ => None,
                    },
                    Protocol::Http => None,
                };
                let mut answer = self.resend(sent, call.as_deref()).await;
                if let (Ok(fetched), Some(_)) = (&mut answer, &call) {
                    // As the attempt's own answer is (`mcp::name_session`).
                    let session = sent.parts.headers.get(crate::mcp::MCP_SESSION_ID);
                    crate::mcp::name_session(&mut fetched.parts.headers, session.cloned());
                }
                resent(classify(answer, &self.route, call.as_deref()))
            }
        };
        metrics::counter!(
            "idemgate_reconcile_lookups_total",
            "route" => self.route.name.clone(),
            "by" => self.ask.name(),
            "result" => result.as_str()
        )
        .increment(1);
        tracing::info!(attempt = %self.attempt, job = %self.job, status, %result, by = self.ask.name(), "asked the upstream about the attempt's outcome");
        let lookup = Lookup {
            at: SystemTime::now(),
            status,
            result,
        };
        self.record(&lookup).await;
        let resolution = match (result, found) {
            (LookupResult::SettledSucceeded, Some(stored)) => Resolution::Succeeded(stored),
            (LookupResult::SettledNoEffect, _) => Resolution::Failed,
            _ => return Next::Again,
        };
        self.settle(resolution).await
    }

    /// Records an ask on the attempt. One that leaves it unknown is
    /// retried into a store that does not answer, for a minute at least:
    /// the record is what a reconciler started afresh, the scan for
    /// orphaned lookups and `Retry-After` go by, and a held-back "no
    /// record" in it is owed one last ask (`docs/design.md` §5). One that
    /// settles it is tried once: the settlement that follows is what
    /// matters, and is retried itself ([`Reconciler::settle`]).
    async fn record(&self, lookup: &Lookup) {
        let (store, attempt) = (&self.store, self.attempt);
        let write = || store.record_lookup(attempt, lookup);
        let recorded = match lookup.result.settles() {
            true => write().await,
            false => {
                let until = at_least_until(Instant::now());
                idemgate_store::retrying(
                    (
                        "record a lookup of",
                        "its finding is not kept; its next lookup asks again",
                    ),
                    attempt,
                    until,
                    write,
                )
                .await
            }
        };
        if let Err(e) = recorded {
            tracing::warn!(%attempt, error = %Chain(&e), "could not record a lookup");
        }
    }

    /// Where a call of the attempt may still be out at `now`.
    fn out(&self, now: SystemTime) -> Out<'_> {
        match &self.call {
            Some(call) if !call.is_cancelled() => Out::Here(call),
            Some(_) => Out::Over,
            None => {
                let until = self.deadline_at + CALL_OUT_GRACE;
                match now < until {
                    true => Out::Elsewhere(until),
                    false => Out::Over,
                }
            }
        }
    }

    /// What a lookup's finding proves where a call may have been out
    /// (`out`, as it was sent): a `2xx` is the attempt's outcome whenever
    /// it comes, but no record of it (`404`, `410`) proves no effect only
    /// once the call had ended.
    fn judged(&self, result: LookupResult, out: Out<'_>) -> LookupResult {
        if result != LookupResult::SettledNoEffect {
            return result;
        }
        match out {
            Out::Over => return result,
            Out::Here(_) => {
                tracing::info!(attempt = %self.attempt, "the upstream has no record of the attempt yet, but its call is still out: still unknown");
            }
            Out::Elsewhere(_) => {
                tracing::info!(attempt = %self.attempt, "the upstream has no record of the attempt yet, and the call of the replica that started it may be out until its deadline: still unknown");
            }
        }
        self.held_back.store(true, Ordering::Relaxed);
        LookupResult::StillUnknown
    }

    /// The upstream's answer to the lookup, read whole.
    async fn lookup(&self, path: &str) -> Result<StoredResponse, String> {
        let mut request = Request::builder()
            .method(Method::GET)
            .uri(path)
            .body(full(bytes::Bytes::new()))
            .map_err(|e| format!("the lookup path is not a request path: {e}"))?;
        if let Ok(v) = HeaderValue::from_str(&self.job.to_string()) {
            request.headers_mut().insert(self.key_header.clone(), v);
        }
        // Its answer may be committed as the attempt's (replayed, judged).
        super::ask_uncompressed(request.headers_mut());
        request.extensions_mut().insert(Target(self.target.clone()));
        if let Some(proven) = &self.proven {
            request.extensions_mut().insert(proven.clone());
        }
        match self.fetch(request).await {
            Ok(fetched) => Ok(replay::capture(&fetched)),
            Err(e) => Err(Chain(&e).to_string()),
        }
    }

    /// The attempt's request sent again, as it was (its target, its
    /// forwarded key, its body), and the answer read whole.
    ///
    /// A resent MCP tool call (`call`, its `id`) is at its server as the
    /// attempt's call was: while it is out, its agent's cancel is held
    /// back, here and (by a mark of its own, [`crate::mcp::mark_resend`])
    /// at other replicas (`docs/design.md` §19, "An agent's cancel").
    async fn resend(&self, sent: &Sent, call: Option<&[u8]>) -> Result<Fetched, UpstreamError> {
        let session = sent.parts.headers.get(crate::mcp::MCP_SESSION_ID);
        let at = (self.route.name.as_str(), session);
        let _at_server = call.and_then(|id| self.calls.start(at.0, at.1, id));
        let _marked = match call {
            Some(id) => {
                let (store, instance) = (&self.store, self.instance);
                crate::mcp::mark_resend(store, instance, at, id, self.timeout).await
            }
            None => None,
        };
        let request = Request::from_parts(sent.parts.clone(), full(sent.body.clone()));
        self.fetch(request).await
    }

    /// Sends an ask, timed into `idemgate_reconcile_seconds`, apart from
    /// the attempts' `idemgate_upstream_response_seconds`.
    async fn fetch(
        &self,
        mut request: Request<idemgate_proxy::http::Body>,
    ) -> Result<Fetched, UpstreamError> {
        let timings = Timings::reconcile(self.target.name(), self.ask.name());
        let stopwatch = Stopwatch::into(timings);
        request.extensions_mut().insert(stopwatch.clone());
        let (progress, _) = tokio::sync::watch::channel(0u64);
        let fetch = upstream::fetch(
            self.upstream.clone(),
            request,
            self.max_response_size,
            progress,
        );
        tokio::time::timeout(self.timeout, fetch)
            .await
            .unwrap_or_else(|_| {
                stopwatch.timed_out();
                Err(UpstreamError::TimedOut(self.timeout))
            })
    }

    /// Applies the finding by the resolution CAS, retrying while the store
    /// is unreachable until the attempt's deadline, and for at least
    /// [`SETTLE_AT_LEAST`] (the last ask of a "no record" held back comes
    /// after the deadline).
    async fn settle(&self, resolution: Resolution) -> Next {
        let mut wait = Duration::from_millis(50);
        let ends = (self.started_at + self.deadline).max(SystemTime::now() + SETTLE_AT_LEAST);
        loop {
            match self
                .store
                .reconcile_attempt(self.attempt, resolution.clone())
                .await
            {
                Ok(detail) => {
                    self.count(&detail);
                    tracing::info!(attempt = %self.attempt, job = %self.job, state = %detail.job.state, "attempt reconciled by its upstream");
                    return Next::Stop;
                }
                Err(StoreError::Refused(Refusal::AttemptIs { state, .. })) => {
                    tracing::debug!(attempt = %self.attempt, %state, "attempt settled meanwhile; the finding is not applied");
                    return Next::Stop;
                }
                Err(e) if e.is_transient() && SystemTime::now() + wait < ends => {
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
                Err(e) => {
                    tracing::error!(attempt = %self.attempt, error = %Chain(&e), "could not apply the upstream's finding");
                    return Next::Stop;
                }
            }
        }
    }
}

impl Reconciler {
    /// Counts the settlement the store took: the attempt's second end,
    /// after its `unknown` one (`docs/design.md` §12, "Metrics").
    fn count(&self, detail: &JobDetail) {
        let by = match self.ask {
            Ask::Lookup(_) => By::Lookup,
            Ask::Resend(_) => By::Resend,
        };
        if let Some(attempt) = detail.attempts.iter().find(|a| a.id == self.attempt) {
            let state = attempt.state.as_str();
            ends::ended(&self.route.name, self.target.name(), state, by);
        }
    }
}

/// What a resend's answer means: an answer the route would commit is the
/// attempt's result (the upstream deduplicated the resend by its key, so it
/// reports the first call's outcome); anything else proves nothing, and
/// never "no effect" (a `503` to the resend says nothing of the first).
fn resent(verdict: Verdict) -> (LookupResult, Option<u16>, Option<StoredResponse>) {
    match verdict {
        // "A request with this key is in progress" (Stripe's
        // `idempotency_key_in_use`, the IETF draft's `409`, `425 Too
        // Early`): of the first call, that says nothing.
        Verdict::Commit(stored) if matches!(stored.status, 409 | 425) => {
            (LookupResult::StillUnknown, Some(stored.status), None)
        }
        Verdict::Commit(stored) => (
            LookupResult::SettledSucceeded,
            Some(stored.status),
            Some(stored),
        ),
        Verdict::Fail(
            AttemptFailure::Failed {
                status: Some(status),
                ..
            }
            | AttemptFailure::Rejected { status, .. },
            _,
        ) => (LookupResult::StillUnknown, Some(status), None),
        Verdict::Fail(..) | Verdict::Unknown(..) => (LookupResult::Error, None, None),
    }
}
