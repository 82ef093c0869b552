//! The PostgreSQL backend: the source of truth in production.
//!
//! SQL lives next to the method that runs it. The hot path is two single
//! statements: [`Backend::begin`] (a read, then `INSERT … ON CONFLICT DO
//! NOTHING` of the job and its first attempt) and [`Backend::commit`] (the
//! CAS). Every other change locks the job row (`FOR UPDATE`), reads its
//! attempts, and writes what the domain decided, in one transaction; all
//! writers of a job take its row lock first, so they never interleave.
//!
//! Job-state changes are announced with `NOTIFY` (a trigger, see
//! `migrations/postgres`), tagged with the instance that made them, so a
//! replica ignores its own announcements: it has already rung its doorbell.

use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use deadpool_postgres::{GenericClient, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use futures_util::StreamExt;
use tokio_postgres::types::ToSql;
use tokio_postgres::{AsyncMessage, NoTls, Row};
use uuid::Uuid;

use super::{
    attempt_state, commit_under_lock, expire_each, job_state, millis, Applied, Backend, Begin,
    Committed, Cursor, Decide, Doorbell, Lock, Records, StoreError,
};
use crate::config::PgSettings;
use crate::domain::attempt::{Attempt, AttemptState, NewAttempt};
use crate::domain::fingerprint::Fingerprint;
use crate::domain::id::{AttemptId, JobId};
use crate::domain::job::{Job, JobDetail, JobState, NewJob};
use crate::domain::key::{IdempotencyKey, Owner};
use crate::domain::response::StoredResponse;
use crate::domain::transition::{AttemptHead, Change, JobHead, Refusal, Snapshot, Start};

mod budget;
mod replication;

pub use budget::Budget;
pub use replication::Replication;

mod embedded {
    refinery::embed_migrations!("migrations/postgres");
}

/// The channel job-state changes are announced on.
const CHANNEL: &str = "idemgate_jobs";
/// Serialises migrations when several replicas start at once.
const MIGRATION_LOCK: i64 = 0x1de6_6a7e;

const JOB_COLUMNS: &str = "j.id, j.owner, j.key, j.fingerprint, j.route, j.state, j.version, \
     j.attempt_count, j.completed_by, j.response_status, j.response_header_names, \
     j.response_header_values, j.response_body, j.created_at, j.expires_at";
const JOB_WIDTH: usize = 15;
const ATTEMPT_COLUMNS: &str = "a.id, a.job_id, a.number, a.upstream, a.state, a.job_version, \
     a.started_at, a.finished_at, a.lease_expires_at, a.upstream_status, a.detail";
const ATTEMPT_WIDTH: usize = 11;
/// A job's head, the database's clock, and each attempt's head: one row per attempt.
const SNAPSHOT_COLUMNS: &str = "j.id, j.state, j.version, j.attempt_count, j.completed_by, now(), \
     a.id, a.number, a.state, a.job_version, a.lease_expires_at";

/// The PostgreSQL [`Backend`].
#[derive(Clone)]
pub struct Postgres {
    pool: Pool,
    /// For sessions of their own: LISTEN and migrations.
    direct: tokio_postgres::Config,
    instance: Uuid,
}

impl std::fmt::Debug for Postgres {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Postgres").finish_non_exhaustive()
    }
}

impl Postgres {
    /// Builds the pool for gateway `instance`. Connections are made lazily,
    /// so a database that is down at start-up makes requests answer 503
    /// rather than the gateway refuse to start.
    pub fn new(settings: &PgSettings, instance: Uuid) -> Result<Self, StoreError> {
        let config = session(&settings.url, settings, instance)?;
        let direct = match &settings.direct_url {
            Some(url) => session(url, settings, instance)?,
            None => config.clone(),
        };
        let manager = Manager::from_config(
            config.clone(),
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(settings.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(settings.connect_timeout))
            .create_timeout(Some(settings.connect_timeout))
            .recycle_timeout(Some(settings.connect_timeout))
            .pre_recycle(replication::fence())
            .build()
            .map_err(|e| StoreError::Internal(Box::new(e)))?;
        Ok(Postgres {
            pool,
            direct,
            instance,
        })
    }

    /// Applies the SQL migrations under `migrations/postgres`, holding an
    /// advisory lock so that replicas starting together apply them once.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let (mut client, connection) = self.direct.connect(NoTls).await.map_err(map_pg)?;
        let driver = tokio::spawn(connection);
        client
            .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(map_pg)?;
        let report = embedded::migrations::runner()
            .set_abort_divergent(true)
            .run_async(&mut client)
            .await;
        let _ = client
            .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
            .await;
        drop(client);
        let _ = driver.await;
        let report = report.map_err(|e| StoreError::Internal(Box::new(e)))?;
        for m in report.applied_migrations() {
            tracing::info!(migration = %m, "applied migration");
        }
        Ok(())
    }

