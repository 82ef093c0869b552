//! Every change a job and its attempts may go through, decided in one place.
//!
//! Each operation of the store (claim, hedge, commit, settle, resolve, lease
//! expiry) is a pure function here: it reads a [`Snapshot`] of one job and
//! all its attempts, as locked by the store, and returns the [`Change`] to
//! write, or a typed [`Refusal`]. Stores only lock, read, write back and ring
//! the doorbell; none of them decides anything. The rules themselves, and why,
//! are in `docs/design.md` (§3 "States and transitions", §4 "The commit
//! rule").
//!
//! Two rules hold for every change:
//!
//! - a job that is not completed takes the state [derived](JobState::derive)
//!   from its attempts, and only along a move [`JobState::can_become`] allows;
//! - `version` moves exactly when who may commit changes: a commit, a claim
//!   from `open`, an operator's resolution. A hedge does not move it, so the
//!   hedge and the attempt it races commit under the same version.

use std::time::SystemTime;

use crate::attempt::{AttemptFailure, AttemptState, NewAttempt, Resolution};
use crate::id::{AttemptId, JobId};
use crate::job::JobState;
use crate::response::StoredResponse;

/// Why an attempt that answered was not committed.
pub const SUPERSEDED: &str = "answered after another attempt had won, or after the job moved on";

/// What decides who may commit, for one job: its state and version, without
/// the stored response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobHead {
    /// The job.
    pub id: JobId,
    /// Where it stands.
    pub state: JobState,
    /// Moves on every change that decides who may commit.
    pub version: i64,
    /// How many attempts were made.
    pub attempt_count: i32,
    /// The attempt whose response was committed.
    pub completed_by: Option<AttemptId>,
}

/// One attempt, as a transition sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptHead {
    /// The attempt.
    pub id: AttemptId,
    /// 1, 2, …
    pub number: i32,
    /// Where it stands.
    pub state: AttemptState,
    /// The job version it started under; its commit is a CAS on it.
    pub job_version: i64,
    /// When its lease lapses unless renewed.
    pub lease_expires_at: SystemTime,
}

/// A job and all its attempts, read under the job's lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The job.
    pub job: JobHead,
    /// Its attempts, by number.
    pub attempts: Vec<AttemptHead>,
}

/// The writes of one transition, made in one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The job's state before the change.
    pub before: JobState,
    /// The job as it is after the change (written whole).
    pub job: JobHead,
    /// The committed response, when the change completes the job.
    pub response: Option<StoredResponse>,
    /// Attempts that reach a new state.
    pub settled: Vec<Settle>,
    /// A new attempt, when the change starts one.
    pub started: Option<Start>,
}

/// An attempt reaching a new state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settle {
    /// The attempt.
    pub attempt: AttemptId,
    /// Its new state.
    pub state: AttemptState,
    /// The upstream's status, when it answered.
    pub status: Option<u16>,
    /// Why, for the operator.
    pub detail: Option<String>,
    /// The operator who decided it, when one did (written with the time
    /// of the change).
    pub resolved_by: Option<String>,
}

impl Settle {
    /// Whether the attempt is finished by this (an unknown one is not: its
    /// answer may still come).
    pub fn finishes(&self) -> bool {
        self.state != AttemptState::Unknown
    }
}

/// A new attempt joining the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Start {
    /// What the gateway asked for.
    pub attempt: NewAttempt,
    /// Its number under the job.
    pub number: i32,
    /// The version its commit will be a CAS on.
    pub job_version: i64,
}

/// Why a transition does not apply to the job as it stands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The job moved on from the version the caller read.
    #[error("job {job} moved on from version {expected} (it is at {actual})")]
    Stale {
        /// The job.
        job: JobId,
        /// The version the caller read.
        expected: i64,
        /// The version now.
        actual: i64,
    },
    /// The job's state does not allow the operation.
    #[error("job {job} is {state}: it cannot {operation}")]
    JobIs {
        /// The job.
        job: JobId,
        /// Its state.
        state: JobState,
        /// What was asked.
        operation: &'static str,
    },
    /// The attempt already reached a state the operation cannot move it from.
    #[error("attempt {attempt} is already {state}")]
    AttemptIs {
        /// The attempt.
        attempt: AttemptId,
        /// Its state.
        state: AttemptState,
    },
    /// The attempt does not belong to the job that was locked.
    #[error("attempt {0} is not an attempt of this job")]
    NoSuchAttempt(AttemptId),
    /// The move is one the job's state machine does not have.
    #[error("a job cannot move from {from} to {to}")]
    Forbidden {
        /// Its state.
        from: JobState,
        /// The state the change would give it.
        to: JobState,
    },
}

