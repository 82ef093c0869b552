//! A change the domain decided, written in the transaction that holds its
//! job's lock.

use super::map_pg;
use super::rows::{attempt_from_row, split_headers};
use super::sql::ATTEMPT_COLUMNS;
use crate::{millis, StoreError};
use idemgate_domain::attempt::{Attempt, AttemptState};
use idemgate_domain::id::JobId;
use idemgate_domain::transition::{Change, Start};

/// Writes a change inside the transaction holding its job's lock; returns
/// the attempt it started, as stored.
pub(super) async fn write(
    tx: &deadpool_postgres::Transaction<'_>,
    change: &Change,
) -> Result<Option<Attempt>, StoreError> {
    let head = &change.job;
    let response = change.response.as_ref();
    let (names, values) = response.map(split_headers).unzip();
    // The response columns are written once, by the change that completes
    // the job; any other change passes NULL and leaves them.
    tx.execute(
        "UPDATE jobs SET state = $2, version = $3, attempt_count = $4, completed_by = $5, \
                response_status = COALESCE($6, response_status), \
                response_header_names = COALESCE($7, response_header_names), \
                response_header_values = COALESCE($8, response_header_values), \
                response_body = COALESCE($9, response_body), updated_at = now() \
         WHERE id = $1",
        &[
            &head.id.0,
            &head.state.as_str(),
            &head.version,
            &head.attempt_count,
            &head.completed_by.map(|a| a.0),
            &response.map(|r| r.status as i16),
            &names,
            &values,
            &response.map(|r| r.body.as_ref()),
        ],
    )
    .await
    .map_err(map_pg)?;
    for settled in &change.settled {
        tx.execute(
            "UPDATE attempts SET state = $2, \
                    finished_at = CASE WHEN $3 THEN now() ELSE finished_at END, \
                    upstream_status = COALESCE($4, upstream_status), \
                    detail = COALESCE($5, detail), \
                    resolved_by = COALESCE($6, resolved_by), \
                    resolved_at = CASE WHEN $6::text IS NULL THEN resolved_at ELSE now() END \
             WHERE id = $1",
            &[
                &settled.attempt.0,
                &settled.state.as_str(),
                &settled.finishes(),
                &settled.status.map(|s| s as i16),
                &settled.detail,
                &settled.resolved_by,
            ],
        )
        .await
        .map_err(map_pg)?;
    }
    match &change.started {
        Some(start) => insert_attempt(tx, head.id, start).await.map(Some),
        None => Ok(None),
    }
}

/// Inserts the attempt a change started, in that change's transaction;
/// returns it as stored.
async fn insert_attempt(
    tx: &deadpool_postgres::Transaction<'_>,
    job: JobId,
    start: &Start,
) -> Result<Attempt, StoreError> {
    let row = tx
        .query_one(
            &format!(
                "INSERT INTO attempts AS a (id, job_id, number, upstream, state, job_version, \
                                            instance, lease_expires_at, deadline_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, \
                         now() + $8::bigint * interval '1 millisecond', \
                         now() + $9::bigint * interval '1 millisecond') \
                 RETURNING {ATTEMPT_COLUMNS}"
            ),
            &[
                &start.attempt.id.0,
                &job.0,
                &start.number,
                &start.attempt.upstream,
                &AttemptState::Started.as_str(),
                &start.job_version,
                &start.attempt.instance,
                &millis(start.attempt.lease),
                &millis(start.attempt.deadline),
            ],
        )
        .await
        .map_err(map_pg)?;
    attempt_from_row(&row, 0)
}
