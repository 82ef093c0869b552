//! Errors of a request the idempotency layer handles, by who caused them
//! (the client, the upstream, the store, the gateway), and the one table
//! that maps each to its problem answer (rendered by
//! [`idemgate_proxy::problem`]). Logging happens at the edge (the request
//! span), not here.

use std::time::Duration;

use http::{HeaderName, HeaderValue, Response, StatusCode};
use serde_json::Map;

use idemgate_domain::fingerprint::AmbiguousJson;
use idemgate_domain::key::KeyError;
use idemgate_domain::path::Ambiguity;
use idemgate_domain::sse::BadResumePoint;
use idemgate_domain::BoxError;
use idemgate_proxy::http::idle::BodyTimedOut;
use idemgate_proxy::http::{full, Outcome};
use idemgate_proxy::http::{Body, CollectError};
use idemgate_proxy::problem::{problem_response_with, PROBLEM_BASE};
use idemgate_proxy::upstream::UpstreamError;
use idemgate_store::{StoreError, StoreErrorKind};
use idemgate_trust::TrustError;

/// Tells a client's SDK whether to retry on its own (the OpenAI and
/// Anthropic SDKs read it), for refusals no retry can win and for replayed
/// errors.
pub(crate) const SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");

/// The IETF draft whose answers the key problems give; each links the
/// section it answers to in a `spec` member (RFC 9457 §3.2), the link to
/// documentation the draft asks of them (§2.7).
const DRAFT: &str =
    "https://datatracker.ietf.org/doc/html/draft-ietf-httpapi-idempotency-key-header-07";

/// The draft's section for a problem type: the header's syntax (a key
/// missing or malformed), a key's uniqueness (reused with another
/// request), its enforcement (a request still in progress).
fn draft_section(slug: &str) -> Option<&'static str> {
    match slug {
        "idempotency-key-missing" | "invalid-idempotency-key" => Some("2.1"),
        "idempotency-key-mismatch" => Some("2.2"),
        "request-in-progress" => Some("2.6"),
        _ => None,
    }
}

