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

use std::fs::File;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use rusqlite::{
    params, Connection, OptionalExtension, Row, Savepoint, Transaction, TransactionBehavior,
};
use uuid::Uuid;

use super::codec::{decode_headers, encode_headers};
use super::{
    attempt_state, commit_under_lock, expire_each, job_state, millis, Applied, Backend, Begin,
    Committed, Cursor, Decide, Lock, Records, StoreError,
};
use crate::domain::attempt::{Attempt, AttemptFailure, AttemptState, NewAttempt};
use crate::domain::fingerprint::Fingerprint;
use crate::domain::id::{AttemptId, JobId};
use crate::domain::job::{Job, JobDetail, JobState, NewJob};
use crate::domain::key::{IdempotencyKey, Owner};
use crate::domain::response::StoredResponse;
use crate::domain::transition::{self, AttemptHead, Change, JobHead, Refusal, Snapshot};

mod embedded {
    refinery::embed_migrations!("migrations/sqlite");
}

const JOB_COLUMNS: &str = "j.id, j.owner, j.key, j.fingerprint, j.route, j.state, j.version, \
     j.attempt_count, j.completed_by, j.response_status, j.response_headers, j.response_body, \
     j.created_at, j.expires_at";
const ATTEMPT_COLUMNS: &str = "a.id, a.job_id, a.number, a.upstream, a.state, a.job_version, \
     a.started_at, a.finished_at, a.lease_expires_at, a.upstream_status, a.detail";

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

/// An operation for the store's thread: it runs on the connection and
/// returns how to hand its result back once the batch's commit is known.
type Op = Box<dyn FnOnce(&mut Connection) -> Deliver + Send>;
/// Hands an operation's result back, given how its batch's commit went.
type Deliver = Box<dyn FnOnce(&Result<(), StoreError>) + Send>;

/// At most this many operations share one commit, so a long queue still
/// answers its first callers early.
const MAX_BATCH: usize = 64;

