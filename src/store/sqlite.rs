//! The embedded store: SQLite in one local file, for single-node use and
//! demos, with the same guarantees as PostgreSQL.
//!
//! - `UNIQUE (owner, key)` is the arbiter; the commit is a CAS on `version`
//!   with `completed_by IS NULL`, exactly as in PostgreSQL.
//! - Every operation runs on a blocking thread (`spawn_blocking`), never on
//!   the async runtime, over one connection: SQLite has one writer at a time
//!   anyway, and serialising here makes each operation trivially atomic.
//! - Durability: WAL journal with `synchronous = FULL`, so a transaction
//!   that returned is on disk (fsync per commit) and survives a crash or a
//!   power loss; a response is committed before any client sees it.
//! - One gateway per file, enforced by an exclusive lock on `<file>.lock`:
//!   held duplicates are woken in-process only. Several replicas need
//!   PostgreSQL.
//! - At start-up every attempt still `started` belonged to a gateway that
//!   stopped (the lock proves none is running): it becomes `unknown`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use rusqlite::{params, Connection, OptionalExtension, Row, Transaction, TransactionBehavior};
use uuid::Uuid;

use super::codec::{decode_headers, encode_headers};
use super::{
    next_job_state, parse_attempt_state, parse_job_state, Begin, CommitOutcome, Doorbell, Joining,
    Store, StoreError,
};
use crate::attempt::{Attempt, AttemptFailure, AttemptId, AttemptState, NewAttempt, Resolution};
use crate::fingerprint::Fingerprint;
use crate::job::{Job, JobDetail, JobId, JobState, NewJob, StoredResponse};
use crate::key::{IdempotencyKey, Owner};

mod embedded {
    refinery::embed_migrations!("migrations/sqlite");
}

const JOB_COLUMNS: &str = "j.id, j.owner, j.key, j.fingerprint, j.route, j.state, j.version, \
     j.attempt_count, j.completed_by, j.response_status, j.response_headers, j.response_body, \
     j.created_at, j.expires_at";
const ATTEMPT_COLUMNS: &str = "a.id, a.job_id, a.number, a.upstream, a.state, a.job_version, \
     a.started_at, a.finished_at, a.lease_expires_at, a.upstream_status, a.detail";

/// The SQLite implementation of [`Store`].
#[derive(Clone)]
pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    doorbell: Arc<Doorbell>,
    path: PathBuf,
    _lock: Arc<File>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish()
    }
}

impl SqliteStore {
    /// Opens (creating if need be) the store at `path`, applies migrations,
    /// and records attempts left `started` by a previous run as `unknown`.
    pub async fn open(path: &Path, doorbell: Arc<Doorbell>) -> Result<Self, StoreError> {
        let path = path.to_owned();
        tokio::task::spawn_blocking(move || Self::open_blocking(path, doorbell))
            .await
            .map_err(|e| StoreError::Internal(e.to_string()))?
    }

