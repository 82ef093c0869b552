//! The admin API's JSON: jobs (whole, or summed up for listings), their
//! attempts and stored responses, upstreams with their probe verdicts.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use base64::Engine;
use http::{header, HeaderValue, Response, StatusCode};
use serde_json::{json, Value};

use super::Reconciling;
use idemgate_domain::attempt::{Attempt, AttemptState};
use idemgate_domain::job::JobDetail;
use idemgate_domain::reconcile::{self, Lookups};
use idemgate_domain::response::StoredResponse;
use idemgate_proxy::http::{full, Body};
use idemgate_proxy::upstream::UpstreamSettings;
use idemgate_upkeep::probe::{Failure, Standing, Verdict};

/// A JSON answer.
pub(super) fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    let mut response = Response::new(full(value.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// A job with its attempts and its response; `reconciling` says what
/// becomes of its unknown attempts' lookups.
pub(super) fn job(detail: &JobDetail, reconciling: &Reconciling) -> Value {
    let job = &detail.job;
    let now = SystemTime::now();
    let attempts: Vec<Value> = detail
        .attempts
        .iter()
        .map(|a| attempt(a, schedule(&job.route, a, reconciling, now)))
        .collect();
    json!({
        "id": job.id.to_string(),
        "owner": job.owner.as_str(),
        "key": job.key.as_str(),
        "fingerprint": job.fingerprint.to_string(),
        "route": job.route,
        "state": job.state.as_str(),
        "version": job.version,
        "attempt_count": job.attempt_count,
        "completed_by": job.completed_by.map(|a| a.to_string()),
        "created_at": time(job.created_at),
        "expires_at": time(job.expires_at),
        "response": job.response.as_ref().map(response),
        "attempts": attempts,
    })
}

/// A job without its response, for listings: its unknown attempts (id,
/// upstream, start) are what an operator acts on.
pub(super) fn job_summary(detail: &JobDetail) -> Value {
    let job = &detail.job;
    let unknown: Vec<Value> = detail
        .attempts
        .iter()
        .filter(|a| a.state == AttemptState::Unknown)
        .map(|a| {
            json!({
                "id": a.id.to_string(),
                "number": a.number,
                "upstream": a.upstream,
                "started_at": time(a.started_at),
            })
        })
        .collect();
    json!({
        "id": job.id.to_string(),
        "owner": job.owner.as_str(),
        "key": job.key.as_str(),
        "route": job.route,
        "state": job.state.as_str(),
        "attempt_count": job.attempt_count,
        "created_at": time(job.created_at),
        "expires_at": time(job.expires_at),
        "unknown_attempts": unknown,
    })
}

/// An attempt. Its `upstream_status` is only ever the upstream's; an
/// operator's answer is `resolved_by`'s (who, when) and the job's response.
fn attempt(a: &Attempt, schedule: Schedule) -> Value {
    json!({
        "id": a.id.to_string(),
        "number": a.number,
        "upstream": a.upstream,
        "state": a.state.as_str(),
        "job_version": a.job_version,
        "started_at": time(a.started_at),
        "finished_at": a.finished_at.map(time),
        "lease_expires_at": time(a.lease_expires_at),
        "upstream_status": a.upstream_status,
        "detail": a.detail,
        "resolved_by": a.resolved_by.as_ref().map(|r| json!({
            "operator": r.operator,
            "at": time(r.at),
        })),
        "lookups": lookups(&a.lookups, schedule),
    })
}

/// Where an attempt's lookups stand: the next one due, or why none
/// follows.
enum Schedule {
    /// The next lookup is due then (overdue when past: nobody asks now,
    /// and a replica's scan adopts it).
    Next(SystemTime),
    /// None follows, for this reason.
    Stopped(String),
    /// Nothing to say: the attempt was never unknown on a route that looks
    /// up.
    None,
}

/// What follows an attempt's lookups on `route` (`docs/design.md` §5):
/// the backoff's next one while it is unknown and within its deadline.
fn schedule(route: &str, a: &Attempt, reconciling: &Reconciling, now: SystemTime) -> Schedule {
    let Some(how) = reconciling.routes.get(route) else {
        return match a.state {
            AttemptState::Unknown => Schedule::Stopped(format!(
                "route {route} does not look attempts up (no `reconcile`): only an operator settles it"
            )),
            _ => Schedule::None,
        };
    };
    if a.state != AttemptState::Unknown {
        return match a.lookups.count {
            0 => Schedule::None,
            _ => Schedule::Stopped(format!("the attempt is {}", a.state)),
        };
    }
    let deadline = reconciling.deadline;
    let at = (a.started_at, a.deadline_at);
    match reconcile::next_ask(&a.lookups, at, (deadline, *how == "lookup"), now) {
        Some(wait) => Schedule::Next(now + wait),
        None => Schedule::Stopped(format!(
            "its deadline passed at {} (attempt_deadline, {} s after it started) with no {how} settling it: only an operator settles it now",
            time(a.started_at + deadline),
            deadline.as_secs()
        )),
    }
}

/// The lookups made to reconcile an attempt (`docs/design.md` §5): how
/// many, the last one, and when the next is or why none follows.
fn lookups(l: &Lookups, schedule: Schedule) -> Value {
    let (next, stopped) = match schedule {
        Schedule::Next(at) => (Some(time(at)), None),
        Schedule::Stopped(why) => (None, Some(why)),
        Schedule::None => (None, None),
    };
    json!({
        "count": l.count,
        "last": l.last.as_ref().map(|last| json!({
            "at": time(last.at),
            "status": last.status,
            "result": last.result.as_str(),
        })),
        "next_at": next,
        "stopped": stopped,
    })
}

/// Stored header values the admin API does not show: what would let its
/// reader act as the caller. A cookie the upstream set is replayed to its
/// owner only; the MCP session a tool call ran in is kept only to tell a
/// retry in that same session (`docs/design.md` §19, "The answer"), and
/// whoever holds it may post in that session at its server.
const REDACTED: [&str; 2] = ["set-cookie", "mcp-session-id"];

/// A stored response: its body as text when it is UTF-8, else base64; the
/// values of [`REDACTED`] headers shown as `[redacted]`.
fn response(r: &StoredResponse) -> Value {
    let headers: Vec<Value> = r
        .headers
        .iter()
        .map(
            |(n, v)| match REDACTED.iter().any(|r| n.eq_ignore_ascii_case(r)) {
                true => json!([n, "[redacted]"]),
                false => json!([n, String::from_utf8_lossy(v)]),
            },
        )
        .collect();
    let mut out = json!({"status": r.status, "headers": headers});
    match std::str::from_utf8(&r.body) {
        Ok(text) => out["body"] = json!(text),
        Err(_) => {
            out["body_base64"] = json!(base64::engine::general_purpose::STANDARD.encode(&r.body))
        }
    }
    out
}

/// Every upstream, with its standing under each contract it is probed for
/// (`standings` by upstream name and contract).
pub(super) fn upstreams(
    upstreams: &[Arc<UpstreamSettings>],
    standings: &BTreeMap<(String, String), Standing>,
) -> Value {
    let list: Vec<Value> = upstreams
        .iter()
        .map(|u| {
            let contracts: Vec<Value> = standings
                .iter()
                .filter(|((name, _), _)| name == u.name())
                .map(|((_, contract), s)| standing(contract, s))
                .collect();
            json!({"name": u.name(), "url": u.base.to_string(), "contracts": contracts})
        })
        .collect();
    json!({ "upstreams": list })
}

/// Eligibility, the last verdict (`passed`, `result`, `checked_at`,
/// `failures`, as before verdicts were kept) and the last verdicts, newest
/// first.
fn standing(contract: &str, s: &Standing) -> Value {
    let mut out = json!({
        "contract": contract,
        "eligible": s.eligible,
        "needed": s.needed,
        "passes_in_a_row": s.passes_in_a_row,
        "history": s.history.iter().rev().map(verdict).collect::<Vec<_>>(),
    });
    if let Some(last) = s.last() {
        out["passed"] = json!(last.passed());
        if let Value::Object(fields) = verdict(last) {
            for (k, v) in fields {
                out[k] = v;
            }
        }
    }
    out
}

fn verdict(v: &Verdict) -> Value {
    json!({
        "result": v.result,
        "checked_at": time(v.checked_at),
        "failures": v.failures.iter().map(failure).collect::<Vec<_>>(),
    })
}

fn failure(f: &Failure) -> Value {
    json!({"probe": f.probe, "result": f.result, "why": f.why})
}

/// RFC 3339, to the millisecond.
fn time(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}
