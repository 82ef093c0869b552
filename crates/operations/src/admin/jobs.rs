//! The job API: a job by id, or by owner and key; the operator's inbox of
//! unknown jobs, a page at a time; and the resolution of an attempt whose
//! outcome is unknown (`docs/design.md`, §14), which goes through
//! [`Store::resolve_attempt`](idemgate_store::Store::resolve_attempt) and
//! the commit rule (§4).

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{Response, StatusCode};
use serde_json::json;
use uuid::Uuid;

use super::error::AdminError;
use super::views::{self, json_response};
use super::{resolution, Admin};
use idemgate_domain::attempt::AttemptState;
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::job::JobDetail;
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_domain::BoxError;
use idemgate_proxy::http::{collect_limited, Body};
use idemgate_store::{Cursor, StoreErrorKind};

/// Largest resolution body accepted.
const MAX_BODY: usize = 16 * 1024 * 1024;

/// `GET /admin/v1/jobs?…`'s parameters, as given.
#[derive(Default)]
struct JobsQuery {
    owner: Option<String>,
    key: Option<String>,
    state: Option<String>,
    limit: Option<String>,
    before: Option<String>,
}

impl JobsQuery {
    /// Reads the known parameters of `query`; others are ignored.
    fn parse(query: &str) -> Self {
        let mut q = JobsQuery::default();
        for (k, v) in form_urlencoded::parse(query.as_bytes()) {
            let slot = match k.as_ref() {
                "owner" => &mut q.owner,
                "key" => &mut q.key,
                "state" => &mut q.state,
                "limit" => &mut q.limit,
                "before" => &mut q.before,
                _ => continue,
            };
            *slot = Some(v.into_owned());
        }
        q
    }
}

impl Admin {
    /// `GET /admin/v1/jobs/{id}`: a job and its attempts.
    pub(super) async fn job(&self, id: &str) -> Result<Response<Body>, AdminError> {
        let id = JobId(parse_uuid(id)?);
        let detail = self.store.job_detail(id).await?;
        self.found(self.whole(detail).await?, "no job with this id")
    }

    /// `GET /admin/v1/jobs?…`: the inbox when a `state` is asked for, else
    /// the job of an owner (anonymous when not given) and a key.
    pub(super) async fn jobs(&self, query: &str) -> Result<Response<Body>, AdminError> {
        let query = JobsQuery::parse(query);
        if query.state.is_some() {
            return self.inbox(query).await;
        }
        let owner = match query.owner.as_deref() {
            None => Owner::anonymous(),
            Some(text) => self.owner(text)?,
        };
        let key = query
            .key
            .ok_or_else(|| AdminError::bad_request("the `key` query parameter is required"))?;
        let key = IdempotencyKey::parse(key.as_bytes())
            .map_err(|e| AdminError::bad_request(e.to_string()))?;
        let detail = self.store.find_job(&owner, &key).await?;
        self.found(self.whole(detail).await?, "no job for this owner and key")
    }

    /// The owner an operator typed: its stored form (`anonymous`,
    /// `hmac:<64 hex>`) or the raw value `[owner]`'s first source reads. A
    /// text that looks like a stored form but is not one is refused rather
    /// than taken as a raw value that finds nothing.
    fn owner(&self, text: &str) -> Result<Owner, AdminError> {
        const FORMS: &str = "give its stored form (anonymous, hmac:<64 hex>, as the job API shows it) \
                             or the raw value [owner]'s first source reads (the Authorization header's value)";
        if Owner::parse_stored(text).is_none() {
            if let Some((prefix, _)) = text
                .split_once(':')
                .filter(|(p, _)| ["hmac", "sha256"].contains(&p.to_ascii_lowercase().as_str()))
            {
                return Err(AdminError::bad_request(format!(
                    "`owner` {prefix}:… is not an owner: stored owners are hmac: and 64 hex digits; {FORMS}"
                )));
            }
        }
        self.trust
            .owner_from_admin(text)
            .ok_or_else(|| AdminError::bad_request(format!("`owner` is not an owner: {FORMS}")))
    }

    /// A job's view, or 404 saying what was looked for.
    fn found(
        &self,
        detail: Option<JobDetail>,
        missing: &'static str,
    ) -> Result<Response<Body>, AdminError> {
        detail
            .map(|d| json_response(StatusCode::OK, &views::job(&d, &self.reconciling)))
            .ok_or(AdminError::JobNotFound(missing))
    }

    /// `detail` with its committed response, read on its own when it was too
    /// large to come with the job (`docs/design.md` §18): an operator
    /// asking for one job sees all of it.
    async fn whole(&self, detail: Option<JobDetail>) -> Result<Option<JobDetail>, AdminError> {
        let Some(mut detail) = detail else {
            return Ok(None);
        };
        if detail.job.response_in_store.is_some() {
            detail.job.response = self.store.response(detail.job.id).await?;
        }
        Ok(Some(detail))
    }

