//! Running one attempt, in its own task (`docs/design.md`, §5).
//!
//! The task, not the client's request, owns the attempt: a client that hangs
//! up does not cancel it, and it still commits if the upstream answers late.
//! Its [`task`] does three things, each its own function:
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
//!    until the store takes it, for the attempt's deadline and a minute
//!    after it was learned at least (`WRITE_AT_LEAST`), holding the
//!    attempt's lease meanwhile. The request is answered once the write is
//!    in, or after `PATIENCE` at most (then with `503` for an answer not yet
//!    committed: the client's retry is held until it is, and replays it).
//!
//! The [`Runner`] starts tasks, and asks the upstream about attempts of
//! unknown outcome that outlived the request that started them.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Request, Response};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tower::util::BoxCloneSyncService;

use crate::error::GatewayError;
use crate::recording::Recording;
use idemgate_domain::attempt::Attempt;
use idemgate_domain::response::StoredResponse;
use idemgate_proxy::http::Body;
use idemgate_proxy::upstream::UpstreamError;

/// How long a request waits for its attempt's outcome to be recorded before
/// it is answered anyway (the write goes on in the background).
pub(super) const PATIENCE: Duration = Duration::from_secs(2);

mod call;
mod ends;
mod reconcile;
mod reconnect;
mod runner;
mod task;
mod verdict;

pub(crate) use ends::zero;
pub(crate) use runner::Runner;

/// What an answer read whole costs the memory budget per byte while it is
/// held: itself, and the two copies its commit makes on the way to the
/// store (the client library's encoding of the statement, and its socket
/// buffer; SQLite's private copy of a bound blob, and the record it
/// builds). Counted before the buffer grows, so answers that do not fit
/// are refused before they are read (`docs/design.md` §18).
pub const ANSWER_WEIGHT: usize = 4;

/// Asks the upstream for the answer uncompressed (`Accept-Encoding:
/// identity`), in place of whatever the client accepts. A keyed request's
/// answer is judged, checked against its contract, cut into events, resumed
/// and replayed to every duplicate whatever each of them accepts, so the
/// gateway records the one representation all of that can read
/// (`docs/design.md` §11, "A keyed answer is asked for uncompressed").
pub(super) fn ask_uncompressed(headers: &mut http::HeaderMap) {
    headers.insert(
        http::header::ACCEPT_ENCODING,
        http::HeaderValue::from_static("identity"),
    );
}

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
