//! What an upstream's answer means for its attempt, decided from the answer
//! alone (pure, `docs/design.md` §3): refused before sending → `failed`;
//! broken after sending, or too large to record → `unknown`; a retryable
//! status → `failed`, handed back uncommitted; a 2xx that breaks the route's
//! contract → `rejected`; anything else → commit.

use http::Response;

use super::Uncommitted;
use crate::error::GatewayError;
use crate::replay;
use crate::route::{Protocol, Route};
use idemgate_domain::attempt::AttemptFailure;
use idemgate_domain::contract::excerpt;
use idemgate_domain::jsonrpc;
use idemgate_domain::response::StoredResponse;
use idemgate_domain::sse::verdict::{said, Said};
use idemgate_proxy::http::full;
use idemgate_proxy::upstream::{Fetched, UpstreamError, UpstreamErrorKind};
use idemgate_telemetry::Chain;

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
    if let Some(code) = retryable_rpc_error(route, &fetched.body) {
        let failure = AttemptFailure::Failed {
            status: Some(status),
            detail: format!(
                "the tool call was answered JSON-RPC error {code}, configured as retryable \
                 (retryable_rpc_codes)"
            ),
        };
        let response = Response::from_parts(fetched.parts, full(fetched.body));
        return Verdict::Fail(failure, Uncommitted::Response(response));
    }
    // An event stream read whole (its head came after the attempt went
    // unknown, or it answers a resend) is judged as a stream all the same.
    if route.streams(&fetched.parts.headers) {
        return whole_stream(replay::capture(&fetched), fetched, route);
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

/// What an event stream the route streams means when it was read whole
/// rather than streamed (`docs/design.md` §10, "In-band errors and whole
/// streams"): as a streamed one's end would ([`ended`]), then checked by
/// the contract's `events`, never as one JSON document.
fn whole_stream(stored: StoredResponse, fetched: Fetched, route: &Route) -> Verdict {
    let status = stored.status;
    match ended(route, &stored) {
        Ended::Whole => {}
        Ended::Error {
            kind,
            retryable: true,
        } => {
            let failure = AttemptFailure::Failed {
                status: Some(status),
                detail: format!(
                    "the stream reported {kind} in band after its {status} head: a type the \
                     route retries ([routes.stream_errors]); nothing committed"
                ),
            };
            let response = Response::from_parts(fetched.parts, full(fetched.body));
            return Verdict::Fail(failure, Uncommitted::Response(response));
        }
        // The upstream's own verdict, like a `4xx`: never checked against
        // the contract.
        Ended::Error { .. } => return Verdict::Commit(stored),
        Ended::Unended => {
            let detail = "the stream ended without one of the route's end events \
                          (stream_end_events): it stopped short";
            let error = UpstreamError::Broken(detail.into());
            let failure = AttemptFailure::Unknown {
                detail: detail.to_owned(),
            };
            return Verdict::Unknown(failure, error.into());
        }
    }
    let contract = route
        .contract
        .as_ref()
        .filter(|_| (200..300).contains(&status));
    if let Some((contract, Some(Err(why)))) = contract.map(|c| (c, c.check_stream(&stored.body))) {
        let failure = AttemptFailure::Rejected {
            status,
            detail: format!(
                "broke contract {}: {why}; answer: {}",
                contract.name,
                excerpt(&stored.body)
            ),
        };
        let error = UpstreamError::ContractViolation(why);
        return Verdict::Fail(failure, Uncommitted::Error(error.into()));
    }
    Verdict::Commit(stored)
}

/// The code of a JSON-RPC error answer that had no effect on an MCP route
/// (one of its `retryable_rpc_codes`, `docs/design.md` §19): not
/// committed, like a retryable status. Any other error answer is the
/// tool call's answer.
fn retryable_rpc_error(route: &Route, message: &[u8]) -> Option<i64> {
    let Protocol::Mcp(mcp) = &route.protocol else {
        return None;
    };
    let code = jsonrpc::error_code(message)?;
    mcp.retryable_codes.contains(&code).then_some(code)
}

/// Whether `kind`, an in-band error's type, is one of an MCP route's
/// retryable JSON-RPC codes.
fn rpc_code_retryable(route: &Route, kind: &str) -> bool {
    match (&route.protocol, kind.parse::<i64>()) {
        (Protocol::Mcp(mcp), Ok(code)) => mcp.retryable_codes.contains(&code),
        _ => false,
    }
}

/// What a streamed answer that ended cleanly means, beyond its status
/// (`docs/design.md` §10, "In-band errors and whole streams"). Only an
/// event stream says more than its bytes.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Ended {
    /// Nothing against it: checked against the contract, then committed.
    Whole,
    /// It reported an error in band after its head: a type the route
    /// retries had no effect (nothing is committed, the job reopens); any
    /// other is the answer, committed as the upstream's own verdict (like
    /// a `400`, never checked against the contract).
    Error {
        /// The error's type (`/error/type`, else `/error/code`).
        kind: String,
        /// Whether the route retries it.
        retryable: bool,
    },
    /// It stopped short: none of the route's end events came last. Cut,
    /// as a reset is: its outcome is unknown.
    Unended,
}

/// What `stored`, a whole streamed answer of `route`, means.
pub(super) fn ended(route: &Route, stored: &StoredResponse) -> Ended {
    if !crate::recording::is_event_stream(&stored.headers) {
        return Ended::Whole;
    }
    let errors = &route.stream_errors;
    match said(&stored.body, errors.enabled, &route.stream_end_events) {
        Said::Whole => Ended::Whole,
        Said::Unended => Ended::Unended,
        // An MCP server's JSON-RPC error answer in a stream is one too:
        // its code is its type.
        Said::Error(kind) => Ended::Error {
            retryable: errors.is_retryable(&kind) || rpc_code_retryable(route, &kind),
            kind,
        },
    }
}

#[cfg(test)]
mod tests;
