//! The PostgreSQL store: the source of truth in production.
//!
//! SQL lives next to the method that runs it. The hot path is two single
//! statements: [`Store::begin_job`] (`INSERT … ON CONFLICT DO NOTHING` of the
//! job and its first attempt) and [`Store::commit`] (the CAS). Paths that
//! settle an attempt lock the job row, so that two attempts settling at once
//! derive the job's state from each other's writes.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use deadpool_postgres::{GenericClient, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use futures_util::StreamExt;
use tokio_postgres::{AsyncMessage, NoTls, Row};
use uuid::Uuid;

use super::{
    next_job_state, parse_attempt_state, parse_job_state, Begin, CommitOutcome, Doorbell, Joining,
    Store, StoreError,
};
use crate::attempt::{Attempt, AttemptFailure, AttemptId, AttemptState, NewAttempt, Resolution};
use crate::fingerprint::Fingerprint;
use crate::job::{Job, JobDetail, JobId, JobState, NewJob, StoredResponse};
use crate::key::{IdempotencyKey, Owner};

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

/// Connection settings for [`PgStore`].
#[derive(Debug, Clone)]
pub struct PgSettings {
    /// A libpq-style URL or key=value string.
    pub url: String,
    /// Most connections in the pool.
    pub pool_size: usize,
    /// How long to wait for a connection (new or pooled) before answering 503.
    pub connect_timeout: Duration,
}

/// The PostgreSQL implementation of [`Store`].
#[derive(Clone)]
pub struct PgStore {
    pool: Pool,
    config: tokio_postgres::Config,
    doorbell: Arc<Doorbell>,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore").finish_non_exhaustive()
    }
}

