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
//! held back there too.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request};
use idemgate_domain::id::AttemptId;
use idemgate_proxy::http::Body;
use idemgate_store::{CallAt, Store};
use idemgate_telemetry::Chain;

use super::{id_text, session_of, MCP_SESSION_ID};

/// How often a session's end held back here asks the store again whether
/// another replica's call of the session is still at its server.
const ASK_AGAIN: Duration = Duration::from_millis(250);

/// How many times a mark is asked to be taken off before it is left to
/// lapse at its attempt's deadline.
const UNMARK_TRIES: u32 = 6;

/// The keyed tool calls whose attempts are at their server from this
/// process, by session (`Mcp-Session-Id`) and `id` (as JSON text).
#[derive(Default)]
pub(crate) struct Calls {
    at_server: std::sync::Mutex<HashMap<(Bytes, String), usize>>,
    /// Told whenever a call leaves its server.
    left: tokio::sync::Notify,
}

/// Marks an MCP route's `DELETE`: the end of the session it names.
#[derive(Clone, Copy)]
pub(crate) struct SessionEnd;

/// Whether `req` ends an MCP session: it waits for the session's keyed
/// calls at their server ([`Calls::quiet`]).
pub(crate) fn ends_session(req: &Request<Body>) -> bool {
    req.extensions().get::<SessionEnd>().is_some()
}

/// One keyed call at its server from here, until dropped.
pub(crate) struct AtServer(Arc<Calls>, (Bytes, String));

impl Calls {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(Bytes, String), usize>> {
        self.at_server.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether keyed calls of `session` are at their server from here.
    fn in_session(&self, session: &Bytes) -> bool {
        self.lock().keys().any(|(s, _)| s == session)
    }

    /// Waits until no keyed call of the session `req` ends is at its
    /// server, from here or (as the store says) from another replica, or
    /// `limit` passed. A store that does not answer holds nothing back.
    pub(crate) async fn quiet(&self, store: &dyn Store, req: &Request<Body>, limit: Duration) {
        let Some(session) = req.headers().get(MCP_SESSION_ID) else {
            return;
        };
        let session = session_of(Some(session));
        let wait = async {
            let mut told = false;
            loop {
                let left = self.left.notified();
                tokio::pin!(left);
                left.as_mut().enable();
                let busy = self.in_session(&session) || marked(store, &session, None).await;
                if !busy {
                    return;
                }
                if !told {
                    tracing::info!("an MCP session's end is held back until its keyed tool calls in flight end");
                    told = true;
                }
                // A call here says when it leaves; another replica's is
                // asked about again.
                tokio::select! {
                    () = left => {}
                    () = tokio::time::sleep(ASK_AGAIN) => {}
                }
            }
        };
        let _ = tokio::time::timeout(limit, wait).await;
    }

    /// Marks the call `id` of `session` at its server until the mark drops.
    /// A call in no session is not marked: without one, one agent's call
    /// and another's cancel of its own call of the same `id` could not be
    /// told apart, and a cancel held back for the wrong call would be lost.
    pub(crate) fn start(
        self: &Arc<Self>,
        session: Option<&HeaderValue>,
        id: &[u8],
    ) -> Option<AtServer> {
        let at = (session_of(Some(session?)), id_text(id));
        *self.lock().entry(at.clone()).or_default() += 1;
        Some(AtServer(self.clone(), at))
    }

    /// Whether `body`, a message posted in the session `parts` name, is a
    /// `notifications/cancelled` of a keyed call at its server, from here
    /// or (as the store says) from another replica: it is held back.
    pub(crate) async fn holds_cancel(
        &self,
        store: &dyn Store,
        parts: &http::request::Parts,
        body: &[u8],
    ) -> bool {
        let Some((session, request)) = cancel_of(parts, body) else {
            return false;
        };
        let here = self
            .lock()
            .contains_key(&(session.clone(), request.clone()));
        let held = here || marked(store, &session, Some(&request)).await;
        if held {
            tracing::info!(request = %request, here, "an agent's cancel of a keyed tool call in flight is held back: the call goes on, and its answer is kept for the retry");
        }
        held
    }
}

/// The session and the request a `notifications/cancelled` in `body`
/// names, posted in the session `parts` name; `None` for any other message,
/// and for a cancel in no session (no call in none is marked).
fn cancel_of(parts: &http::request::Parts, body: &[u8]) -> Option<(Bytes, String)> {
    const CANCELLED: &[u8] = b"notifications/cancelled";
    let session = parts.headers.get(MCP_SESSION_ID)?;
    // Most messages are not cancels: not parsed to learn so.
    if !body.windows(CANCELLED.len()).any(|w| w == CANCELLED) {
        return None;
    }
    let message = serde_json::from_slice::<serde_json::Value>(body).ok()?;
    let cancel = message.get("method").and_then(serde_json::Value::as_str)
        == Some("notifications/cancelled")
        && message.get("id").is_none();
    let request = message.pointer("/params/requestId").filter(|_| cancel)?;
    Some((session_of(Some(session)), request.to_string()))
}

/// Whether the store has a call of `session` (the request `id`, or any)
/// marked at its server by any replica; `false` when it does not answer.
async fn marked(store: &dyn Store, session: &[u8], id: Option<&str>) -> bool {
    match store.call_at_server(session, id).await {
        Ok(marked) => marked,
        Err(e) => {
            tracing::warn!(error = %Chain(&e), "could not ask the store whether another replica has an MCP call at its server; the agent's message passes");
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
/// dropped (as its attempt's task ends), or left to lapse at the attempt's
/// deadline should the store not answer.
pub(crate) struct Marked {
    store: Arc<dyn Store>,
    attempt: AttemptId,
}

/// Marks in `store` the call `id` that `attempt` sends in `session`, for
/// `for_at_most` (the attempt's deadline); `None` for a call in no session,
/// or when the store does not answer (the call goes on: a cancel reaching
/// another replica then passes, as one always did).
pub(crate) async fn mark(
    store: &Arc<dyn Store>,
    attempt: AttemptId,
    session: Option<&HeaderValue>,
    id: &[u8],
    for_at_most: Duration,
) -> Option<Marked> {
    let (session, id) = (session?.as_bytes(), id_text(id));
    let call = CallAt { session, id: &id };
    match store.mark_call(attempt, call, for_at_most).await {
        Ok(()) => Some(Marked {
            store: store.clone(),
            attempt,
        }),
        Err(e) => {
            tracing::warn!(error = %Chain(&e), %attempt, "could not mark the MCP call at its server for other replicas; an agent's cancel reaching another passes");
            None
        }
    }
}

impl Drop for Marked {
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, attempt) = (self.store.clone(), self.attempt);
        runtime.spawn(async move {
            let mut backoff = Duration::from_millis(50);
            for _ in 0..UNMARK_TRIES {
                match store.unmark_call(attempt).await {
                    Ok(()) => return,
                    Err(e) if e.is_transient() => tokio::time::sleep(backoff).await,
                    Err(_) => break,
                }
                backoff *= 2;
            }
            tracing::info!(%attempt, "the MCP call's mark for other replicas is left to lapse at its attempt's deadline");
        });
    }
}
