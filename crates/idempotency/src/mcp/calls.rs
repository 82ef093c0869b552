//! Keyed tool calls at their server, and an agent's cancel of one held back
//! (`docs/design.md` §19, "An agent's cancel"). An agent that gives up on a
//! call sends `notifications/cancelled` naming it, or ends its session with
//! `DELETE`; either would cut the call at the server and leave its outcome
//! unknown. So while a keyed call's attempt is at its server, a cancel of
//! it is answered `202` and never forwarded, and its session's end waits
//! for it.
//!
//! Each process knows the calls its own attempts have at their server
//! ([`Calls`]); a store shared by replicas (PostgreSQL) is told of each
//! ([`mark`]), so that a cancel or a `DELETE` reaching another replica is
//! held back there too. A call is known by digests of its route, its
//! session and its `id` ([`CallAt`]): the same on every replica, fixed in
//! size whatever a client sends.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::{BoxFuture, FutureExt, Shared};
use http::{HeaderValue, Request};
use idemgate_domain::id::AttemptId;
use idemgate_proxy::http::Body;
use idemgate_store::{CallAt, Store};
use idemgate_telemetry::Chain;
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{id_text, MCP_SESSION_ID};
use crate::opt_in::SessionEnd;

/// How long a question to the store about marks may take (the default
/// `database_timeout`): past it, the store is taken not to answer (a cancel
/// or a session's end passes, as they did before replicas shared marks; a
/// call is sent, its mark still on its way).
const PATIENCE: Duration = Duration::from_secs(2);

/// How often, at first, a session's end held back here asks the store again
/// whether another replica's call of the session is still at its server;
/// the pause doubles up to [`ASK_AT_MOST_EVERY`].
const ASK_AGAIN: Duration = Duration::from_millis(250);
const ASK_AT_MOST_EVERY: Duration = Duration::from_secs(2);

/// The keyed tool calls whose attempts are at their server from this
/// process, and how many attempts have each.
#[derive(Default)]
pub(crate) struct Calls {
    at_server: std::sync::Mutex<HashMap<CallAt, usize>>,
    /// Told whenever a call leaves its server.
    left: tokio::sync::Notify,
    /// The store's answer about each session's marks, on its way or
    /// given, and when it was asked: the `DELETE`s of a session held here
    /// share it for [`ASK_AGAIN`], so a client that sends many asks the
    /// store about as often as one would.
    asked: std::sync::Mutex<HashMap<[u8; 32], (Instant, Answer)>>,
}

/// The store's answer to whether a session has calls marked, shared by
/// everyone who waits for it.
type Answer = Shared<BoxFuture<'static, bool>>;

/// Whether `req` ends an MCP session: it waits for the session's keyed
/// calls at their server ([`Calls::quiet`]).
pub(crate) fn ends_session(req: &Request<Body>) -> bool {
    req.extensions().get::<SessionEnd>().is_some()
}

/// The call `id` (its JSON text) made in `session` on `route`, as its marks
/// are found.
fn call_at(route: &str, session: &[u8], id: &str) -> CallAt {
    let of_session = session_key(route, session);
    let mut call = Sha256::new();
    call.update(of_session);
    call.update(id.as_bytes());
    CallAt {
        session: of_session,
        call: call.finalize().into(),
    }
}

/// The digest of `route` and `session`: each part framed by its length, so
/// that no two pairs write the same bytes.
fn session_key(route: &str, session: &[u8]) -> [u8; 32] {
    let mut digest = Sha256::new();
    for part in [route.as_bytes(), session] {
        digest.update((part.len() as u64).to_be_bytes());
        digest.update(part);
    }
    digest.finalize().into()
}

/// One keyed call at its server from here, until dropped.
pub(crate) struct AtServer(Arc<Calls>, CallAt);

impl Calls {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<CallAt, usize>> {
        self.at_server.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether keyed calls of the session `session` (its key) are at their
    /// server from here.
    fn in_session(&self, session: &[u8; 32]) -> bool {
        self.lock().keys().any(|at| &at.session == session)
    }

