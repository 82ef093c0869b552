//! The writes ([`Backend`]): begin and the CAS commit (both sent in
//! batches, `batch/`), a change under its job's lock, lease expiry.

use std::collections::HashSet;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::GenericClient;
use futures_util::future::try_join_all;

use super::batch::{commit_alone, BeginRequest, CommitRequest, BATCHED_BODY};
use super::rows::snapshots;
use super::sql::{lapsed_jobs_statement, SNAPSHOT_COLUMNS};
use super::write::write;
use super::{map_pg, Postgres};
use crate::{
    commit_under_lock, expire_each, Applied, Backend, Begin, Committed, Decide, Lock, StoreError,
};
use idemgate_domain::attempt::{Attempt, AttemptState, NewAttempt};
use idemgate_domain::job::NewJob;
use idemgate_domain::response::StoredResponse;
use idemgate_domain::transition::{Change, Refusal};
use idemgate_telemetry::Chain;
use tokio::time::Instant;

#[async_trait]
impl Backend for Postgres {
    async fn begin(&self, job: NewJob, attempt: NewAttempt) -> Result<Begin, StoreError> {
        self.begins().ask(BeginRequest { job, attempt }).await
    }

    async fn commit(
        &self,
        attempt: &Attempt,
        response: &StoredResponse,
    ) -> Result<Committed, StoreError> {
        // The winner's path: the CAS, in a batch unless the answer is large.
        let request = CommitRequest::of(attempt, response);
        let won = if response.body.len() <= BATCHED_BODY {
            self.commits().ask(request).await?
        } else {
            commit_alone(&self.pool, &request).await?
        };
        if let Some(won) = won {
            return Ok(won);
        }
        // Not won: the CAS lost, for good (a moved version, a winner, a
        // settled attempt), or skipped a job another transaction holds.
        // The locked path waits for that lock from this request's task,
        // never from a batch's (at most the lock timeout: then the write
        // is tried again, docs/design.md §13, "A lock waited for"), and
        // decides the same CAS under it: it commits a skipped attempt that
        // still may, and supersedes a loser and derives the job's state
        // again (the loser may have been the last attempt running).
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
        // The lock first, then the read, in two statements sent together:
        // the read starts once the lock is taken, with a snapshot of its own
        // (one per statement at READ COMMITTED), so it sees every write of a
        // transaction the lock waited for. Read in the locking statement,
        // the attempts would be as they were before the wait (only the
        // locked job row is read again), missing an attempt that
        // transaction started or settled (docs/design.md §13, "A locked job
        // is skipped").
        let take = tx
            .prepare_cached(&format!(
                "SELECT j.id FROM jobs j WHERE {filter} FOR UPDATE"
            ))
            .await
            .map_err(map_pg)?;
        let read = tx
            .prepare_cached(&format!(
                "SELECT {SNAPSHOT_COLUMNS} FROM jobs j JOIN attempts a ON a.job_id = j.id \
                 WHERE {filter} ORDER BY a.number"
            ))
            .await
            .map_err(map_pg)?;
        let (taken, rows) =
            futures_util::future::try_join(tx.query(&take, &[&id]), tx.query(&read, &[&id]))
                .await
                .map_err(map_pg)?;
        let (snapshots, now) = snapshots(&rows)?;
        // Only the job the lock took: the read asks its filter again.
        let taken = taken.first().map(|row| row.get::<_, uuid::Uuid>(0));
        let Some(snapshot) = snapshots.first().filter(|s| Some(s.job.id.0) == taken) else {
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
        // Jobs another writer holds (or one of whose attempts it holds) are
        // skipped, not waited for: the next sweep (of this replica or
        // another) takes them. Locked first, then read in a statement of
        // its own, as `change` does: a job whose attempt committed after
        // the locking statement began is locked in its newest version, but
        // its attempts would be read as they were, and an attempt that had
        // just succeeded marked unknown.
        let locked: Vec<uuid::Uuid> = tx
            .query(
                lapsed_jobs_statement(),
                &[&i64::from(batch), &AttemptState::Started.as_str()],
            )
            .await
            .map_err(map_pg)?
            .iter()
            .map(|row| row.get(0))
            .collect();
        if locked.is_empty() {
            return Ok(Vec::new());
        }
        let rows = tx
            .query(
                &format!(
                    "SELECT {SNAPSHOT_COLUMNS} FROM jobs j JOIN attempts a ON a.job_id = j.id \
                     WHERE j.id = ANY($1) ORDER BY j.id, a.number"
                ),
                &[&locked],
            )
            .await
            .map_err(map_pg)?;
        let (snapshots, now) = snapshots(&rows)?;
        let changes = expire_each(&snapshots, now);
        // Distinct jobs' rows: sent together, not one round trip each while
        // the batch's locks are held (`write.rs`). The first goes alone and
        // prepares the statements (on a connection that has none yet) the
        // rest then only use.
        if let Some((first, rest)) = changes.split_first() {
            write(&tx, first).await?;
            try_join_all(rest.iter().map(|change| write(&tx, change))).await?;
        }
        let committed = tx.commit().await.map_err(map_pg);
        // Back to the pool (a broken one is dropped there) before asking.
        drop(client);
        match committed {
            Ok(()) => Ok(changes),
            Err(error) => self.landed(changes, error).await,
        }
    }
}

/// How long a sweep whose commit failed goes on asking whether it landed.
const CONFIRM_FOR: Duration = Duration::from_secs(10);

impl Postgres {
    /// The expiries of a sweep whose commit failed (`error`), as far as
    /// they landed all the same: a commit whose reply was lost with its
    /// connection is in. The attempts are read again, on another
    /// connection, until PostgreSQL answers or [`CONFIRM_FOR`] passes;
    /// those now `unknown` are reported as expired, so that their jobs'
    /// bells ring here and a route that reconciles looks them up, as after
    /// any sweep (`docs/design.md` §7, "A sweep whose reply was lost").
    /// None unknown, or no answer: the sweep's error, as before.
    async fn landed(
        &self,
        changes: Vec<Change>,
        error: StoreError,
    ) -> Result<Vec<Change>, StoreError> {
        let ids: Vec<uuid::Uuid> = changes
            .iter()
            .flat_map(|c| c.settled.iter().map(|s| s.attempt.0))
            .collect();
        let Some(unknown) = self.unknown_among(&ids).await else {
            return Err(error);
        };
        let landed: Vec<Change> = changes
            .into_iter()
            .filter(|c| c.settled.iter().any(|s| unknown.contains(&s.attempt.0)))
            .collect();
        if landed.is_empty() {
            return Err(error);
        }
        tracing::info!(error = %Chain(&error), jobs = landed.len(), "a sweep's commit failed, yet its attempts are unknown: it landed, its reply was lost");
        Ok(landed)
    }

    /// Which of `ids` are `unknown`, asked until PostgreSQL answers or
    /// [`CONFIRM_FOR`] passes (`None`).
    async fn unknown_among(&self, ids: &[uuid::Uuid]) -> Option<HashSet<uuid::Uuid>> {
        let read = || async {
            let client = self.client().await?;
            let rows = client
                .query(
                    "SELECT id FROM attempts WHERE id = ANY($1) AND state = $2",
                    &[&ids, &AttemptState::Unknown.as_str()],
                )
                .await
                .map_err(map_pg)?;
            Ok::<_, StoreError>(rows.iter().map(|r| r.get(0)).collect())
        };
        let deadline = Instant::now() + CONFIRM_FOR;
        let mut backoff = Duration::from_millis(50);
        loop {
            match read().await {
                Ok(unknown) => return Some(unknown),
                Err(e) if e.is_transient() && Instant::now() + backoff < deadline => {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                Err(_) => return None,
            }
        }
    }
}
