//! Rows to domain values and back: ids as UUID text, times as milliseconds
//! since the epoch, converted here and nowhere else.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rusqlite::{Connection, OptionalExtension, Row};
use uuid::Uuid;

use crate::codec::decode_headers;
use crate::{attempt_state, job_state, lookups, millis, StoreError};
use idemgate_domain::attempt::Attempt;
use idemgate_domain::fingerprint::Fingerprint;
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::job::{Job, JobDetail};
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_domain::response::StoredResponse;

pub(super) const JOB_COLUMNS: &str =
    "j.id, j.owner, j.key, j.fingerprint, j.route, j.state, j.version, \
     j.attempt_count, j.completed_by, j.response_status, j.response_headers, \
     CASE WHEN length(j.response_body) <= 262144 THEN j.response_body END, \
     length(j.response_body), j.created_at, j.expires_at";
pub(super) const ATTEMPT_COLUMNS: &str =
    "a.id, a.job_id, a.number, a.upstream, a.state, a.job_version, \
     a.started_at, a.finished_at, a.lease_expires_at, a.upstream_status, a.detail, \
     a.lookups, a.last_lookup_at, a.last_lookup_status, a.last_lookup_result, \
     a.resolved_by, a.resolved_at, a.deadline_at";

pub(super) fn now_ms() -> i64 {
    to_ms(SystemTime::now())
}

pub(super) fn to_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).map(millis).unwrap_or(0)
}

pub(super) fn from_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

pub(super) fn uuid(s: &str) -> Result<Uuid, StoreError> {
    s.parse().map_err(|_| StoreError::Corrupt("id"))
}

pub(super) fn attempt_id(s: Option<&str>) -> Result<Option<AttemptId>, StoreError> {
    s.map(uuid).transpose().map(|id| id.map(AttemptId))
}

pub(super) fn read_job(
    conn: &Connection,
    filter: &str,
    params: impl rusqlite::Params,
) -> Result<Option<Job>, StoreError> {
    conn.query_row(
        &format!("SELECT {JOB_COLUMNS} FROM jobs j WHERE {filter}"),
        params,
        job_from_row,
    )
    .optional()
    .map_err(map_sqlite)?
    .transpose()
}

pub(super) fn read_attempt(
    conn: &Connection,
    id: AttemptId,
) -> Result<Option<Attempt>, StoreError> {
    conn.query_row(
        &format!("SELECT {ATTEMPT_COLUMNS} FROM attempts a WHERE a.id = ?1"),
        [id.0.to_string()],
        attempt_from_row,
    )
    .optional()
    .map_err(map_sqlite)?
    .transpose()
}

/// A job with its attempts; the caller's single connection makes the two
/// reads one consistent view (no writer can come between them).
pub(super) fn read_detail(
    conn: &Connection,
    job: Option<Job>,
) -> Result<Option<JobDetail>, StoreError> {
    let Some(job) = job else {
        return Ok(None);
    };
    let mut stmt = conn
        .prepare_cached(&format!(
            "SELECT {ATTEMPT_COLUMNS} FROM attempts a WHERE a.job_id = ?1 ORDER BY a.number"
        ))
        .map_err(map_sqlite)?;
    let attempts = stmt
        .query_map([job.id.0.to_string()], attempt_from_row)
        .map_err(map_sqlite)?
        .map(|r| r.map_err(map_sqlite)?)
        .collect::<Result<_, _>>()?;
    Ok(Some(JobDetail { job, attempts }))
}

fn response(
    status: u16,
    headers: Option<&[u8]>,
    body: Option<Vec<u8>>,
) -> Result<StoredResponse, StoreError> {
    Ok(StoredResponse {
        status,
        headers: decode_headers(headers.unwrap_or_default())
            .ok_or(StoreError::Corrupt("response headers"))?,
        body: Bytes::from(body.unwrap_or_default()),
    })
}

/// The committed response of `job`, body and all: what a job read leaves
/// in the store when its body is large.
pub(super) fn read_response(
    conn: &Connection,
    job: JobId,
) -> Result<Option<StoredResponse>, StoreError> {
    let row = conn
        .query_row(
            "SELECT response_status, response_headers, response_body FROM jobs WHERE id = ?1",
            [job.0.to_string()],
            |row| {
                Ok((
                    row.get::<_, Option<u16>>(0)?,
                    row.get::<_, Option<Vec<u8>>>(1)?,
                    row.get::<_, Option<Vec<u8>>>(2)?,
                ))
            },
        )
        .optional()
        .map_err(map_sqlite)?;
    match row {
        Some((Some(status), headers, body)) => response(status, headers.as_deref(), body).map(Some),
        _ => Ok(None),
    }
}