impl PgStore {
    /// Builds the pool. Connections are made lazily, so a database that is
    /// down at start-up makes requests answer 503 rather than the gateway
    /// refuse to start.
    pub fn new(settings: &PgSettings, doorbell: Arc<Doorbell>) -> Result<Self, StoreError> {
        let mut config: tokio_postgres::Config = settings
            .url
            .parse()
            .map_err(|e| StoreError::Internal(format!("database URL: {e}")))?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(settings.connect_timeout);
        }
        config.keepalives_idle(Duration::from_secs(10));
        if config.get_application_name().is_none() {
            config.application_name("idemgate");
        }
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
            .build()
            .map_err(|e| StoreError::Internal(format!("database pool: {e}")))?;
        Ok(PgStore {
            pool,
            config,
            doorbell,
        })
    }

    /// Applies the SQL migrations under `migrations/postgres`, holding an
    /// advisory lock so that replicas starting together apply them once.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let (mut client, connection) = self.config.connect(NoTls).await.map_err(map_pg)?;
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
        let report = report.map_err(|e| StoreError::Internal(format!("migrations: {e}")))?;
        for m in report.applied_migrations() {
            tracing::info!(migration = %m, "applied migration");
        }
        Ok(())
    }

    /// Listens for job-state changes made by any replica and rings the
    /// doorbell; reconnects after losing the database, ringing every bell
    /// then, since announcements made meanwhile were lost.
    pub async fn listen(self, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        let mut backoff = Duration::from_millis(100);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                result = self.listen_once() => {
                    match result {
                        Ok(()) => backoff = Duration::from_millis(100),
                        Err(e) => tracing::warn!(error = %e, "job notifications interrupted; reconnecting"),
                    }
                }
            }
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    async fn listen_once(&self) -> Result<(), StoreError> {
        let (client, mut connection) = self.config.connect(NoTls).await.map_err(map_pg)?;
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        let doorbell = self.doorbell.clone();
        let mut driver = tokio::spawn(async move {
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(n)) => {
                        if let Ok(id) = n.payload().parse::<Uuid>() {
                            metrics::counter!("idemgate_wakeups_total", "source" => "postgres")
                                .increment(1);
                            doorbell.ring_local(JobId(id));
                        }
                    }
                    Ok(_) => {}
                    Err(e) => return Err(map_pg(e)),
                }
            }
            Ok(())
        });
        client
            .batch_execute(&format!("LISTEN {CHANNEL}"))
            .await
            .map_err(map_pg)?;
        // Whatever changed while we were not listening went unannounced.
        self.doorbell.ring_all();
        let result = (&mut driver)
            .await
            .unwrap_or_else(|e| Err(StoreError::Internal(e.to_string())));
        drop(client);
        result
    }

    async fn client(&self) -> Result<deadpool_postgres::Client, StoreError> {
        self.pool
            .get()
            .await
            .map_err(|e| StoreError::Unavailable(e.to_string()))
    }

    /// Settles one attempt and derives its job's state again, in one
    /// transaction holding the job row.
    async fn settle(
        &self,
        attempt: AttemptId,
        to: AttemptState,
        status: Option<u16>,
        detail: &str,
        from: &[AttemptState],
    ) -> Result<Option<JobId>, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(map_pg)?;
        let (job, job_state, current) = lock_attempt(&tx, attempt).await?;
        if !from.contains(&current) || !current.can_become(to) {
            // Already settled by someone else (a commit, an operator): leave it.
            return Ok(None);
        }
        let finished = (to != AttemptState::Unknown).then(SystemTime::now);
        tx.execute(
            "UPDATE attempts SET state = $2, finished_at = $3, \
             upstream_status = COALESCE($4, upstream_status), detail = $5 WHERE id = $1",
            &[
                &attempt.0,
                &to.as_str(),
                &finished,
                &status.map(|s| s as i16),
                &detail,
            ],
        )
        .await
        .map_err(map_pg)?;
        if !job_state.is_terminal() {
            let derived = derive_job_state(&tx, job, job_state).await?;
            if derived != job_state {
                tx.execute(
                    "UPDATE jobs SET state = $2, updated_at = now() WHERE id = $1",
                    &[&job.0, &derived.as_str()],
                )
                .await
                .map_err(map_pg)?;
            }
        }
        tx.commit().await.map_err(map_pg)?;
        self.doorbell.ring(job);
        Ok(Some(job))
    }

    /// Adds the next attempt to a job, if the job is still at `version` and
    /// in the state `how` needs: one statement, so the check and the insert
    /// cannot be split by another writer.
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
                        attempt_count = attempt_count + 1, updated_at = now() \
                 WHERE id = $1 AND version = $2 AND state = 'open'"
            }
            Joining::Hedge => {
                "UPDATE jobs SET attempt_count = attempt_count + 1, updated_at = now() \
                 WHERE id = $1 AND version = $2 AND state IN ('running', 'unknown')"
            }
        };
        let client = self.client().await?;
        let row = client
            .query_opt(
                &format!(
                    "WITH j AS ({update} RETURNING id, version, attempt_count), \
                     a AS ( \
                       INSERT INTO attempts (id, job_id, number, upstream, state, job_version, instance, \
                                             lease_expires_at, deadline_at) \
                       SELECT $3, j.id, j.attempt_count, $4, 'started', j.version, $5, \
                              now() + $6::bigint * interval '1 millisecond', \
                              now() + $7::bigint * interval '1 millisecond' \
                       FROM j \
                       RETURNING * \
                     ) \
                     SELECT {ATTEMPT_COLUMNS} FROM a"
                ),
                &[
                    &job.0,
                    &version,
                    &attempt.id.0,
                    &attempt.upstream,
                    &attempt.instance,
                    &millis(attempt.lease),
                    &millis(attempt.deadline),
                ],
            )
            .await
            .map_err(map_pg)?;
        row.map(|r| attempt_from_row(&r, 0)).transpose()
    }

    async fn attempts_of(
        &self,
        client: &deadpool_postgres::Client,
        job: JobId,
    ) -> Result<Vec<Attempt>, StoreError> {
        let rows = client
            .query(
                &format!("SELECT {ATTEMPT_COLUMNS} FROM attempts a WHERE a.job_id = $1 ORDER BY a.number"),
                &[&job.0],
            )
            .await
            .map_err(map_pg)?;
        rows.iter().map(|r| attempt_from_row(r, 0)).collect()
    }
}

