//! What an upstream's answer means for its attempt, decided from the answer
//! alone (pure, `docs/design.md` §3): refused before sending → `failed`;
//! broken after sending, or too large to record → `unknown`; a retryable
//! status → `failed`, handed back uncommitted; a 2xx that breaks the route's
//! contract → `rejected` on a `side_effect_free` route, `unknown` on any
//! other; anything else → commit. On an MCP route, what the
//! answer says of the tool call comes first (`docs/design.md` §19, "What an
//! answer means").

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
    /// Provably no effect (refused, retryable status, contract broken on
    /// a side-effect-free route).
    Fail(AttemptFailure, Uncommitted),
    /// It may have acted; nobody can tell how.
    Unknown(AttemptFailure, GatewayError),
}

/// Decides what an upstream's answer (or failure) means for its attempt;
/// `call` is the JSON-RPC `id` of the tool call it answers, on an MCP route.
pub(super) fn classify(
    result: Result<Fetched, UpstreamError>,
    route: &Route,
    call: Option<&[u8]>,
) -> Verdict {
    classify_reporting(result, route, call).0
}

/// [`classify`], and the error an event stream read whole reported in
/// band (its type, and whether the route retries it), for the attempt to
/// count as it counts a streamed one's.
pub(super) fn classify_reporting(
    result: Result<Fetched, UpstreamError>,
    route: &Route,
    call: Option<&[u8]>,
) -> (Verdict, Option<InBand>) {
    let fetched = match result {
        Ok(fetched) => fetched,
        Err(error) => {
            let detail = Chain(&error).to_string();
            let verdict = match error.kind() {
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
            return (verdict, None);
        }
    };
    let status = fetched.parts.status.as_u16();
    // An informational status is no answer (hyper reads `100` and `103`
    // past): a `101` switched the connection to a protocol the gateway
    // never asked for (it forwards no `Upgrade`), so what the upstream did
    // is unknown, and committed it would switch every replay's connection.
    if fetched.parts.status.is_informational() {
        let detail = format!("upstream answered {status}, which is no final answer");
        let failure = AttemptFailure::Unknown {
            detail: detail.clone(),
        };
        let error = UpstreamError::Unanswered(detail);
        return (Verdict::Unknown(failure, error.into()), None);
    }
    if route.retryable_statuses.contains(&status) {
        let failure = AttemptFailure::Failed {
            status: Some(status),
            detail: format!("upstream answered {status}, configured as retryable"),
        };
        let response = Response::from_parts(fetched.parts, full(fetched.body));
        return (
            Verdict::Fail(failure, Uncommitted::Response(response)),
            None,
        );
    }
    let to_call = to_the_call(route, call, status, &fetched.parts.headers, &fetched.body);
    let retryable_code = match &to_call {
        Some(ToCall::Refused) => {
            let failure = AttemptFailure::Failed {
                status: Some(status),
                detail: format!(
                    "the MCP server refused the message before dispatching it: {status} without \
                     a response to the call"
                ),
            };
            let response = Response::from_parts(fetched.parts, full(fetched.body));
            return (
                Verdict::Fail(failure, Uncommitted::Response(response)),
                None,
            );
        }
        Some(ToCall::Unanswered(why)) => {
            let detail = format!("{why} (answered {status}): the tool may have run");
            let failure = AttemptFailure::Unknown {
                detail: detail.clone(),
            };
            return (
                Verdict::Unknown(failure, UpstreamError::Unanswered(detail).into()),
                None,
            );
        }
        Some(ToCall::Answered(jsonrpc::Answer::Error(Some(code)))) => {
            rpc_code_retryable(route, *code).then_some(*code)
        }
        Some(ToCall::Answered(_)) => None,
        // Not read: its code, if any, as before.
        None => retryable_rpc_error(route, &fetched.body),
    };
    if let Some(code) = retryable_code {
        let failure = AttemptFailure::Failed {
            status: Some(status),
            detail: format!(
                "the tool call was answered JSON-RPC error {code}, configured as retryable \
                 (retryable_rpc_codes)"
            ),
        };
        let response = Response::from_parts(fetched.parts, full(fetched.body));
        return (
            Verdict::Fail(failure, Uncommitted::Response(response)),
            None,
        );
    }
    // An event stream read whole (its head came after the attempt went
    // unknown, or it answers a resend) is judged as a stream all the same.
    if route.streams(&fetched.parts.headers) {
        return whole_stream(replay::capture(&fetched), fetched, route, call);
    }
    if let Some(contract) = route
        .contract
        .as_ref()
        .filter(|_| fetched.parts.status.is_success())
    {
        if let Err(why) = contract.check(&fetched.body) {
            let detail = format!(
                "broke contract {}: {why}; answer: {}",
                contract.name,
                excerpt(&fetched.body)
            );
            let error = GatewayError::from(UpstreamError::ContractViolation(why));
            let verdict = match breach(route, status, detail) {
                failure @ AttemptFailure::Rejected { .. } => {
                    Verdict::Fail(failure, Uncommitted::Error(error))
                }
                failure => Verdict::Unknown(failure, error),
            };
            return (verdict, None);
        }
    }
    (Verdict::Commit(replay::capture(&fetched)), None)
}

/// What a `2xx` that broke the route's contract means for its attempt
/// (`docs/design.md` §6): a safe failure (`rejected`: failed over, and the
/// job reopened for a retry) only on a route whose requests have no
/// effect but their answer (`side_effect_free`). On any other, the
/// upstream said it succeeded, so it may have acted: the outcome is
/// unknown, never failed over nor run again on a retry until evidence or
/// an operator settles it.
fn breach(route: &Route, status: u16, detail: String) -> AttemptFailure {
    let (outcome, failure) = match route.side_effect_free {
        true => ("rejected", AttemptFailure::Rejected { status, detail }),
        false => (
            "unknown",
            AttemptFailure::Unknown {
                detail: format!(
                    "{detail}; the {status} says the upstream acted, and the route is not \
                     side_effect_free: outcome unknown"
                ),
            },
        ),
    };
    // Counted here, whatever it becomes: an operator sees every breach,
    // and those on routes with effects each wait for a decision.
    metrics::counter!("idemgate_attempts_rejected_total", "outcome" => outcome).increment(1);
    failure
}

/// What a whole event stream means for its attempt, streamed or read
/// whole (`docs/design.md` §10, "In-band errors and whole streams"): what
/// it says of itself ([`ended`]), then the contract's `events`.
#[derive(Debug)]
pub(super) struct Judged {
    pub(super) outcome: StreamOutcome,
    /// The in-band error it reported.
    pub(super) error: Option<InBand>,
}

/// An error a stream reported in band.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct InBand {
    /// Its type (the upstream's text).
    pub(super) kind: String,
    /// Whether the route retries it.
    pub(super) retryable: bool,
    /// Whether it came after a tool the provider ran, which keeps a type
    /// the route lists from being retried.
    pub(super) after_a_tool: bool,
}