impl Change {
    fn of(snapshot: &Snapshot) -> Change {
        Change {
            before: snapshot.job.state,
            job: snapshot.job.clone(),
            response: None,
            settled: Vec::new(),
            started: None,
        }
    }

    /// Whether the job's state changes (then held duplicates are woken).
    pub fn moves_job(&self) -> bool {
        self.before != self.job.state
    }

    /// Whether this change commits `attempt`'s response.
    pub fn commits(&self, attempt: AttemptId) -> bool {
        self.response.is_some() && self.job.completed_by == Some(attempt)
    }

    /// Derives the job's state again from its attempts with this change's
    /// settlements applied, refusing a move the state machine does not have.
    fn rederive(mut self, snapshot: &Snapshot) -> Result<Change, Refusal> {
        if self.job.state.is_terminal() {
            return Ok(self);
        }
        let states = snapshot.attempts.iter().map(|a| {
            self.settled
                .iter()
                .find(|s| s.attempt == a.id)
                .map_or(a.state, |s| s.state)
        });
        let started = self.started.as_ref().map(|_| AttemptState::Started);
        let next = JobState::derive(states.chain(started));
        if !self.before.can_become(next) {
            return Err(Refusal::Forbidden {
                from: self.before,
                to: next,
            });
        }
        self.job.state = next;
        Ok(self)
    }
}

impl JobHead {
    /// The head of a job as read.
    pub fn of(job: &crate::job::Job) -> Self {
        JobHead {
            id: job.id,
            state: job.state,
            version: job.version,
            attempt_count: job.attempt_count,
            completed_by: job.completed_by,
        }
    }
}

impl AttemptHead {
    /// The head of an attempt as read.
    pub fn of(attempt: &crate::attempt::Attempt) -> Self {
        AttemptHead {
            id: attempt.id,
            number: attempt.number,
            state: attempt.state,
            job_version: attempt.job_version,
            lease_expires_at: attempt.lease_expires_at,
        }
    }
}

impl Snapshot {
    fn attempt(&self, id: AttemptId) -> Result<&AttemptHead, Refusal> {
        self.attempts
            .iter()
            .find(|a| a.id == id)
            .ok_or(Refusal::NoSuchAttempt(id))
    }

    fn at_version(&self, expected: i64) -> Result<(), Refusal> {
        if self.job.version == expected {
            Ok(())
        } else {
            Err(Refusal::Stale {
                job: self.job.id,
                expected,
                actual: self.job.version,
            })
        }
    }

    fn job_is(&self, operation: &'static str) -> Refusal {
        Refusal::JobIs {
            job: self.job.id,
            state: self.job.state,
            operation,
        }
    }

    fn start(&self, attempt: NewAttempt, job_version: i64) -> Start {
        Start {
            attempt,
            number: self.job.attempt_count + 1,
            job_version,
        }
    }
}

/// The next try of an `open` job, if it is still at `version`: moves the
/// version, so of two simultaneous claims exactly one applies.
pub fn claim(snapshot: &Snapshot, version: i64, attempt: NewAttempt) -> Result<Change, Refusal> {
    snapshot.at_version(version)?;
    if snapshot.job.state != JobState::Open {
        return Err(snapshot.job_is("take a new attempt"));
    }
    let mut change = Change::of(snapshot);
    change.job.version += 1;
    change.job.attempt_count += 1;
    change.started = Some(snapshot.start(attempt, change.job.version));
    change.rederive(snapshot)
}

/// An attempt beside a running (or unknown) one, at the same version, so
/// both may commit and the first wins. Only side-effect-free routes hedge.
pub fn hedge(snapshot: &Snapshot, version: i64, attempt: NewAttempt) -> Result<Change, Refusal> {
    snapshot.at_version(version)?;
    if !matches!(snapshot.job.state, JobState::Running | JobState::Unknown) {
        return Err(snapshot.job_is("take a hedged attempt"));
    }
    let mut change = Change::of(snapshot);
    change.job.attempt_count += 1;
    change.started = Some(snapshot.start(attempt, version));
    change.rederive(snapshot)
}