/// Locks an attempt and its job for the rest of the transaction, so that
/// two attempts settling at once see each other's writes; returns the job's
/// id and state and the attempt's state.
async fn lock_attempt(
    tx: &deadpool_postgres::Transaction<'_>,
    attempt: AttemptId,
) -> Result<(JobId, JobState, AttemptState), StoreError> {
    let row = tx
        .query_opt(
            "SELECT j.id, j.state, a.state FROM jobs j JOIN attempts a ON a.job_id = j.id \
             WHERE a.id = $1 FOR UPDATE OF j, a",
            &[&attempt.0],
        )
        .await
        .map_err(map_pg)?
        .ok_or(StoreError::NotFound("attempt"))?;
    Ok((
        JobId(row.get(0)),
        parse_job_state(row.get(1))?,
        parse_attempt_state(row.get(2))?,
    ))
}

async fn derive_job_state(
    client: &impl GenericClient,
    job: JobId,
    current: JobState,
) -> Result<JobState, StoreError> {
    let rows = client
        .query("SELECT state FROM attempts WHERE job_id = $1", &[&job.0])
        .await
        .map_err(map_pg)?;
    let states = rows
        .iter()
        .map(|r| parse_attempt_state(r.get(0)))
        .collect::<Result<Vec<_>, _>>()?;
    next_job_state(current, states)
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[async_trait]
impl Store for PgStore {
    async fn begin_job(&self, job: NewJob, attempt: NewAttempt) -> Result<Begin, StoreError> {
        let client = self.client().await?;
        let insert = format!(
            "WITH j AS ( \
               INSERT INTO jobs (id, owner, key, fingerprint, route, state, version, attempt_count, expires_at) \
               VALUES ($1, $2, $3, $4, $5, 'running', 1, 1, now() + $6::bigint * interval '1 millisecond') \
               ON CONFLICT (owner, key) DO NOTHING \
               RETURNING * \
             ), a AS ( \
               INSERT INTO attempts (id, job_id, number, upstream, state, job_version, instance, \
                                     lease_expires_at, deadline_at) \
               SELECT $7, j.id, 1, $8, 'started', j.version, $9, \
                      now() + $10::bigint * interval '1 millisecond', \
                      now() + $11::bigint * interval '1 millisecond' \
               FROM j \
               RETURNING * \
             ) \
             SELECT {JOB_COLUMNS}, {ATTEMPT_COLUMNS} FROM j, a"
        );
        let insert = client.prepare_cached(&insert).await.map_err(map_pg)?;
        let select = client
            .prepare_cached(&format!(
                "SELECT {JOB_COLUMNS}, j.expires_at <= now() FROM jobs j \
                 WHERE j.owner = $1 AND j.key = $2"
            ))
            .await
            .map_err(map_pg)?;
        // Bounded: each round either answers, deletes the expired job that
        // blocked the key, or lost an insert race whose winner the next read finds.
        for _ in 0..3 {
            // Most requests that reach the store are duplicates: a plain read
            // answers them without a write transaction. The insert below stays
            // the only arbiter of creation.
            let existing = client
                .query_opt(&select, &[&job.owner.as_str(), &job.key.as_str()])
                .await
                .map_err(map_pg)?;
            match existing {
                Some(row) if !row.get::<_, bool>(JOB_WIDTH) => {
                    return Ok(Begin::Existing(job_from_row(&row)?))
                }
                // Expired but not purged yet: forgotten, the key starts afresh.
                Some(row) => {
                    client
                        .execute(
                            "DELETE FROM jobs WHERE id = $1 AND expires_at <= now()",
                            &[&row.get::<_, Uuid>(0)],
                        )
                        .await
                        .map_err(map_pg)?;
                }
                None => {}
            }
            let rows = client
                .query(
                    &insert,
                    &[
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
                    ],
                )
                .await
                .map_err(map_pg)?;
            if let Some(row) = rows.first() {
                return Ok(Begin::Created(
                    job_from_row(row)?,
                    attempt_from_row(row, JOB_WIDTH)?,
                ));
            }
        }
        Err(StoreError::Conflict(
            "the key kept changing under the request; try again".into(),
        ))
    }

    async fn claim_attempt(
        &self,
        job: JobId,
        version: i64,
        attempt: NewAttempt,
    ) -> Result<Option<Attempt>, StoreError> {
        self.start_attempt(job, version, attempt, Joining::Claim)
            .await
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
        let client = self.client().await?;
        let (names, values) = split_headers(response);
        let status = response.status as i16;
        // The CAS of DESIGN §2: zero rows from `won` means another attempt
        // won or the job moved on; the attempt is then superseded.
        let commit = client
            .prepare_cached(
                "WITH won AS ( \
                   UPDATE jobs SET state = 'completed', completed_by = $2, response_status = $3, \
                          response_header_names = $4, response_header_values = $5, \
                          response_body = $6, version = version + 1, updated_at = now() \
                   WHERE id = $1 AND version = $7 AND completed_by IS NULL \
                   RETURNING id \
                 ), settled AS ( \
                   UPDATE attempts SET \
                          state = CASE WHEN EXISTS (SELECT 1 FROM won) THEN 'succeeded' ELSE 'superseded' END, \
                          finished_at = now(), upstream_status = $3 \
                   WHERE id = $2 AND state IN ('started', 'unknown') \
                   RETURNING id \
                 ) \
                 SELECT EXISTS (SELECT 1 FROM won)",
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
                ],
            )
            .await
            .map_err(map_pg)?;
        let won: bool = row.get(0);
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
        let from: &[AttemptState] = match failure {
            AttemptFailure::Unknown { .. } => &[AttemptState::Started],
            _ => &[AttemptState::Started, AttemptState::Unknown],
        };
        self.settle(
            attempt,
            failure.state(),
            failure.status(),
            failure.detail(),
            from,
        )
        .await
        .map(|_| ())
    }

    async fn resolve_attempt(
        &self,
        attempt: AttemptId,
        resolution: Resolution,
    ) -> Result<JobDetail, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(map_pg)?;
        let (job, job_state, current) = lock_attempt(&tx, attempt).await?;
        if !current.is_unsettled() {
            return Err(StoreError::Conflict(format!(
                "attempt {attempt} is already {current}; only started or unknown attempts can be resolved"
            )));
        }
        match &resolution {
            Resolution::Succeeded(response) => {
                if job_state.is_terminal() {
                    return Err(StoreError::Conflict(format!(
                        "job {job} is already completed by another attempt"
                    )));
                }
                let (names, values) = split_headers(response);
                tx.execute(
                    "UPDATE jobs SET state = 'completed', completed_by = $2, response_status = $3, \
                            response_header_names = $4, response_header_values = $5, \
                            response_body = $6, version = version + 1, updated_at = now() \
                     WHERE id = $1",
                    &[
                        &job.0,
                        &attempt.0,
                        &(response.status as i16),
                        &names,
                        &values,
                        &response.body.as_ref(),
                    ],
                )
                .await
                .map_err(map_pg)?;
                tx.execute(
                    "UPDATE attempts SET state = 'succeeded', finished_at = now(), \
                            upstream_status = $2, detail = 'resolved by an operator' WHERE id = $1",
                    &[&attempt.0, &(response.status as i16)],
                )
                .await
                .map_err(map_pg)?;
            }
            Resolution::Failed | Resolution::Cancelled => {
                tx.execute(
                    "UPDATE attempts SET state = $2, finished_at = now(), \
                            detail = 'resolved by an operator' WHERE id = $1",
                    &[&attempt.0, &resolution.state().as_str()],
                )
                .await
                .map_err(map_pg)?;
                if !job_state.is_terminal() {
                    let derived = derive_job_state(&tx, job, job_state).await?;
                    // The version moves: the attempt's own late answer must
                    // no longer be able to commit.
                    tx.execute(
                        "UPDATE jobs SET state = $2, version = version + 1, updated_at = now() \
                         WHERE id = $1",
                        &[&job.0, &derived.as_str()],
                    )
                    .await
                    .map_err(map_pg)?;
                }
            }
        }
        tx.commit().await.map_err(map_pg)?;
        self.doorbell.ring(job);
        self.job_detail(job)
            .await?
            .ok_or(StoreError::NotFound("job"))
    }

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
        let Some(job) = self.job(id).await? else {
            return Ok(None);
        };
        let client = self.client().await?;
        let attempts = self.attempts_of(&client, id).await?;
        Ok(Some(JobDetail { job, attempts }))
    }

    async fn find_job(
        &self,
        owner: &Owner,
        key: &IdempotencyKey,
    ) -> Result<Option<JobDetail>, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_opt(
                &format!("SELECT {JOB_COLUMNS} FROM jobs j WHERE j.owner = $1 AND j.key = $2"),
                &[&owner.as_str(), &key.as_str()],
            )
            .await
            .map_err(map_pg)?;
        let Some(row) = row else { return Ok(None) };
        let job = job_from_row(&row)?;
        let attempts = self.attempts_of(&client, job.id).await?;
        Ok(Some(JobDetail { job, attempts }))
    }

    async fn renew_leases(
        &self,
        attempts: &[AttemptId],
        lease: Duration,
    ) -> Result<u64, StoreError> {
        if attempts.is_empty() {
            return Ok(0);
        }
        let ids: Vec<Uuid> = attempts.iter().map(|a| a.0).collect();
        let client = self.client().await?;
        client
            .execute(
                "UPDATE attempts SET lease_expires_at = now() + $2::bigint * interval '1 millisecond' \
                 WHERE id = ANY($1) AND state = 'started'",
                &[&ids, &millis(lease)],
            )
            .await
            .map_err(map_pg)
    }

    async fn expire_leases(&self, batch: u32) -> Result<u64, StoreError> {
        let lapsed = {
            let client = self.client().await?;
            client
                .query(
                    "SELECT id FROM attempts WHERE state = 'started' AND lease_expires_at < now() \
                     ORDER BY lease_expires_at LIMIT $1",
                    &[&i64::from(batch)],
                )
                .await
                .map_err(map_pg)?
        };
        let mut expired = 0;
        for row in lapsed {
            let attempt = AttemptId(row.get(0));
            let settled = self
                .settle(
                    attempt,
                    AttemptState::Unknown,
                    None,
                    "lease lapsed: the gateway running this attempt stopped renewing it",
                    &[AttemptState::Started],
                )
                .await?;
            if let Some(job) = settled {
                tracing::warn!(%attempt, %job, "attempt lease lapsed; outcome unknown");
                expired += 1;
            }
        }
        Ok(expired)
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
        client.simple_query("SELECT 1").await.map_err(map_pg)?;
        Ok(())
    }
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
            .map_err(|e| StoreError::Internal(format!("stored key: {e}")))?,
        fingerprint: Fingerprint::from_slice(fingerprint)
            .ok_or_else(|| StoreError::Internal("stored fingerprint is not 32 bytes".into()))?,
        route: row.get(4),
        state: parse_job_state(row.get(5))?,
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
        state: parse_attempt_state(row.get(at + 4))?,
        job_version: row.get(at + 5),
        started_at: row.get(at + 6),
        finished_at: row.get(at + 7),
        lease_expires_at: row.get(at + 8),
        upstream_status: row.get::<_, Option<i16>>(at + 9).map(|s| s as u16),
        detail: row.get(at + 10),
    })
}

/// A database that cannot be reached is `Unavailable` (503, nothing
/// proxied); anything the database itself refused is `Internal`.
fn map_pg(e: tokio_postgres::Error) -> StoreError {
    if let Some(db) = e.as_db_error() {
        let code = db.code().code();
        // Class 08 (connection), 57P0x (shutdown), 53 (resources), and
        // 42P01 (no such table: migrations not applied yet).
        if code.starts_with("08")
            || code.starts_with("57P")
            || code.starts_with("53")
            || code == "42P01"
        {
            return StoreError::Unavailable(db.to_string());
        }
        return StoreError::Internal(db.to_string());
    }
    StoreError::Unavailable(e.to_string())
}