    /// Listens for job-state changes announced by other replicas and rings
    /// `doorbell` for each. Returns when the connection is lost (the caller
    /// reconnects); rings every bell once listening, since announcements
    /// made while nobody listened were lost.
    pub async fn listen(&self, doorbell: &Doorbell) -> Result<(), StoreError> {
        let (client, mut connection) = self.direct.connect(NoTls).await.map_err(map_pg)?;
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        let (heard, mut announcements) = tokio::sync::mpsc::unbounded_channel();
        let mut driver = tokio::spawn(async move {
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(n)) => {
                        let _ = heard.send(n.payload().to_owned());
                    }
                    Ok(_) => {}
                    Err(e) => return Err(map_pg(e)),
                }
            }
            Ok(())
        });
        self.check(&client).await;
        client
            .batch_execute(&format!("LISTEN {CHANNEL}"))
            .await
            .map_err(map_pg)?;
        // Duplicates held while nobody listened look again.
        doorbell.ring_all();
        loop {
            tokio::select! {
                ended = &mut driver => {
                    return ended.unwrap_or_else(|e| Err(StoreError::Internal(Box::new(e))));
                }
                Some(payload) = announcements.recv() => {
                    // `<job id> <instance>`; an untagged payload rings too.
                    let mut parts = payload.split(' ');
                    let job = parts.next().and_then(|j| j.parse().ok());
                    let origin = parts.next().and_then(|i| i.parse::<Uuid>().ok());
                    if let Some(job) = job {
                        if origin != Some(self.instance) {
                            metrics::counter!("idemgate_wakeups_total", "source" => "postgres").increment(1);
                            doorbell.ring_local(JobId(job));
                        }
                    }
                }
            }
        }
    }

    /// Warns of what the gateway can see is wrong with the database it
    /// (re)connected to: replication that can lose acknowledged commits on
    /// a failover, a pool that will not fit.
    async fn check(&self, client: &tokio_postgres::Client) {
        match Replication::read(client).await {
            Ok(replication) => match replication.risk() {
                Some(risk) => tracing::warn!("{risk}"),
                None => tracing::debug!(?replication, "replication keeps acknowledged commits"),
            },
            Err(e) => tracing::debug!(error = %e, "cannot read the database's replication"),
        }
        match Budget::read(client).await {
            Ok(budget) => {
                if let Some(risk) = budget.risk(self.pool.status().max_size) {
                    tracing::warn!("{risk}");
                }
            }
            Err(e) => tracing::debug!(error = %e, "cannot read the database's connection budget"),
        }
    }

    async fn client(&self) -> Result<deadpool_postgres::Client, StoreError> {
        self.pool
            .get()
            .await
            .map_err(|e| StoreError::Unavailable(Box::new(e)))
    }
}

/// The connection settings for `url`: the gateway's defaults where the URL
/// says nothing, and this instance's name for the NOTIFY trigger.
fn session(
    url: &str,
    settings: &PgSettings,
    instance: Uuid,
) -> Result<tokio_postgres::Config, StoreError> {
    let mut config: tokio_postgres::Config =
        url.parse().map_err(|e| StoreError::Internal(Box::new(e)))?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(settings.connect_timeout);
    }
    config.keepalives_idle(Duration::from_secs(10));
    if config.get_application_name().is_none() {
        config.application_name("idemgate");
    }
    // Read by the NOTIFY trigger, so announcements name their origin.
    let options = format!(
        "{} -c idemgate.instance={instance}",
        config.get_options().unwrap_or_default()
    );
    config.options(options.trim_start());
    Ok(config)
}

