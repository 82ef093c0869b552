//! Commits in batches (`docs/design.md` §13, "Batched begins and
//! commits"): the CAS of many attempts, each of its own job, in one
//! statement.
//!
//! The CAS stays exactly as strict as one by one: a row is committed only
//! where its job still has the version the attempt started under, no
//! winner, and the attempt is unsettled; the statement checks just that,
//! per row. A batch holds each job once (a second attempt of a job waits
//! for the next batch), and locks its jobs in id order before it writes,
//! skipping any job or attempt another transaction holds, so a batch
//! never waits on a row's lock (an operator's `UPDATE attempts` left open
//! would otherwise hold the commit slot for the lock timeout, and again
//! for the split that followed). Rows come back by job id, never by
//! position. A request the batch did not commit lost the CAS or found its
//! job held; its caller settles it under the job's lock, which waits for
//! that holder (at most the lock timeout), from the request's own task
//! (`docs/design.md` §13, "A locked job is skipped", "A lock waited for").
//! A batch whose statement fails is split, each commit sent alone.

use std::collections::HashMap;

use deadpool_postgres::Pool;
use tokio_postgres::types::ToSql;
use uuid::Uuid;

use super::super::rows::split_headers;
use super::super::{map_pg, Postgres};
use super::{Batched, Waiting};
use crate::{Committed, StoreError};
use idemgate_domain::attempt::{Attempt, AttemptState};
use idemgate_domain::job::JobState;
use idemgate_domain::response::StoredResponse;

/// The largest answer a batch carries; a larger one commits alone, so a
/// batch's buffers stay small (64 of these at most).
pub(in crate::postgres) const BATCHED_BODY: usize = 64 * 1024;

/// An attempt's CAS commit of `response`.
pub(in crate::postgres) struct CommitRequest {
    pub(in crate::postgres) job: Uuid,
    pub(in crate::postgres) attempt: Uuid,
    pub(in crate::postgres) version: i64,
    pub(in crate::postgres) response: StoredResponse,
}

impl CommitRequest {
    pub(in crate::postgres) fn of(attempt: &Attempt, response: &StoredResponse) -> Self {
        CommitRequest {
            job: attempt.job_id.0,
            attempt: attempt.id.0,
            version: attempt.job_version,
            response: response.clone(),
        }
    }
}

/// What the CAS said: won (and whether the job is watched), or lost.
pub(in crate::postgres) type Won = Option<Committed>;

impl Batched for CommitRequest {
    type Key = Uuid;
    type Answer = Won;

    fn key(&self) -> Uuid {
        self.job
    }

    fn weight(&self) -> usize {
        let headers: usize = self
            .response
            .headers
            .iter()
            .map(|(name, value)| name.len() + value.len())
            .sum();
        self.response.body.len() + headers
    }

    async fn send(pool: Pool, batch: Vec<Waiting<Self>>) {
        send(&pool, batch).await
    }
}

/// Sends `batch` as one statement and answers each request; if it failed,
/// each is sent again alone.
async fn send(pool: &Pool, mut batch: Vec<Waiting<CommitRequest>>) {
    if batch.len() == 1 {
        // Alone, the one-row statement is the cheaper (`COMMIT_ONE`).
        return answer_alone(pool, batch).await;
    }
    batch.sort_by_key(|w| w.request.job);
    match commit_many(pool, &batch).await {
        Ok(mut won) => {
            for waiting in batch {
                let answer = won.remove(&(waiting.request.job, waiting.request.attempt));
                waiting.answer(Ok(answer));
            }
        }
        Err(_) => answer_alone(pool, batch).await,
    }
}

/// Sends each of `requests` alone, at once, and answers it.
async fn answer_alone(pool: &Pool, requests: Vec<Waiting<CommitRequest>>) {
    let alone = requests.into_iter().map(|waiting| async move {
        let answer = commit_alone(pool, &waiting.request).await;
        waiting.answer(answer);
    });
    futures_util::future::join_all(alone).await;
}

