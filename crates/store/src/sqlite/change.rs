//! One change to a job, inside one `BEGIN IMMEDIATE` transaction: the
//! locked job's snapshot, the domain's transition, and its writes.

use std::ops::Deref;
use std::time::SystemTime;

use rusqlite::{
    params, Connection, OptionalExtension, Savepoint, Transaction, TransactionBehavior,
};

use super::rows::{map_sqlite, read_attempt, read_detail, read_job, to_ms, uuid};
use crate::codec::encode_headers;
use crate::{millis, Applied, Decide, Lock, StoreError};
use idemgate_domain::attempt::{Attempt, AttemptState, NewAttempt};
use idemgate_domain::id::JobId;
use idemgate_domain::transition::{AttemptHead, Change, JobHead, Refusal, Snapshot};

/// none, a savepoint inside the batch's transaction (see [`super::group_commit::writer`]).
pub(super) enum Tx<'c> {
    Own(Transaction<'c>),
    Nested(Savepoint<'c>),
}

impl Tx<'_> {
    pub(super) fn commit(self) -> rusqlite::Result<()> {
        match self {
            Tx::Own(tx) => tx.commit(),
            Tx::Nested(sp) => sp.commit(),
        }
    }
}

impl Deref for Tx<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        match self {
            Tx::Own(tx) => tx,
            Tx::Nested(sp) => sp,
        }
    }
}

pub(super) fn immediate(conn: &mut Connection) -> Result<Tx<'_>, StoreError> {
    if conn.is_autocommit() {
        conn.transaction_with_behavior(TransactionBehavior::Immediate)
            .map(Tx::Own)
    } else {
        conn.savepoint().map(Tx::Nested)
    }
    .map_err(map_sqlite)
}

/// Reads a job with its attempts, as the domain's transitions see it (the
/// whole rows: reading the response too costs nothing on a local file).
pub(super) fn snapshot(conn: &Connection, job: JobId) -> Result<Option<Snapshot>, StoreError> {
    let job = read_job(conn, "j.id = ?1", [job.0.to_string()])?;
    Ok(read_detail(conn, job)?.map(|d| Snapshot {
        job: JobHead::of(&d.job),
        attempts: d.attempts.iter().map(AttemptHead::of).collect(),
    }))
}

pub(super) fn job_of(conn: &Connection, lock: Lock) -> Result<JobId, StoreError> {
    match lock {
        Lock::Job(job) => Ok(job),
        Lock::JobOf(attempt) => {
            let job: Option<String> = conn
                .query_row(
                    "SELECT job_id FROM attempts WHERE id = ?1",
                    [attempt.0.to_string()],
                    |r| r.get(0),
                )
                .optional()
                .map_err(map_sqlite)?;
            Ok(JobId(uuid(&job.ok_or(StoreError::NotFound("attempt"))?)?))
        }
    }
}

/// Locks, decides and writes one change (see [`crate::Backend::change`]).
pub(super) fn change_blocking(
    conn: &mut Connection,
    lock: Lock,
    decide: Decide,
) -> Result<Result<Applied, Refusal>, StoreError> {
    let now = SystemTime::now();
    let tx = immediate(conn)?;
    let job = job_of(&tx, lock)?;
    let snapshot = snapshot(&tx, job)?.ok_or(StoreError::NotFound("job"))?;
    let change = match decide(&snapshot, now) {
        Ok(change) => change,
        Err(refusal) => return Ok(Err(refusal)),
    };
    let started = write(&tx, &change, now)?;
    tx.commit().map_err(map_sqlite)?;
    Ok(Ok(Applied { change, started }))
}

/// Writes a change inside the caller's immediate transaction.
pub(super) fn write(
    tx: &Connection,
    change: &Change,
    now: SystemTime,
) -> Result<Option<Attempt>, StoreError> {
    let now = to_ms(now);
    let head = &change.job;
    let id = head.id.0.to_string();
    let response = change.response.as_ref();
    // The response columns are written once, by the change that completes
    // the job; any other change passes NULL and leaves them.
    tx.execute(
        "UPDATE jobs SET state = ?2, version = ?3, attempt_count = ?4, completed_by = ?5, \
                updated_at = ?6, response_status = COALESCE(?7, response_status), \
                response_headers = COALESCE(?8, response_headers), \
                response_body = COALESCE(?9, response_body) WHERE id = ?1",
        params![
            id,
            head.state.as_str(),
            head.version,
            head.attempt_count,
            head.completed_by.map(|a| a.0.to_string()),
            now,
            response.map(|r| r.status),
            response.map(|r| encode_headers(&r.headers)),
            response.map(|r| r.body.as_ref()),
        ],
    )
    .map_err(map_sqlite)?;
    for settled in &change.settled {
        tx.execute(
            "UPDATE attempts SET state = ?2, \
                    finished_at = CASE WHEN ?3 THEN ?4 ELSE finished_at END, \
                    upstream_status = COALESCE(?5, upstream_status), \
                    detail = COALESCE(?6, detail), \
                    resolved_by = COALESCE(?7, resolved_by), \
                    resolved_at = CASE WHEN ?7 IS NULL THEN resolved_at ELSE ?4 END \
             WHERE id = ?1",
            params![
                settled.attempt.0.to_string(),
                settled.state.as_str(),
                settled.finishes(),
                now,
                settled.status,
                settled.detail,
                settled.resolved_by,
            ],
        )
        .map_err(map_sqlite)?;
    }
    let Some(start) = &change.started else {
        return Ok(None);
    };
    insert_attempt(
        tx,
        head.id,
        start.number,
        start.job_version,
        &start.attempt,
        now,
    )
    .map(Some)
}

pub(super) fn insert_attempt(
    tx: &Connection,
    job: JobId,
    number: i32,
    version: i64,
    attempt: &NewAttempt,
    now: i64,
) -> Result<Attempt, StoreError> {
    tx.execute(
        "INSERT INTO attempts (id, job_id, number, upstream, state, job_version, instance, \
                               started_at, lease_expires_at, deadline_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
        params![
            attempt.id.0.to_string(),
            job.0.to_string(),
            number,
            attempt.upstream,
            AttemptState::Started.as_str(),
            version,
            attempt.instance.to_string(),
            now,
            now + millis(attempt.lease),
            now + millis(attempt.deadline),
        ],
    )
    .map_err(map_sqlite)?;
    read_attempt(tx, attempt.id)?.ok_or(StoreError::NotFound("attempt"))
}
