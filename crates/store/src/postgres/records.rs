//! Reads, lease renewal, purges and the watch mark: what every backend
//! answers alike ([`Records`]).

use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use deadpool_postgres::GenericClient;
use uuid::Uuid;

use super::rows::{attempt_from_row, job_from_row, response_of};
use super::sql::{purge_statement, ATTEMPT_COLUMNS, JOB_COLUMNS, JOB_WIDTH};
use super::{map_pg, Postgres};
use crate::{millis, CallAt, Cursor, Records, StoreError};
use idemgate_domain::attempt::AttemptState;
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::job::{Job, JobDetail};
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_domain::reconcile::Lookup;
use idemgate_domain::response::StoredResponse;

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

    async fn response(&self, job: JobId) -> Result<Option<StoredResponse>, StoreError> {
        let client = self.client().await?;
        let select = client
            .prepare_cached(
                "SELECT response_status, response_header_names, response_header_values, \
                 response_body FROM jobs WHERE id = $1",
            )
            .await
            .map_err(map_pg)?;
        let row = client.query_opt(&select, &[&job.0]).await.map_err(map_pg)?;
        let response = row.map(response_of).transpose()?.flatten();
        Postgres::release(client, response.as_ref().map_or(0, |r| r.body.len()));
        Ok(response)
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
        // Served by the partial index `jobs_unknown_newest` (migration V4),
        // the cursor its bound: the first page's is past every row, so the
        // one plan the session keeps (design §13, "One plan a statement")
        // starts each page where the last one ended.
        let select = client
            .prepare_cached(&format!(
                "SELECT {JOB_COLUMNS} FROM jobs j WHERE j.state = 'unknown' \
                 AND (j.created_at, j.id) < (coalesce($1::timestamptz, 'infinity'), \
                      coalesce($2::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff')) \
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

    async fn unknown_attempts(
        &self,
        since: SystemTime,
        limit: u32,
    ) -> Result<Vec<(JobId, AttemptId)>, StoreError> {
        let client = self.client().await?;
        // Served by the partial index `attempts_unknown_started` (V6).
        let select = client
            .prepare_cached(
                "SELECT job_id, id FROM attempts WHERE state = 'unknown' AND started_at > $1 \
                 ORDER BY started_at, id LIMIT $2",
            )
            .await
            .map_err(map_pg)?;
        let rows = client
            .query(&select, &[&since, &i64::from(limit)])
            .await
            .map_err(map_pg)?;
        Ok(rows
            .iter()
            .map(|r| (JobId(r.get(0)), AttemptId(r.get(1))))
            .collect())
    }

    async fn renew_leases(
        &self,
        attempts: &[AttemptId],
        lease: Duration,
    ) -> Result<u64, StoreError> {
        let ids: Vec<Uuid> = attempts.iter().map(|a| a.0).collect();
        let client = self.client().await?;
        // An attempt locked by another transaction is being settled (its
        // commit, perhaps in a batch that locks many) and is skipped: waiting
        // would let the two wait on each other's rows in opposite orders
        // (design §13), and the next renewal, well inside the lease, takes
        // it if it is still started.
        let renewed = client
            .execute(
                "UPDATE attempts SET lease_expires_at = now() + $2::bigint * interval '1 millisecond' \
                 WHERE id IN (SELECT id FROM attempts WHERE id = ANY($1) AND state = $3 \
                              FOR UPDATE SKIP LOCKED)",
                &[&ids, &millis(lease), &AttemptState::Started.as_str()],
            )
            .await
            .map_err(map_pg)?;
        // The MCP calls' marks of the attempts, whatever their state (a
        // call recorded `unknown` may still be at its server), never past
        // the attempt's deadline: a mark lapses one lease after its replica
        // stopped renewing it (design §19, "An agent's cancel"). A hint's
        // upkeep: apart, so that it fails no renewal, and skipping a mark
        // another transaction holds (the purge's delete), as above.
        let marks = "UPDATE mcp_calls_at_server m SET good_until = \
                     LEAST(a.deadline_at, now() + $2::bigint * interval '1 millisecond') \
                     FROM attempts a WHERE a.id = m.attempt_id AND m.attempt_id IN \
                     (SELECT attempt_id FROM mcp_calls_at_server WHERE attempt_id = ANY($1) \
                      FOR UPDATE SKIP LOCKED)";
        if let Err(e) = client.execute(marks, &[&ids, &millis(lease)]).await {
            tracing::debug!(error = %e, "could not renew the MCP calls' marks");
        }
        Ok(renewed)
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let client = self.client().await?;
        // A job another transaction holds (a commit batch locks many, in id
        // order) is left for the next sweep rather than waited on in
        // expiry order, which could deadlock the two; replicas sweeping at
        // once take different jobs. So is a job one of whose attempts is
        // held: the delete cascades to its attempts.
        let purged = client
            .execute(purge_statement(), &[&i64::from(batch)])
            .await
            .map_err(map_pg)?;
        // With them, the MCP calls' lapsed marks (no longer renewed: their
        // replica died, or their attempts' deadlines passed), skipping one
        // a renewal holds: a hint's upkeep, whose failure fails no purge.
        let stale = "DELETE FROM mcp_calls_at_server WHERE attempt_id IN \
                     (SELECT attempt_id FROM mcp_calls_at_server WHERE good_until < now() \
                      FOR UPDATE SKIP LOCKED)";
        if let Err(e) = client.execute(stale, &[]).await {
            tracing::debug!(error = %e, "could not delete the MCP calls' lapsed marks");
        }
        Ok(purged)
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

    async fn mark_call(
        &self,
        attempt: AttemptId,
        instance: Uuid,
        call: &CallAt,
        for_at_most: Duration,
    ) -> Result<(), StoreError> {
        let client = self.client().await?;
        let mark = client
            .prepare_cached(
                "INSERT INTO mcp_calls_at_server \
                 (attempt_id, instance, session_key, call_key, good_until) \
                 VALUES ($1, $2, $3, $4, now() + $5::bigint * interval '1 millisecond') \
                 ON CONFLICT (attempt_id) DO NOTHING",
            )
            .await
            .map_err(map_pg)?;
        let (session, key) = (&call.session[..], &call.call[..]);
        let until = millis(for_at_most);
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
            [&attempt.0, &instance, &session, &key, &until];
        client.execute(&mark, &params).await.map_err(map_pg)?;
        Ok(())
    }

    async fn unmark_call(&self, attempt: AttemptId) -> Result<(), StoreError> {
        let client = self.client().await?;
        let unmark = client
            .prepare_cached("DELETE FROM mcp_calls_at_server WHERE attempt_id = $1")
            .await
            .map_err(map_pg)?;
        client
            .execute(&unmark, &[&attempt.0])
            .await
            .map_err(map_pg)?;
        Ok(())
    }

    async fn call_at_server(
        &self,
        session: &[u8; 32],
        call: Option<&[u8; 32]>,
        except: Uuid,
    ) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let marked = client
            .prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM mcp_calls_at_server \
                 WHERE session_key = $1 AND ($2::bytea IS NULL OR call_key = $2) \
                 AND instance <> $3 AND good_until > now())",
            )
            .await
            .map_err(map_pg)?;
        let (session, call) = (&session[..], call.map(|c| &c[..]));
        let row = client
            .query_one(&marked, &[&session, &call, &except])
            .await
            .map_err(map_pg)?;
        Ok(row.get(0))
    }

    async fn record_lookup(&self, attempt: AttemptId, lookup: &Lookup) -> Result<(), StoreError> {
        let client = self.client().await?;
        let record = client
            .prepare_cached(
                "UPDATE attempts SET lookups = lookups + 1, last_lookup_at = $2, \
                 last_lookup_status = $3, last_lookup_result = $4 WHERE id = $1",
            )
            .await
            .map_err(map_pg)?;
        let status = lookup.status.map(|s| s as i16);
        let updated = client
            .execute(
                &record,
                &[&attempt.0, &lookup.at, &status, &lookup.result.as_str()],
            )
            .await
            .map_err(map_pg)?;
        if updated == 0 {
            return Err(StoreError::NotFound("attempt"));
        }
        Ok(())
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
