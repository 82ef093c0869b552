//! A job: the durable record of one client intent.
//!
//! A job is created by the first request carrying an `(owner, key)` pair and
//! never changes identity afterwards. Its state is not set by hand: it is
//! [derived](JobState::derive) from the states of its attempts, except for
//! `Completed`, which only a commit can reach.
//!
//! ```text
//!            claim (CAS on version)
//!     ┌───────────────────────────────────┐
//!     ▼                                   │
//!  running ───every attempt failed───▶  open
//!   │ │  ▲           safely               ▲
//!   │(1)(2)                               │ (3)
//!   │ ▼  │                                │
//!   │ unknown ────────────────────────────┘
//!   │  │
//!   │  │ (4)
//!   ▼  ▼
//!  completed  (terminal; every later request replays it)
//! ```
//!
//! - running → completed: an attempt's answer is committed;
//! - (1) an attempt's outcome became unknown: silence past the timeout, a
//!   connection broken after sending, a stream cut, an answer too large to
//!   record, a lease lapsed;
//! - (2) the unknown attempt is settled (proven failed, or resolved `failed`
//!   or `cancelled` by an operator) while another attempt, a hedge beside
//!   it, is still in flight;
//! - (3) the same with no other attempt in flight;
//! - (4) the unknown attempt's late answer commits, a hedge beside it
//!   commits, or an operator resolves it `succeeded` with a response.
//!
//! [`JobState::can_become`] also admits `open → completed`, which no
//! transition makes (an open job has no unsettled attempt to commit).

use std::fmt;
use std::time::{Duration, SystemTime};

use crate::attempt::{Attempt, AttemptState};
use crate::fingerprint::Fingerprint;
use crate::id::{AttemptId, JobId};
use crate::key::{IdempotencyKey, Owner};
use crate::response::StoredResponse;

/// Where a job stands. See the module docs for the transitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JobState {
    /// An attempt is in flight.
    Running,
    /// An attempt's outcome is unknown; no new attempt until it is resolved.
    Unknown,
    /// No winner yet, and every attempt so far failed in a way that is safe to retry.
    Open,
    /// A result is committed; it is replayed to every later request.
    Completed,
}

