//! The domain's transitions, run on a backend: the one implementation of
//! [`Store`].
//!
//! Each operation asks the backend to lock the job, hands the snapshot to a
//! function of [`idemgate_domain::transition`], and lets the backend write what it
//! returns. A change that moves a job's state rings the doorbell here, and
//! only here, once. With encryption configured, responses are sealed here on
//! their way in and opened on their way out (see [`crate::seal`]).
//!
//! The backend is held [`Measured`]: every call to it is timed and counted
//! there, so the operations below forward to it without measuring anything
//! themselves.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio_util::task::TaskTracker;

use super::measured::Measured;
use super::{
    Backend, Begin, CallAt, CommitOutcome, Cursor, Decide, Doorbell, Lapsed, Lock, Records, Store,
    StoreError,
};
use crate::seal::{self, Sealer};
use idemgate_domain::attempt::{Attempt, AttemptFailure, AttemptState, NewAttempt, Resolution};
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::job::{Job, JobDetail, NewJob};
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_domain::reconcile::Lookup;
use idemgate_domain::response::StoredResponse;
use idemgate_domain::transition::{self, Change, Refusal};

/// How often the job a resolution left is read before a store that does
/// not answer fails the call, and the first wait between reads (doubling:
/// 50 ms to 400 ms, under a second in all).
const READ_BACK_TRIES: u32 = 5;
const READ_BACK_FIRST_WAIT: Duration = Duration::from_millis(50);

/// A [`Store`] over a [`Backend`].
pub struct Machine<B> {
    /// Shared with the writes that outlive a request ([`Machine::unsent`]).
    backend: Arc<Measured<B>>,
    doorbell: Arc<Doorbell>,
    sealer: Option<Arc<Sealer>>,
    /// Told of every attempt a sweep made `unknown`, when someone listens.
    lapsed: Option<tokio::sync::mpsc::UnboundedSender<Lapsed>>,
    /// The writes that outlive their request, for the drain to wait on
    /// ([`Store::finish_writes`]).
    background: TaskTracker,
}

impl<B: Backend> Machine<B> {
    /// The store over `backend`, ringing `doorbell` on every change of a
    /// job's state.
    pub fn new(backend: B, doorbell: Arc<Doorbell>) -> Self {
        Machine {
            backend: Arc::new(Measured(backend)),
            doorbell,
            sealer: None,
            lapsed: None,
            background: TaskTracker::new(),
        }
    }

    /// Reports every attempt a sweep makes `unknown` on `lapsed` (so that
    /// it can be looked up on its upstream, `docs/design.md` §5).
    pub fn reporting_lapsed(
        mut self,
        lapsed: Option<tokio::sync::mpsc::UnboundedSender<Lapsed>>,
    ) -> Self {
        self.lapsed = lapsed;
        self
    }

    /// Seals responses at rest with `sealer`.
    pub fn sealed_with(mut self, sealer: Option<Arc<Sealer>>) -> Self {
        self.sealer = sealer;
        self
    }

    fn seal(&self, job: JobId, response: &StoredResponse) -> StoredResponse {
        match &self.sealer {
            Some(sealer) => sealer.seal(job, response),
            None => response.clone(),
        }
    }

    fn open(&self, mut job: Job) -> Result<Job, StoreError> {
        if let Some(response) = job.response.take() {
            job.response = Some(seal::open(self.sealer.as_deref(), job.id, response)?);
        }
        Ok(job)
    }

    fn open_detail(&self, detail: Option<JobDetail>) -> Result<Option<JobDetail>, StoreError> {
        detail
            .map(|d| {
                Ok(JobDetail {
                    job: self.open(d.job)?,
                    attempts: d.attempts,
                })
            })
            .transpose()
    }

    fn ring(&self, change: &Change) {
        ring(&self.doorbell, change);
    }

