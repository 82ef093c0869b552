//! One opted-in request, ready to run: the data every later step (holding,
//! replaying, attempts) takes, apart from how it was prepared (`opt_in.rs`).

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::watch;
use tracing::Span;

use crate::route::Route;
use idemgate_domain::fingerprint::Fingerprint;
use idemgate_domain::id::JobId;
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_domain::sse::ResumePoint;
use idemgate_proxy::budget::Charge;

/// Who asks, for what, on which route: what a job is the job of, and
/// whom its committed answer is kept for in the replay tiers above the
/// store (only the very request that made it: same owner, key and
/// fingerprint).
pub(crate) struct Intent {
    /// The route it matched.
    pub route: Arc<Route>,
    /// Who the key belongs to.
    pub owner: Owner,
    /// The client's key.
    pub key: IdempotencyKey,
    /// What a duplicate must match.
    pub fingerprint: Fingerprint,
}

/// One opted-in request, buffered and fingerprinted.
pub(crate) struct Keyed {
    /// Who asks, for what: shared with its attempts, which keep the
    /// answer they commit for it.
    pub intent: Arc<Intent>,
    /// Its head, as received.
    pub parts: http::request::Parts,
    /// Its whole body.
    pub body: Bytes,
    /// What it holds against the memory budget: its body, its attempts'
    /// answers, replays copied for it (`docs/design.md` §18). Its attempts
    /// hold it too, and its answer until sent.
    pub charge: Arc<Charge>,
    /// Where a retry of a streamed job picks the stream up; `None`: from
    /// the start (`docs/design.md` §10, "Resume").
    pub resume: Option<ResumePoint>,
    /// Its span: its attempts' spans are children of it.
    pub span: Span,
    /// Told the job once the request would wait for it (its attempts run,
    /// or it is held): a request that prefers to be answered at once then
    /// gets `202` (`Prefer: respond-async`, `docs/design.md` §10).
    pub waiting: Option<watch::Sender<Option<JobId>>>,
    /// The JSON-RPC `id` of an MCP tool call: every answer it gets that
    /// its own attempt did not make (a replay, a held duplicate's, a
    /// joined stream) is readdressed to it (`docs/design.md` §19).
    pub rpc_id: Option<Vec<u8>>,
}

impl Keyed {
    /// Says the request waits on `job` from now on.
    pub(crate) fn waits_on(&self, job: JobId) {
        if let Some(waiting) = &self.waiting {
            waiting.send_replace(Some(job));
        }
    }
}