/// Reads the snapshots in `rows` (of [`SNAPSHOT_COLUMNS`], ordered by job),
/// with the database's clock.
fn snapshots(rows: &[Row]) -> Result<(Vec<Snapshot>, SystemTime), StoreError> {
    let mut out: Vec<Snapshot> = Vec::new();
    let mut now = SystemTime::now();
    for row in rows {
        let id = JobId(row.get(0));
        now = row.get(5);
        let attempt = AttemptHead {
            id: AttemptId(row.get(6)),
            number: row.get(7),
            state: attempt_state(row.get(8))?,
            job_version: row.get(9),
            lease_expires_at: row.get(10),
        };
        match out.last_mut() {
            Some(s) if s.job.id == id => s.attempts.push(attempt),
            _ => out.push(Snapshot {
                job: JobHead {
                    id,
                    state: job_state(row.get(1))?,
                    version: row.get(2),
                    attempt_count: row.get(3),
                    completed_by: row.get::<_, Option<Uuid>>(4).map(AttemptId),
                },
                attempts: vec![attempt],
            }),
        }
    }
    Ok((out, now))
}

/// Writes a change inside the transaction holding its job's lock; returns
/// the attempt it started, as stored.
async fn write(
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
                    detail = COALESCE($5, detail) \
             WHERE id = $1",
            &[
                &settled.attempt.0,
                &settled.state.as_str(),
                &settled.finishes(),
                &settled.status.map(|s| s as i16),
                &settled.detail,
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

/// [`Backend::begin`]'s statement: one round trip for a new key and for a
/// duplicate alike. The job of `(owner, key)` ($2, $3) is read, and
/// inserted ($1, $4-$6, $12) with its first attempt ($7-$11, $13) only when
/// there is none. The insert's `ON CONFLICT DO NOTHING` stays the only
/// arbiter of creation; for a duplicate it inserts nothing, so its commit
/// writes nothing either. See [`answer`] for what its row says.
fn begin_statement() -> String {
    format!(
        "WITH existing AS ( \
           SELECT {JOB_COLUMNS}, j.expires_at <= now() AS expired FROM jobs j \
           WHERE j.owner = $2 AND j.key = $3 \
         ), j AS ( \
           INSERT INTO jobs (id, owner, key, fingerprint, route, state, version, attempt_count, expires_at) \
           SELECT $1, $2, $3, $4, $5, $12, 1, 1, now() + $6::bigint * interval '1 millisecond' \
           WHERE NOT EXISTS (SELECT 1 FROM existing) \
           ON CONFLICT (owner, key) DO NOTHING \
           RETURNING * \
         ), a AS ( \
           INSERT INTO attempts (id, job_id, number, upstream, state, job_version, instance, \
                                 lease_expires_at, deadline_at) \
           SELECT $7, j.id, 1, $8, $13, j.version, $9, \
                  now() + $10::bigint * interval '1 millisecond', \
                  now() + $11::bigint * interval '1 millisecond' \
           FROM j \
           RETURNING * \
         ) \
         SELECT {JOB_COLUMNS}, {ATTEMPT_COLUMNS}, false FROM j, a \
         UNION ALL \
         SELECT {JOB_COLUMNS}, NULL::uuid, NULL::uuid, NULL::integer, NULL::text, NULL::text, \
                NULL::bigint, NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, \
                NULL::smallint, NULL::text, j.expired \
         FROM existing j"
    )
}

/// The answer in a row of [`begin_statement`]: the job created with its
/// first attempt (the attempt's columns are set), or the job that exists;
/// `None` when that job expired (the last column) but was not purged yet.
fn answer(row: &Row) -> Result<Option<Begin>, StoreError> {
    if row.get::<_, Option<Uuid>>(JOB_WIDTH).is_some() {
        return Ok(Some(Begin::Created(
            job_from_row(row)?,
            attempt_from_row(row, JOB_WIDTH)?,
        )));
    }
    if row.get::<_, bool>(JOB_WIDTH + ATTEMPT_WIDTH) {
        return Ok(None);
    }
    Ok(Some(Begin::Existing(job_from_row(row)?)))
}

#[async_trait]
impl Records for Postgres {
    async fn job(&self, id: JobId) -> Result<Option<Job>, StoreError> {
        let client = self.client().await?;
        let select = client
            .prepare_cached(&format!("SELECT {JOB_COLUMNS} FROM jobs j WHERE j.id = $1"))
            .await
            .map_err(map_pg)?;
        let row = client.query_opt(&select, &[&id.0]).await.map_err(map_pg)?;
        row.map(|r| job_from_row(&r)).transpose()
    }

    async fn job_detail(&self, id: JobId) -> Result<Option<JobDetail>, StoreError> {
        let client = self.client().await?;
        detail(&client, "j.id = $1", &[&id.0]).await
    }

    async fn find_job(
        &self,
        owner: &Owner,
        key: &IdempotencyKey,
    ) -> Result<Option<JobDetail>, StoreError> {
        let client = self.client().await?;
        detail(
            &client,
            "j.owner = $1 AND j.key = $2",
            &[&owner.as_str(), &key.as_str()],
        )
        .await
    }

    async fn unknown_jobs(
        &self,
        after: Option<Cursor>,
        limit: u32,
    ) -> Result<Vec<Job>, StoreError> {
        let client = self.client().await?;
        // Served by the partial index `jobs_unknown_newest` (migration V4).
        let select = client
            .prepare_cached(&format!(
                "SELECT {JOB_COLUMNS} FROM jobs j WHERE j.state = 'unknown' \
                 AND ($1::timestamptz IS NULL OR (j.created_at, j.id) < ($1, $2::uuid)) \
                 ORDER BY j.created_at DESC, j.id DESC LIMIT $3"
            ))
            .await
            .map_err(map_pg)?;
        let (at, id) = (after.map(|c| c.created_at), after.map(|c| c.job.0));
        let rows = client
            .query(&select, &[&at, &id, &i64::from(limit)])
            .await
            .map_err(map_pg)?;
        rows.iter().map(job_from_row).collect()
    }

    async fn renew_leases(
        &self,
        attempts: &[AttemptId],
        lease: Duration,
    ) -> Result<u64, StoreError> {
        let ids: Vec<Uuid> = attempts.iter().map(|a| a.0).collect();
        let client = self.client().await?;
        client
            .execute(
                "UPDATE attempts SET lease_expires_at = now() + $2::bigint * interval '1 millisecond' \
                 WHERE id = ANY($1) AND state = $3",
                &[&ids, &millis(lease), &AttemptState::Started.as_str()],
            )
            .await
            .map_err(map_pg)
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let client = self.client().await?;
        client
            .execute(
                "DELETE FROM jobs WHERE id IN ( \
                   SELECT id FROM jobs WHERE expires_at < now() ORDER BY expires_at LIMIT $1)",
                &[&i64::from(batch)],
            )
            .await
            .map_err(map_pg)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        // Our own table: a database that answers but was never migrated
        // is not ready either.
        client
            .simple_query("SELECT 1 FROM jobs LIMIT 1")
            .await
            .map_err(map_pg)?;
        Ok(())
    }

    async fn watch(&self, job: JobId) -> Result<(), StoreError> {
        let client = self.client().await?;
        let watch = client
            .prepare_cached("UPDATE jobs SET watched = true WHERE id = $1 AND NOT watched")
            .await
            .map_err(map_pg)?;
        client.execute(&watch, &[&job.0]).await.map_err(map_pg)?;
        Ok(())
    }
}

#[async_trait]
impl Backend for Postgres {
    async fn begin(&self, job: NewJob, attempt: NewAttempt) -> Result<Begin, StoreError> {
        let client = self.client().await?;
        let begin = client
            .prepare_cached(&begin_statement())
            .await
            .map_err(map_pg)?;
        let params: [&(dyn ToSql + Sync); 13] = [
            &job.id.0,
            &job.owner.as_str(),
            &job.key.as_str(),
            &job.fingerprint.0.as_slice(),
            &job.route,
            &millis(job.ttl),
            &attempt.id.0,
            &attempt.upstream,
            &attempt.instance,
            &millis(attempt.lease),
            &millis(attempt.deadline),
            &JobState::Running.as_str(),
            &AttemptState::Started.as_str(),
        ];
        // Bounded: each round either answers, deletes the expired job that
        // blocked the key, or lost an insert race whose winner the next
        // round reads.
        for _ in 0..3 {
            let row = client.query_opt(&begin, &params).await.map_err(map_pg)?;
            let Some(row) = row else { continue };
            if let Some(begin) = answer(&row)? {
                return Ok(begin);
            }
            // Expired but not purged yet: forgotten, the key starts afresh.
            client
                .execute(
                    "DELETE FROM jobs WHERE id = $1 AND expires_at <= now()",
                    &[&row.get::<_, Uuid>(0)],
                )
                .await
                .map_err(map_pg)?;
        }
        Err(StoreError::Contended)
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
        drop(client);
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

/// A job and its attempts in one statement, so they are read as of one
/// moment.
async fn detail(
    client: &deadpool_postgres::Client,
    filter: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Option<JobDetail>, StoreError> {
    let rows = client
        .query(
            &format!(
                "SELECT {JOB_COLUMNS}, {ATTEMPT_COLUMNS} FROM jobs j \
                 LEFT JOIN attempts a ON a.job_id = j.id WHERE {filter} ORDER BY a.number"
            ),
            params,
        )
        .await
        .map_err(map_pg)?;
    let Some(first) = rows.first() else {
        return Ok(None);
    };
    let job = job_from_row(first)?;
    let attempts = rows
        .iter()
        .filter(|r| r.get::<_, Option<Uuid>>(JOB_WIDTH).is_some())
        .map(|r| attempt_from_row(r, JOB_WIDTH))
        .collect::<Result<_, _>>()?;
    Ok(Some(JobDetail { job, attempts }))
}

fn split_headers(response: &StoredResponse) -> (Vec<&str>, Vec<&[u8]>) {
    response
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_ref()))
        .unzip()
}

fn job_from_row(row: &Row) -> Result<Job, StoreError> {
    let fingerprint: &[u8] = row.get(3);
    let response = match row.get::<_, Option<i16>>(9) {
        None => None,
        Some(status) => {
            let names: Vec<String> = row.get::<_, Option<_>>(10).unwrap_or_default();
            let values: Vec<Vec<u8>> = row.get::<_, Option<_>>(11).unwrap_or_default();
            if names.len() != values.len() {
                return Err(StoreError::Corrupt("response headers"));
            }
            let body: Vec<u8> = row.get::<_, Option<_>>(12).unwrap_or_default();
            Some(StoredResponse {
                status: status as u16,
                headers: names
                    .into_iter()
                    .zip(values.into_iter().map(Bytes::from))
                    .collect(),
                body: Bytes::from(body),
            })
        }
    };
    Ok(Job {
        id: JobId(row.get(0)),
        owner: Owner::from_stored(row.get(1)),
        key: IdempotencyKey::new(row.get::<_, String>(2))
            .map_err(|_| StoreError::Corrupt("idempotency key"))?,
        fingerprint: Fingerprint::from_slice(fingerprint)
            .ok_or(StoreError::Corrupt("fingerprint"))?,
        route: row.get(4),
        state: job_state(row.get(5))?,
        version: row.get(6),
        attempt_count: row.get(7),
        completed_by: row.get::<_, Option<Uuid>>(8).map(AttemptId),
        response,
        created_at: row.get(13),
        expires_at: row.get(14),
    })
}

fn attempt_from_row(row: &Row, at: usize) -> Result<Attempt, StoreError> {
    Ok(Attempt {
        id: AttemptId(row.get(at)),
        job_id: JobId(row.get(at + 1)),
        number: row.get(at + 2),
        upstream: row.get(at + 3),
        state: attempt_state(row.get(at + 4))?,
        job_version: row.get(at + 5),
        started_at: row.get(at + 6),
        finished_at: row.get(at + 7),
        lease_expires_at: row.get(at + 8),
        upstream_status: row.get::<_, Option<i16>>(at + 9).map(|s| s as u16),
        detail: row.get(at + 10),
    })
}

/// A database that cannot be reached, or that is read-only (a standby),
/// is `Unavailable` (503, nothing proxied); anything else the database
/// itself refused is `Internal`.
fn map_pg(e: tokio_postgres::Error) -> StoreError {
    if let Some(db) = e.as_db_error() {
        let code = db.code().code();
        // The server is (or has become) a standby: retry on the primary.
        if code == "25006" {
            replication::saw_read_only();
            return StoreError::Unavailable(Box::new(e));
        }
        // Class 08 (connection), 57P0x (shutdown), 53 (resources), 40001/40P01
        // (serialisation, deadlock: try again) and 42P01 (no such table:
        // migrations not applied yet).
        if code.starts_with("08")
            || code.starts_with("57P")
            || code.starts_with("53")
            || code.starts_with("40")
            || code == "42P01"
        {
            return StoreError::Unavailable(Box::new(e));
        }
        return StoreError::Internal(Box::new(e));
    }
    StoreError::Unavailable(Box::new(e))
}