/// A new attempt of a job whose outcome is unknown and which has no attempt
/// in flight, at the same version, so the unknown attempt's late answer may
/// still commit and the first wins: how a route with `on_unknown =
/// "new_attempt"` moves on (side-effect-free routes only, `docs/design.md`
/// §5). The job becomes `running`, so of two simultaneous duplicates exactly
/// one moves on; the other finds it running and waits.
pub fn move_on(snapshot: &Snapshot, version: i64, attempt: NewAttempt) -> Result<Change, Refusal> {
    snapshot.at_version(version)?;
    if snapshot.job.state != JobState::Unknown {
        return Err(snapshot.job_is("move on from an unknown attempt"));
    }
    let mut change = Change::of(snapshot);
    change.job.attempt_count += 1;
    change.started = Some(snapshot.start(attempt, version));
    change.rederive(snapshot)
}

/// Whether `attempt` may commit: it is still unsettled, the job is still at
/// the version it started under, and nothing else committed. This is the
/// compare-and-swap every store's commit implements.
pub fn may_commit(snapshot: &Snapshot, attempt: &AttemptHead) -> bool {
    attempt.state.is_unsettled()
        && snapshot.job.completed_by.is_none()
        && snapshot.job.version == attempt.job_version
}

/// An attempt's answer: committed when [`may_commit`] holds (the job
/// completes and its version moves), otherwise the attempt is `superseded`
/// and its payload discarded. An attempt that is already settled is left
/// as it is.
pub fn commit(
    snapshot: &Snapshot,
    attempt: AttemptId,
    response: &StoredResponse,
) -> Result<Change, Refusal> {
    let head = snapshot.attempt(attempt)?;
    let mut change = Change::of(snapshot);
    if may_commit(snapshot, head) {
        change.job.state = JobState::Completed;
        change.job.version += 1;
        change.job.completed_by = Some(attempt);
        change.response = Some(response.clone());
        change.settled.push(Settle {
            attempt,
            state: AttemptState::Succeeded,
            status: Some(response.status),
            detail: None,
            resolved_by: None,
        });
        if !change.before.can_become(JobState::Completed) {
            return Err(Refusal::Forbidden {
                from: change.before,
                to: JobState::Completed,
            });
        }
        return Ok(change);
    }
    if head.state.is_unsettled() {
        change.settled.push(Settle {
            attempt,
            state: AttemptState::Superseded,
            status: Some(response.status),
            detail: Some(SUPERSEDED.into()),
            resolved_by: None,
        });
    }
    change.rederive(snapshot)
}

/// The states an attempt may be settled from with `failure`: evidence of
/// what happened (failed, rejected, superseded) also settles an attempt a
/// lapsed lease made `unknown`; only a started attempt becomes unknown.
pub fn settles_from(failure: &AttemptFailure, state: AttemptState) -> bool {
    match failure {
        AttemptFailure::Unknown { .. } => state == AttemptState::Started,
        _ => state.is_unsettled(),
    }
}

/// Records how an attempt ended without a result, and derives its job's
/// state again: the job reopens when every attempt provably failed, and
/// blocks while any is unknown.
pub fn settle(
    snapshot: &Snapshot,
    attempt: AttemptId,
    failure: &AttemptFailure,
) -> Result<Change, Refusal> {
    let head = snapshot.attempt(attempt)?;
    if !settles_from(failure, head.state) {
        return Err(Refusal::AttemptIs {
            attempt,
            state: head.state,
        });
    }
    let mut change = Change::of(snapshot);
    change.settled.push(Settle {
        attempt,
        state: failure.state(),
        status: failure.status(),
        detail: Some(failure.detail().to_owned()),
        resolved_by: None,
    });
    change.rederive(snapshot)
}

/// An operator's decision about an unsettled attempt, by an operator
/// whose name was not given: [`resolve_as`].
pub fn resolve(
    snapshot: &Snapshot,
    attempt: AttemptId,
    resolution: &Resolution,
) -> Result<Change, Refusal> {
    resolve_as(
        snapshot,
        attempt,
        resolution,
        crate::attempt::UNRECORDED_OPERATOR,
    )
}

/// An operator's decision about an unsettled attempt, recorded as
/// `operator`'s. The version moves, so the attempt's own late answer can no
/// longer commit. A status the operator typed is the job's response, never
/// the attempt's upstream status: the upstream said nothing (`docs/design.md`
/// §14, "who decided").
pub fn resolve_as(
    snapshot: &Snapshot,
    attempt: AttemptId,
    resolution: &Resolution,
    operator: &str,
) -> Result<Change, Refusal> {
    let head = snapshot.attempt(attempt)?;
    if !head.state.is_unsettled() {
        return Err(Refusal::AttemptIs {
            attempt,
            state: head.state,
        });
    }
    let by = Decider::Operator(operator);
    resolved(snapshot, attempt, resolution, by)
}

