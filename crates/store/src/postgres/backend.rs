//! The writes ([`Backend`]): begin and the CAS commit (both sent in
//! batches, `batch/`), a change under its job's lock, lease expiry.

use std::time::{Duration, SystemTime};

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
            commit_alone(self.pool(), &request).await?
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
        // The transaction's id, and the server's start, sent with the read:
        // should the commit's reply be lost, the server is asked what became
        // of it. An id is the server's own: another server (a promoted
        // standby) or the same one restarted may give it out again.
        let read = format!(
            "SELECT {SNAPSHOT_COLUMNS} FROM jobs j JOIN attempts a ON a.job_id = j.id \
             WHERE j.id = ANY($1) ORDER BY j.id, a.number"
        );
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&locked];
        let (xid, rows) = tokio::try_join!(
            tx.query_one("SELECT txid_current(), pg_postmaster_start_time()", &[]),
            tx.query(&read, &params),
        )
        .map_err(map_pg)?;
        let xid = Xid {
            id: xid.get(0),
            server: xid.get(1),
        };
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
            Err(error) => self.landed(changes, xid, error).await,
        }
    }
}

/// How long a sweep whose commit failed goes on asking whether it landed.
const CONFIRM_FOR: Duration = Duration::from_secs(10);

/// A transaction's id, on the server (known by its start) that gave it.
#[derive(Clone, Copy)]
struct Xid {
    id: i64,
    server: SystemTime,
}

impl Postgres {
    /// The expiries of a sweep whose commit failed (`error`), if its
    /// transaction (`xid`) committed all the same: a commit whose reply was
    /// lost with its connection is in. The server is asked, on another
    /// connection, until it says committed or aborted or [`CONFIRM_FOR`]
    /// passes; committed, the expiries are reported as after any sweep, so
    /// that their jobs' bells ring here and a route that reconciles looks
    /// them up (`docs/design.md` §7, "A sweep whose reply was lost").
    /// Aborted, or no answer: the sweep's error, as before. The
    /// transaction's fate, not the attempts' states: another replica's
    /// sweep may have expired the same attempts since, and reports them
    /// itself.
    async fn landed(
        &self,
        changes: Vec<Change>,
        xid: Xid,
        error: StoreError,
    ) -> Result<Vec<Change>, StoreError> {
        if !self.committed(xid).await {
            return Err(error);
        }
        tracing::info!(error = %Chain(&error), jobs = changes.len(), "a sweep's commit failed, yet it committed: its reply was lost");
        Ok(changes)
    }

    /// Whether the transaction `xid` committed, asked until the server says
    /// ([`fate`]) or [`CONFIRM_FOR`] passes (then `false`).
    async fn committed(&self, xid: Xid) -> bool {
        let ask = || async {
            let client = self.client().await?;
            let row = client
                .query_one(
                    "SELECT txid_status($1), pg_postmaster_start_time(), \
                            txid_visible_in_snapshot($1, txid_current_snapshot())",
                    &[&xid.id],
                )
                .await
                .map_err(map_pg)?;
            let status = row.get::<_, Option<&str>>(0);
            let same_server = row.get::<_, SystemTime>(1) == xid.server;
            Ok::<_, StoreError>(fate(status, same_server, row.get(2)))
        };
        let deadline = Instant::now() + CONFIRM_FOR;
        let mut backoff = Duration::from_millis(50);
        loop {
            match ask().await {
                Ok(Fate::Committed) => return true,
                Ok(Fate::Aborted | Fate::Unknowable) => return false,
                Ok(Fate::InProgress) => {}
                Err(e) if e.is_transient() => {}
                Err(_) => return false,
            }
            if Instant::now() + backoff >= deadline {
                return false;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}

/// What became of a transaction, as its server says.
#[derive(Debug, PartialEq, Eq)]
enum Fate {
    Committed,
    Aborted,
    /// Not yet decided: the server has not seen its connection go, or a
    /// commit still waits for a synchronous standby.
    InProgress,
    /// The server cannot say: it no longer knows the id (`txid_status` is
    /// null for a transaction too old, not for one seconds old), or it is
    /// not the one that gave it (restarted, or another after a failover:
    /// the id may be another transaction's there).
    Unknowable,
}

/// The fate `txid_status` (`status`) says, on the server that gave the id
/// or not (`same_server`), its changes `seen` in a snapshot taken now.
/// Servers before the minor releases of August 2022 say committed while
/// the commit still waits for a synchronous standby, its changes not yet
/// seen: in progress, then.
fn fate(status: Option<&str>, same_server: bool, seen: bool) -> Fate {
    match status {
        _ if !same_server => Fate::Unknowable,
        Some("committed") if seen => Fate::Committed,
        Some("committed" | "in progress") => Fate::InProgress,
        Some("aborted") => Fate::Aborted,
        _ => Fate::Unknowable,
    }
}

#[cfg(test)]
mod tests {
    use super::{fate, Fate};

    #[test]
    fn a_transaction_counts_as_committed_only_once_seen_on_its_own_server() {
        assert_eq!(fate(Some("committed"), true, true), Fate::Committed);
        assert_eq!(fate(Some("committed"), true, false), Fate::InProgress);
        assert_eq!(fate(Some("in progress"), true, false), Fate::InProgress);
        assert_eq!(fate(Some("aborted"), true, false), Fate::Aborted);
        assert_eq!(fate(None, true, false), Fate::Unknowable);
        assert_eq!(fate(Some("committed"), false, true), Fate::Unknowable);
    }
}
