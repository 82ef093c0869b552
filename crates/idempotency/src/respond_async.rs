//! Calls longer than a connection (RFC 7240 `Prefer: respond-async`,
//! `docs/design.md` §10, "Answered later"): a keyed request that prefers it,
//! whose answer is not ready within its `wait` preference, is answered
//! `202 Accepted` with where to poll; its attempts go on (they outlive any
//! client already), and a `GET` on that place by the same owner answers
//! `202` while the job runs, then its committed answer.

use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderValue, LOCATION, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};
use tokio::sync::watch;
use tracing::Instrument;

use crate::error::GatewayError;
use crate::execute::UpstreamService;
use crate::flow;
use crate::keyed::Keyed;
use crate::replay;
use crate::shared::Shared;
use idemgate_domain::id::JobId;
use idemgate_proxy::http::{full, Body, Outcome};

/// `Prefer`, RFC 7240.
const PREFER: &str = "prefer";
/// `Preference-Applied`, RFC 7240 §3.
const PREFERENCE_APPLIED: &str = "preference-applied";

/// How long a request that prefers `respond-async` waits for its answer
/// before `202` (its `wait` preference, 0 when it names none, at most
/// `cap`); `None` when it does not prefer it. Preferences are tokens
/// separated by commas, over any number of `Prefer` lines, names without
/// case (RFC 7240 §2).
pub(crate) fn preference(headers: &HeaderMap, cap: Duration) -> Option<Duration> {
    let mut wanted = false;
    let mut wait = Duration::ZERO;
    let values = headers
        .get_all(PREFER)
        .iter()
        .filter_map(|v| v.to_str().ok());
    for preference in values.flat_map(|line| line.split(',')) {
        let token = preference.split(';').next().unwrap_or_default().trim();
        let (name, value) = match token.split_once('=') {
            Some((name, value)) => (name.trim(), Some(value.trim().trim_matches('"'))),
            None => (token, None),
        };
        if name.eq_ignore_ascii_case("respond-async") {
            wanted = true;
        } else if name.eq_ignore_ascii_case("wait") {
            if let Some(seconds) = value.and_then(|v| v.parse::<u64>().ok()) {
                wait = Duration::from_secs(seconds);
            }
        }
    }
    wanted.then_some(wait.min(cap))
}

/// The answer to a keyed request that prefers to be answered at once: the
/// flow's own, when it comes before the request would wait on its job, or
/// within `wait` after; otherwise `202` with where to poll. The flow goes
/// on in a task of its own either way: failover and hedging still run.
pub(crate) async fn answer(
    shared: Arc<Shared>,
    mut request: Keyed,
    upstream: UpstreamService,
    wait: Duration,
) -> Response<Body> {
    let (tx, mut waiting) = watch::channel(None);
    request.waiting = Some(tx);
    let retry_after = shared.config.retry_after;
    let path = shared.config.respond_async_path.clone();
    // In the request's span still: what the flow logs names the request.
    let flow = flow::run(shared, request, upstream).instrument(tracing::Span::current());
    let mut run = tokio::spawn(flow);
    let finished = |done: Result<Response<Body>, tokio::task::JoinError>| {
        done.unwrap_or_else(|e| {
            GatewayError::internal(format!("the request's task: {e}")).into_response()
        })
    };
    let job = tokio::select! {
        done = &mut run => return finished(done),
        job = waiting.wait_for(Option::is_some) => job.ok().and_then(|job| *job),
    };
    // The flow ended without telling: its answer is the answer.
    let Some(job) = job else {
        return finished(run.await);
    };
    match tokio::time::timeout(wait, &mut run).await {
        Ok(done) => finished(done),
        Err(_) => accepted(job, &path, retry_after, true),
    }
}

/// `202 Accepted` for `job`: where to poll (`Location`), when
/// (`Retry-After`), and, for the request that asked for it, that its
/// preference was applied.
pub(crate) fn accepted(
    job: JobId,
    path: &str,
    retry_after: Duration,
    applied: bool,
) -> Response<Body> {
    let location = format!("{path}/{job}");
    let body =
        serde_json::json!({ "job": job.to_string(), "state": "running", "location": location });
    let mut response = Response::new(full(body.to_string()));
    *response.status_mut() = StatusCode::ACCEPTED;
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Ok(location) = HeaderValue::from_str(&location) {
        headers.insert(LOCATION, location);
    }
    let seconds = retry_after.as_secs_f64().ceil().max(1.0) as u64;
    headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
    if applied {
        headers.insert(
            PREFERENCE_APPLIED,
            HeaderValue::from_static("respond-async"),
        );
    }
    replay::set_job(&mut response, job);
    response.extensions_mut().insert(job);
    response.extensions_mut().insert(Outcome::Executed);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefer(lines: &[&str]) -> Option<Duration> {
        let mut headers = HeaderMap::new();
        for line in lines {
            headers.append(PREFER, HeaderValue::from_str(line).unwrap());
        }
        preference(&headers, Duration::from_secs(30))
    }

    #[test]
    fn respond_async_is_read_with_its_wait_capped() {
        assert_eq!(prefer(&[]), None);
        assert_eq!(prefer(&["return=minimal"]), None);
        assert_eq!(prefer(&["respond-async"]), Some(Duration::ZERO));
        assert_eq!(
            prefer(&["Respond-Async, wait=10"]),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            prefer(&["wait=\"5\"", "respond-async"]),
            Some(Duration::from_secs(5))
        );
        assert_eq!(
            prefer(&["respond-async; x=y, wait=100"]),
            Some(Duration::from_secs(30))
        );
        assert_eq!(prefer(&["respond-async, wait=soon"]), Some(Duration::ZERO));
        assert_eq!(prefer(&["respond-asynchronously"]), None);
    }
}