/// One statement for all of `batch`: the commits that won, by job and
/// attempt, and whether each job is watched. A batch holds a job once
/// ([`Batched::key`]); told by job and attempt both, a second commit of
/// one job could still never hear the first's win as its own.
async fn commit_many(
    pool: &Pool,
    batch: &[Waiting<CommitRequest>],
) -> Result<HashMap<(Uuid, Uuid), Committed>, StoreError> {
    let client = Postgres::pooled(pool).await?;
    let statement = client.prepare_cached(COMMIT_MANY).await.map_err(map_pg)?;
    let columns = Columns::of(batch.iter().map(|w| &w.request));
    let rows = client
        .query(&statement, &columns.params())
        .await
        .map_err(map_pg)?;
    Postgres::release(client, columns.carried);
    Ok(rows
        .iter()
        .map(|row| {
            let watched = row.get(1);
            ((row.get(0), row.get(2)), Committed { won: true, watched })
        })
        .collect())
}

/// One commit alone: the CAS in one statement (`COMMIT_ONE`).
pub(in crate::postgres) async fn commit_alone(
    pool: &Pool,
    request: &CommitRequest,
) -> Result<Won, StoreError> {
    let client = Postgres::pooled(pool).await?;
    let commit = client.prepare_cached(COMMIT_ONE).await.map_err(map_pg)?;
    let response = &request.response;
    let (names, values) = split_headers(response);
    let row = client
        .query_one(
            &commit,
            &[
                &request.job,
                &request.attempt,
                &(response.status as i16),
                &names,
                &values,
                &response.body.as_ref(),
                &request.version,
                &JobState::Completed.as_str(),
                &unsettled().as_slice(),
                &AttemptState::Succeeded.as_str(),
            ],
        )
        .await
        .map_err(map_pg)?;
    Postgres::release(client, response.body.len());
    Ok(row.get::<_, bool>(0).then(|| Committed {
        won: true,
        watched: row.get(1),
    }))
}

/// The states an attempt may commit from.
fn unsettled() -> [&'static str; 2] {
    [
        AttemptState::Started.as_str(),
        AttemptState::Unknown.as_str(),
    ]
}

/// The CAS for one attempt: `transition::may_commit` as a compare-and-swap,
/// the attempt succeeding with it. A job or an attempt another transaction
/// has locked is skipped, not waited on (`SKIP LOCKED`, the job's row
/// locked first): the commit then goes to the locked path from its
/// request's own task, so a lock held long (an operator's open transaction)
/// holds up that job's commit only, never the batch slot every other commit
/// of the replica waits for (`docs/design.md` §13, "A locked job is
/// skipped"). Locked, the attempt's state is also checked in its newest
/// version, not the statement's snapshot.
const COMMIT_ONE: &str = "WITH locked AS MATERIALIZED ( \
       SELECT j.id FROM jobs j JOIN attempts a ON a.id = $2 AND a.job_id = j.id \
       WHERE j.id = $1 AND j.version = $7 AND j.completed_by IS NULL AND a.state = ANY($9) \
       FOR NO KEY UPDATE OF j SKIP LOCKED FOR NO KEY UPDATE OF a SKIP LOCKED \
     ), won AS ( \
       UPDATE jobs j SET state = $8, completed_by = $2, response_status = $3, \
              response_header_names = $4, response_header_values = $5, \
              response_body = $6, version = j.version + 1, updated_at = now() \
       FROM locked l WHERE j.id = l.id AND j.version = $7 AND j.completed_by IS NULL \
       RETURNING j.id, j.watched \
     ), settled AS ( \
       UPDATE attempts SET state = $10, finished_at = now(), upstream_status = $3 \
       WHERE id = $2 AND EXISTS (SELECT 1 FROM won) \
       RETURNING id \
     ) \
     SELECT EXISTS (SELECT 1 FROM won), COALESCE((SELECT watched FROM won), false)";