    /// The operator's inbox: unknown jobs, newest first, a page at a time;
    /// `next` (when there may be more) is the `before` of the next page.
    async fn inbox(&self, query: JobsQuery) -> Result<Response<Body>, AdminError> {
        if query.state.as_deref() != Some("unknown") {
            return Err(AdminError::bad_request(
                "only state=unknown is listed (the jobs waiting for an operator); find others by id or by owner and key",
            ));
        }
        let limit = match query.limit.as_deref() {
            None => 50,
            Some(n) => n
                .parse::<u32>()
                .ok()
                .filter(|n| (1..=500).contains(n))
                .ok_or_else(|| AdminError::bad_request("limit must be a number from 1 to 500"))?,
        };
        let after = query.before.as_deref().map(parse_cursor).transpose()?;
        let jobs = self.store.unknown_jobs(after, limit).await?;
        let next = (jobs.len() == limit as usize)
            .then(|| jobs.last().map(|j| cursor_text(Cursor::after(j))))
            .flatten();
        // Each with its attempts: the unknown one's id and upstream are what
        // the operator acts on. A job gone meanwhile (purged) is left out.
        let mut listed = Vec::with_capacity(jobs.len());
        for job in &jobs {
            if let Some(detail) = self.store.job_detail(job.id).await? {
                listed.push(views::job_summary(&detail));
            }
        }
        Ok(json_response(
            StatusCode::OK,
            &json!({"jobs": listed, "next": next}),
        ))
    }

    /// `POST /admin/v1/attempts/{id}/resolve`: the operator (`caller`)
    /// says what the attempt did, recorded as theirs; the answer is its job
    /// as it now stands.
    pub(super) async fn resolve<B>(
        &self,
        id: &str,
        body: B,
        caller: &str,
    ) -> Result<Response<Body>, AdminError>
    where
        B: http_body::Body<Data = Bytes> + Send,
        B::Error: Into<BoxError>,
    {
        let id = AttemptId(parse_uuid(id)?);
        let body = collect_limited(body, MAX_BODY)
            .await
            .map_err(|e| AdminError::bad_request(e.to_string()))?;
        let resolution = resolution::parse(&body)?;
        let detail = match self.store.resolve_attempt_as(id, resolution, caller).await {
            Err(e) if e.kind() == StoreErrorKind::NotFound => {
                return Err(self.not_an_attempt(id).await)
            }
            done => done?,
        };
        counted(&detail, id);
        tracing::info!(attempt = %id, job = %detail.job.id, state = %detail.job.state, operator = caller, "attempt resolved by an operator");
        Ok(json_response(
            StatusCode::OK,
            &views::job(&detail, &self.reconciling),
        ))
    }

    /// Why no attempt has `id`: when it is a job's id (the two share their
    /// first characters), says so and names the job's unknown attempts.
    async fn not_an_attempt(&self, id: AttemptId) -> AdminError {
        let Ok(Some(detail)) = self.store.job_detail(JobId(id.0)).await else {
            return AdminError::AttemptNotFound(format!("no attempt has id {id}"));
        };
        let unknown: Vec<String> = detail
            .attempts
            .iter()
            .filter(|a| a.state == AttemptState::Unknown)
            .map(|a| format!("#{} {}", a.number, a.id))
            .collect();
        AdminError::AttemptNotFound(match unknown.as_slice() {
            [] => format!("{id} is a job's id, not an attempt's, and the job ({}) has no attempt of unknown outcome", detail.job.state),
            _ => format!("{id} is a job's id, not an attempt's: resolve its unknown attempt ({})", unknown.join(", ")),
        })
    }
}

/// Counts an operator's resolution the store took as the attempt's end
/// (`idemgate_attempts_ended_total{by="operator"}`, and a commit when it
/// succeeded: `docs/design.md` §12, "Metrics").
pub(super) fn counted(detail: &JobDetail, attempt: AttemptId) {
    use idemgate_telemetry::ends::{ended, By};
    if let Some(a) = detail.attempts.iter().find(|a| a.id == attempt) {
        ended(
            &detail.job.route,
            &a.upstream,
            a.state.as_str(),
            By::Operator,
        );
    }
}

fn parse_uuid(s: &str) -> Result<Uuid, AdminError> {
    s.parse()
        .map_err(|_| AdminError::bad_request(format!("{s:?} is not an id")))
}

/// A listing's cursor as text: the job's creation in microseconds since
/// the epoch, a dot, the job id.
fn cursor_text(cursor: Cursor) -> String {
    let micros = cursor
        .created_at
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros());
    format!("{micros}.{}", cursor.job)
}

/// The cursor [`cursor_text`] wrote.
fn parse_cursor(text: &str) -> Result<Cursor, AdminError> {
    let invalid = || AdminError::bad_request("before must be the `next` of a previous page");
    let (micros, id) = text.split_once('.').ok_or_else(invalid)?;
    let micros: u64 = micros.parse().map_err(|_| invalid())?;
    Ok(Cursor {
        created_at: SystemTime::UNIX_EPOCH + Duration::from_micros(micros),
        job: JobId(id.parse().map_err(|_| invalid())?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_reads_back_as_written() {
        let cursor = Cursor {
            created_at: SystemTime::UNIX_EPOCH + Duration::from_micros(1_722_000_000_123_456),
            job: JobId::new(),
        };
        let text = cursor_text(cursor);
        assert!(text.starts_with("1722000000123456."), "{text}");
        assert_eq!(parse_cursor(&text).unwrap(), cursor);
        assert!(parse_cursor("1722000000123456").is_err());
        assert!(parse_cursor("soon.0").is_err());
    }
}
