//! Persistence of jobs and attempts.
//!
//! [`Store`] has one method per domain operation and nothing else. Every
//! implementation keeps the same guarantees, held to one conformance suite
//! (`tests/it/store_conformance.rs`):
//!
//! - a uniqueness constraint on `(owner, key)` is the only arbiter of "seen
//!   before" ([`Store::begin_job`]);
//! - the commit is one compare-and-swap on the job's `version` with
//!   `completed_by IS NULL` ([`Store::commit`]); the loser is `superseded`;
//! - the next attempt of an open job is claimed by a CAS on `version`
//!   ([`Store::claim_attempt`]), so two simultaneous retries make one attempt;
//! - every change of a job's state rings the [`Doorbell`], on every replica.

pub(crate) mod codec;
mod doorbell;
pub mod postgres;
pub mod sqlite;

use std::time::Duration;

use async_trait::async_trait;

use crate::attempt::{Attempt, AttemptFailure, AttemptId, AttemptState, NewAttempt, Resolution};
use crate::job::{Job, JobDetail, JobId, JobState, NewJob, StoredResponse};
use crate::key::{IdempotencyKey, Owner};

pub use doorbell::Doorbell;

/// What [`Store::begin_job`] found.
#[derive(Debug)]
pub enum Begin {
    /// The key was new: the job exists now, running its first attempt.
    Created(Job, Attempt),
    /// The key was seen before: here is its job as it stands.
    Existing(Job),
}

/// What [`Store::commit`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitOutcome {
    /// This attempt's response is the job's result.
    Committed,
    /// Another attempt won, or the job moved on (a resolution): this
    /// attempt is `superseded` and its payload discarded.
    Superseded,
}

/// How a new attempt joins its job (for the stores' shared attempt insert).
#[derive(Debug, Clone, Copy)]
enum Joining {
    /// The next try of an `open` job: moves the version.
    Claim,
    /// Beside a running attempt: keeps the version, so both race fairly.
    Hedge,
}

/// The state a job moves to once one of its attempts settled: derived from
/// all its attempts, and refused (rolling the change back) if the domain does
/// not allow the move.
fn next_job_state(current: JobState, attempts: Vec<AttemptState>) -> Result<JobState, StoreError> {
    let next = JobState::derive(attempts);
    if current.can_become(next) {
        Ok(next)
    } else {
        Err(StoreError::Internal(format!(
            "a job cannot move from {current} to {next}"
        )))
    }
}

fn parse_job_state(s: &str) -> Result<JobState, StoreError> {
    JobState::parse(s).ok_or_else(|| StoreError::Internal(format!("unknown job state {s:?}")))
}

fn parse_attempt_state(s: &str) -> Result<AttemptState, StoreError> {
    AttemptState::parse(s)
        .ok_or_else(|| StoreError::Internal(format!("unknown attempt state {s:?}")))
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached (connection refused, pool exhausted,
    /// timed out). Nothing was recorded.
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
    /// No such job or attempt.
    #[error("{0} not found")]
    NotFound(&'static str),
    /// The operation does not apply to the record in its current state.
    #[error("conflict: {0}")]
    Conflict(String),
    /// The store answered with something the gateway cannot read.
    #[error("store error: {0}")]
    Internal(String),
}

/// One method per domain operation. See the module docs for the guarantees.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Creates the job and its first attempt if `(owner, key)` is new, in one
    /// atomic step; otherwise returns the existing job. An existing job past
    /// its expiry is forgotten and the key starts afresh.
    async fn begin_job(&self, job: NewJob, attempt: NewAttempt) -> Result<Begin, StoreError>;

    /// Starts the next attempt of an `open` job, if its version is still
    /// `version` (a CAS: of two simultaneous claims, one gets `Some`).
    async fn claim_attempt(
        &self,
        job: JobId,
        version: i64,
        attempt: NewAttempt,
    ) -> Result<Option<Attempt>, StoreError>;

    /// Adds an attempt beside a running (or unknown) one without moving the
    /// version (a hedge): both race fairly, and `completed_by IS NULL` picks
    /// the first to commit. `None` when the job moved on from `version`, or
    /// is open or completed. Only side-effect-free routes hedge.
    async fn hedge_attempt(
        &self,
        job: JobId,
        version: i64,
        attempt: NewAttempt,
    ) -> Result<Option<Attempt>, StoreError>;

    /// Commits the attempt's response as the job's result: one CAS on the
    /// version the attempt started under, with `completed_by IS NULL`.
    async fn commit(
        &self,
        attempt: &Attempt,
        response: &StoredResponse,
    ) -> Result<CommitOutcome, StoreError>;

    /// Records how an attempt ended without a result; the job's state is
    /// derived again from all its attempts.
    async fn fail_attempt(
        &self,
        attempt: AttemptId,
        failure: AttemptFailure,
    ) -> Result<(), StoreError>;

    /// Applies an operator's resolution to an unsettled attempt. Moves the
    /// job's version, so the attempt's own late answer can no longer commit.
    async fn resolve_attempt(
        &self,
        attempt: AttemptId,
        resolution: Resolution,
    ) -> Result<JobDetail, StoreError>;

    /// Reads a job.
    async fn job(&self, id: JobId) -> Result<Option<Job>, StoreError>;

    /// Reads a job with its attempts.
    async fn job_detail(&self, id: JobId) -> Result<Option<JobDetail>, StoreError>;

    /// Finds the job of an `(owner, key)` pair.
    async fn find_job(
        &self,
        owner: &Owner,
        key: &IdempotencyKey,
    ) -> Result<Option<JobDetail>, StoreError>;

    /// Extends the leases of attempts this instance is running.
    async fn renew_leases(
        &self,
        attempts: &[AttemptId],
        lease: Duration,
    ) -> Result<u64, StoreError>;

    /// Turns started attempts whose lease lapsed into `unknown` (their
    /// gateway died holding them). Returns how many, at most `batch`.
    async fn expire_leases(&self, batch: u32) -> Result<u64, StoreError>;

    /// Deletes up to `batch` jobs (and their attempts) past their expiry.
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError>;

    /// Checks that the store answers.
    async fn ping(&self) -> Result<(), StoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_settled_attempt_moves_its_job_only_along_allowed_transitions() {
        use AttemptState::*;
        assert_eq!(
            next_job_state(JobState::Running, vec![Failed]).unwrap(),
            JobState::Open
        );
        assert_eq!(
            next_job_state(JobState::Unknown, vec![Unknown, Failed]).unwrap(),
            JobState::Unknown
        );
        // An open job has nothing in flight; an attempt turning unknown under
        // it would be a bug, refused rather than written.
        assert!(next_job_state(JobState::Open, vec![Unknown]).is_err());
        assert!(next_job_state(JobState::Completed, vec![Failed]).is_err());
    }
}