/// The same CAS for many attempts, one element of each array per attempt:
/// job ids ($1), attempt ids ($2), statuses ($3), the versions they started
/// under ($4), bodies ($5); every attempt's header names ($6) and values
/// ($7) in one flat array each, an attempt's from its `lo` ($8) to its `hi`
/// ($9), 1-based and inclusive (`hi < lo`: none). The jobs that may commit
/// are locked in id order first (`locked`), with the lock the single CAS's
/// update takes, so an attempt's insert (which locks its job for the
/// foreign key) is not held up; a job or an attempt another transaction
/// holds is skipped, as by [`COMMIT_ONE`], and its commit goes to the
/// locked path. One row per job committed, with the attempt that won. Both CASes check that the
/// attempt is the job's.
const COMMIT_MANY: &str = "WITH input AS ( \
       SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::smallint[], $4::bigint[], \
                            $5::bytea[], $8::int[], $9::int[]) \
         AS i(job_id, attempt_id, status, version, body, lo, hi) \
     ), locked AS MATERIALIZED ( \
       SELECT j.id FROM jobs j JOIN input i ON i.job_id = j.id \
         JOIN attempts a ON a.id = i.attempt_id AND a.job_id = i.job_id \
       WHERE j.version = i.version AND j.completed_by IS NULL AND a.state = ANY($11) \
       ORDER BY j.id FOR NO KEY UPDATE OF j SKIP LOCKED FOR NO KEY UPDATE OF a SKIP LOCKED \
     ), won AS ( \
       UPDATE jobs j SET state = $10, completed_by = i.attempt_id, response_status = i.status, \
              response_header_names = ($6::text[])[i.lo:i.hi], \
              response_header_values = ($7::bytea[])[i.lo:i.hi], \
              response_body = i.body, version = j.version + 1, updated_at = now() \
       FROM locked l JOIN input i ON i.job_id = l.id \
       WHERE j.id = l.id AND j.version = i.version AND j.completed_by IS NULL \
       RETURNING j.id, j.watched, i.attempt_id, i.status \
     ), settled AS ( \
       UPDATE attempts a SET state = $12, finished_at = now(), upstream_status = w.status \
       FROM won w WHERE a.id = w.attempt_id \
       RETURNING a.id \
     ) \
     SELECT id, watched, attempt_id FROM won";

/// The batched statement's parameters.
struct Columns<'a> {
    jobs: Vec<Uuid>,
    attempts: Vec<Uuid>,
    statuses: Vec<i16>,
    versions: Vec<i64>,
    bodies: Vec<&'a [u8]>,
    names: Vec<&'a str>,
    values: Vec<&'a [u8]>,
    lo: Vec<i32>,
    hi: Vec<i32>,
    /// The bodies' bytes, which the connection's buffers held.
    carried: usize,
    completed: &'static str,
    unsettled: Vec<&'static str>,
    succeeded: &'static str,
}

impl<'a> Columns<'a> {
    fn of(requests: impl ExactSizeIterator<Item = &'a CommitRequest>) -> Self {
        let n = requests.len();
        let mut c = Columns {
            jobs: Vec::with_capacity(n),
            attempts: Vec::with_capacity(n),
            statuses: Vec::with_capacity(n),
            versions: Vec::with_capacity(n),
            bodies: Vec::with_capacity(n),
            names: Vec::new(),
            values: Vec::new(),
            lo: Vec::with_capacity(n),
            hi: Vec::with_capacity(n),
            carried: 0,
            completed: JobState::Completed.as_str(),
            unsettled: unsettled().to_vec(),
            succeeded: AttemptState::Succeeded.as_str(),
        };
        for r in requests {
            c.jobs.push(r.job);
            c.attempts.push(r.attempt);
            c.statuses.push(r.response.status as i16);
            c.versions.push(r.version);
            c.bodies.push(r.response.body.as_ref());
            c.carried += r.response.body.len();
            c.lo.push(c.names.len() as i32 + 1);
            for (name, value) in &r.response.headers {
                c.names.push(name);
                c.values.push(value);
            }
            c.hi.push(c.names.len() as i32);
        }
        c
    }

    fn params(&self) -> [&(dyn ToSql + Sync); 12] {
        [
            &self.jobs,
            &self.attempts,
            &self.statuses,
            &self.versions,
            &self.bodies,
            &self.names,
            &self.values,
            &self.lo,
            &self.hi,
            &self.completed,
            &self.unsettled,
            &self.succeeded,
        ]
    }
}
