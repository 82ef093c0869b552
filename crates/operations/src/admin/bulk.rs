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
//! absent), so a preview's window can be run as it was previewed, and says
//! `truncated` when it stopped at `MAX_JOBS` with unknown jobs left unread:
//! an empty `matched` then does not mean an empty window.

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

/// The unknown attempts a window holds, as far as they were read.
struct Window {
    matched: Vec<Matched>,
    /// `MAX_JOBS` unknown jobs were read (newest first) and older ones
    /// remain: attempts of theirs in the window are not in `matched`.
    truncated: bool,
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
        let Window { matched, truncated } = self
            .unknown_in(&bulk.upstream, since, until, MAX_JOBS)
            .await?;
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
                "truncated": truncated,
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

    /// The unknown attempts on `upstream` that started in `[since, until)`,
    /// among the newest `max_jobs` unknown jobs (`MAX_JOBS`; fewer in
    /// tests, which cannot make that many quickly).
    async fn unknown_in(
        &self,
        upstream: &str,
        since: SystemTime,
        until: SystemTime,
        max_jobs: usize,
    ) -> Result<Window, AdminError> {
        let (mut matched, mut read, mut after) = (Vec::new(), 0, None);
        loop {
            let page = PAGE.min(u32::try_from(max_jobs - read).unwrap_or(PAGE));
            let jobs = self.store.unknown_jobs(after, page).await?;
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
                Some(last) if jobs.len() == page as usize => after = Some(Cursor::after(last)),
                _ => {
                    return Ok(Window {
                        matched,
                        truncated: false,
                    })
                }
            }
            if read >= max_jobs {
                // A full last page may have been the last: one more row
                // says whether the answer leaves any job unread.
                let truncated = !self.store.unknown_jobs(after, 1).await?.is_empty();
                return Ok(Window { matched, truncated });
            }
        }
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::console::{self, Console};
    use idemgate_domain::attempt::{AttemptFailure, NewAttempt};
    use idemgate_domain::fingerprint::Fingerprint;
    use idemgate_domain::id::{AttemptId, JobId};
    use idemgate_domain::job::NewJob;
    use idemgate_domain::key::{IdempotencyKey, Owner, OwnerSalt};
    use idemgate_store::memory::Memory;
    use idemgate_store::{Begin, Doorbell, Machine, Store};
    use idemgate_trust::Trust;
    use idemgate_upkeep::health::Dependencies;
    use idemgate_upkeep::supervise::Supervisor;

    /// An admin API over an empty memory store.
    fn admin() -> Admin {
        Admin {
            store: Arc::new(Machine::new(
                Memory::default(),
                Arc::new(Doorbell::default()),
            )),
            token: None,
            console: Console::new(console::Config::default()),
            metrics: idemgate_telemetry::metrics(),
            upstreams: Vec::new(),
            probes: Arc::default(),
            tasks: Supervisor::new(CancellationToken::new()),
            dependencies: Arc::new(Dependencies::new(Vec::new())),
            trust: Arc::new(Trust::with_salt(OwnerSalt::new(b"test salt, not a secret"))),
            reconciling: Default::default(),
        }
    }

    /// A job of `key` whose one attempt, sent to `primary`, went unknown.
    async fn unknown_job(store: &dyn Store, key: &str) -> AttemptId {
        let job = NewJob {
            id: JobId::new(),
            owner: Owner::of(&OwnerSalt::new(b"test salt, not a secret"), &[b"Bearer t"]),
            key: IdempotencyKey::new(key).unwrap(),
            fingerprint: Fingerprint([7; 32]),
            route: "default".into(),
            ttl: Duration::from_secs(3600),
        };
        let attempt = NewAttempt {
            id: AttemptId::new(),
            upstream: "primary".into(),
            instance: uuid::Uuid::nil(),
            lease: Duration::from_secs(30),
            deadline: Duration::from_secs(300),
        };
        let Begin::Created(_, started) = store.begin_job(job, attempt).await.unwrap() else {
            panic!("a new key");
        };
        let unknown = AttemptFailure::Unknown {
            detail: "no answer".into(),
        };
        assert!(store.fail_attempt(started.id, unknown).await.unwrap());
        // Jobs are read newest first: each a little newer than the last.
        tokio::time::sleep(Duration::from_millis(2)).await;
        started.id
    }

    /// Three unknown jobs newer than the window's one: read up to a cap of
    /// three, the window looks empty and the answer says it stopped early;
    /// with a cap that reaches it (exactly, or with room to spare), it is
    /// matched and nothing was left unread.
    #[tokio::test]
    async fn a_window_past_the_cap_of_unknown_jobs_is_said_to_be_truncated() {
        let admin = admin();
        let since = SystemTime::now();
        let older = unknown_job(&*admin.store, "older").await;
        let until = SystemTime::now();
        for n in 0..3 {
            unknown_job(&*admin.store, &format!("newer-{n}")).await;
        }
        for (cap, matched, truncated) in [
            (3, None, true),
            (4, Some(older), false),
            (5, Some(older), false),
        ] {
            let window = admin
                .unknown_in("primary", since, until, cap)
                .await
                .unwrap();
            let found: Vec<AttemptId> = window.matched.iter().map(|m| m.attempt).collect();
            assert_eq!(found, Vec::from_iter(matched), "cap {cap}");
            assert_eq!(window.truncated, truncated, "cap {cap}");
        }
    }
}
