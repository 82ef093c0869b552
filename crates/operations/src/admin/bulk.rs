//! `POST /admin/v1/attempts/resolve`: many unknown attempts settled at
//! once, after an outage of one upstream, chosen by upstream and the time
//! they started; `dry_run` lists them without touching them.
//!
//! Only "had no effect" (`failed`) and `cancelled` are offered: one answer
//! cannot be every attempt's. Each attempt is resolved on its own through
//! the same CAS as a single resolution, so one settled meanwhile (by its
//! late answer, a lookup, another operator) is skipped and said so.
//!
//! The answer echoes the window as read (`since`, `until`: now when it was
//! absent), so a preview's window can be run as it was previewed.

use std::time::SystemTime;

use bytes::Bytes;
use http::{Response, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::AdminError;
use super::views::json_response;
use super::Admin;
use idemgate_domain::attempt::{AttemptState, Resolution};
use idemgate_domain::BoxError;
use idemgate_proxy::http::{collect_limited, Body};
use idemgate_store::Cursor;
use idemgate_telemetry::Chain;

/// Most unknown jobs one bulk resolution reads.
const MAX_JOBS: usize = 10_000;
const PAGE: u32 = 500;

/// The request, as posted.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Bulk {
    /// The upstream the attempts were sent to.
    upstream: String,
    /// Started at or after (RFC 3339).
    since: String,
    /// Started before (RFC 3339); now when absent.
    until: Option<String>,
    /// `failed` (no effect) or `cancelled`.
    outcome: String,
    /// List what would be resolved, change nothing.
    #[serde(default)]
    dry_run: bool,
}

/// One unknown attempt the window holds.
struct Matched {
    job: String,
    key: String,
    attempt: idemgate_domain::id::AttemptId,
    started_at: SystemTime,
}

impl Admin {
    /// Resolves (or with `dry_run` lists) every unknown attempt on one
    /// upstream that started within the window, as `caller`'s resolutions.
    pub(super) async fn resolve_many<B>(
        &self,
        body: B,
        caller: &str,
    ) -> Result<Response<Body>, AdminError>
    where
        B: http_body::Body<Data = Bytes> + Send,
        B::Error: Into<BoxError>,
    {
        let body = collect_limited(body, 64 * 1024)
            .await
            .map_err(|e| AdminError::bad_request(e.to_string()))?;
        let bulk: Bulk = serde_json::from_slice(&body).map_err(|e| {
            AdminError::bad_request(format!(
                "invalid bulk resolution ({e}); send {{\"upstream\": \"…\", \"since\": \"2026-12-01T10:00:00Z\", \
                 \"until\": \"…\", \"outcome\": \"failed\", \"dry_run\": true}}"
            ))
        })?;
        let resolution = match bulk.outcome.as_str() {
            "failed" => Resolution::Failed,
            "cancelled" => Resolution::Cancelled,
            _ => {
                return Err(AdminError::bad_request(
                    "outcome must be failed or cancelled: one answer cannot be every attempt's",
                ))
            }
        };
        self.known_upstream(&bulk.upstream)?;
        let since = time("since", &bulk.since)?;
        let until = bulk
            .until
            .as_deref()
            .map(|t| time("until", t))
            .transpose()?
            .unwrap_or_else(SystemTime::now);
        let matched = self.unknown_in(&bulk.upstream, since, until).await?;
        let (mut resolved, mut skipped) = (Vec::new(), Vec::new());
        if !bulk.dry_run {
            for m in &matched {
                match self
                    .store
                    .resolve_attempt_as(m.attempt, resolution.clone(), caller)
                    .await
                {
                    Ok(detail) => {
                        super::jobs::counted(&detail, m.attempt);
                        tracing::info!(attempt = %m.attempt, job = %m.job, upstream = %bulk.upstream, operator = caller, "attempt resolved by an operator (bulk)");
                        resolved.push(m.attempt.to_string());
                    }
                    Err(e) => skipped.push(
                        json!({"attempt": m.attempt.to_string(), "why": Chain(&e).to_string()}),
                    ),
                }
            }
        }
        let listed: Vec<Value> = matched
            .iter()
            .map(|m| json!({"job": m.job, "key": m.key, "attempt": m.attempt.to_string(), "started_at": humantime::format_rfc3339_millis(m.started_at).to_string()}))
            .collect();
        Ok(json_response(
            StatusCode::OK,
            &json!({
                "dry_run": bulk.dry_run,
                "since": exact(since),
                "until": exact(until),
                "matched": listed,
                "resolved": resolved,
                "skipped": skipped,
            }),
        ))
    }

    /// Refuses an upstream no configuration names: a misspelling would
    /// match nothing and look like "nothing to resolve". Lists those that
    /// exist.
    fn known_upstream(&self, upstream: &str) -> Result<(), AdminError> {
        if self.upstreams.iter().any(|u| u.name() == upstream) {
            return Ok(());
        }
        let names: Vec<&str> = self.upstreams.iter().map(|u| u.name()).collect();
        Err(AdminError::bad_request(format!(
            "no upstream is named {upstream:?}; the upstreams are: {} (an attempt on an upstream no longer configured is resolved on its own, by its id)",
            names.join(", ")
        )))
    }

    /// The unknown attempts on `upstream` that started in `[since, until)`.
    async fn unknown_in(
        &self,
        upstream: &str,
        since: SystemTime,
        until: SystemTime,
    ) -> Result<Vec<Matched>, AdminError> {
        let (mut matched, mut read, mut after) = (Vec::new(), 0, None);
        while read < MAX_JOBS {
            let jobs = self.store.unknown_jobs(after, PAGE).await?;
            read += jobs.len();
            for job in &jobs {
                let Some(detail) = self.store.job_detail(job.id).await? else {
                    continue;
                };
                matched.extend(
                    detail
                        .attempts
                        .iter()
                        .filter(|a| a.state == AttemptState::Unknown && a.upstream == upstream)
                        .filter(|a| a.started_at >= since && a.started_at < until)
                        .map(|a| Matched {
                            job: job.id.to_string(),
                            key: job.key.as_str().to_owned(),
                            attempt: a.id,
                            started_at: a.started_at,
                        }),
                );
            }
            match jobs.last() {
                Some(last) if jobs.len() == PAGE as usize => after = Some(Cursor::after(last)),
                _ => break,
            }
        }
        Ok(matched)
    }
}

/// The window's bounds as read, to the nanosecond: a dry run without
/// `until` says which "now" it stopped at, so the console's real run can
/// send it back and match what was previewed, not what started since.
fn exact(at: SystemTime) -> String {
    humantime::format_rfc3339_nanos(at).to_string()
}

fn time(key: &str, text: &str) -> Result<SystemTime, AdminError> {
    humantime::parse_rfc3339_weak(text).map_err(|e| {
        AdminError::bad_request(format!(
            "{key}: {e}; write it as RFC 3339, 2026-12-01T10:00:00Z"
        ))
    })
}