/// Something the client did.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The path could be read two ways by upstreams (`docs/design.md` §2).
    #[error("{0}")]
    AmbiguousPath(#[from] Ambiguity),
    /// A header that tells the route's requests apart
    /// (`significant_headers`) sent in another spelling, which an upstream
    /// behind CGI reads as that header (`docs/design.md` §11).
    #[error("the header `{sent}` is read as `{reads_as}` by upstreams that fold `_` into `-` (CGI, Rack, PHP-FPM), and `{reads_as}` tells this route's requests apart: send it as `{reads_as}`")]
    AmbiguousHeader {
        /// The name as sent.
        sent: String,
        /// The significant header it is read as.
        reads_as: String,
    },
    /// A request whose method-override header names another method than
    /// its line, on a path a route takes for either (`docs/design.md` §2).
    #[error("the request is sent as {sent} but names {named} in a method-override header (X-HTTP-Method-Override, X-HTTP-Method, X-Method-Override), which upstreams that honour it run instead: send it as {named}, without the header")]
    AmbiguousMethod {
        /// The line's method.
        sent: String,
        /// What the header names.
        named: String,
    },
    /// The route requires a key and there was none.
    #[error("this route requires an Idempotency-Key header")]
    MissingKey,
    /// The key header is malformed.
    #[error("invalid Idempotency-Key: {0}")]
    InvalidKey(#[from] KeyError),
    /// The body is larger than the route allows.
    #[error("the request body is larger than {limit} bytes")]
    BodyTooLarge {
        /// The route's limit.
        limit: usize,
    },
    /// The body's canonical parse would hold more than the whole memory
    /// budget (a JSON body of very many values): it never fits, so it is
    /// refused rather than told to retry (`docs/design.md` §18).
    #[error(
        "canonicalising this JSON body would hold about {footprint} bytes, more than the \
         whole memory budget ({budget} bytes): send fewer values in one request"
    )]
    TooManyValues {
        /// The parse's estimated footprint.
        footprint: usize,
        /// The budget.
        budget: usize,
    },
    /// The body could not be read.
    #[error("the request body could not be read")]
    BodyUnreadable(#[source] BoxError),
    /// The client paused mid-body past the body-read timeout
    /// (`docs/design.md` §18).
    #[error("{0}; nothing was done: send the request again, whole")]
    BodyTimedOut(BodyTimedOut),
    /// A JSON body the route canonicalises names a member twice.
    #[error(transparent)]
    AmbiguousJson(#[from] AmbiguousJson),
    /// The key was used before with a different request.
    #[error("this Idempotency-Key was already used with a different request (method, path, significant headers or body)")]
    KeyMismatch {
        /// 409 or 422, as configured.
        status: StatusCode,
    },
    /// A duplicate of a running job: held past the hold timeout, or on a
    /// route that answers at once (`in_progress = "conflict"`).
    #[error("a request with this Idempotency-Key is still being processed; retry after the Retry-After delay to get its answer")]
    InProgress {
        /// When to try again.
        retry_after: Duration,
    },
    /// The job's last attempt has an unknown outcome.
    #[error("the outcome of an earlier attempt with this Idempotency-Key is unknown; it must be resolved before the request can be retried")]
    OutcomeUnknown {
        /// When to try again.
        retry_after: Duration,
    },
    /// A JSON-RPC batch holding a keyed `tools/call` (`docs/design.md`
    /// §19): one answer cannot be addressed to several calls.
    #[error(
        "a batch may not hold a keyed tools/call: send each keyed call as a request of its own"
    )]
    KeyedBatch,
    /// A POST to an MCP route that is not JSON in UTF-8 (`docs/design.md`
    /// §19): a keyed tool call in it could not be seen, and would run on
    /// every retry at a server that reads it anyway.
    #[error("an MCP route reads every POST as a JSON-RPC message, JSON in UTF-8 (a Content-Encoding or another charset is not read): send the message so")]
    UnreadableMessage,
    /// A keyed `tools/call` with no `id`, or a null one (`docs/design.md`
    /// §19): an answer could not be addressed to it.
    #[error(
        "a keyed tools/call needs an id (a number or a string) its answer can be addressed to"
    )]
    KeyedCallWithoutId,
    /// A polled job that does not exist, expired, or is another owner's
    /// (`Prefer: respond-async`): the same answer for each.
    #[error("no job of yours is at this place: it never existed, it expired, or it is not yours")]
    NoSuchJob,
    /// A polled job whose attempts failed without effect: nothing runs
    /// for it now, and it has no answer.
    #[error("the job's attempts failed without effect and nothing runs for it now: send the request again with the same Idempotency-Key to run it")]
    NothingRunning,
    /// Who is asking could not be established: no owner for a keyed
    /// request, or no proven client on a route that serves only those.
    #[error(transparent)]
    Unproven(#[from] TrustError),
    /// A resume point that cannot be read (`docs/design.md` §10, "Resume").
    #[error(transparent)]
    BadResumePoint(#[from] BadResumePoint),
    /// A resume point the job's answer does not reach, or a job with no
    /// event stream to resume: nothing was replayed, nothing run.
    #[error("{why}")]
    ResumeUnsatisfiable {
        /// What the client should do instead.
        why: String,
        /// How many events the whole answer has, once it is known.
        events: Option<usize>,
    },
}

impl From<CollectError> for ClientError {
    fn from(e: CollectError) -> Self {
        match e {
            CollectError::TooLarge { limit } => ClientError::BodyTooLarge { limit },
            CollectError::Read(e) => match BodyTimedOut::within(&*e) {
                Some(timed_out) => ClientError::BodyTimedOut(timed_out),
                None => ClientError::BodyUnreadable(e),
            },
            // Not the client's doing: the caller answers it as overload.
            CollectError::OverBudget => {
                ClientError::BodyUnreadable("the memory budget has no room for the body".into())
            }
        }
    }
}

/// Everything that can stop a request, grouped by source.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The client's request.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The upstream.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// The store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The upstream answered, but the store has not taken the answer yet:
    /// the write goes on, and a retry with the key gets the answer.
    #[error("the upstream answered; its answer is not recorded yet")]
    Unrecorded(#[source] StoreError),
    /// The gateway is saturated: too many requests in progress.
    #[error("the gateway has too many requests in progress; retry later")]
    Overloaded {
        /// When to try again.
        retry_after: Duration,
    },
    /// The gateway holds as many bytes for requests as its memory budget
    /// allows (`docs/design.md` §18): a new keyed request is refused before
    /// any job exists.
    #[error("the gateway holds as many request and answer bytes as its memory budget allows; nothing was done: retry later with the same Idempotency-Key")]
    OverBudget {
        /// When to try again.
        retry_after: Duration,
    },
    /// The gateway itself.
    #[error("internal gateway error")]
    Internal(#[source] BoxError),
}

impl From<TrustError> for GatewayError {
    fn from(e: TrustError) -> Self {
        GatewayError::Client(e.into())
    }
}

impl GatewayError {
    /// A defect of the gateway's own, described by `message`.
    pub fn internal(message: impl Into<String>) -> Self {
        GatewayError::Internal(message.into().into())
    }
}

/// A problem answer before it is rendered.
#[derive(Debug)]
struct Problem {
    status: StatusCode,
    slug: &'static str,
    title: &'static str,
    retry_after: Option<Duration>,
}

impl Problem {
    const fn new(status: StatusCode, slug: &'static str, title: &'static str) -> Self {
        Problem {
            status,
            slug,
            title,
            retry_after: None,
        }
    }

    const fn retry_after(self, after: Duration) -> Self {
        Problem {
            retry_after: Some(after),
            ..self
        }
    }
}

impl ClientError {
    /// What the request itself got wrong, else what its job says.
    fn problem(&self) -> Problem {
        let p = Problem::new;
        match self {
            ClientError::AmbiguousPath(_) => p(
                StatusCode::BAD_REQUEST,
                "ambiguous-path",
                "Path that upstreams could read two ways",
            ),
            ClientError::AmbiguousHeader { .. } => p(
                StatusCode::BAD_REQUEST,
                "ambiguous-header",
                "Header that upstreams could read two ways",
            ),
            ClientError::AmbiguousMethod { .. } => p(
                StatusCode::BAD_REQUEST,
                "ambiguous-method",
                "Method that upstreams could read two ways",
            ),
            ClientError::MissingKey => p(
                StatusCode::BAD_REQUEST,
                "idempotency-key-missing",
                "Idempotency-Key missing",
            ),
            ClientError::InvalidKey(_) => p(
                StatusCode::BAD_REQUEST,
                "invalid-idempotency-key",
                "Invalid Idempotency-Key",
            ),
            ClientError::BodyTooLarge { .. } | ClientError::TooManyValues { .. } => p(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request-too-large",
                "Request body too large",
            ),
            ClientError::BodyUnreadable(_) => p(
                StatusCode::BAD_REQUEST,
                "request-body-unreadable",
                "Request body could not be read",
            ),
            ClientError::BodyTimedOut(_) => p(
                StatusCode::REQUEST_TIMEOUT,
                "request-body-timeout",
                "Request body not received in time",
            ),
            ClientError::AmbiguousJson(_) => p(
                StatusCode::BAD_REQUEST,
                "ambiguous-json",
                "JSON body names a member twice",
            ),
            ClientError::KeyedBatch => p(
                StatusCode::BAD_REQUEST,
                "keyed-batch",
                "A JSON-RPC batch holds a keyed tool call",
            ),
            ClientError::KeyedCallWithoutId => p(
                StatusCode::BAD_REQUEST,
                "keyed-call-without-id",
                "A keyed tool call has no id",
            ),
            ClientError::UnreadableMessage => p(
                StatusCode::BAD_REQUEST,
                "unreadable-message",
                "Not a JSON-RPC message in UTF-8",
            ),
            ClientError::BadResumePoint(_) => p(
                StatusCode::BAD_REQUEST,
                "invalid-resume-point",
                "Resume point that cannot be read",
            ),
            // A token that does not verify is answered as one never sent
            // (docs/design.md §15).
            ClientError::Unproven(
                TrustError::OwnerMissing { .. } | TrustError::OwnerUnproven { .. },
            ) => p(
                StatusCode::UNAUTHORIZED,
                "owner-required",
                "Who owns this Idempotency-Key could not be established",
            ),
            ClientError::Unproven(TrustError::OwnerAmbiguous { .. }) => p(
                StatusCode::BAD_REQUEST,
                "owner-ambiguous",
                "Who owns this Idempotency-Key is ambiguous",
            ),
            ClientError::Unproven(TrustError::ClientUnproven { .. }) => p(
                StatusCode::UNAUTHORIZED,
                "client-unauthenticated",
                "This route serves only the gateway's clients",
            ),
            about_the_job => about_the_job.job_problem(),
        }
    }

    /// What the job the request's key names says to it.
    fn job_problem(&self) -> Problem {
        let p = Problem::new;
        match self {
            ClientError::KeyMismatch { status } => p(
                *status,
                "idempotency-key-mismatch",
                "Idempotency-Key reused with a different request",
            ),
            ClientError::InProgress { retry_after } => p(
                StatusCode::CONFLICT,
                "request-in-progress",
                "A request with this Idempotency-Key is in progress",
            )
            .retry_after(*retry_after),
            ClientError::OutcomeUnknown { retry_after } => p(
                StatusCode::CONFLICT,
                "attempt-outcome-unknown",
                "Outcome of an earlier attempt unknown",
            )
            .retry_after(*retry_after),
            ClientError::ResumeUnsatisfiable { .. } => p(
                StatusCode::RANGE_NOT_SATISFIABLE,
                "resume-point-not-satisfiable",
                "Nothing to resume from that point",
            ),
            ClientError::NoSuchJob => p(StatusCode::NOT_FOUND, "job-not-found", "No such job"),
            ClientError::NothingRunning => p(
                StatusCode::CONFLICT,
                "job-not-running",
                "The job has no answer and nothing runs for it",
            ),
            // The request's own mistakes are answered by `problem`.
            _ => INTERNAL,
        }
    }
}

/// The problem an upstream's failure is answered with.
fn upstream_problem(e: &UpstreamError) -> Problem {
    let p = Problem::new;
    match e {
        UpstreamError::Refused(_) => p(
            StatusCode::BAD_GATEWAY,
            "upstream-unreachable",
            "Upstream unreachable; the request was not sent",
        ),
        UpstreamError::Broken(_) => p(
            StatusCode::BAD_GATEWAY,
            "attempt-outcome-unknown",
            "Upstream connection failed after the request was sent; outcome unknown",
        ),
        UpstreamError::Unanswered(_) => p(
            StatusCode::BAD_GATEWAY,
            "attempt-outcome-unknown",
            "Upstream answered without an answer to the call; outcome unknown",
        ),
        UpstreamError::ContractViolation(_) => p(
            StatusCode::BAD_GATEWAY,
            "upstream-contract-violation",
            "Upstream answer broke the route's contract",
        ),
        UpstreamError::TimedOut(_) => p(
            StatusCode::GATEWAY_TIMEOUT,
            "attempt-outcome-unknown",
            "Upstream did not answer in time; outcome unknown",
        ),
        UpstreamError::ResponseTooLarge { .. } => p(
            StatusCode::BAD_GATEWAY,
            "upstream-response-too-large",
            "Upstream response too large to record; outcome unknown",
        ),
        // The answer was not delivered, like a cut one; the client's retry
        // meets the attempt's unknown outcome (docs/design.md §18).
        UpstreamError::OverBudget => p(
            StatusCode::SERVICE_UNAVAILABLE,
            "overloaded",
            "Gateway overloaded: no room in its memory budget for the upstream's answer; outcome unknown",
        )
        .retry_after(Duration::from_secs(1)),
        UpstreamError::Unconfigured(_) => INTERNAL,
    }
}

/// The problem a store failure is answered with.
fn store_problem(e: &StoreError) -> Problem {
    match e.kind() {
        StoreErrorKind::Unavailable => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            "Idempotency store unavailable; the request was not proxied",
        ),
        StoreErrorKind::Conflict | StoreErrorKind::NotFound => Problem::new(
            StatusCode::CONFLICT,
            "request-in-progress",
            "A request with this Idempotency-Key is in progress",
        ),
        StoreErrorKind::Internal => INTERNAL,
    }
}

/// A defect of the gateway's own.
const INTERNAL: Problem = Problem::new(
    StatusCode::INTERNAL_SERVER_ERROR,
    "internal-error",
    "Internal gateway error",
);

impl GatewayError {
    /// Who caused it decides the answer.
    fn problem(&self) -> Problem {
        match self {
            GatewayError::Client(e) => e.problem(),
            GatewayError::Upstream(e) => upstream_problem(e),
            GatewayError::Store(e) => store_problem(e),
            GatewayError::Unrecorded(_) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "outcome-not-recorded",
                "The upstream answered; its answer is being recorded. Retry with the same Idempotency-Key to get it",
            )
            .retry_after(Duration::from_secs(1)),
            GatewayError::Overloaded { retry_after } | GatewayError::OverBudget { retry_after } => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                "Gateway overloaded; nothing was done",
            )
            .retry_after(*retry_after),
            GatewayError::Internal(_) => INTERNAL,
        }
    }

    /// The status the answer for this error has.
    pub fn status(&self) -> StatusCode {
        self.problem().status
    }

    /// A low-cardinality label for metrics.
    pub fn metric_label(&self) -> &'static str {
        self.problem().slug
    }

    /// The problem+json answer for this error.
    pub fn into_response(self) -> Response<Body> {
        let problem = self.problem();
        let mut members = Map::new();
        if let Some(section) = draft_section(problem.slug) {
            members.insert("spec".into(), format!("{DRAFT}#section-{section}").into());
        }
        if let GatewayError::Client(ClientError::ResumeUnsatisfiable {
            events: Some(n), ..
        }) = &self
        {
            members.insert("events".into(), (*n).into());
        }
        let unwinnable = self.unwinnable();
        let mut response = problem_response_with(
            problem.status,
            problem.slug,
            problem.title,
            &self.to_string(),
            problem.retry_after,
            members,
        );
        if unwinnable {
            response
                .headers_mut()
                .insert(SHOULD_RETRY, HeaderValue::from_static("false"));
        }
        response
    }

    /// Whether sending the same request again can never succeed: the key
    /// is already another request's, malformed or missing, or the caller is
    /// not who it must be. The official OpenAI and Anthropic SDKs retry a
    /// `409` on their own unless told not to (`x-should-retry: false`).
    fn unwinnable(&self) -> bool {
        let problem = self.problem();
        problem.status == StatusCode::UNAUTHORIZED
            || matches!(
                self,
                GatewayError::Client(
                    ClientError::KeyMismatch { .. }
                        | ClientError::InvalidKey(_)
                        | ClientError::MissingKey
                )
            )
    }

    /// Whether an MCP client is told this as a JSON-RPC error of the tool
    /// call it made: what its key met (a mismatch, a call in progress, an
    /// unknown outcome), a key missing or malformed, or how its own call
    /// went upstream (silent past the timeout: unknown; refused; broken).
    /// Who is asking, the body and the gateway's own state stay HTTP
    /// answers (an MCP client answers a `401` by authorising, for one).
    pub fn is_the_calls(&self) -> bool {
        matches!(
            self,
            GatewayError::Upstream(_)
                | GatewayError::Client(
                    ClientError::KeyMismatch { .. }
                        | ClientError::InProgress { .. }
                        | ClientError::OutcomeUnknown { .. }
                        | ClientError::MissingKey
                        | ClientError::InvalidKey(_)
                )
        )
    }

    /// The JSON-RPC error response to the request `id` (HTTP `200`, as
    /// MCP carries errors; `docs/design.md` §19): the problem's title as its
    /// message, the problem document as its `data`.
    pub fn into_jsonrpc(self, id: &[u8]) -> Response<Body> {
        let problem = self.problem();
        let document = serde_json::json!({
            "type": format!("{PROBLEM_BASE}{}", problem.slug),
            "title": problem.title,
            "status": problem.status.as_u16(),
            "detail": self.to_string(),
        });
        let error =
            serde_json::json!({ "code": -32000, "message": problem.title, "data": document });
        let id = String::from_utf8_lossy(id);
        let body = format!("{{\"jsonrpc\":\"2.0\",\"id\":{id},\"error\":{error}}}");
        let mut response = Response::new(full(body));
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        if let Some(after) = problem.retry_after {
            let seconds = after.as_secs_f64().ceil().max(1.0) as u64;
            response
                .headers_mut()
                .insert(http::header::RETRY_AFTER, http::HeaderValue::from(seconds));
        }
        response.extensions_mut().insert(Outcome::Problem);
        response
    }
}