/// The outcome of a [`Judged`] stream.
#[derive(Debug)]
pub(super) enum StreamOutcome {
    /// Commit it.
    Commit,
    /// No effect (a retryable in-band error, a server's refusal): nothing
    /// committed, the job reopens.
    NoEffect(AttemptFailure),
    /// It may have acted, and holds no answer to keep: cut.
    Unknown(String),
    /// It broke the contract's events (`why`) on a side-effect-free route:
    /// a safe failure, cut.
    Rejected(AttemptFailure, String),
}

/// Judges `stored`, a whole event stream of `route`; `call` is the `id`
/// of the MCP tool call it answers.
pub(super) fn judge_stream(route: &Route, stored: &StoredResponse, call: Option<&[u8]>) -> Judged {
    let status = stored.status;
    let (outcome, error) = match ended(route, stored, call) {
        Ended::Whole => (None, None),
        Ended::Error(error) => {
            let InBand { kind, .. } = &error;
            let outcome = error.retryable.then(|| {
                StreamOutcome::NoEffect(AttemptFailure::Failed {
                    status: Some(status),
                    detail: format!(
                        "the stream reported {kind} in band after its {status} head: a type the \
                         route retries ([routes.stream_errors]); nothing committed"
                    ),
                })
            });
            // Any other is the upstream's own verdict, like a `4xx`: never
            // checked against the contract.
            (Some(outcome.unwrap_or(StreamOutcome::Commit)), Some(error))
        }
        Ended::Unknown(detail) => (Some(StreamOutcome::Unknown(detail)), None),
        Ended::Refused(detail) => {
            let failure = AttemptFailure::Failed {
                status: Some(status),
                detail,
            };
            (Some(StreamOutcome::NoEffect(failure)), None)
        }
    };
    let outcome = outcome.unwrap_or_else(|| {
        let broken = route
            .contract
            .as_ref()
            .and_then(|c| Some((c, c.check_stream(&stored.body)?.err()?)));
        match broken {
            Some((contract, why)) => {
                let detail = format!(
                    "broke contract {}: {why}; answer: {}",
                    contract.name,
                    excerpt(&stored.body)
                );
                match breach(route, status, detail) {
                    failure @ AttemptFailure::Rejected { .. } => {
                        StreamOutcome::Rejected(failure, why)
                    }
                    failure => StreamOutcome::Unknown(failure.detail().to_owned()),
                }
            }
            None => StreamOutcome::Commit,
        }
    });
    Judged { outcome, error }
}

