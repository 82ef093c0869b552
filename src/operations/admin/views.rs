//! The admin API's JSON: jobs (whole, or summed up for listings), their
//! attempts and stored responses, upstreams with their probe verdicts.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use base64::Engine;
use http::{header, HeaderValue, Response, StatusCode};
use serde_json::{json, Value};

use crate::config::UpstreamSettings;
use crate::domain::attempt::Attempt;
use crate::domain::job::{Job, JobDetail};
use crate::domain::response::StoredResponse;
use crate::proxy::http::{full, Body};
use crate::upkeep::probe::Verdict;

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
fn lookups(l: &crate::domain::reconcile::Lookups) -> Value {
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

/// Every upstream, with its verdict under each contract it is probed for
/// (`verdicts` by upstream name and contract).
pub(super) fn upstreams(
    upstreams: &[Arc<UpstreamSettings>],
    verdicts: &BTreeMap<(String, String), Verdict>,
) -> Value {
    let list: Vec<Value> = upstreams
        .iter()
        .map(|u| {
            let contracts: Vec<Value> = verdicts
                .iter()
                .filter(|((name, _), _)| name == u.name())
                .map(|((_, contract), v)| verdict(contract, v))
                .collect();
            json!({"name": u.name(), "url": u.base.to_string(), "contracts": contracts})
        })
        .collect();
    json!({ "upstreams": list })
}

fn verdict(contract: &str, v: &Verdict) -> Value {
    json!({
        "contract": contract,
        "passed": v.passed,
        "checked_at": time(v.checked_at),
        "failures": v
            .failures
            .iter()
            .map(|(probe, why)| json!({"probe": probe, "why": why}))
            .collect::<Vec<_>>(),
    })
}

/// RFC 3339, to the millisecond.
fn time(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}
