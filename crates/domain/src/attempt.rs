//! An attempt: one try at satisfying a job.
//!
//! Attempts accumulate under a job. Each one holds a lease renewed by the
//! gateway instance running it; a lapsed lease means that instance died and
//! the attempt's outcome is unknown.

use std::fmt;
use std::time::SystemTime;

use uuid::Uuid;

use crate::id::{AttemptId, JobId};

/// Where an attempt stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttemptState {
    /// Sent or about to be sent; its gateway holds the lease.
    Started,
    /// Its response was committed as the job's result.
    Succeeded,
    /// Provably had no effect (refused before send, or a retryable status).
    Failed,
    /// Sent, and no answer is known: timeout, reset after send, lease lapsed.
    Unknown,
    /// Resolved out of band by an operator.
    Cancelled,
    /// Finished after another attempt had already won; its payload was discarded.
    Superseded,
    /// Answered, but the answer broke the route's response contract.
    Rejected,
}

impl AttemptState {
    /// The name used in storage and in the admin API.
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptState::Started => "started",
            AttemptState::Succeeded => "succeeded",
            AttemptState::Failed => "failed",
            AttemptState::Unknown => "unknown",
            AttemptState::Cancelled => "cancelled",
            AttemptState::Superseded => "superseded",
            AttemptState::Rejected => "rejected",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "started" => AttemptState::Started,
            "succeeded" => AttemptState::Succeeded,
            "failed" => AttemptState::Failed,
            "unknown" => AttemptState::Unknown,
            "cancelled" => AttemptState::Cancelled,
            "superseded" => AttemptState::Superseded,
            "rejected" => AttemptState::Rejected,
            _ => return None,
        })
    }

    /// Still able to produce a result: in flight, or sent with the outcome not known.
    pub fn is_unsettled(self) -> bool {
        matches!(self, AttemptState::Started | AttemptState::Unknown)
    }

    /// Whether an attempt in this state may move to `next`.
    ///
    /// Only unsettled attempts move. An unknown attempt may still succeed (its
    /// late answer) or be superseded, or be resolved by an operator; it never
    /// goes back to started.
    pub fn can_become(self, next: AttemptState) -> bool {
        use AttemptState::*;
        match self {
            Started => next != Started,
            Unknown => matches!(next, Succeeded | Failed | Cancelled | Superseded | Rejected),
            _ => false,
        }
    }
}

impl fmt::Display for AttemptState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a gateway asks the store to create when it starts an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewAttempt {
    /// The attempt's id, chosen by the caller.
    pub id: AttemptId,
    /// The name of the upstream it goes to.
    pub upstream: String,
    /// The gateway instance that runs it and renews its lease.
    pub instance: Uuid,
    /// How long the lease lasts without renewal.
    pub lease: std::time::Duration,
    /// After this long the attempt is abandoned even if the upstream never answers.
    pub deadline: std::time::Duration,
}

/// An attempt as read from the store.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// Its id.
    pub id: AttemptId,
    /// The job it belongs to.
    pub job_id: JobId,
    /// 1, 2, … in the order they were made.
    pub number: i32,
    /// The name of the upstream it went to.
    pub upstream: String,
    /// Where it stands.
    pub state: AttemptState,
    /// The job version it was started under; its commit is a CAS on it.
    pub job_version: i64,
    /// When it started.
    pub started_at: SystemTime,
    /// When it reached a final state.
    pub finished_at: Option<SystemTime>,
    /// When its lease lapses unless renewed.
    pub lease_expires_at: SystemTime,
    /// When its call is given up, answered or not (`attempt_deadline` from
    /// its start, on the store's clock): its replica drops the call then,
    /// and may commit an answer that came by then for a minute more, all
    /// within [`crate::reconcile::CALL_OUT_GRACE`].
    pub deadline_at: SystemTime,
    /// The status the upstream answered with, if it did: never an
    /// operator's typed answer (that is the job's response, and
    /// `resolved_by` says who gave it).
    pub upstream_status: Option<u16>,
    /// Why it ended the way it did, for the operator.
    pub detail: Option<String>,
    /// The lookups made to reconcile it, when its outcome was unknown.
    pub lookups: crate::reconcile::Lookups,
    /// Who settled it by hand, and when, when an operator did (boxed: most
    /// attempts have none, and an attempt travels in every `Begin`).
    pub resolved_by: Option<Box<ResolvedBy>>,
}

