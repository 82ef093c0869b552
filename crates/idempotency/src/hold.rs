//! The hold of duplicates: a request whose job is running waits here until
//! the job is no longer running (or its answer starts streaming, to join
//! it), then the flow decides again (`docs/design.md` §2, §7).
//!
//! No polling: the [`Doorbell`] rings on every change of the job, here or
//! (through PostgreSQL or Redis) on another replica, and the job is read
//! again after each ring — and once after subscribing, so a change between
//! the first read and the subscription is not missed. Duplicates held on one
//! job share the reads a ring causes. Past `hold_timeout` a duplicate is
//! answered `409 …/request-in-progress` with `Retry-After`. A route with
//! `in_progress = "conflict"` holds nobody: `flow.rs` answers that `409` at
//! once (`docs/design.md` §11).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{ClientError, GatewayError};
use idemgate_domain::attempt::AttemptState;
use idemgate_domain::id::JobId;
use idemgate_domain::job::{Job, JobState};
use idemgate_domain::response::StoredResponse;
use idemgate_store::{Bell, Doorbell, Observed, Store};

/// How long duplicates are held, and what they are told after.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// Longest a duplicate waits for a running job.
    pub timeout: Duration,
    /// `Retry-After` on the answer of a duplicate held too long.
    pub retry_after: Duration,
}

/// Holds duplicates of running jobs.
pub(crate) struct Holds {
    store: Arc<dyn Store>,
    doorbell: Arc<Doorbell>,
    config: Config,
}

impl Holds {
    /// Holds on `store`, woken by `doorbell`.
    pub(crate) fn new(store: Arc<dyn Store>, doorbell: Arc<Doorbell>, config: Config) -> Self {
        Holds {
            store,
            doorbell,
            config,
        }
    }

    /// Waits until `job` is no longer running, or `streaming` says its
    /// answer streams (the duplicate joins the stream), or the hold timeout.
    pub(crate) async fn wait<S, F>(&self, job: JobId, streaming: S) -> Result<Job, GatewayError>
    where
        S: Fn(JobId, i32) -> F,
        F: Future<Output = bool>,
    {
        let deadline = Instant::now() + self.config.timeout;
        let done = |seen: &Observed| seen.job.state != JobState::Running || seen.streaming;
        self.watch(job, deadline, &streaming, done)
            .await?
            .ok_or_else(|| self.in_progress())
    }

    /// Waits, for at most `limit` (not the hold timeout: the caller is not a
    /// client's request but what completes one), until `job` is no longer
    /// running; `None` when it still is.
    pub(crate) async fn wait_settled<S, F>(
        &self,
        job: JobId,
        limit: Duration,
        streaming: S,
    ) -> Result<Option<Job>, GatewayError>
    where
        S: Fn(JobId, i32) -> F,
        F: Future<Output = bool>,
    {
        self.wait_out(job, JobState::Running, limit, streaming)
            .await
    }

    /// Waits, for at most `limit`, until `job` (whose outcome is unknown)
    /// is settled by evidence: a lookup due within `limit` on a route that
    /// looks up (`docs/design.md` §5). `None` when it is still unknown.
    ///
    /// `streaming` is asked as in [`Holds::wait`]: waiters share what one
    /// of them observed.
    pub(crate) async fn wait_for_evidence<S, F>(
        &self,
        job: JobId,
        limit: Duration,
        streaming: S,
    ) -> Result<Option<Job>, GatewayError>
    where
        S: Fn(JobId, i32) -> F,
        F: Future<Output = bool>,
    {
        let limit = limit.min(self.config.timeout);
        self.wait_out(job, JobState::Unknown, limit, streaming)
            .await
    }

    /// Waits, for at most `limit`, until `job` leaves `state`; `None` when
    /// it has not.
    async fn wait_out<S, F>(
        &self,
        job: JobId,
        state: JobState,
        limit: Duration,
        streaming: S,
    ) -> Result<Option<Job>, GatewayError>
    where
        S: Fn(JobId, i32) -> F,
        F: Future<Output = bool>,
    {
        let done = |seen: &Observed| seen.job.state != state;
        self.watch(job, Instant::now() + limit, &streaming, done)
            .await
    }