    /// What a commit of `response` whose compare-and-swap failed is:
    /// `Committed` when the job's winner is `attempt`, committed by the
    /// attempt itself (no lookup's detail or operator's name on it; the
    /// detail of an `unknown` it committed from may still be there) with
    /// this very answer (read from the store when it is too large for the
    /// job's row): its first try landed and the reply was lost, so the
    /// retry met its own commit. `Superseded` otherwise (another attempt
    /// won, a lookup or an operator settled this one). A read that fails
    /// transiently fails the commit, which is tried again (`docs/design.md`
    /// §7, "A commit whose reply was lost").
    async fn lost_to(
        &self,
        attempt: &Attempt,
        response: &StoredResponse,
    ) -> Result<CommitOutcome, StoreError> {
        let detail = match self.job_detail(attempt.job_id).await {
            Ok(Some(detail)) => detail,
            Err(e) if e.is_transient() => return Err(e),
            _ => return Ok(CommitOutcome::Superseded),
        };
        let own = detail.attempts.iter().find(|a| a.id == attempt.id);
        let committed_by_itself = detail.job.completed_by == Some(attempt.id)
            && own.is_some_and(|a| {
                a.state == AttemptState::Succeeded
                    && a.detail.as_deref() != Some(transition::RECONCILED)
                    && a.resolved_by.is_none()
            });
        if !committed_by_itself {
            return Ok(CommitOutcome::Superseded);
        }
        // An answer larger than the row holds is left in the store when the
        // job is read: read it now, or a large answer that committed would
        // be told it lost, and a stream of it cut for every reader.
        let stored = match detail.job.response_in_store {
            None => detail.job.response,
            Some(_) => match self.response(attempt.job_id).await {
                Ok(stored) => stored,
                Err(e) if e.is_transient() => return Err(e),
                Err(_) => return Ok(CommitOutcome::Superseded),
            },
        };
        if stored.as_ref() != Some(response) {
            return Ok(CommitOutcome::Superseded);
        }
        tracing::info!(job = %attempt.job_id, attempt = %attempt.id, "the commit's retry found its own first try committed: its reply had been lost");
        Ok(CommitOutcome::Committed)
    }

    /// Runs one transition; rings when it moved the job.
    async fn apply(&self, lock: Lock, decide: Decide) -> Result<super::Applied, StoreError> {
        apply(&self.backend, &self.doorbell, lock, decide).await
    }

    /// Applies a resolution, sealing a given response first: an operator's
    /// (`operator`, recorded on the attempt) or, with none, a lookup's;
    /// answers the job as it is after.
    async fn resolve_by(
        &self,
        attempt: AttemptId,
        resolution: Resolution,
        operator: Option<String>,
    ) -> Result<JobDetail, StoreError> {
        let sealer = self.sealer.clone();
        let decide: Decide = Box::new(move |s, _| {
            let resolution = match (resolution, sealer) {
                (Resolution::Succeeded(response), Some(sealer)) => {
                    Resolution::Succeeded(sealer.seal(s.job.id, &response))
                }
                (resolution, _) => resolution,
            };
            match &operator {
                Some(who) => transition::resolve_as(s, attempt, &resolution, who),
                None => transition::reconcile(s, attempt, &resolution),
            }
        });
        let applied = self.apply(Lock::JobOf(attempt), decide).await?;
        self.read_back(applied.change.job.id).await
    }

    /// The job as a resolution just written left it. The write took, so a
    /// read the store does not answer is tried again rather than reported:
    /// as an error it would say the resolution failed (the admin API's 503,
    /// bulk's "skipped", no end counted) and a lookup, applying its finding
    /// again, would be refused as settled. Retrying suits every caller, as
    /// each needs the whole job (its route and the attempt's upstream for the
    /// metric, the job page for the answer), which only a read has: the
    /// change written holds the job's state, not its route or the
    /// attempt's upstream (`docs/operations.md`, the admin API). A job
    /// gone meanwhile (purged past `key_ttl` once reopened) has nothing to
    /// show and stays `NotFound`.
    async fn read_back(&self, job: JobId) -> Result<JobDetail, StoreError> {
        let mut wait = READ_BACK_FIRST_WAIT;
        for _ in 1..READ_BACK_TRIES {
            match self.job_detail(job).await {
                Err(e) if e.is_transient() => {
                    tracing::warn!(%job, error = %idemgate_telemetry::Chain(&e), "the resolution is written; reading its job again");
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                }
                read => return read?.ok_or(StoreError::NotFound("job")),
            }
        }
        self.job_detail(job)
            .await?
            .ok_or(StoreError::NotFound("job"))
    }

