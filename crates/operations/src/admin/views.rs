//! The admin API's JSON: jobs (whole, or summed up for listings), their
//! attempts and stored responses, upstreams with their probe verdicts.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use base64::Engine;
use http::{header, HeaderValue, Response, StatusCode};
use serde_json::{json, Value};

use idemgate_domain::attempt::Attempt;
use idemgate_domain::job::{Job, JobDetail};
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

/// A job with its attempts and its response.
pub(super) fn job(detail: &JobDetail) -> Value {
    let job = &detail.job;
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
        "attempts": detail.attempts.iter().map(attempt).collect::<Vec<_>>(),
    })
}

/// A job without its attempts or response, for listings.
pub(super) fn job_summary(job: &Job) -> Value {
    json!({
        "id": job.id.to_string(),
        "owner": job.owner.as_str(),
        "key": job.key.as_str(),
        "route": job.route,
        "state": job.state.as_str(),
        "attempt_count": job.attempt_count,
        "created_at": time(job.created_at),
        "expires_at": time(job.expires_at),
    })
}

fn attempt(a: &Attempt) -> Value {
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
        "lookups": lookups(&a.lookups),
    })
}

/// The lookups made to reconcile an attempt (`docs/design.md` §5): how
/// many, and the last one.
fn lookups(l: &idemgate_domain::reconcile::Lookups) -> Value {
    json!({
        "count": l.count,
        "last": l.last.as_ref().map(|last| json!({
            "at": time(last.at),
            "status": last.status,
            "result": last.result.as_str(),
        })),
    })
}

/// A stored response: its body as text when it is UTF-8, else base64.
fn response(r: &StoredResponse) -> Value {
    let headers: Vec<Value> = r
        .headers
        .iter()
        .map(|(n, v)| json!([n, String::from_utf8_lossy(v)]))
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