    /// Waits until no keyed call of the session `req` ends is at its
    /// server, from here or (as the store says) from another replica
    /// (`instance` is this one), or `limit` passed. A store that does not
    /// answer holds nothing back.
    pub(crate) async fn quiet(
        &self,
        store: &Arc<dyn Store>,
        instance: Uuid,
        req: &Request<Body>,
        limit: Duration,
    ) {
        let (Some(session), Some(end)) = (
            req.headers().get(MCP_SESSION_ID),
            req.extensions().get::<SessionEnd>(),
        ) else {
            return;
        };
        let session = session_key(&end.route, session.as_bytes());
        let wait = async {
            let mut pause = ASK_AGAIN;
            let mut told = false;
            loop {
                let left = self.left.notified();
                tokio::pin!(left);
                left.as_mut().enable();
                let busy = self.in_session(&session)
                    || self.session_marked(store, &session, instance).await;
                if !busy {
                    return;
                }
                if !told {
                    tracing::info!("an MCP session's end is held back until its keyed tool calls in flight end");
                    told = true;
                }
                // A call here says when it leaves; another replica's is
                // asked about again, less often the longer it runs.
                tokio::select! {
                    () = left => {}
                    () = tokio::time::sleep(pause) => pause = (pause * 2).min(ASK_AT_MOST_EVERY),
                }
            }
        };
        let _ = tokio::time::timeout(limit, wait).await;
    }

    /// Whether the store has a call of `session` marked by another replica:
    /// the answer to a question asked less than [`ASK_AGAIN`] ago, on its
    /// way or given, or to one asked now.
    async fn session_marked(
        &self,
        store: &Arc<dyn Store>,
        session: &[u8; 32],
        instance: Uuid,
    ) -> bool {
        let answer = {
            let mut asked = self.asked.lock().unwrap_or_else(|e| e.into_inner());
            match asked.get(session) {
                Some((at, answer)) if at.elapsed() < ASK_AGAIN => answer.clone(),
                _ => {
                    asked.retain(|_, (at, _)| at.elapsed() < ASK_AGAIN);
                    let (store, key) = (store.clone(), *session);
                    let asking = async move { marked(store.as_ref(), &key, None, instance).await };
                    let answer = asking.boxed().shared();
                    // Stamped as asked, not as answered: the answer is of then.
                    asked.insert(*session, (Instant::now(), answer.clone()));
                    answer
                }
            }
        };
        answer.await
    }

    /// Marks the call `id` of `session` on `route` at its server until the
    /// mark drops. A call in no session is not marked: without one, one
    /// agent's call and another's cancel of its own call of the same `id`
    /// could not be told apart, and a cancel held back for the wrong call
    /// would be lost.
    pub(crate) fn start(
        self: &Arc<Self>,
        route: &str,
        session: Option<&HeaderValue>,
        id: &[u8],
    ) -> Option<AtServer> {
        let at = call_at(route, session?.as_bytes(), &id_text(id));
        *self.lock().entry(at).or_default() += 1;
        Some(AtServer(self.clone(), at))
    }

