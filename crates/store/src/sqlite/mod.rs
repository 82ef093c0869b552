//! The embedded backend: SQLite in one local file, for single-node use and
//! demos, with the same guarantees as PostgreSQL.
//!
//! - `UNIQUE (owner, key)` is the arbiter; every change, the commit
//!   included, runs the domain's transition on the locked job inside one
//!   `BEGIN IMMEDIATE` transaction (SQLite's single writer lock).
//! - Every operation runs on one thread of the store's own, never on the
//!   async runtime, over one connection: SQLite has one writer at a time
//!   anyway, and serialising here makes each operation trivially atomic.
//! - Group commit: the operations waiting when the thread turns to its
//!   queue run one after another inside one transaction (each in a
//!   savepoint of its own, so one that fails undoes only itself), and one
//!   `COMMIT`, one fsync, makes them all durable. No operation's result is
//!   handed back before that commit.
//! - Durability: WAL journal with `synchronous = FULL`, so a transaction
//!   that returned is on disk (fsync per commit) and survives a crash or a
//!   power loss; a response is committed before any client sees it.
//! - One gateway per file, enforced by an exclusive lock on `<file>.lock`:
//!   held duplicates are woken in-process only. Several replicas need
//!   PostgreSQL.
//! - At start-up every attempt still `started` belonged to a gateway that
//!   stopped (the lock proves none is running): it becomes `unknown`.
//!
//! Ids are stored as UUID text and times as milliseconds since the epoch;
//! both are converted at this boundary, never passed around as strings.

mod change;
mod group_commit;
mod open;
mod rows;
#[cfg(test)]
mod tests;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use rusqlite::{params, Connection};

use self::change::{change_blocking, immediate, insert_attempt, snapshot, write};
use self::group_commit::Op;
use self::rows::{
    job_from_row, map_sqlite, now_ms, read_detail, read_job, read_response, to_ms, uuid,
    JOB_COLUMNS,
};
use crate::{
    commit_under_lock, expire_each, millis, Applied, Backend, Begin, Committed, Cursor, Decide,
    Lock, Records, StoreError,
};
use idemgate_domain::attempt::{Attempt, AttemptState, NewAttempt};
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::job::{Job, JobDetail, JobState, NewJob};
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_domain::reconcile::Lookup;
use idemgate_domain::response::StoredResponse;
use idemgate_domain::transition::{Change, Refusal};

/// The SQLite [`Backend`].
#[derive(Clone)]
pub struct Sqlite {
    /// The store's thread, which owns the connection (see [`writer`]).
    ops: mpsc::Sender<Op>,
    /// Batches committed so far (each one `COMMIT`, one fsync).
    batches: Arc<AtomicUsize>,
    path: PathBuf,
    _lock: Arc<File>,
}

impl std::fmt::Debug for Sqlite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sqlite")
            .field("path", &self.path)
            .field("batches", &self.batches.load(Ordering::Relaxed))
            .finish()
    }
}

impl Sqlite {
    /// Opens (creating if need be) the store at `path`, applies migrations,
    /// and records attempts left `started` by a previous run as `unknown`.
    pub async fn open(path: &Path) -> Result<Self, StoreError> {
        let path = path.to_owned();
        tokio::task::spawn_blocking(move || Self::open_blocking(path))
            .await
            .map_err(|e| StoreError::Internal(Box::new(e)))?
    }

    /// Runs `f` on the connection, on the store's thread, and answers once
    /// what it wrote is committed.
    async fn call<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let (answer, answered) = tokio::sync::oneshot::channel();
        let op: Op = Box::new(move |conn| {
            let result = f(conn);
            Box::new(move |committed: &Result<(), StoreError>| {
                let result = match (result, committed) {
                    (Ok(_), Err(e)) => Err(StoreError::Unavailable(
                        format!("the commit failed: {e}").into(),
                    )),
                    (result, _) => result,
                };
                let _ = answer.send(result);
            })
        });
        let stopped = || StoreError::Internal("the embedded store's thread stopped".into());
        self.ops.send(op).map_err(|_| stopped())?;
        answered.await.map_err(|_| stopped())?
    }
}

#[async_trait]
impl Records for Sqlite {
    async fn job(&self, id: JobId) -> Result<Option<Job>, StoreError> {
        self.call(move |conn| read_job(conn, "j.id = ?1", [id.0.to_string()]))
            .await
    }

    async fn response(&self, job: JobId) -> Result<Option<StoredResponse>, StoreError> {
        self.call(move |conn| read_response(conn, job)).await
    }

    async fn job_detail(&self, id: JobId) -> Result<Option<JobDetail>, StoreError> {
        self.call(move |conn| {
            let job = read_job(conn, "j.id = ?1", [id.0.to_string()])?;
            read_detail(conn, job)
        })
        .await
    }

    async fn find_job(
        &self,
        owner: &Owner,
        key: &IdempotencyKey,
    ) -> Result<Option<JobDetail>, StoreError> {
        let (owner, key) = (owner.clone(), key.clone());
        self.call(move |conn| {
            let job = read_job(
                conn,
                "j.owner = ?1 AND j.key = ?2",
                params![owner.as_str(), key.as_str()],
            )?;
            read_detail(conn, job)
        })
        .await
    }