    fn open_blocking(path: PathBuf, doorbell: Arc<Doorbell>) -> Result<Self, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                StoreError::Unavailable(format!("cannot create {}: {e}", dir.display()))
            })?;
        }
        let lock_path = {
            let mut p = path.clone().into_os_string();
            p.push(".lock");
            PathBuf::from(p)
        };
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| {
                StoreError::Unavailable(format!("cannot open {}: {e}", lock_path.display()))
            })?;
        lock.try_lock().map_err(|_| {
            StoreError::Unavailable(format!(
                "another idemgate is using {}; the embedded store serves one gateway \
                 (use PostgreSQL, database_url, to run several replicas)",
                path.display()
            ))
        })?;
        let mut conn = Connection::open(&path).map_err(map_sqlite)?;
        conn.execute_batch(
            "PRAGMA journal_mode = WAL; \
             PRAGMA synchronous = FULL; \
             PRAGMA foreign_keys = ON; \
             PRAGMA busy_timeout = 5000;",
        )
        .map_err(map_sqlite)?;
        let report = embedded::migrations::runner()
            .set_abort_divergent(true)
            .run(&mut conn)
            .map_err(|e| StoreError::Internal(format!("migrations: {e}")))?;
        for m in report.applied_migrations() {
            tracing::info!(migration = %m, "applied migration");
        }
        let store = SqliteStore {
            conn: Arc::new(Mutex::new(conn)),
            doorbell,
            path,
            _lock: Arc::new(lock),
        };
        store.abandon_orphans()?;
        Ok(store)
    }

    fn abandon_orphans(&self) -> Result<(), StoreError> {
        let mut conn = self.lock();
        let orphans: Vec<String> = {
            let mut stmt = conn
                .prepare("SELECT id FROM attempts WHERE state = 'started'")
                .map_err(map_sqlite)?;
            let rows = stmt
                .query_map([], |r| r.get(0))
                .map_err(map_sqlite)?
                .collect::<Result<_, _>>()
                .map_err(map_sqlite)?;
            rows
        };
        for id in orphans {
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(map_sqlite)?;
            settle_tx(
                &tx,
                &id,
                AttemptState::Unknown,
                None,
                "the gateway stopped while this attempt was in flight",
                &[AttemptState::Started],
            )?;
            tx.commit().map_err(map_sqlite)?;
            tracing::warn!(attempt = %id, "attempt left in flight by a previous run; outcome unknown");
        }
        Ok(())
    }

    /// Adds the next attempt to a job, if the job is still at `version` and
    /// in the state `how` needs.
    async fn start_attempt(
        &self,
        job: JobId,
        version: i64,
        attempt: NewAttempt,
        how: Joining,
    ) -> Result<Option<Attempt>, StoreError> {
        let update = match how {
            Joining::Claim => {
                "UPDATE jobs SET state = 'running', version = version + 1, \
                        attempt_count = attempt_count + 1, updated_at = ?3 \
                 WHERE id = ?1 AND version = ?2 AND state = 'open'"
            }
            Joining::Hedge => {
                "UPDATE jobs SET attempt_count = attempt_count + 1, updated_at = ?3 \
                 WHERE id = ?1 AND version = ?2 AND state IN ('running', 'unknown')"
            }
        };
        self.call(move |conn| {
            let now = now_ms();
            let tx = immediate(conn)?;
            let id = job.0.to_string();
            if tx
                .execute(update, params![id, version, now])
                .map_err(map_sqlite)?
                == 0
            {
                return Ok(None);
            }
            let (number, version): (i64, i64) = tx
                .query_row(
                    "SELECT attempt_count, version FROM jobs WHERE id = ?1",
                    [&id],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .map_err(map_sqlite)?;
            let attempt = insert_attempt(&tx, &id, number, version, &attempt, now)?;
            tx.commit().map_err(map_sqlite)?;
            Ok(Some(attempt))
        })
        .await
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the connection, on a blocking thread.
    async fn call<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let conn = self.conn.clone();
        tokio::task::spawn_blocking(move || {
            let mut conn = conn.lock().unwrap_or_else(|e| e.into_inner());
            f(&mut conn)
        })
        .await
        .map_err(|e| StoreError::Internal(e.to_string()))?
    }
}

fn now_ms() -> i64 {
    to_ms(SystemTime::now())
}

fn to_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn from_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn insert_attempt(
    tx: &Transaction<'_>,
    job: &str,
    number: i64,
    version: i64,
    attempt: &NewAttempt,
    now: i64,
) -> Result<Attempt, StoreError> {
    tx.execute(
        "INSERT INTO attempts (id, job_id, number, upstream, state, job_version, instance, \
                               started_at, lease_expires_at, deadline_at) \
         VALUES (?1, ?2, ?3, ?4, 'started', ?5, ?6, ?7, ?8, ?9)",
        params![
            attempt.id.0.to_string(),
            job,
            number,
            attempt.upstream,
            version,
            attempt.instance.to_string(),
            now,
            now + ms(attempt.lease),
            now + ms(attempt.deadline),
        ],
    )
    .map_err(map_sqlite)?;
    read_attempt(tx, &attempt.id.0.to_string())?.ok_or(StoreError::NotFound("attempt"))
}

fn read_job(conn: &Connection, id: &str) -> Result<Option<Job>, StoreError> {
    conn.query_row(
        &format!("SELECT {JOB_COLUMNS} FROM jobs j WHERE j.id = ?1"),
        [id],
        job_from_row,
    )
    .optional()
    .map_err(map_sqlite)?
    .transpose()
}

fn read_attempt(conn: &Connection, id: &str) -> Result<Option<Attempt>, StoreError> {
    conn.query_row(
        &format!("SELECT {ATTEMPT_COLUMNS} FROM attempts a WHERE a.id = ?1"),
        [id],
        attempt_from_row,
    )
    .optional()
    .map_err(map_sqlite)?
    .transpose()
}