    /// Whether `body`, a message posted on `route` in the session `parts`
    /// name, is a `notifications/cancelled` of a keyed call at its server,
    /// from here or (as the store says) from another replica (`instance`
    /// is this one): it is held back.
    pub(crate) async fn holds_cancel(
        &self,
        store: &dyn Store,
        instance: Uuid,
        route: &str,
        (parts, body): (&http::request::Parts, &[u8]),
    ) -> bool {
        let Some((session, request)) = cancel_of(parts, body) else {
            return false;
        };
        let at = call_at(route, session.as_bytes(), &request);
        let here = self.lock().contains_key(&at);
        let held = here || marked(store, &at.session, Some(&at.call), instance).await;
        if held {
            tracing::info!(request = %request, here, "an agent's cancel of a keyed tool call in flight is held back: the call goes on, and its answer is kept for the retry");
        }
        held
    }
}

/// The session and the request a `notifications/cancelled` in `body`
/// names, posted in the session `parts` name; `None` for any other message,
/// and for a cancel in no session (no call in none is marked).
fn cancel_of(parts: &http::request::Parts, body: &[u8]) -> Option<(HeaderValue, String)> {
    const CANCELLED: &[u8] = b"notifications/cancelled";
    let session = parts.headers.get(MCP_SESSION_ID)?;
    // Most messages are not cancels: not parsed to learn so.
    if !body.windows(CANCELLED.len()).any(|w| w == CANCELLED) {
        return None;
    }
    // Past a byte order mark, as a tool call is read.
    let body = idemgate_domain::jsonrpc::without_bom(body);
    let message = serde_json::from_slice::<serde_json::Value>(body).ok()?;
    let cancel = message.get("method").and_then(serde_json::Value::as_str)
        == Some("notifications/cancelled")
        && message.get("id").is_none();
    let request = message.pointer("/params/requestId").filter(|_| cancel)?;
    Some((session.clone(), request.to_string()))
}

/// Whether the store has a call of `session` (the call `call`, or any)
/// marked at its server by a replica other than `instance`; `false` when
/// it does not answer within [`PATIENCE`].
async fn marked(
    store: &dyn Store,
    session: &[u8; 32],
    call: Option<&[u8; 32]>,
    instance: Uuid,
) -> bool {
    let asked = store.call_at_server(session, call, instance);
    match tokio::time::timeout(PATIENCE, asked).await {
        Ok(Ok(marked)) => marked,
        Ok(Err(e)) => {
            tracing::warn!(error = %Chain(&e), "could not ask the store whether another replica has an MCP call at its server; the agent's message passes");
            false
        }
        Err(_) => {
            metrics::counter!("idemgate_mcp_store_timeouts_total", "question" => "ask")
                .increment(1);
            tracing::warn!("the store did not say in time whether another replica has an MCP call at its server; the agent's message passes");
            false
        }
    }
}

impl Drop for AtServer {
    fn drop(&mut self) {
        {
            let mut calls = self.0.lock();
            if let Some(n) = calls.get_mut(&self.1) {
                *n -= 1;
                if *n == 0 {
                    calls.remove(&self.1);
                }
            }
        }
        self.0.left.notify_waiters();
    }
}

/// A keyed call's mark in the store, for other replicas: taken off when
/// dropped (as its attempt's task ends, or its resend), asked again until
/// it is or the mark lapses by itself.
pub(crate) struct Marked {
    store: Arc<dyn Store>,
    attempt: AttemptId,
    lapses: Instant,
    /// The insert, while it may still land: taken off only after it.
    marking: Option<tokio::task::JoinHandle<()>>,
    /// Stops the insert's retries once the call is over.
    ended: CancellationToken,
}

/// Marks in `store` the call `id` that `attempt` sends from `instance` in
/// `session` on `route`, for a `lease` the attempt's renewals renew, until
/// `deadline` (the attempt's); `None` for a call in no session. The insert
/// is waited for at most [`PATIENCE`]: a call is not held by a store that
/// does not answer (a cancel reaching another replica before its mark
/// lands passes, as one always did). It is retried while the store is
/// unreachable, until the call ends or its deadline passes: what the
/// gateway knows of a call out is not dropped for a transient fault
/// (`docs/design.md` §19). An insert still on its way is stopped and
/// waited for before the mark is taken off, so that it cannot land after.
pub(crate) async fn mark(
    store: &Arc<dyn Store>,
    (attempt, instance): (AttemptId, Uuid),
    (route, session): (&str, Option<&HeaderValue>),
    id: &[u8],
    (deadline, lease): (Instant, Duration),
) -> Option<Marked> {
    let at = call_at(route, session?.as_bytes(), &id_text(id));
    let ended = CancellationToken::new();
    let (tried, first_try) = tokio::sync::oneshot::channel();
    let insert = tokio::spawn(insert_mark(
        store.clone(),
        (attempt, instance),
        at,
        (lease, deadline),
        (tried, ended.clone()),
    ));
    // Made before the wait: a caller that stops waiting (a shutdown) drops
    // it, which stops the retries and takes off a mark that landed.
    let mut marked = Marked {
        store: store.clone(),
        attempt,
        lapses: deadline,
        marking: Some(insert),
        ended,
    };
    // The first try is waited for, not its retries: a call is not held
    // up by a store that refuses.
    if tokio::time::timeout(PATIENCE, first_try).await.is_err() {
        metrics::counter!("idemgate_mcp_store_timeouts_total", "question" => "mark").increment(1);
        tracing::warn!(%attempt, "the MCP call's mark for other replicas is not written yet; the call is sent, its mark on its way");
    }
    if marked
        .marking
        .as_ref()
        .is_some_and(|insert| insert.is_finished())
    {
        marked.marking = None;
    }
    Some(marked)
}

/// Inserts the mark, retried with backoff while the store is unreachable,
/// until `ended` (the call is over) or `deadline`; `tried` is told when the
/// first try has ended. Each try is good for a `lease` from when it is
/// sent, never past the deadline, and renewed with the attempt's lease: a
/// replica that dies holds its calls' cancels back elsewhere one lease,
/// not to the deadline.
async fn insert_mark(
    store: Arc<dyn Store>,
    (attempt, instance): (AttemptId, Uuid),
    at: CallAt,
    (lease, deadline): (Duration, Instant),
    (tried, ended): (tokio::sync::oneshot::Sender<()>, CancellationToken),
) {
    let mut backoff = Duration::from_millis(50);
    let mut failures = 0u32;
    let mut tried = Some(tried);
    loop {
        let good = deadline
            .saturating_duration_since(Instant::now())
            .min(lease);
        let marked = store.mark_call(attempt, instance, &at, good).await;
        if let Some(tried) = tried.take() {
            let _ = tried.send(());
        }
        let e = match marked {
            Ok(()) if failures > 0 => {
                return tracing::info!(%attempt, failures, "the MCP call is marked for other replicas, the store back");
            }
            Ok(()) => return,
            Err(e) => e,
        };
        if !e.is_transient() || Instant::now() + backoff >= deadline {
            return tracing::warn!(error = %Chain(&e), %attempt, failures, "could not mark the MCP call at its server for other replicas; an agent's cancel reaching another passes");
        }
        if failures == 0 {
            tracing::warn!(error = %Chain(&e), %attempt, "could not mark the MCP call at its server for other replicas yet; retrying while it is out");
        }
        failures += 1;
        tokio::select! {
            biased;
            () = ended.cancelled() => return,
            () = tokio::time::sleep(backoff) => backoff = (backoff * 2).min(ASK_AT_MOST_EVERY),
        }
    }
}

/// Marks in `store` a resend of the call `id` (`reconcile = "resend"`)
/// from `instance` in `session` on `route`, for the resend's `limit`: under
/// an id of its own, so that it neither meets the attempt's own mark (its
/// call may still be out) nor is renewed with it, and good for the
/// resend's whole time however long its insert took ([`PATIENCE`] at
/// most). Taken off as the resend ends; a replica that dies meanwhile
/// holds that call's cancels back elsewhere until `limit` has passed.
pub(crate) async fn mark_resend(
    store: &Arc<dyn Store>,
    instance: Uuid,
    at: (&str, Option<&HeaderValue>),
    id: &[u8],
    limit: Duration,
) -> Option<Marked> {
    let good = limit + PATIENCE;
    let by = (AttemptId::new(), instance);
    mark(store, by, at, id, (Instant::now() + good, good)).await
}

impl Drop for Marked {
    fn drop(&mut self) {
        // First: the retries stop even where nothing can take a mark off.
        self.ended.cancel();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, attempt, lapses) = (self.store.clone(), self.attempt, self.lapses);
        let marking = self.marking.take();
        runtime.spawn(async move {
            if let Some(insert) = marking {
                let _ = insert.await;
            }
            let mut backoff = Duration::from_millis(50);
            loop {
                match store.unmark_call(attempt).await {
                    Ok(()) => return,
                    Err(e) if e.is_transient() && Instant::now() + backoff < lapses => {
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(ASK_AT_MOST_EVERY);
                    }
                    Err(e) => {
                        tracing::info!(error = %Chain(&e), %attempt, "the MCP call's mark for other replicas is left to lapse: a lease after its attempt's last renewal, or a resend's at its limit");
                        return;
                    }
                }
            }
        });
    }
}