    /// Starts `attempt` by `transition` (claim, move-on or hedge); `None` when the
    /// job moved on or is in a state that does not take one.
    async fn start(
        &self,
        job: JobId,
        attempt: AttemptId,
        decide: Decide,
    ) -> Result<Option<Attempt>, StoreError> {
        match self.apply(Lock::Job(job), decide).await {
            Ok(applied) => applied
                .started
                .map(Some)
                .ok_or_else(|| StoreError::internal("a start wrote no attempt")),
            Err(StoreError::Refused(Refusal::Stale { .. } | Refusal::JobIs { .. })) => Ok(None),
            Err(StoreError::NotFound(_)) => Ok(None),
            Err(e) if e.is_transient() => self.started_after_all(job, attempt, e).await,
            Err(e) => Err(e),
        }
    }

    /// A start whose transaction failed with its outcome unknown: the
    /// connection can be lost after the commit, before its reply. The
    /// attempt is looked for by its id, which only this request knows: if
    /// it was written and is still started, it is this request's to run.
    /// Failed instead, the request would leave a started attempt nobody
    /// runs, and every retry of the key would be held on it until its lease
    /// lapsed into `unknown` (`docs/design.md` §5, "A start whose reply was
    /// lost"). Not written, or not readable, the error stands.
    async fn started_after_all(
        &self,
        job: JobId,
        attempt: AttemptId,
        error: StoreError,
    ) -> Result<Option<Attempt>, StoreError> {
        let Ok(Some(detail)) = self.backend.job_detail(job).await else {
            return Err(error);
        };
        // A job completed meanwhile (by a hedge's other attempt, or the
        // late answer of the attempt a move-on went past) needs no call.
        // An attempt near or past its lease still runs: nobody else will,
        // and its answer commits from `unknown` too (§5).
        let done = detail.job.state.is_terminal();
        match detail.attempts.into_iter().find(|a| a.id == attempt) {
            Some(started) if done && started.state == AttemptState::Started => {
                self.unsent(job, &started);
                Ok(None)
            }
            Some(_) if done => Ok(None),
            Some(started) if started.state == AttemptState::Started => {
                tracing::info!(%job, %attempt, "the attempt's start was written though its reply was lost; it runs");
                // Rung as `apply` rings a claim, which moved the job (for
                // a hedge, which did not, it costs the holders one read).
                self.doorbell.ring(job);
                Ok(Some(started))
            }
            // Settled already (taken over by an operator, or lapsed):
            // not ours to run.
            Some(_) => Ok(None),
            None => Err(error),
        }
    }

    /// Settles `attempt`, written but not to be run (its job completed
    /// before its start's lost reply was read back), as never sent: left
    /// `started`, it would lapse into `unknown` on a completed job, where
    /// an operator would see an outcome in doubt and the reconciler would
    /// look it up with the upstream. Written in the background, retried
    /// while the store fails transiently, as any outcome is
    /// ([`crate::retrying`]), until its lease lapses (the sweeper's then; `docs/design.md` §5,
    /// "A start whose reply was lost"): the request that learned it goes
    /// on to the job's answer meanwhile.
    fn unsent(&self, job: JobId, attempt: &Attempt) {
        let (backend, doorbell) = (self.backend.clone(), self.doorbell.clone());
        // The lease's length, both ends by the database's clock: nothing
        // renews an attempt nobody runs, so it lapses within that.
        let lease =
            (attempt.lease_expires_at.duration_since(attempt.started_at)).unwrap_or_default();
        let deadline = tokio::time::Instant::now() + lease;
        let attempt = attempt.id;
        let settle = move || -> Decide {
            let failure = AttemptFailure::Failed {
                status: None,
                detail: NEVER_SENT_OVERTAKEN.into(),
            };
            Box::new(move |s, _| transition::settle(s, attempt, &failure))
        };
        self.background.spawn(async move {
            let write = || async {
                match apply(&backend, &doorbell, Lock::Job(job), settle()).await {
                    Ok(_) => Ok(true),
                    // Settled already (a try whose reply was lost, an
                    // operator), or purged: nothing left to write.
                    Err(
                        StoreError::Refused(Refusal::AttemptIs { .. }) | StoreError::NotFound(_),
                    ) => Ok(false),
                    Err(e) => Err(e),
                }
            };
            if let Ok(true) = crate::retrying(("settle", crate::retry::LAPSES), attempt, deadline, write).await {
                tracing::info!(%job, %attempt, "an attempt whose start was written though its reply was lost, on a job completed meanwhile, is settled failed: it was never sent");
            }
        });
    }
}