    /// Reads `job` after every ring until `done` says so (`Some`) or
    /// `deadline` passes (`None`).
    async fn watch<S, F>(
        &self,
        job: JobId,
        deadline: Instant,
        streaming: &S,
        done: impl Fn(&Observed) -> bool,
    ) -> Result<Option<Job>, GatewayError>
    where
        S: Fn(JobId, i32) -> F,
        F: Future<Output = bool>,
    {
        let bell = self.doorbell.bell(job);
        // Changes of a job are announced to other replicas only once
        // someone waits on it; the reads below follow the mark.
        // Boxed, as the reads below: a held duplicate waits in this future
        // (for the ring, or the deadline), which would otherwise be as
        // large as the largest read it awaits (docs/performance.md, "Per
        // held duplicate").
        Box::pin(bell.watched(|| self.store.watch(job))).await?;
        metrics::counter!("idemgate_requests_held_total").increment(1);
        let _held = HeldGauge::new();
        loop {
            let rung = bell.notified();
            tokio::pin!(rung);
            rung.as_mut().enable();
            // What another waiter read since the last ring serves here too.
            let since = bell.rings();
            // Settled, or streaming: the caller decides (and joins). Read in
            // the `if let`, so no `Job` stays in scope while it waits below.
            if let Some(job) = self.settled(&bell, since, job, streaming, &done).await? {
                return Ok(Some(job));
            }
            tokio::select! {
                () = &mut rung => {}
                () = tokio::time::sleep_until(deadline) => return Ok(None),
            }
        }
    }

    /// The job as read after ring `since` (or as another waiter read it),
    /// when `done` says the wait is over.
    async fn settled<S, F>(
        &self,
        bell: &Bell,
        since: u64,
        job: JobId,
        streaming: &S,
        done: &impl Fn(&Observed) -> bool,
    ) -> Result<Option<Job>, GatewayError>
    where
        S: Fn(JobId, i32) -> F,
        F: Future<Output = bool>,
    {
        // Boxed: a held duplicate waits in `watch` for the next ring, which
        // would otherwise be as large as this read (docs/performance.md,
        // "Per held duplicate").
        let seen = Box::pin(bell.observe(since, || self.observe(job, streaming))).await?;
        Ok(done(&seen).then_some(seen.job))
    }

    /// Reads the job, and whether its answer streams.
    async fn observe<S, F>(&self, job: JobId, streaming: &S) -> Result<Observed, GatewayError>
    where
        S: Fn(JobId, i32) -> F,
        F: Future<Output = bool>,
    {
        let job = self.reread(job).await?;
        let streaming =
            job.state == JobState::Running && streaming(job.id, job.attempt_count).await;
        Ok(Observed { job, streaming })
    }

    /// The job as the store has it now.
    pub(crate) async fn reread(&self, job: JobId) -> Result<Job, GatewayError> {
        // Purged under our feet (expired): the client may simply retry.
        self.store.job(job).await?.ok_or_else(|| self.in_progress())
    }

    /// Whether attempt number `number` of `job` still runs (`started`, its
    /// job running), as the store says now; `None` when the store cannot
    /// say, so a reader that cannot be sure which answer streams is held,
    /// not joined.
    pub(crate) async fn attempt_runs(&self, job: JobId, number: i32) -> Option<bool> {
        let detail = self.store.job_detail(job).await.ok()??;
        let started = detail
            .attempts
            .iter()
            .any(|a| a.number == number && a.state == AttemptState::Started);
        Some(started && detail.job.state == JobState::Running)
    }

    /// The number of the attempt whose answer `job` committed, if the
    /// store can say.
    pub(crate) async fn committed_by(&self, job: JobId) -> Option<i32> {
        let detail = self.store.job_detail(job).await.ok()??;
        let by = detail.job.completed_by?;
        detail
            .attempts
            .iter()
            .find(|a| a.id == by)
            .map(|a| a.number)
    }

    /// The committed answer of a completed `job`, read from the store when
    /// it was too large to come with the job (`docs/design.md` §18).
    pub(crate) async fn committed(&self, job: Job) -> Result<Option<StoredResponse>, GatewayError> {
        match (job.response, job.response_in_store) {
            (Some(stored), _) => Ok(Some(stored)),
            (None, Some(_)) => Ok(self.store.response(job.id).await?),
            (None, None) => Ok(None),
        }
    }

    /// The answer to a duplicate that cannot be held (longer).
    pub(crate) fn in_progress(&self) -> GatewayError {
        ClientError::InProgress {
            retry_after: self.config.retry_after,
        }
        .into()
    }
}

/// Counts the duplicates held right now (`idemgate_held_requests`).
struct HeldGauge;

impl HeldGauge {
    fn new() -> Self {
        metrics::gauge!("idemgate_held_requests").increment(1.0);
        HeldGauge
    }
}

impl Drop for HeldGauge {
    fn drop(&mut self) {
        metrics::gauge!("idemgate_held_requests").decrement(1.0);
    }
}