    async fn unknown_jobs(
        &self,
        after: Option<Cursor>,
        limit: u32,
    ) -> Result<Vec<Job>, StoreError> {
        let after_ms = after.map(|c| to_ms(c.created_at));
        let after_id = after.map(|c| c.job.0.to_string());
        self.call(move |conn| {
            let mut select = conn
                .prepare_cached(&format!(
                    "SELECT {JOB_COLUMNS} FROM jobs j WHERE j.state = 'unknown' \
                     AND (?1 IS NULL OR j.created_at < ?1 OR (j.created_at = ?1 AND j.id < ?2)) \
                     ORDER BY j.created_at DESC, j.id DESC LIMIT ?3"
                ))
                .map_err(map_sqlite)?;
            let rows = select
                .query_map(params![after_ms, after_id, limit], job_from_row)
                .map_err(map_sqlite)?;
            rows.map(|row| row.map_err(map_sqlite)?).collect()
        })
        .await
    }

    async fn unknown_attempts(
        &self,
        since: SystemTime,
        limit: u32,
    ) -> Result<Vec<(JobId, AttemptId)>, StoreError> {
        let since = to_ms(since);
        self.call(move |conn| {
            // Served by the partial index `attempts_unknown_started` (V3).
            let mut select = conn
                .prepare_cached(
                    "SELECT job_id, id FROM attempts WHERE state = 'unknown' AND started_at > ?1 \
                     ORDER BY started_at, id LIMIT ?2",
                )
                .map_err(map_sqlite)?;
            let rows = select
                .query_map(params![since, limit], |row| {
                    Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?))
                })
                .map_err(map_sqlite)?;
            rows.map(|row| {
                let (job, attempt) = row.map_err(map_sqlite)?;
                Ok((JobId(rows::uuid(&job)?), AttemptId(rows::uuid(&attempt)?)))
            })
            .collect()
        })
        .await
    }

    async fn renew_leases(
        &self,
        attempts: &[AttemptId],
        lease: Duration,
    ) -> Result<u64, StoreError> {
        let ids: Vec<String> = attempts.iter().map(|a| a.0.to_string()).collect();
        self.call(move |conn| {
            let until = now_ms() + millis(lease);
            let tx = immediate(conn)?;
            let mut renewed = 0;
            for id in &ids {
                renewed += tx
                    .execute(
                        "UPDATE attempts SET lease_expires_at = ?2 WHERE id = ?1 AND state = ?3",
                        params![id, until, AttemptState::Started.as_str()],
                    )
                    .map_err(map_sqlite)? as u64;
            }
            tx.commit().map_err(map_sqlite)?;
            Ok(renewed)
        })
        .await
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.call(move |conn| {
            conn.execute(
                &format!(
                    "DELETE FROM jobs WHERE id IN ( \
                       SELECT id FROM jobs j WHERE {} ORDER BY expires_at LIMIT ?2)",
                    forgotten("?1")
                ),
                params![now_ms(), batch],
            )
            .map(|n| n as u64)
            .map_err(map_sqlite)
        })
        .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.call(|conn| {
            conn.query_row("SELECT 1", [], |_| Ok(()))
                .map_err(map_sqlite)
        })
        .await
    }

    async fn watch(&self, _job: JobId) -> Result<(), StoreError> {
        // One gateway per file: every waiter is woken in-process.
        Ok(())
    }

    async fn mark_call(
        &self,
        _attempt: AttemptId,
        _instance: uuid::Uuid,
        _call: &crate::CallAt,
        _for_at_most: Duration,
    ) -> Result<(), StoreError> {
        // One gateway per file: its calls are known in that process.
        Ok(())
    }

    async fn unmark_call(&self, _attempt: AttemptId) -> Result<(), StoreError> {
        Ok(())
    }

    async fn call_at_server(
        &self,
        _session: &[u8; 32],
        _call: Option<&[u8; 32]>,
        _except: uuid::Uuid,
    ) -> Result<bool, StoreError> {
        Ok(false)
    }

    async fn record_lookup(&self, attempt: AttemptId, lookup: &Lookup) -> Result<(), StoreError> {
        let (id, at) = (attempt.0.to_string(), to_ms(lookup.at));
        let (status, result) = (lookup.status, lookup.result.as_str());
        self.call(move |conn| {
            let updated = conn
                .execute(
                    "UPDATE attempts SET lookups = lookups + 1, last_lookup_at = ?2, \
                     last_lookup_status = ?3, last_lookup_result = ?4 WHERE id = ?1",
                    params![id, at, status, result],
                )
                .map_err(map_sqlite)?;
            if updated == 0 {
                return Err(StoreError::NotFound("attempt"));
            }
            Ok(())
        })
        .await
    }
}

