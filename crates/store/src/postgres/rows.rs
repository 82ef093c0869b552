//! Rows read back into the domain: jobs, attempts, the snapshots a locked
//! change decides on, and what the begin statement answered.

use std::time::SystemTime;

use bytes::Bytes;
use tokio_postgres::Row;
use uuid::Uuid;

use super::sql::{ATTEMPT_WIDTH, JOB_WIDTH};
use crate::{attempt_state, job_state, lookups, resolved_by, Begin, StoreError};
use idemgate_domain::attempt::Attempt;
use idemgate_domain::fingerprint::Fingerprint;
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::job::Job;
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_domain::response::StoredResponse;
use idemgate_domain::transition::{AttemptHead, JobHead, Snapshot};

/// Reads the snapshots in `rows` (of [`SNAPSHOT_COLUMNS`](super::sql::SNAPSHOT_COLUMNS), ordered by job),
/// with the database's clock.
pub(super) fn snapshots(rows: &[Row]) -> Result<(Vec<Snapshot>, SystemTime), StoreError> {
    let mut out: Vec<Snapshot> = Vec::new();
    let mut now = SystemTime::now();
    for row in rows {
        let id = JobId(row.get(0));
        now = row.get(5);
        let attempt = AttemptHead {
            id: AttemptId(row.get(6)),
            number: row.get(7),
            state: attempt_state(row.get(8))?,
            job_version: row.get(9),
            lease_expires_at: row.get(10),
        };
        match out.last_mut() {
            Some(s) if s.job.id == id => s.attempts.push(attempt),
            _ => out.push(Snapshot {
                job: JobHead {
                    id,
                    state: job_state(row.get(1))?,
                    version: row.get(2),
                    attempt_count: row.get(3),
                    completed_by: row.get::<_, Option<Uuid>>(4).map(AttemptId),
                },
                attempts: vec![attempt],
            }),
        }
    }
    Ok((out, now))
}

/// The answer in a row of [`begin_statement`](super::sql::begin_statement): the job created with its
/// first attempt (the attempt's columns are set), or the job that exists;
/// `None` when that job expired (the last column) but was not purged yet.
pub(super) fn answer(row: &Row) -> Result<Option<Begin>, StoreError> {
    if row.get::<_, Option<Uuid>>(JOB_WIDTH).is_some() {
        return Ok(Some(Begin::Created(
            job_from_row(row)?,
            attempt_from_row(row, JOB_WIDTH)?,
        )));
    }
    if row.get::<_, bool>(JOB_WIDTH + ATTEMPT_WIDTH) {
        return Ok(None);
    }
    Ok(Some(Begin::Existing(job_from_row(row)?)))
}

pub(super) fn split_headers(response: &StoredResponse) -> (Vec<&str>, Vec<&[u8]>) {
    response
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_ref()))
        .unzip()
}

/// The response in the four columns from `at` (status, header names,
/// header values, body), if there is one, without its body.
fn head_at(row: &Row, at: usize) -> Result<Option<StoredResponse>, StoreError> {
    let Some(status) = row.get::<_, Option<i16>>(at) else {
        return Ok(None);
    };
    let names: Vec<String> = row.get::<_, Option<_>>(at + 1).unwrap_or_default();
    let values: Vec<Vec<u8>> = row.get::<_, Option<_>>(at + 2).unwrap_or_default();
    if names.len() != values.len() {
        return Err(StoreError::Corrupt("response headers"));
    }
    Ok(Some(StoredResponse {
        status: status as u16,
        headers: names
            .into_iter()
            .zip(values.into_iter().map(Bytes::from))
            .collect(),
        body: Bytes::new(),
    }))
}

/// The response a row of status, header names, header values and body
/// holds, its body not copied: the bytes stay in the row as it was read
/// (a large answer is held once, not twice; `docs/design.md` §18).
pub(super) fn response_of(row: Row) -> Result<Option<StoredResponse>, StoreError> {
    let Some(mut response) = head_at(&row, 0)? else {
        return Ok(None);
    };
    response.body = match row.get::<_, Option<&[u8]>>(3) {
        Some(_) => Bytes::from_owner(BodyOf(row)),
        None => Bytes::new(),
    };
    Ok(Some(response))
}

/// The body column (the fourth) of a response row, as bytes.
struct BodyOf(Row);

impl AsRef<[u8]> for BodyOf {
    fn as_ref(&self) -> &[u8] {
        self.0.get::<_, Option<&[u8]>>(3).unwrap_or_default()
    }
}

pub(super) fn job_from_row(row: &Row) -> Result<Job, StoreError> {
    let fingerprint: &[u8] = row.get(3);
    // A body over INLINE_ANSWER was left unread (docs/design.md §18).
    let response_in_store = match (
        row.get::<_, Option<i16>>(9),
        row.get::<_, Option<&[u8]>>(12),
        row.get::<_, Option<i32>>(15),
    ) {
        (Some(_), None, Some(len)) if len > 0 => Some(len as usize),
        _ => None,
    };
    let response = match response_in_store {
        None => head_at(row, 9)?.map(|mut response| {
            let body: Vec<u8> = row.get::<_, Option<_>>(12).unwrap_or_default();
            response.body = Bytes::from(body);
            response
        }),
        Some(_) => None,
    };
    Ok(Job {
        id: JobId(row.get(0)),
        owner: Owner::from_stored(row.get(1)),
        key: IdempotencyKey::new(row.get::<_, String>(2))
            .map_err(|_| StoreError::Corrupt("idempotency key"))?,
        fingerprint: Fingerprint::from_slice(fingerprint)
            .ok_or(StoreError::Corrupt("fingerprint"))?,
        route: row.get(4),
        state: job_state(row.get(5))?,
        version: row.get(6),
        attempt_count: row.get(7),
        completed_by: row.get::<_, Option<Uuid>>(8).map(AttemptId),
        response,
        response_in_store,
        created_at: row.get(13),
        expires_at: row.get(14),
    })
}

pub(super) fn attempt_from_row(row: &Row, at: usize) -> Result<Attempt, StoreError> {
    Ok(Attempt {
        id: AttemptId(row.get(at)),
        job_id: JobId(row.get(at + 1)),
        number: row.get(at + 2),
        upstream: row.get(at + 3),
        state: attempt_state(row.get(at + 4))?,
        job_version: row.get(at + 5),
        started_at: row.get(at + 6),
        finished_at: row.get(at + 7),
        lease_expires_at: row.get(at + 8),
        upstream_status: row.get::<_, Option<i16>>(at + 9).map(|s| s as u16),
        detail: row.get(at + 10),
        lookups: lookups(
            row.get(at + 11),
            row.get(at + 12),
            row.get::<_, Option<i16>>(at + 13).map(|s| s as u16),
            row.get(at + 14),
        )?,
        resolved_by: resolved_by(row.get(at + 15), row.get(at + 16)),
        deadline_at: row.get(at + 17),
    })
}
