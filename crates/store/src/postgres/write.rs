//! A change the domain decided, written in the transaction that holds its
//! job's lock.
//!
//! Its statements are prepared once per connection and sent together: the
//! job's row, each settled attempt and the started one are distinct rows of
//! one transaction, so none waits on another's answer, and the job's lock
//! is held one round trip, not one per statement (a statement sent as text
//! is parsed and described in a round trip of its own before it runs).

use std::sync::LazyLock;

use futures_util::future::{try_join3, try_join_all};

use super::map_pg;
use super::rows::{attempt_from_row, split_headers};
use super::sql::ATTEMPT_COLUMNS;
use crate::{millis, StoreError};
use idemgate_domain::attempt::{Attempt, AttemptState};
use idemgate_domain::id::JobId;
use idemgate_domain::transition::{Change, Settle, Start};

type Transaction<'a> = deadpool_postgres::Transaction<'a>;
type Statement = tokio_postgres::Statement;

/// The job's new head. The response columns are written once, by the
/// change that completes the job; any other change passes NULL and leaves
/// them.
const UPDATE_JOB: &str = "UPDATE jobs SET state = $2, version = $3, attempt_count = $4, \
        completed_by = $5, \
        response_status = COALESCE($6, response_status), \
        response_header_names = COALESCE($7, response_header_names), \
        response_header_values = COALESCE($8, response_header_values), \
        response_body = COALESCE($9, response_body), updated_at = now() \
     WHERE id = $1";

/// An attempt the change settled.
const SETTLE_ATTEMPT: &str = "UPDATE attempts SET state = $2, \
        finished_at = CASE WHEN $3 THEN now() ELSE finished_at END, \
        upstream_status = COALESCE($4, upstream_status), \
        detail = COALESCE($5, detail), \
        resolved_by = COALESCE($6, resolved_by), \
        resolved_at = CASE WHEN $6::text IS NULL THEN resolved_at ELSE now() END \
     WHERE id = $1";

/// The attempt the change started, returned as stored.
fn insert_attempt_statement() -> &'static str {
    static TEXT: LazyLock<String> = LazyLock::new(|| {
        format!(
            "INSERT INTO attempts AS a (id, job_id, number, upstream, state, job_version, \
                                        instance, lease_expires_at, deadline_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, \
                     now() + $8::bigint * interval '1 millisecond', \
                     now() + $9::bigint * interval '1 millisecond') \
             RETURNING {ATTEMPT_COLUMNS}"
        )
    });
    &TEXT
}

/// Writes a change inside the transaction holding its job's lock; returns
/// the attempt it started, as stored. Every statement is prepared before
/// any is sent, so they go in one order (the job, the settled attempts, the
/// started one), and the first error back is the one that failed, not a
/// later statement's "transaction aborted".
pub(super) async fn write(
    tx: &Transaction<'_>,
    change: &Change,
) -> Result<Option<Attempt>, StoreError> {
    let (update, settle, insert) = try_join3(
        tx.prepare_cached(UPDATE_JOB),
        prepare_if(tx, !change.settled.is_empty(), SETTLE_ATTEMPT),
        prepare_if(tx, change.started.is_some(), insert_attempt_statement()),
    )
    .await
    .map_err(map_pg)?;
    // `settle` is prepared exactly when the change settles attempts.
    let settled: Vec<_> = match &settle {
        Some(statement) => change
            .settled
            .iter()
            .map(|s| settle_attempt(tx, statement, s))
            .collect(),
        None => Vec::new(),
    };
    let started = async {
        match (&change.started, &insert) {
            (Some(start), Some(statement)) => insert_attempt(tx, statement, change.job.id, start)
                .await
                .map(Some),
            _ => Ok(None),
        }
    };
    let (_, _, started) = try_join3(
        update_job(tx, &update, change),
        try_join_all(settled),
        started,
    )
    .await?;
    Ok(started)
}

/// `text` prepared (or found prepared on this connection) when `needed`.
async fn prepare_if(
    tx: &Transaction<'_>,
    needed: bool,
    text: &str,
) -> Result<Option<Statement>, tokio_postgres::Error> {
    match needed {
        true => tx.prepare_cached(text).await.map(Some),
        false => Ok(None),
    }
}

async fn update_job(
    tx: &Transaction<'_>,
    statement: &Statement,
    change: &Change,
) -> Result<u64, StoreError> {
    let head = &change.job;
    let response = change.response.as_ref();
    let (names, values) = response.map(split_headers).unzip();
    tx.execute(
        statement,
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
    .map_err(map_pg)
}

async fn settle_attempt(
    tx: &Transaction<'_>,
    statement: &Statement,
    settled: &Settle,
) -> Result<u64, StoreError> {
    tx.execute(
        statement,
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
    .map_err(map_pg)
}

/// Inserts the attempt a change started, in that change's transaction;
/// returns it as stored.
async fn insert_attempt(
    tx: &Transaction<'_>,
    statement: &Statement,
    job: JobId,
    start: &Start,
) -> Result<Attempt, StoreError> {
    let row = tx
        .query_one(
            statement,
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
