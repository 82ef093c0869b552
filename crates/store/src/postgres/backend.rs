//! The writes ([`Backend`]): begin, the CAS commit, a change under its
//! job's lock, lease expiry.

use async_trait::async_trait;
use deadpool_postgres::GenericClient;

use super::rows::{snapshots, split_headers};
use super::sql::SNAPSHOT_COLUMNS;
use super::write::write;
use super::{map_pg, Postgres};
use crate::{
    commit_under_lock, expire_each, Applied, Backend, Begin, Committed, Decide, Lock, StoreError,
};
use idemgate_domain::attempt::{Attempt, AttemptState, NewAttempt};
use idemgate_domain::job::{JobState, NewJob};
use idemgate_domain::response::StoredResponse;
use idemgate_domain::transition::{Change, Refusal};

#[async_trait]
impl Backend for Postgres {
    async fn begin(&self, job: NewJob, attempt: NewAttempt) -> Result<Begin, StoreError> {
        self.batcher().begin(job, attempt).await
    }

    async fn commit(
        &self,
        attempt: &Attempt,
        response: &StoredResponse,
    ) -> Result<Committed, StoreError> {
        let client = self.client().await?;
        let (names, values) = split_headers(response);
        let status = response.status as i16;
        let unsettled = [
            AttemptState::Started.as_str(),
            AttemptState::Unknown.as_str(),
        ];
        // The winner's path, in one statement: `transition::may_commit` as a
        // compare-and-swap, the attempt succeeding with it.
        let commit = client
            .prepare_cached(
                "WITH won AS ( \
                   UPDATE jobs SET state = $8, completed_by = $2, response_status = $3, \
                          response_header_names = $4, response_header_values = $5, \
                          response_body = $6, version = version + 1, updated_at = now() \
                   WHERE id = $1 AND version = $7 AND completed_by IS NULL \
                     AND EXISTS (SELECT 1 FROM attempts WHERE id = $2 AND state = ANY($9)) \
                   RETURNING id, watched \
                 ), settled AS ( \
                   UPDATE attempts SET state = $10, finished_at = now(), upstream_status = $3 \
                   WHERE id = $2 AND EXISTS (SELECT 1 FROM won) \
                   RETURNING id \
                 ) \
                 SELECT EXISTS (SELECT 1 FROM won), COALESCE((SELECT watched FROM won), false)",
            )
            .await
            .map_err(map_pg)?;
        let row = client
            .query_one(
                &commit,
                &[
                    &attempt.job_id.0,
                    &attempt.id.0,
                    &status,
                    &names,
                    &values,
                    &response.body.as_ref(),
                    &attempt.job_version,
                    &JobState::Completed.as_str(),
                    &unsettled.as_slice(),
                    &AttemptState::Succeeded.as_str(),
                ],
            )
            .await
            .map_err(map_pg)?;
        Postgres::release(client, response.body.len());
        if row.get(0) {
            return Ok(Committed {
                won: true,
                watched: row.get(1),
            });
        }
        // Lost: every reason to lose (a moved version, a winner, a settled
        // attempt) is for good, so the locked path agrees, and it also
        // supersedes the attempt and derives the job's state again (the
        // loser may have been the last attempt running).
        commit_under_lock(self, attempt, response).await
    }

    async fn change(
        &self,
        lock: Lock,
        decide: Decide,
    ) -> Result<Result<Applied, Refusal>, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(map_pg)?;
        let (filter, id) = match lock {
            Lock::Job(job) => ("j.id = $1", job.0),
            Lock::JobOf(attempt) => (
                "j.id = (SELECT job_id FROM attempts WHERE id = $1)",
                attempt.0,
            ),
        };
        let rows = tx
            .query(
                &format!(
                    "SELECT {SNAPSHOT_COLUMNS} FROM jobs j JOIN attempts a ON a.job_id = j.id \
                     WHERE {filter} ORDER BY a.number FOR UPDATE OF j"
                ),
                &[&id],
            )
            .await
            .map_err(map_pg)?;
        let (snapshots, now) = snapshots(&rows)?;
        let Some(snapshot) = snapshots.first() else {
            return Err(StoreError::NotFound(match lock {
                Lock::Job(_) => "job",
                Lock::JobOf(_) => "attempt",
            }));
        };
        let change = match decide(snapshot, now) {
            Ok(change) => change,
            Err(refusal) => return Ok(Err(refusal)),
        };
        let started = write(&tx, &change).await?;
        tx.commit().await.map_err(map_pg)?;
        Postgres::release(client, change.response.as_ref().map_or(0, |r| r.body.len()));
        Ok(Ok(Applied { change, started }))
    }

    async fn expire_lapsed(&self, batch: u32) -> Result<Vec<Change>, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(map_pg)?;
        // Jobs another writer holds are skipped, not waited for: the next
        // sweep (of this replica or another) takes them.
        let rows = tx
            .query(
                &format!(
                    "SELECT {SNAPSHOT_COLUMNS} FROM jobs j JOIN attempts a ON a.job_id = j.id \
                     WHERE j.id IN ( \
                       SELECT job_id FROM attempts \
                       WHERE state = $2 AND lease_expires_at < now() \
                       ORDER BY lease_expires_at LIMIT $1) \
                     ORDER BY j.id, a.number FOR UPDATE OF j SKIP LOCKED"
                ),
                &[&i64::from(batch), &AttemptState::Started.as_str()],
            )
            .await
            .map_err(map_pg)?;
        let (snapshots, now) = snapshots(&rows)?;
        let changes = expire_each(&snapshots, now);
        for change in &changes {
            write(&tx, change).await?;
        }
        tx.commit().await.map_err(map_pg)?;
        Ok(changes)
    }
}