fn read_attempts(conn: &Connection, job: &str) -> Result<Vec<Attempt>, StoreError> {
    let mut stmt = conn
        .prepare(&format!(
            "SELECT {ATTEMPT_COLUMNS} FROM attempts a WHERE a.job_id = ?1 ORDER BY a.number"
        ))
        .map_err(map_sqlite)?;
    let rows = stmt
        .query_map([job], attempt_from_row)
        .map_err(map_sqlite)?;
    rows.map(|r| r.map_err(map_sqlite)?).collect()
}

fn read_detail(conn: &Connection, id: &str) -> Result<Option<JobDetail>, StoreError> {
    let Some(job) = read_job(conn, id)? else {
        return Ok(None);
    };
    let attempts = read_attempts(conn, id)?;
    Ok(Some(JobDetail { job, attempts }))
}

fn derive_job_state(
    conn: &Connection,
    job: &str,
    current: JobState,
) -> Result<JobState, StoreError> {
    let mut stmt = conn
        .prepare("SELECT state FROM attempts WHERE job_id = ?1")
        .map_err(map_sqlite)?;
    let states = stmt
        .query_map([job], |r| r.get::<_, String>(0))
        .map_err(map_sqlite)?
        .map(|s| parse_attempt_state(&s.map_err(map_sqlite)?))
        .collect::<Result<Vec<_>, _>>()?;
    next_job_state(current, states)
}

/// An attempt's job id and state and its own state (the caller's immediate
/// transaction already holds the write lock).
fn read_attempt_and_job(
    tx: &Transaction<'_>,
    attempt: &str,
) -> Result<(String, JobState, AttemptState), StoreError> {
    let (job, job_state, state) = tx
        .query_row(
            "SELECT j.id, j.state, a.state FROM jobs j JOIN attempts a ON a.job_id = j.id \
             WHERE a.id = ?1",
            [attempt],
            |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                ))
            },
        )
        .optional()
        .map_err(map_sqlite)?
        .ok_or(StoreError::NotFound("attempt"))?;
    Ok((
        job,
        parse_job_state(&job_state)?,
        parse_attempt_state(&state)?,
    ))
}

/// Settles one attempt and derives its job's state again, inside `tx`.
/// Returns the job's id when the attempt moved.
fn settle_tx(
    tx: &Transaction<'_>,
    attempt: &str,
    to: AttemptState,
    status: Option<u16>,
    detail: &str,
    from: &[AttemptState],
) -> Result<Option<String>, StoreError> {
    let (job, job_state, current) = read_attempt_and_job(tx, attempt)?;
    if !from.contains(&current) || !current.can_become(to) {
        return Ok(None);
    }
    let finished = (to != AttemptState::Unknown).then(now_ms);
    tx.execute(
        "UPDATE attempts SET state = ?2, finished_at = ?3, \
         upstream_status = COALESCE(?4, upstream_status), detail = ?5 WHERE id = ?1",
        params![attempt, to.as_str(), finished, status, detail],
    )
    .map_err(map_sqlite)?;
    if !job_state.is_terminal() {
        let derived = derive_job_state(tx, &job, job_state)?;
        if derived != job_state {
            tx.execute(
                "UPDATE jobs SET state = ?2, updated_at = ?3 WHERE id = ?1",
                params![job, derived.as_str(), now_ms()],
            )
            .map_err(map_sqlite)?;
        }
    }
    Ok(Some(job))
}

fn complete_tx(
    tx: &Transaction<'_>,
    job: &str,
    attempt: &str,
    version: Option<i64>,
    response: &StoredResponse,
) -> Result<bool, StoreError> {
    let changed = tx
        .execute(
            "UPDATE jobs SET state = 'completed', completed_by = ?2, response_status = ?3, \
                    response_headers = ?4, response_body = ?5, version = version + 1, updated_at = ?6 \
             WHERE id = ?1 AND (?7 IS NULL OR version = ?7) AND completed_by IS NULL",
            params![
                job,
                attempt,
                response.status,
                encode_headers(&response.headers),
                response.body.as_ref(),
                now_ms(),
                version,
            ],
        )
        .map_err(map_sqlite)?;
    Ok(changed == 1)
}

fn immediate(conn: &mut Connection) -> Result<Transaction<'_>, StoreError> {
    conn.transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(map_sqlite)
}