impl JobState {
    /// The name used in storage and in the admin API.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Running => "running",
            JobState::Unknown => "unknown",
            JobState::Open => "open",
            JobState::Completed => "completed",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "running" => JobState::Running,
            "unknown" => JobState::Unknown,
            "open" => JobState::Open,
            "completed" => JobState::Completed,
            _ => return None,
        })
    }

    /// The state of a job that has no committed result, from its attempts.
    ///
    /// One rule, shared by every store: an attempt in flight makes the job
    /// `running` (a duplicate waits for it, `docs/design.md` §3); with none
    /// in flight, an unknown attempt makes it `unknown`, so a hedged attempt
    /// failing next to an unknown one can never reopen the job; only a job
    /// whose every attempt provably failed is `open`.
    pub fn derive<I: IntoIterator<Item = AttemptState>>(attempts: I) -> JobState {
        let mut unknown = false;
        for state in attempts {
            match state {
                AttemptState::Started => return JobState::Running,
                AttemptState::Unknown => unknown = true,
                _ => {}
            }
        }
        if unknown {
            JobState::Unknown
        } else {
            JobState::Open
        }
    }

    /// Whether a job in this state may move to `next`.
    pub fn can_become(self, next: JobState) -> bool {
        use JobState::*;
        matches!(
            (self, next),
            (Running, Unknown | Open | Completed)
                | (Unknown, Open | Completed | Running)
                | (Open, Running | Completed)
        ) || self == next && self != Completed
    }

    /// Completed is the only state nothing leaves.
    pub fn is_terminal(self) -> bool {
        self == JobState::Completed
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a request asks the store to create when its key is new.
#[derive(Debug, Clone)]
pub struct NewJob {
    /// The job's id, chosen by the caller.
    pub id: JobId,
    /// Who the key belongs to.
    pub owner: Owner,
    /// The client's key.
    pub key: IdempotencyKey,
    /// The request fingerprint every duplicate must match.
    pub fingerprint: Fingerprint,
    /// The route that matched, for the operator.
    pub route: String,
    /// How long the key is remembered.
    pub ttl: std::time::Duration,
}

/// A copy of a committed answer kept outside the store (in Redis, in a
/// replica's memory) is not used this close to its job's expiry: the
/// gateways' clocks and the database's may disagree by this much, and past
/// the expiry the key may already name a new job.
pub const EXPIRY_MARGIN: Duration = Duration::from_secs(5);

/// The largest committed body read together with its job. A larger one is
/// read on its own, by a replay that has room for it in the memory budget:
/// duplicates that are refused, mismatched or told to wait never read it
/// (`docs/design.md` §18).
pub const INLINE_ANSWER: usize = 256 << 10;

/// A job as read from the store.
#[derive(Debug, Clone)]
pub struct Job {
    /// Its id.
    pub id: JobId,
    /// Who the key belongs to.
    pub owner: Owner,
    /// The client's key.
    pub key: IdempotencyKey,
    /// The fingerprint of the request that created it.
    pub fingerprint: Fingerprint,
    /// The route that matched.
    pub route: String,
    /// Where it stands.
    pub state: JobState,
    /// Moves on every change that decides who may commit.
    pub version: i64,
    /// How many attempts were made.
    pub attempt_count: i32,
    /// The attempt whose result was committed.
    pub completed_by: Option<AttemptId>,
    /// The committed response, once completed, when it was read with the
    /// job: one whose body is larger than [`INLINE_ANSWER`] is left in the
    /// store (see `response_in_store`).
    pub response: Option<StoredResponse>,
    /// The size in bytes of a committed body left in the store, so that a
    /// replay can make room for it in the memory budget before reading it
    /// (`docs/design.md` §18); `None` when `response` holds it, or there is
    /// none.
    pub response_in_store: Option<usize>,
    /// When the first request arrived.
    pub created_at: SystemTime,
    /// When the key is forgotten, unless a call of it still runs then
    /// ([`Job::is_expired`]).
    pub expires_at: SystemTime,
}

impl Job {
    /// Whether the job is past its expiry at `now` and answers no request
    /// of its key any more: a job whose call still runs is kept past it
    /// (the stores also keep one whose `unknown` attempt may still answer
    /// before its deadline; `docs/design.md` §11, "not forgotten").
    pub fn is_expired(&self, now: SystemTime) -> bool {
        self.expires_at <= now && self.state != JobState::Running
    }
}

/// A job together with its attempts, for the admin API.
#[derive(Debug, Clone)]
pub struct JobDetail {
    /// The job.
    pub job: Job,
    /// Its attempts, by number.
    pub attempts: Vec<Attempt>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use AttemptState::*;

    #[test]
    fn derive_prefers_running_then_unknown_then_open() {
        assert_eq!(
            JobState::derive([Failed, Unknown, Started]),
            JobState::Running
        );
        assert_eq!(JobState::derive([Unknown, Failed]), JobState::Unknown);
        assert_eq!(JobState::derive([Failed, Started]), JobState::Running);
        assert_eq!(
            JobState::derive([Failed, Cancelled, Rejected]),
            JobState::Open
        );
        assert_eq!(JobState::derive([]), JobState::Open);
    }

    #[test]
    fn completed_is_terminal() {
        for next in [
            JobState::Running,
            JobState::Open,
            JobState::Unknown,
            JobState::Completed,
        ] {
            assert!(!JobState::Completed.can_become(next));
        }
        assert!(JobState::Unknown.can_become(JobState::Completed));
        assert!(JobState::Open.can_become(JobState::Running));
        assert!(!JobState::Open.can_become(JobState::Unknown));
    }

    #[test]
    fn names_round_trip() {
        for s in [
            JobState::Running,
            JobState::Unknown,
            JobState::Open,
            JobState::Completed,
        ] {
            assert_eq!(JobState::parse(s.as_str()), Some(s));
        }
    }
}