/// Runs one transition on `backend`; rings `doorbell` when it moved the job.
async fn apply<B: Backend>(
    backend: &Measured<B>,
    doorbell: &Doorbell,
    lock: Lock,
    decide: Decide,
) -> Result<super::Applied, StoreError> {
    let applied = backend.change(lock, decide).await??;
    ring(doorbell, &applied.change);
    Ok(applied)
}

fn ring(doorbell: &Doorbell, change: &Change) {
    if change.moves_job() {
        doorbell.ring(change.job.id);
    }
}

/// The detail of an attempt [`Machine::unsent`] settles.
pub(crate) const NEVER_SENT_OVERTAKEN: &str = "never sent upstream: its start was written, but the reply was lost and the job was completed meanwhile";

#[async_trait]
impl<B: Backend> Records for Machine<B> {
    async fn job(&self, id: JobId) -> Result<Option<Job>, StoreError> {
        self.backend
            .job(id)
            .await?
            .map(|j| self.open(j))
            .transpose()
    }

    async fn response(&self, job: JobId) -> Result<Option<StoredResponse>, StoreError> {
        self.backend
            .response(job)
            .await?
            .map(|r| Ok(seal::open(self.sealer.as_deref(), job, r)?))
            .transpose()
    }

    async fn job_detail(&self, id: JobId) -> Result<Option<JobDetail>, StoreError> {
        self.open_detail(self.backend.job_detail(id).await?)
    }

    async fn find_job(
        &self,
        owner: &Owner,
        key: &IdempotencyKey,
    ) -> Result<Option<JobDetail>, StoreError> {
        self.open_detail(self.backend.find_job(owner, key).await?)
    }

    async fn unknown_jobs(
        &self,
        after: Option<Cursor>,
        limit: u32,
    ) -> Result<Vec<Job>, StoreError> {
        let jobs = self.backend.unknown_jobs(after, limit).await?;
        jobs.into_iter().map(|j| self.open(j)).collect()
    }

    async fn unknown_attempts(
        &self,
        since: std::time::SystemTime,
        limit: u32,
    ) -> Result<Vec<(JobId, AttemptId)>, StoreError> {
        self.backend.unknown_attempts(since, limit).await
    }

    async fn renew_leases(
        &self,
        attempts: &[AttemptId],
        lease: Duration,
    ) -> Result<u64, StoreError> {
        if attempts.is_empty() {
            return Ok(0);
        }
        self.backend.renew_leases(attempts, lease).await
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.backend.purge_expired(batch).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.backend.ping().await
    }

    async fn watch(&self, job: JobId) -> Result<(), StoreError> {
        self.backend.watch(job).await
    }

    async fn record_lookup(&self, attempt: AttemptId, lookup: &Lookup) -> Result<(), StoreError> {
        self.backend.record_lookup(attempt, lookup).await
    }

    async fn mark_call(
        &self,
        attempt: AttemptId,
        instance: uuid::Uuid,
        call: &CallAt,
        for_at_most: Duration,
    ) -> Result<(), StoreError> {
        self.backend
            .mark_call(attempt, instance, call, for_at_most)
            .await
    }

    async fn unmark_call(&self, attempt: AttemptId) -> Result<(), StoreError> {
        self.backend.unmark_call(attempt).await
    }

    async fn call_at_server(
        &self,
        session: &[u8; 32],
        call: Option<&[u8; 32]>,
        except: uuid::Uuid,
    ) -> Result<bool, StoreError> {
        self.backend.call_at_server(session, call, except).await
    }
}

#[async_trait]
impl<B: Backend> Store for Machine<B> {
    async fn finish_writes(&self) {
        // Closed so that `wait` can end once the tracker is empty; a write
        // spawned while it waits (a request still finishing) is waited for
        // too, one spawned after it returned is not.
        self.background.close();
        self.background.wait().await;
    }

    async fn begin_job(&self, job: NewJob, attempt: NewAttempt) -> Result<Begin, StoreError> {
        // A new job has no one waiting on it yet: nothing to ring.
        match self.backend.begin(job, attempt).await? {
            Begin::Existing(job) => Ok(Begin::Existing(self.open(job)?)),
            created => Ok(created),
        }
    }

    async fn claim_attempt(
        &self,
        job: JobId,
        version: i64,
        attempt: NewAttempt,
    ) -> Result<Option<Attempt>, StoreError> {
        self.start(
            job,
            attempt.id,
            Box::new(move |s, _| transition::claim(s, version, attempt)),
        )
        .await
    }