/// The store's thread: takes what is queued, runs it in one transaction,
/// commits once, then answers every operation of the batch. Ends when the
/// last handle to the store is dropped.
fn writer(mut conn: Connection, ops: mpsc::Receiver<Op>, batches: Arc<AtomicUsize>) {
    while let Ok(first) = ops.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match ops.try_recv() {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
        // Without the outer transaction (it could not begin) each operation
        // makes its own, as it would alone.
        let grouped = conn.execute_batch("BEGIN IMMEDIATE").is_ok();
        let deliveries: Vec<Deliver> = batch
            .into_iter()
            .filter_map(|op| {
                // A panicking operation drops its answer (its caller sees an
                // internal error) and its savepoint rolls back as it unwinds.
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op(&mut conn))).ok()
            })
            .collect();
        let committed = if grouped {
            conn.execute_batch("COMMIT").map_err(|e| {
                let _ = conn.execute_batch("ROLLBACK");
                map_sqlite(e)
            })
        } else {
            Ok(())
        };
        batches.fetch_add(1, Ordering::Relaxed);
        for deliver in deliveries {
            deliver(&committed);
        }
    }
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

    fn open_blocking(path: PathBuf) -> Result<Self, StoreError> {
        let unavailable = |what: String, e: std::io::Error| {
            StoreError::Unavailable(format!("{what}: {e}").into())
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| unavailable(format!("cannot create {}", dir.display()), e))?;
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
            .map_err(|e| unavailable(format!("cannot open {}", lock_path.display()), e))?;
        lock.try_lock().map_err(|_| {
            StoreError::Unavailable(
                format!(
                    "another idemgate is using {}; the embedded store serves one gateway \
                     (use PostgreSQL, database_url, to run several replicas)",
                    path.display()
                )
                .into(),
            )
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
            .map_err(|e| StoreError::Internal(Box::new(e)))?;
        for m in report.applied_migrations() {
            tracing::info!(migration = %m, "applied migration");
        }
        abandon_orphans(&mut conn)?;
        let (ops, queue) = mpsc::channel();
        let batches = Arc::new(AtomicUsize::new(0));
        let counted = batches.clone();
        std::thread::Builder::new()
            .name("idemgate-sqlite".into())
            .spawn(move || writer(conn, queue, counted))
            .map_err(|e| unavailable("cannot start the store's thread".into(), e))?;
        Ok(Sqlite {
            ops,
            batches,
            path,
            _lock: Arc::new(lock),
        })
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

/// Attempts a previous run left `started` can no longer be told apart from
/// ones that acted: each becomes `unknown`.
fn abandon_orphans(conn: &mut Connection) -> Result<(), StoreError> {
    let orphans: Vec<AttemptId> = {
        let mut stmt = conn
            .prepare("SELECT id FROM attempts WHERE state = ?1")
            .map_err(map_sqlite)?;
        let ids = stmt
            .query_map([AttemptState::Started.as_str()], |r| r.get::<_, String>(0))
            .map_err(map_sqlite)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(map_sqlite)?;
        ids.iter()
            .map(|id| uuid(id).map(AttemptId))
            .collect::<Result<_, _>>()?
    };
    for attempt in orphans {
        let failure = AttemptFailure::Unknown {
            detail: "the gateway stopped while this attempt was in flight".into(),
        };
        let decide: Decide = Box::new(move |s, _| transition::settle(s, attempt, &failure));
        if change_blocking(conn, Lock::JobOf(attempt), decide)?.is_ok() {
            tracing::warn!(%attempt, "attempt left in flight by a previous run; outcome unknown");
        }
    }
    Ok(())
}

fn now_ms() -> i64 {
    to_ms(SystemTime::now())
}

fn to_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).map(millis).unwrap_or(0)
}

fn from_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

fn uuid(s: &str) -> Result<Uuid, StoreError> {
    s.parse().map_err(|_| StoreError::Corrupt("id"))
}

fn attempt_id(s: Option<&str>) -> Result<Option<AttemptId>, StoreError> {
    s.map(uuid).transpose().map(|id| id.map(AttemptId))
}

/// A write's own transaction: `BEGIN IMMEDIATE` on a connection that has
/// none, a savepoint inside the batch's transaction (see [`writer`]).
enum Tx<'c> {
    Own(Transaction<'c>),
    Nested(Savepoint<'c>),
}

impl Tx<'_> {
    fn commit(self) -> rusqlite::Result<()> {
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

fn immediate(conn: &mut Connection) -> Result<Tx<'_>, StoreError> {
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
fn snapshot(conn: &Connection, job: JobId) -> Result<Option<Snapshot>, StoreError> {
    let job = read_job(conn, "j.id = ?1", [job.0.to_string()])?;
    Ok(read_detail(conn, job)?.map(|d| Snapshot {
        job: JobHead::of(&d.job),
        attempts: d.attempts.iter().map(AttemptHead::of).collect(),
    }))
}

fn job_of(conn: &Connection, lock: Lock) -> Result<JobId, StoreError> {
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

/// Locks, decides and writes one change (see [`Backend::change`]).
fn change_blocking(
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
fn write(tx: &Connection, change: &Change, now: SystemTime) -> Result<Option<Attempt>, StoreError> {
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
                    detail = COALESCE(?6, detail) \
             WHERE id = ?1",
            params![
                settled.attempt.0.to_string(),
                settled.state.as_str(),
                settled.finishes(),
                now,
                settled.status,
                settled.detail,
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

fn insert_attempt(
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

fn read_job(
    conn: &Connection,
    filter: &str,
    params: impl rusqlite::Params,
) -> Result<Option<Job>, StoreError> {
    conn.query_row(
        &format!("SELECT {JOB_COLUMNS} FROM jobs j WHERE {filter}"),
        params,
        job_from_row,
    )
    .optional()
    .map_err(map_sqlite)?
    .transpose()
}

fn read_attempt(conn: &Connection, id: AttemptId) -> Result<Option<Attempt>, StoreError> {
    conn.query_row(
        &format!("SELECT {ATTEMPT_COLUMNS} FROM attempts a WHERE a.id = ?1"),
        [id.0.to_string()],
        attempt_from_row,
    )
    .optional()
    .map_err(map_sqlite)?
    .transpose()
}

/// A job with its attempts; the caller's single connection makes the two
/// reads one consistent view (no writer can come between them).
fn read_detail(conn: &Connection, job: Option<Job>) -> Result<Option<JobDetail>, StoreError> {
    let Some(job) = job else {
        return Ok(None);
    };
    let mut stmt = conn
        .prepare_cached(&format!(
            "SELECT {ATTEMPT_COLUMNS} FROM attempts a WHERE a.job_id = ?1 ORDER BY a.number"
        ))
        .map_err(map_sqlite)?;
    let attempts = stmt
        .query_map([job.id.0.to_string()], attempt_from_row)
        .map_err(map_sqlite)?
        .map(|r| r.map_err(map_sqlite)?)
        .collect::<Result<_, _>>()?;
    Ok(Some(JobDetail { job, attempts }))
}

#[async_trait]
impl Records for Sqlite {
    async fn job(&self, id: JobId) -> Result<Option<Job>, StoreError> {
        self.call(move |conn| read_job(conn, "j.id = ?1", [id.0.to_string()]))
            .await
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

    async fn watch(&self, _job: JobId) -> Result<(), StoreError> {
        // One gateway per file: every waiter is woken in-process.
        Ok(())
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

/// Reads a job row; the outer `Result` is rusqlite's, the inner ours.
fn job_from_row(row: &Row<'_>) -> rusqlite::Result<Result<Job, StoreError>> {
    let id: String = row.get(0)?;
    let owner: String = row.get(1)?;
    let key: String = row.get(2)?;
    let fingerprint: Vec<u8> = row.get(3)?;
    let route: String = row.get(4)?;
    let state: String = row.get(5)?;
    let version: i64 = row.get(6)?;
    let attempt_count: i32 = row.get(7)?;
    let completed_by: Option<String> = row.get(8)?;
    let status: Option<u16> = row.get(9)?;
    let headers: Option<Vec<u8>> = row.get(10)?;
    let body: Option<Vec<u8>> = row.get(11)?;
    let created_at: i64 = row.get(12)?;
    let expires_at: i64 = row.get(13)?;
    Ok((|| {
        let response = match status {
            None => None,
            Some(status) => Some(StoredResponse {
                status,
                headers: decode_headers(headers.as_deref().unwrap_or_default())
                    .ok_or(StoreError::Corrupt("response headers"))?,
                body: Bytes::from(body.unwrap_or_default()),
            }),
        };
        Ok(Job {
            id: JobId(uuid(&id)?),
            owner: Owner::from_stored(owner),
            key: IdempotencyKey::new(key).map_err(|_| StoreError::Corrupt("idempotency key"))?,
            fingerprint: Fingerprint::from_slice(&fingerprint)
                .ok_or(StoreError::Corrupt("fingerprint"))?,
            route,
            state: job_state(&state)?,
            version,
            attempt_count,
            completed_by: attempt_id(completed_by.as_deref())?,
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
            id: AttemptId(uuid(&id)?),
            job_id: JobId(uuid(&job_id)?),
            number,
            upstream,
            state: attempt_state(&state)?,
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
            StoreError::Unavailable(Box::new(e))
        }
        _ => StoreError::Internal(Box::new(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Operations queued while the store's thread is busy share one commit;
    /// one that fails inside the batch undoes only its own writes, and the
    /// others' are durable.
    #[tokio::test]
    async fn queued_operations_share_one_commit_and_fail_alone() {
        let dir = tempfile::tempdir().unwrap();
        let store = Sqlite::open(&dir.path().join("batch.db")).await.unwrap();
        store
            .call(|conn| {
                conn.execute_batch("CREATE TABLE t (v TEXT NOT NULL)")
                    .map_err(map_sqlite)
            })
            .await
            .unwrap();
        let before = store.batches.load(Ordering::SeqCst);
        // Hold the thread until the three operations below are queued.
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (started, running) = tokio::sync::oneshot::channel();
        let blocker = tokio::spawn({
            let store = store.clone();
            async move {
                store
                    .call(move |_| {
                        let _ = started.send(());
                        held.recv().ok();
                        Ok(())
                    })
                    .await
            }
        });
        running.await.unwrap();
        let insert = |v: &'static str, fail: bool| {
            let store = store.clone();
            async move {
                store
                    .call(move |conn| {
                        let tx = immediate(conn)?;
                        tx.execute("INSERT INTO t (v) VALUES (?1)", [v])
                            .map_err(map_sqlite)?;
                        if fail {
                            return Err(StoreError::Contended);
                        }
                        tx.commit().map_err(map_sqlite)
                    })
                    .await
            }
        };
        let (mut a, mut b, mut c) = (
            Box::pin(insert("a", false)),
            Box::pin(insert("b", true)),
            Box::pin(insert("c", false)),
        );
        // Polled once, each is queued behind the blocker.
        assert!(futures_util::poll!(&mut a).is_pending());
        assert!(futures_util::poll!(&mut b).is_pending());
        assert!(futures_util::poll!(&mut c).is_pending());
        release.send(()).unwrap();
        blocker.await.unwrap().unwrap();
        assert!(a.await.is_ok());
        assert!(matches!(b.await, Err(StoreError::Contended)));
        assert!(c.await.is_ok());
        assert_eq!(
            store.batches.load(Ordering::SeqCst) - before,
            2,
            "the blocker's batch, then one for the three"
        );
        drop(store);
        // Reopened from the file: what was answered as written is there.
        let reopened = Sqlite::open(&dir.path().join("batch.db")).await.unwrap();
        let rows: Vec<String> = reopened
            .call(|conn| {
                let mut stmt = conn
                    .prepare("SELECT v FROM t ORDER BY v")
                    .map_err(map_sqlite)?;
                let rows = stmt
                    .query_map([], |r| r.get(0))
                    .map_err(map_sqlite)?
                    .collect::<Result<_, _>>()
                    .map_err(map_sqlite);
                rows
            })
            .await
            .unwrap();
        assert_eq!(rows, ["a", "c"]);
    }
}