#[async_trait]
impl Backend for Sqlite {
    async fn begin(&self, job: NewJob, attempt: NewAttempt) -> Result<Begin, StoreError> {
        self.call(move |conn| {
            let now = now_ms();
            // Most requests that reach the store are duplicates: a plain read
            // answers them without a write transaction. One connection serves
            // the whole gateway, so nothing can come between this read and
            // the insert below.
            let existing = read_job(
                conn,
                "j.owner = ?1 AND j.key = ?2",
                params![job.owner.as_str(), job.key.as_str()],
            )?;
            if let Some(existing) = existing {
                if to_ms(existing.expires_at) > now || !is_forgotten(conn, existing.id, now)? {
                    return Ok(Begin::Existing(existing));
                }
            }
            let tx = immediate(conn)?;
            // An expired job that was not purged yet is forgotten: the key starts afresh.
            tx.execute(
                &format!(
                    "DELETE FROM jobs AS j WHERE j.owner = ?1 AND j.key = ?2 AND {}",
                    forgotten("?3")
                ),
                params![job.owner.as_str(), job.key.as_str(), now],
            )
            .map_err(map_sqlite)?;
            let inserted = tx
                .execute(
                    "INSERT INTO jobs (id, owner, key, fingerprint, route, state, version, attempt_count, \
                                       created_at, updated_at, expires_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, 1, 1, ?7, ?7, ?8) \
                     ON CONFLICT (owner, key) DO NOTHING",
                    params![
                        job.id.0.to_string(),
                        job.owner.as_str(),
                        job.key.as_str(),
                        job.fingerprint.0.as_slice(),
                        job.route,
                        JobState::Running.as_str(),
                        now,
                        now + millis(job.ttl),
                    ],
                )
                .map_err(map_sqlite)?;
            let begin = if inserted == 1 {
                let attempt = insert_attempt(&tx, job.id, 1, 1, &attempt, now)?;
                let created = read_job(&tx, "j.id = ?1", [job.id.0.to_string()])?
                    .ok_or(StoreError::NotFound("job"))?;
                Begin::Created(created, attempt)
            } else {
                let existing = read_job(
                    &tx,
                    "j.owner = ?1 AND j.key = ?2",
                    params![job.owner.as_str(), job.key.as_str()],
                )?
                .ok_or(StoreError::Contended)?;
                Begin::Existing(existing)
            };
            tx.commit().map_err(map_sqlite)?;
            Ok(begin)
        })
        .await
    }

    async fn commit(
        &self,
        attempt: &Attempt,
        response: &StoredResponse,
    ) -> Result<Committed, StoreError> {
        commit_under_lock(self, attempt, response).await
    }

    async fn change(
        &self,
        lock: Lock,
        decide: Decide,
    ) -> Result<Result<Applied, Refusal>, StoreError> {
        self.call(move |conn| change_blocking(conn, lock, decide))
            .await
    }

    async fn expire_lapsed(&self, batch: u32) -> Result<Vec<Change>, StoreError> {
        self.call(move |conn| {
            let now = SystemTime::now();
            let tx = immediate(conn)?;
            let jobs: Vec<JobId> = {
                let mut stmt = tx
                    .prepare(
                        "SELECT DISTINCT job_id FROM attempts \
                         WHERE state = ?1 AND lease_expires_at < ?2 LIMIT ?3",
                    )
                    .map_err(map_sqlite)?;
                let ids = stmt
                    .query_map(
                        params![AttemptState::Started.as_str(), to_ms(now), batch],
                        |r| r.get::<_, String>(0),
                    )
                    .map_err(map_sqlite)?
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(map_sqlite)?;
                ids.iter()
                    .map(|id| uuid(id).map(JobId))
                    .collect::<Result<_, _>>()?
            };
            let mut snapshots = Vec::with_capacity(jobs.len());
            for job in jobs {
                snapshots.extend(snapshot(&tx, job)?);
            }
            let changes = expire_each(&snapshots, now);
            for change in &changes {
                write(&tx, change, now)?;
            }
            tx.commit().map_err(map_sqlite)?;
            Ok(changes)
        })
        .await
    }
}

/// Whether the job `j` is past its expiry at `now` (a placeholder, in
/// milliseconds) and forgotten: none of its attempts may still answer and
/// it has not changed for [`SETTLED_GRACE`](crate::SETTLED_GRACE), as in
/// the PostgreSQL store's `FORGOTTEN` (`docs/design.md` §11, "not
/// forgotten").
fn forgotten(now: &str) -> String {
    let grace = crate::millis(crate::SETTLED_GRACE);
    format!(
        "(j.expires_at <= {now} AND j.updated_at <= {now} - {grace} AND NOT EXISTS ( \
           SELECT 1 FROM attempts a WHERE a.job_id = j.id \
           AND (a.state = 'started' OR (a.state = 'unknown' AND a.deadline_at > {now}))))"
    )
}

/// Whether the expired job `job` is forgotten at `now` ([`forgotten`]).
fn is_forgotten(conn: &Connection, job: JobId, now: i64) -> Result<bool, StoreError> {
    conn.query_row(
        &format!("SELECT {} FROM jobs j WHERE j.id = ?1", forgotten("?2")),
        params![job.0.to_string(), now],
        |row| row.get(0),
    )
    .map_err(map_sqlite)
}