/// Reads a job row; the outer `Result` is rusqlite's, the inner ours.
pub(super) fn job_from_row(row: &Row<'_>) -> rusqlite::Result<Result<Job, StoreError>> {
    let id: String = row.get(0)?;
    let owner: String = row.get(1)?;
    let key: String = row.get(2)?;
    let fingerprint: Vec<u8> = row.get(3)?;
    let route: String = row.get(4)?;
    let state: String = row.get(5)?;
    let version: i64 = row.get(6)?;
    let attempt_count: i32 = row.get(7)?;
    let completed_by: Option<String> = row.get(8)?;
    let status: Option<u16> = row.get(9)?;
    let headers: Option<Vec<u8>> = row.get(10)?;
    let body: Option<Vec<u8>> = row.get(11)?;
    let body_len: Option<i64> = row.get(12)?;
    let created_at: i64 = row.get(13)?;
    let expires_at: i64 = row.get(14)?;
    Ok((|| {
        // A body over INLINE_ANSWER was left unread (docs/design.md §18).
        let response_in_store = match (status, &body, body_len) {
            (Some(_), None, Some(len)) if len > 0 => Some(len as usize),
            _ => None,
        };
        let response = match status {
            Some(status) if response_in_store.is_none() => {
                Some(response(status, headers.as_deref(), body)?)
            }
            _ => None,
        };
        Ok(Job {
            id: JobId(uuid(&id)?),
            owner: Owner::from_stored(owner),
            key: IdempotencyKey::new(key).map_err(|_| StoreError::Corrupt("idempotency key"))?,
            fingerprint: Fingerprint::from_slice(&fingerprint)
                .ok_or(StoreError::Corrupt("fingerprint"))?,
            route,
            state: job_state(&state)?,
            version,
            attempt_count,
            completed_by: attempt_id(completed_by.as_deref())?,
            response,
            response_in_store,
            created_at: from_ms(created_at),
            expires_at: from_ms(expires_at),
        })
    })())
}

pub(super) fn attempt_from_row(row: &Row<'_>) -> rusqlite::Result<Result<Attempt, StoreError>> {
    let id: String = row.get(0)?;
    let job_id: String = row.get(1)?;
    let number: i32 = row.get(2)?;
    let upstream: String = row.get(3)?;
    let state: String = row.get(4)?;
    let job_version: i64 = row.get(5)?;
    let started_at: i64 = row.get(6)?;
    let finished_at: Option<i64> = row.get(7)?;
    let lease_expires_at: i64 = row.get(8)?;
    let upstream_status: Option<u16> = row.get(9)?;
    let detail: Option<String> = row.get(10)?;
    let lookup_count: i32 = row.get(11)?;
    let last_lookup_at: Option<i64> = row.get(12)?;
    let last_lookup_status: Option<u16> = row.get(13)?;
    let last_lookup_result: Option<String> = row.get(14)?;
    let resolved_by: Option<String> = row.get(15)?;
    let resolved_at: Option<i64> = row.get(16)?;
    let deadline_at: i64 = row.get(17)?;
    Ok((|| {
        Ok(Attempt {
            id: AttemptId(uuid(&id)?),
            job_id: JobId(uuid(&job_id)?),
            number,
            upstream,
            state: attempt_state(&state)?,
            job_version,
            started_at: from_ms(started_at),
            finished_at: finished_at.map(from_ms),
            lease_expires_at: from_ms(lease_expires_at),
            upstream_status,
            detail,
            lookups: lookups(
                lookup_count,
                last_lookup_at.map(from_ms),
                last_lookup_status,
                last_lookup_result.as_deref(),
            )?,
            resolved_by: crate::resolved_by(resolved_by, resolved_at.map(from_ms)),
            deadline_at: from_ms(deadline_at),
        })
    })())
}

/// A locked or unopenable database is `Unavailable` (503); anything else
/// SQLite refused is `Internal`.
pub(super) fn map_sqlite(e: rusqlite::Error) -> StoreError {
    use rusqlite::ErrorCode;
    match &e {
        rusqlite::Error::SqliteFailure(f, _)
            if matches!(
                f.code,
                ErrorCode::DatabaseBusy
                    | ErrorCode::DatabaseLocked
                    | ErrorCode::CannotOpen
                    | ErrorCode::DiskFull
                    | ErrorCode::SystemIoFailure
            ) =>
        {
            StoreError::Unavailable(Box::new(e))
        }
        _ => StoreError::Internal(Box::new(e)),
    }
}