#[async_trait]
impl Store for SqliteStore {
    async fn begin_job(&self, job: NewJob, attempt: NewAttempt) -> Result<Begin, StoreError> {
        self.call(move |conn| {
            let now = now_ms();
            // Most requests that reach the store are duplicates: a plain read
            // answers them without a write transaction. One connection serves
            // the whole gateway, so nothing can come between this read and
            // the insert below.
            let existing = conn
                .query_row(
                    &format!("SELECT {JOB_COLUMNS} FROM jobs j WHERE j.owner = ?1 AND j.key = ?2"),
                    params![job.owner.as_str(), job.key.as_str()],
                    job_from_row,
                )
                .optional()
                .map_err(map_sqlite)?
                .transpose()?;
            if let Some(existing) = existing.filter(|j| to_ms(j.expires_at) > now) {
                return Ok(Begin::Existing(existing));
            }
            let tx = immediate(conn)?;
            // An expired job that was not purged yet is forgotten: the key starts afresh.
            tx.execute(
                "DELETE FROM jobs WHERE owner = ?1 AND key = ?2 AND expires_at <= ?3",
                params![job.owner.as_str(), job.key.as_str(), now],
            )
            .map_err(map_sqlite)?;
            let id = job.id.0.to_string();
            let inserted = tx
                .execute(
                    "INSERT INTO jobs (id, owner, key, fingerprint, route, state, version, attempt_count, \
                                       created_at, updated_at, expires_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, 'running', 1, 1, ?6, ?6, ?7) \
                     ON CONFLICT (owner, key) DO NOTHING",
                    params![
                        id,
                        job.owner.as_str(),
                        job.key.as_str(),
                        job.fingerprint.0.as_slice(),
                        job.route,
                        now,
                        now + ms(job.ttl),
                    ],
                )
                .map_err(map_sqlite)?;
            let begin = if inserted == 1 {
                let attempt = insert_attempt(&tx, &id, 1, 1, &attempt, now)?;
                let job = read_job(&tx, &id)?.ok_or(StoreError::NotFound("job"))?;
                Begin::Created(job, attempt)
            } else {
                let existing = tx
                    .query_row(
                        &format!("SELECT {JOB_COLUMNS} FROM jobs j WHERE j.owner = ?1 AND j.key = ?2"),
                        params![job.owner.as_str(), job.key.as_str()],
                        job_from_row,
                    )
                    .map_err(map_sqlite)??;
                Begin::Existing(existing)
            };
            tx.commit().map_err(map_sqlite)?;
            Ok(begin)
        })
        .await
    }

    async fn claim_attempt(
        &self,
        job: JobId,
        version: i64,
        attempt: NewAttempt,
    ) -> Result<Option<Attempt>, StoreError> {
        let claimed = self
            .start_attempt(job, version, attempt, Joining::Claim)
            .await?;
        if claimed.is_some() {
            self.doorbell.ring(job);
        }
        Ok(claimed)
    }

    async fn hedge_attempt(
        &self,
        job: JobId,
        version: i64,
        attempt: NewAttempt,
    ) -> Result<Option<Attempt>, StoreError> {
        self.start_attempt(job, version, attempt, Joining::Hedge)
            .await
    }

    async fn commit(
        &self,
        attempt: &Attempt,
        response: &StoredResponse,
    ) -> Result<CommitOutcome, StoreError> {
        let (job, id, version, response) = (
            attempt.job_id.0.to_string(),
            attempt.id.0.to_string(),
            attempt.job_version,
            response.clone(),
        );
        let won = self
            .call(move |conn| {
                let tx = immediate(conn)?;
                // The CAS of DESIGN §2; zero rows: superseded.
                let won = complete_tx(&tx, &job, &id, Some(version), &response)?;
                tx.execute(
                    "UPDATE attempts SET state = ?2, finished_at = ?3, upstream_status = ?4 \
                     WHERE id = ?1 AND state IN ('started', 'unknown')",
                    params![
                        id,
                        if won { "succeeded" } else { "superseded" },
                        now_ms(),
                        response.status
                    ],
                )
                .map_err(map_sqlite)?;
                tx.commit().map_err(map_sqlite)?;
                Ok(won)
            })
            .await?;
        if won {
            self.doorbell.ring(attempt.job_id);
            Ok(CommitOutcome::Committed)
        } else {
            Ok(CommitOutcome::Superseded)
        }
    }