/// Every problem type a refusal is counted by
/// (`idemgate_requests_refused_total{problem}`), each set at zero when the
/// layer starts, so that a rate over a type reads 0 before its first
/// (`docs/design.md` §12, "Metrics"). The test below keeps it whole.
const PROBLEM_TYPES: [&str; 29] = [
    "ambiguous-header",
    "ambiguous-json",
    "ambiguous-method",
    "ambiguous-path",
    "attempt-outcome-unknown",
    "client-unauthenticated",
    "idempotency-key-mismatch",
    "idempotency-key-missing",
    "internal-error",
    "invalid-idempotency-key",
    "invalid-resume-point",
    "job-not-found",
    "job-not-running",
    "keyed-batch",
    "keyed-call-without-id",
    "outcome-not-recorded",
    "overloaded",
    "owner-ambiguous",
    "owner-required",
    "request-body-timeout",
    "request-body-unreadable",
    "request-in-progress",
    "request-too-large",
    "resume-point-not-satisfiable",
    "store-unavailable",
    "unreadable-message",
    "upstream-contract-violation",
    "upstream-response-too-large",
    "upstream-unreachable",
];

/// Sets `idemgate_requests_refused_total` at zero for every problem type.
pub(crate) fn zero_refusals() {
    for problem in PROBLEM_TYPES {
        metrics::counter!("idemgate_requests_refused_total", "problem" => problem).increment(0);
    }
}

#[cfg(test)]
mod problem_types {
    /// Every slug given to a `Problem` above (the line after its status)
    /// is listed in `PROBLEM_TYPES`, and nothing else is.
    #[test]
    fn every_problem_type_is_set_at_zero() {
        let text = include_str!("error.rs");
        let text = &text[..text.find("const PROBLEM_TYPES").unwrap()];
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        // The status is a `StatusCode`, or a key mismatch's own `*status`.
        let status = |l: &str| l.starts_with("StatusCode::") || l == "*status,";
        let mut slugs: Vec<&str> = lines
            .windows(2)
            .filter(|w| status(w[0]) && w[1].starts_with('"'))
            .map(|w| w[1].trim_end_matches(',').trim_matches('"'))
            .collect();
        // One on a line of its own: `p(StatusCode::X, "slug", "title")`.
        slugs.extend(
            lines
                .iter()
                .filter(|l| l.contains("p(StatusCode::") && l.contains('"'))
                .filter_map(|l| l.split('"').nth(1)),
        );
        slugs.sort_unstable();
        slugs.dedup();
        assert_eq!(slugs, super::PROBLEM_TYPES);
    }
}