/// An operator's resolution, as recorded on its attempt (`docs/design.md`
/// §14): who decided, as the admin API knew them, and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedBy {
    /// Who: `admin token`, `console session`, with the name the operator
    /// gave when they gave one (`alice (admin token)`).
    pub operator: String,
    /// When the resolution was written.
    pub at: SystemTime,
}

/// Who resolved attempts settled by hand before who was recorded.
pub const UNRECORDED_OPERATOR: &str = "an operator (not recorded)";

/// How an attempt ended without a committed result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptFailure {
    /// Provably had no effect: safe to retry.
    Failed {
        /// The upstream status, when it answered with a retryable one.
        status: Option<u16>,
        /// Why.
        detail: String,
    },
    /// Sent, and whether it took effect is not known.
    Unknown {
        /// Why.
        detail: String,
    },
    /// Answered, but broke the route's contract.
    Rejected {
        /// The status it answered with.
        status: u16,
        /// Why.
        detail: String,
    },
    /// Abandoned because another attempt of the job won.
    Superseded {
        /// Why.
        detail: String,
    },
}

impl AttemptFailure {
    /// The attempt state this failure leads to.
    pub fn state(&self) -> AttemptState {
        match self {
            AttemptFailure::Failed { .. } => AttemptState::Failed,
            AttemptFailure::Unknown { .. } => AttemptState::Unknown,
            AttemptFailure::Rejected { .. } => AttemptState::Rejected,
            AttemptFailure::Superseded { .. } => AttemptState::Superseded,
        }
    }

    /// The upstream status, if any.
    pub fn status(&self) -> Option<u16> {
        match self {
            AttemptFailure::Failed { status, .. } => *status,
            AttemptFailure::Unknown { .. } | AttemptFailure::Superseded { .. } => None,
            AttemptFailure::Rejected { status, .. } => Some(*status),
        }
    }

    /// The operator-facing reason.
    pub fn detail(&self) -> &str {
        match self {
            AttemptFailure::Failed { detail, .. }
            | AttemptFailure::Unknown { detail }
            | AttemptFailure::Superseded { detail }
            | AttemptFailure::Rejected { detail, .. } => detail,
        }
    }
}

/// An operator's out-of-band decision about an unsettled attempt.
#[derive(Debug, Clone)]
pub enum Resolution {
    /// It had no effect: the job may be retried.
    Failed,
    /// It is abandoned: the job may be retried.
    Cancelled,
    /// It took effect, with this response, which is committed through the same CAS.
    Succeeded(crate::response::StoredResponse),
}

impl Resolution {
    /// The attempt state this resolution leads to.
    pub fn state(&self) -> AttemptState {
        match self {
            Resolution::Failed => AttemptState::Failed,
            Resolution::Cancelled => AttemptState::Cancelled,
            Resolution::Succeeded(_) => AttemptState::Succeeded,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use AttemptState::*;

    #[test]
    fn only_unsettled_attempts_move() {
        assert!(Started.can_become(Unknown));
        assert!(Unknown.can_become(Succeeded));
        assert!(!Unknown.can_become(Started));
        for settled in [Succeeded, Failed, Cancelled, Superseded, Rejected] {
            assert!(!settled.is_unsettled());
            assert!(!settled.can_become(Succeeded));
        }
    }

    #[test]
    fn names_round_trip() {
        for s in [
            Started, Succeeded, Failed, Unknown, Cancelled, Superseded, Rejected,
        ] {
            assert_eq!(AttemptState::parse(s.as_str()), Some(s));
        }
    }
}