    async fn move_on_attempt(
        &self,
        job: JobId,
        version: i64,
        attempt: NewAttempt,
    ) -> Result<Option<Attempt>, StoreError> {
        self.start(
            job,
            attempt.id,
            Box::new(move |s, _| transition::move_on(s, version, attempt)),
        )
        .await
    }

    async fn hedge_attempt(
        &self,
        job: JobId,
        version: i64,
        attempt: NewAttempt,
    ) -> Result<Option<Attempt>, StoreError> {
        self.start(
            job,
            attempt.id,
            Box::new(move |s, _| transition::hedge(s, version, attempt)),
        )
        .await
    }

    async fn commit(
        &self,
        attempt: &Attempt,
        response: &StoredResponse,
    ) -> Result<CommitOutcome, StoreError> {
        let committed = self
            .backend
            .commit(attempt, &self.seal(attempt.job_id, response))
            .await?;
        if !committed.won {
            // Rung even so: when this very attempt's commit landed but its
            // reply was lost, and the retry found the job completed, no one
            // has rung this replica's holders (its own announcement is
            // ignored here), so they could wait out `hold_timeout`
            // (docs/design.md §7, "A commit whose reply was lost").
            self.doorbell.ring_local(attempt.job_id);
            return self.lost_to(attempt, response).await;
        }
        // Other replicas hear of it only when one of them waits on the job.
        if committed.watched {
            self.doorbell.ring(attempt.job_id);
        } else {
            self.doorbell.ring_local(attempt.job_id);
        }
        Ok(CommitOutcome::Committed)
    }

    async fn fail_attempt(
        &self,
        attempt: AttemptId,
        failure: AttemptFailure,
    ) -> Result<bool, StoreError> {
        let writes = failure.state();
        // The job the attempt is of, as the lock found it.
        let locked = Arc::new(std::sync::OnceLock::new());
        let decide: Decide = Box::new({
            let locked = locked.clone();
            move |s, _| {
                let _ = locked.set(s.job.id);
                transition::settle(s, attempt, &failure)
            }
        });
        match self.apply(Lock::JobOf(attempt), decide).await {
            Ok(_) => Ok(true),
            Err(StoreError::Refused(Refusal::AttemptIs { state, .. })) => {
                tracing::debug!(%attempt, %state, "attempt already settled; its end is not recorded again");
                // Settled as this call would settle it: most likely its own
                // first try, which landed with its reply lost. That try
                // rang nobody here (its announcement is ignored on this
                // replica), so the job's bell is rung now, or the
                // duplicates held here could wait out `hold_timeout` on a
                // job that is open. Settled so by another, it costs the
                // holders one read (docs/design.md §7, "A settle whose
                // reply was lost").
                if state == writes {
                    if let Some(job) = locked.get() {
                        self.doorbell.ring_local(*job);
                    }
                }
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    async fn resolve_attempt(
        &self,
        attempt: AttemptId,
        resolution: Resolution,
    ) -> Result<JobDetail, StoreError> {
        let unnamed = idemgate_domain::attempt::UNRECORDED_OPERATOR;
        self.resolve_attempt_as(attempt, resolution, unnamed).await
    }

    async fn resolve_attempt_as(
        &self,
        attempt: AttemptId,
        resolution: Resolution,
        operator: &str,
    ) -> Result<JobDetail, StoreError> {
        self.resolve_by(attempt, resolution, Some(operator.to_owned()))
            .await
    }

    async fn reconcile_attempt(
        &self,
        attempt: AttemptId,
        resolution: Resolution,
    ) -> Result<JobDetail, StoreError> {
        self.resolve_by(attempt, resolution, None).await
    }

    async fn expire_leases(&self, batch: u32) -> Result<u64, StoreError> {
        let changes = self.backend.expire_lapsed(batch).await?;
        for change in &changes {
            for settled in &change.settled {
                tracing::warn!(attempt = %settled.attempt, job = %change.job.id, "attempt lease lapsed; outcome unknown");
                if let Some(lapsed) = &self.lapsed {
                    let _ = lapsed.send(Lapsed {
                        job: change.job.id,
                        attempt: settled.attempt,
                    });
                }
            }
            self.ring(change);
        }
        Ok(changes.len() as u64)
    }
}

#[cfg(test)]
mod tests;