/// The upstream's own answer about an `unknown` attempt, found by a lookup
/// (`docs/design.md` §5): the same writes as an operator's [`resolve`],
/// `succeeded` with the looked-up response or `failed` when the upstream
/// never acted, but only while the attempt is still `unknown`. An attempt
/// settled meanwhile (its late answer, an operator) is left as it is.
pub fn reconcile(
    snapshot: &Snapshot,
    attempt: AttemptId,
    resolution: &Resolution,
) -> Result<Change, Refusal> {
    let head = snapshot.attempt(attempt)?;
    if head.state != AttemptState::Unknown {
        return Err(Refusal::AttemptIs {
            attempt,
            state: head.state,
        });
    }
    resolved(snapshot, attempt, resolution, Decider::Upstream)
}

/// The detail of an attempt the upstream's own answer settled after its
/// outcome was unknown (a lookup, a resend): what tells it apart from an
/// attempt whose late answer committed by itself, whose detail is still
/// the one its `unknown` was recorded with.
pub const RECONCILED: &str =
    "reconciled: the upstream answered for it (a lookup, or a resend it deduplicated)";

/// Who settled an attempt its own answer did not.
#[derive(Clone, Copy)]
enum Decider<'a> {
    /// The upstream, asked again (a lookup, a resend).
    Upstream,
    /// An operator, by this name.
    Operator(&'a str),
}

/// The writes of a resolution of an unsettled attempt, by whoever decided it.
fn resolved(
    snapshot: &Snapshot,
    attempt: AttemptId,
    resolution: &Resolution,
    by: Decider<'_>,
) -> Result<Change, Refusal> {
    let (detail, resolved_by) = match by {
        Decider::Upstream => (RECONCILED, None),
        Decider::Operator(who) => ("resolved by an operator", Some(who.to_owned())),
    };
    let detail = Some(detail.to_owned());
    let mut change = Change::of(snapshot);
    match resolution {
        Resolution::Succeeded(response) => {
            if snapshot.job.state.is_terminal() {
                return Err(snapshot.job_is("take another result"));
            }
            change.job.state = JobState::Completed;
            change.job.completed_by = Some(attempt);
            change.response = Some(response.clone());
            change.settled.push(Settle {
                attempt,
                state: AttemptState::Succeeded,
                // The upstream's status only when the upstream answered.
                status: resolved_by.is_none().then_some(response.status),
                detail,
                resolved_by,
            });
        }
        Resolution::Failed | Resolution::Cancelled => {
            change.settled.push(Settle {
                attempt,
                state: resolution.state(),
                status: None,
                detail,
                resolved_by,
            });
            change = change.rederive(snapshot)?;
        }
    }
    if !change.before.is_terminal() && decides_who_commits(snapshot, attempt, resolution) {
        change.job.version += 1;
    }
    Ok(change)
}

/// Whether resolving `attempt` decides who may commit, and so moves the
/// job's version: a result does, and so does a failure that leaves no other
/// attempt unsettled. One that leaves a sibling running or unknown (a
/// hedge, a failover past the unknown attempt) does not: moving the version
/// would supersede the sibling's answer, which may still commit. The
/// resolved attempt's own late answer is refused either way, as settled
/// ([`may_commit`]; `docs/design.md` §4).
fn decides_who_commits(snapshot: &Snapshot, attempt: AttemptId, resolution: &Resolution) -> bool {
    matches!(resolution, Resolution::Succeeded(_))
        || !snapshot
            .attempts
            .iter()
            .any(|a| a.id != attempt && a.state.is_unsettled())
}

/// Started attempts whose lease lapsed by `now` become `unknown`: the
/// gateway running them stopped renewing. `None` when none lapsed.
pub fn expire(snapshot: &Snapshot, now: SystemTime) -> Option<Result<Change, Refusal>> {
    let mut change = Change::of(snapshot);
    change.settled = snapshot
        .attempts
        .iter()
        .filter(|a| a.state == AttemptState::Started && a.lease_expires_at < now)
        .map(|a| Settle {
            attempt: a.id,
            state: AttemptState::Unknown,
            status: None,
            detail: Some(
                "lease lapsed: the gateway running this attempt stopped renewing it".into(),
            ),
            resolved_by: None,
        })
        .collect();
    if change.settled.is_empty() {
        return None;
    }
    Some(change.rederive(snapshot))
}

#[cfg(test)]
mod tests;