    async fn fail_attempt(
        &self,
        attempt: AttemptId,
        failure: AttemptFailure,
    ) -> Result<(), StoreError> {
        let settled = self
            .call(move |conn| {
                let from: &[AttemptState] = match failure {
                    AttemptFailure::Unknown { .. } => &[AttemptState::Started],
                    _ => &[AttemptState::Started, AttemptState::Unknown],
                };
                let tx = immediate(conn)?;
                let job = settle_tx(
                    &tx,
                    &attempt.0.to_string(),
                    failure.state(),
                    failure.status(),
                    failure.detail(),
                    from,
                )?;
                tx.commit().map_err(map_sqlite)?;
                Ok(job)
            })
            .await?;
        if let Some(job) = settled.and_then(|j| j.parse().ok()) {
            self.doorbell.ring(JobId(job));
        }
        Ok(())
    }

    async fn resolve_attempt(
        &self,
        attempt: AttemptId,
        resolution: Resolution,
    ) -> Result<JobDetail, StoreError> {
        let detail = self
            .call(move |conn| {
                let id = attempt.0.to_string();
                let tx = immediate(conn)?;
                let (job, job_state, current) = read_attempt_and_job(&tx, &id)?;
                if !current.is_unsettled() {
                    return Err(StoreError::Conflict(format!(
                        "attempt {attempt} is already {current}; only started or unknown attempts can be resolved"
                    )));
                }
                match &resolution {
                    Resolution::Succeeded(response) => {
                        if job_state.is_terminal() || !complete_tx(&tx, &job, &id, None, response)? {
                            return Err(StoreError::Conflict(format!(
                                "job {job} is already completed by another attempt"
                            )));
                        }
                        tx.execute(
                            "UPDATE attempts SET state = 'succeeded', finished_at = ?2, upstream_status = ?3, \
                                    detail = 'resolved by an operator' WHERE id = ?1",
                            params![id, now_ms(), response.status],
                        )
                        .map_err(map_sqlite)?;
                    }
                    Resolution::Failed | Resolution::Cancelled => {
                        tx.execute(
                            "UPDATE attempts SET state = ?2, finished_at = ?3, \
                                    detail = 'resolved by an operator' WHERE id = ?1",
                            params![id, resolution.state().as_str(), now_ms()],
                        )
                        .map_err(map_sqlite)?;
                        if !job_state.is_terminal() {
                            let derived = derive_job_state(&tx, &job, job_state)?;
                            // The version moves: the attempt's own late answer
                            // must no longer be able to commit.
                            tx.execute(
                                "UPDATE jobs SET state = ?2, version = version + 1, updated_at = ?3 \
                                 WHERE id = ?1",
                                params![job, derived.as_str(), now_ms()],
                            )
                            .map_err(map_sqlite)?;
                        }
                    }
                }
                let detail = read_detail(&tx, &job)?.ok_or(StoreError::NotFound("job"))?;
                tx.commit().map_err(map_sqlite)?;
                Ok(detail)
            })
            .await?;
        self.doorbell.ring(detail.job.id);
        Ok(detail)
    }

    async fn job(&self, id: JobId) -> Result<Option<Job>, StoreError> {
        self.call(move |conn| read_job(conn, &id.0.to_string()))
            .await
    }

    async fn job_detail(&self, id: JobId) -> Result<Option<JobDetail>, StoreError> {
        self.call(move |conn| read_detail(conn, &id.0.to_string()))
            .await
    }

    async fn find_job(
        &self,
        owner: &Owner,
        key: &IdempotencyKey,
    ) -> Result<Option<JobDetail>, StoreError> {
        let (owner, key) = (owner.clone(), key.clone());
        self.call(move |conn| {
            let id: Option<String> = conn
                .query_row(
                    "SELECT id FROM jobs WHERE owner = ?1 AND key = ?2",
                    params![owner.as_str(), key.as_str()],
                    |r| r.get(0),
                )
                .optional()
                .map_err(map_sqlite)?;
            match id {
                Some(id) => read_detail(conn, &id),
                None => Ok(None),
            }
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
            let until = now_ms() + ms(lease);
            let tx = immediate(conn)?;
            let mut renewed = 0;
            for id in &ids {
                renewed += tx
                    .execute(
                        "UPDATE attempts SET lease_expires_at = ?2 WHERE id = ?1 AND state = 'started'",
                        params![id, until],
                    )
                    .map_err(map_sqlite)? as u64;
            }
            tx.commit().map_err(map_sqlite)?;
            Ok(renewed)
        })
        .await
    }