/// An event stream the route streams, read whole rather than streamed: a
/// late head's, a resend's ([`judge_stream`], as a streamed one is).
fn whole_stream(
    stored: StoredResponse,
    fetched: Fetched,
    route: &Route,
    call: Option<&[u8]>,
) -> (Verdict, Option<InBand>) {
    let judged = judge_stream(route, &stored, call);
    let verdict = match judged.outcome {
        StreamOutcome::Commit => Verdict::Commit(stored),
        StreamOutcome::NoEffect(failure) => {
            let response = Response::from_parts(fetched.parts, full(fetched.body));
            Verdict::Fail(failure, Uncommitted::Response(response))
        }
        StreamOutcome::Unknown(detail) => {
            let error = UpstreamError::Broken(detail.clone().into());
            Verdict::Unknown(AttemptFailure::Unknown { detail }, error.into())
        }
        StreamOutcome::Rejected(failure, why) => {
            let error = UpstreamError::ContractViolation(why);
            Verdict::Fail(failure, Uncommitted::Error(error.into()))
        }
    };
    (verdict, judged.error)
}

/// What an MCP server's answer says of a keyed tool call.
#[derive(Debug, PartialEq, Eq)]
enum ToCall {
    /// It carries the call's response: the answer, unless its error's code
    /// is one the route retries.
    Answered(jsonrpc::Answer),
    /// It carries none, and its status is a `4xx`: the server refused the
    /// message before dispatching it (a session it does not know, as after
    /// a restart; a session id missing; a protocol version it does not
    /// speak; the transport's rule: "the HTTP response body MAY comprise a
    /// JSON-RPC error response that has no `id`"). The tool never ran.
    Refused,
    /// It carries no answer to keep, yet the call was dispatched: no
    /// response to it (a `500` with `"id": null` when its session was
    /// ended under it, a stream that ended first), or `-32800`, the server
    /// cancelling its handler mid-run as the client asked. The tool may
    /// have run: unknown, and never run again by a retry.
    Unanswered(&'static str),
}

/// What `body`, an MCP server's answer with `status` and `headers`, says of
/// the tool call whose `id` is `call` (`docs/design.md` §19, "What an
/// answer means"). `None` on another route, and for an answer that cannot
/// be read (compressed): it is judged by its status, as any answer.
fn to_the_call(
    route: &Route,
    call: Option<&[u8]>,
    status: u16,
    headers: &http::HeaderMap,
    body: &[u8],
) -> Option<ToCall> {
    let encoded = headers
        .get(http::header::CONTENT_ENCODING)
        .is_some_and(|e| !e.as_bytes().trim_ascii().eq_ignore_ascii_case(b"identity"));
    if encoded {
        return None;
    }
    let stream = headers.get(http::header::CONTENT_TYPE).is_some_and(|t| {
        let t = t.as_bytes();
        t.len() >= 17 && t[..17].eq_ignore_ascii_case(b"text/event-stream")
    });
    says(route, call, status, body, stream)
}

/// Whether `stored`, an MCP tool call's event stream so far, carries no
/// response to the call `call` (yet).
pub(super) fn unanswered(route: &Route, stored: &StoredResponse, call: Option<&[u8]>) -> bool {
    let said = says(route, call, stored.status, &stored.body, true);
    matches!(said, Some(ToCall::Unanswered(_)))
}

/// [`to_the_call`] of a readable answer, `stream` if an event stream.
fn says(
    route: &Route,
    call: Option<&[u8]>,
    status: u16,
    body: &[u8],
    stream: bool,
) -> Option<ToCall> {
    let (Protocol::Mcp(_), Some(call)) = (&route.protocol, call) else {
        return None;
    };
    Some(match jsonrpc::answer_to(body, call, stream) {
        Some(jsonrpc::Answer::Error(Some(jsonrpc::CANCELLED))) => ToCall::Unanswered(
            "the MCP server cancelled the call mid-run (-32800, as its client asked)",
        ),
        Some(answer) => ToCall::Answered(answer),
        None if (400..500).contains(&status) => ToCall::Refused,
        None => ToCall::Unanswered("the MCP server's answer carries no response to the call"),
    })
}

/// The code of a JSON-RPC error answer that had no effect on an MCP route
/// (one of its `retryable_rpc_codes`, `docs/design.md` §19): not
/// committed, like a retryable status. Any other error answer is the
/// tool call's answer.
fn retryable_rpc_error(route: &Route, message: &[u8]) -> Option<i64> {
    let code = jsonrpc::error_code(message)?;
    rpc_code_retryable(route, code).then_some(code)
}

/// Whether `code` is one of an MCP route's retryable JSON-RPC codes.
fn rpc_code_retryable(route: &Route, code: i64) -> bool {
    match &route.protocol {
        Protocol::Mcp(mcp) => mcp.retryable_codes.contains(&code),
        Protocol::Http => false,
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
    Error(InBand),
    /// It carries no answer to keep, though it may have acted: it
    /// stopped short (none of the route's end events came last), or, on
    /// an MCP route, it holds no response to the call, or `-32800` (why).
    /// Cut, as a reset is: its outcome is unknown.
    Unknown(String),
    /// On an MCP route, a `4xx` stream without a response to the call: the
    /// server refused the message before dispatching it (why). No effect:
    /// nothing is committed, the job reopens.
    Refused(String),
}

/// What `stored`, a whole streamed answer of `route`, means; `call` is the
/// `id` of the tool call it answers, on an MCP route (`docs/design.md`
/// §19, "What an answer means": only the call's response is its answer).
pub(super) fn ended(route: &Route, stored: &StoredResponse, call: Option<&[u8]>) -> Ended {
    if !crate::recording::is_event_stream(&stored.headers) {
        // An event stream its upstream encoded though it was asked for it
        // uncompressed: where the route names its end events, none can be
        // read, so its end is not known (docs/design.md §10).
        let typed = stored
            .headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-type"));
        let events = idemgate_domain::sse::is_event_stream(typed.map(|(_, v)| &v[..]), None);
        if events && !route.stream_end_events.is_empty() {
            return Ended::Unknown(
                "the stream came encoded (Content-Encoding), though asked for uncompressed: the \
                 route's end events (stream_end_events) cannot be read in it"
                    .to_owned(),
            );
        }
        return Ended::Whole;
    }
    let errors = &route.stream_errors;
    let status = stored.status;
    match says(route, call, status, &stored.body, true) {
        Some(ToCall::Answered(jsonrpc::Answer::Result)) => return Ended::Whole,
        // Its code is its type.
        Some(ToCall::Answered(jsonrpc::Answer::Error(code))) => {
            let kind = code.map_or_else(|| "unknown".to_owned(), |c| c.to_string());
            return Ended::Error(InBand {
                retryable: errors.is_retryable(&kind)
                    || code.is_some_and(|c| rpc_code_retryable(route, c)),
                kind,
                after_a_tool: false,
            });
        }
        Some(ToCall::Refused) => {
            return Ended::Refused(format!(
                "the MCP server refused the message before dispatching it: {status} without a \
                 response to the call"
            ))
        }
        Some(ToCall::Unanswered(why)) => {
            return Ended::Unknown(format!(
                "{why}; the stream ended (answered {status}): the tool may have run"
            ))
        }
        None => {}
    }
    match said(&stored.body, errors.enabled, &route.stream_end_events) {
        Said::Whole => Ended::Whole,
        Said::Unended => Ended::Unknown(
            "the stream ended without one of the route's end events (stream_end_events): it \
             stopped short"
                .to_owned(),
        ),
        // After a tool the provider ran on the call's behalf (a remote MCP
        // server's, a web search), running the call again would run the
        // tool again: whatever its type, the error is the answer, unless
        // the operator says the route has no effects to repeat
        // (docs/design.md §10, "A tool the provider ran").
        Said::Error { kind, after_a_tool } => Ended::Error(InBand {
            retryable: (!after_a_tool || route.side_effect_free)
                && (errors.is_retryable(&kind)
                    || kind.parse().is_ok_and(|c| rpc_code_retryable(route, c))),
            kind,
            after_a_tool,
        }),
    }
}

#[cfg(test)]
mod tests;