    async fn expire_leases(&self, batch: u32) -> Result<u64, StoreError> {
        let jobs = self
            .call(move |conn| {
                let now = now_ms();
                let lapsed: Vec<String> = {
                    let mut stmt = conn
                        .prepare(
                            "SELECT id FROM attempts WHERE state = 'started' AND lease_expires_at < ?1 \
                             ORDER BY lease_expires_at LIMIT ?2",
                        )
                        .map_err(map_sqlite)?;
                    let rows = stmt
                        .query_map(params![now, batch], |r| r.get(0))
                        .map_err(map_sqlite)?
                        .collect::<Result<_, _>>()
                        .map_err(map_sqlite)?;
                    rows
                };
                let tx = immediate(conn)?;
                let mut jobs = Vec::new();
                for id in lapsed {
                    if let Some(job) = settle_tx(
                        &tx,
                        &id,
                        AttemptState::Unknown,
                        None,
                        "lease lapsed: the gateway running this attempt stopped renewing it",
                        &[AttemptState::Started],
                    )? {
                        tracing::warn!(attempt = %id, %job, "attempt lease lapsed; outcome unknown");
                        jobs.push(job);
                    }
                }
                tx.commit().map_err(map_sqlite)?;
                Ok(jobs)
            })
            .await?;
        for job in &jobs {
            if let Ok(id) = job.parse() {
                self.doorbell.ring(JobId(id));
            }
        }
        Ok(jobs.len() as u64)
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.call(move |conn| {
            conn.execute(
                "DELETE FROM jobs WHERE id IN ( \
                   SELECT id FROM jobs WHERE expires_at < ?1 ORDER BY expires_at LIMIT ?2)",
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
}

fn parse_uuid(s: &str) -> Result<Uuid, StoreError> {
    s.parse()
        .map_err(|_| StoreError::Internal(format!("stored id {s:?} is not a UUID")))
}

/// Reads a job row; the outer `Result` is rusqlite's, the inner ours.
fn job_from_row(row: &Row<'_>) -> rusqlite::Result<Result<Job, StoreError>> {
    let id: String = row.get(0)?;
    let key: String = row.get(2)?;
    let fingerprint: Vec<u8> = row.get(3)?;
    let state: String = row.get(5)?;
    let completed_by: Option<String> = row.get(8)?;
    let status: Option<u16> = row.get(9)?;
    let headers: Option<Vec<u8>> = row.get(10)?;
    let body: Option<Vec<u8>> = row.get(11)?;
    let owner: String = row.get(1)?;
    let route: String = row.get(4)?;
    let version: i64 = row.get(6)?;
    let attempt_count: i32 = row.get(7)?;
    let created_at: i64 = row.get(12)?;
    let expires_at: i64 = row.get(13)?;
    Ok((|| {
        let response = match status {
            None => None,
            Some(status) => Some(StoredResponse {
                status,
                headers: decode_headers(headers.as_deref().unwrap_or_default())
                    .ok_or_else(|| StoreError::Internal("stored headers are corrupt".into()))?,
                body: Bytes::from(body.unwrap_or_default()),
            }),
        };
        Ok(Job {
            id: JobId(parse_uuid(&id)?),
            owner: Owner::from_stored(owner),
            key: IdempotencyKey::new(key)
                .map_err(|e| StoreError::Internal(format!("stored key: {e}")))?,
            fingerprint: Fingerprint::from_slice(&fingerprint)
                .ok_or_else(|| StoreError::Internal("stored fingerprint is not 32 bytes".into()))?,
            route,
            state: parse_job_state(&state)?,
            version,
            attempt_count,
            completed_by: completed_by
                .as_deref()
                .map(parse_uuid)
                .transpose()?
                .map(AttemptId),
            response,
            created_at: from_ms(created_at),
            expires_at: from_ms(expires_at),
        })
    })())
}

fn attempt_from_row(row: &Row<'_>) -> rusqlite::Result<Result<Attempt, StoreError>> {
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
    Ok((|| {
        Ok(Attempt {
            id: AttemptId(parse_uuid(&id)?),
            job_id: JobId(parse_uuid(&job_id)?),
            number,
            upstream,
            state: parse_attempt_state(&state)?,
            job_version,
            started_at: from_ms(started_at),
            finished_at: finished_at.map(from_ms),
            lease_expires_at: from_ms(lease_expires_at),
            upstream_status,
            detail,
        })
    })())
}

/// A locked or unopenable database is `Unavailable` (503); anything else
/// SQLite refused is `Internal`.
fn map_sqlite(e: rusqlite::Error) -> StoreError {
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
            StoreError::Unavailable(e.to_string())
        }
        _ => StoreError::Internal(e.to_string()),
    }
}
