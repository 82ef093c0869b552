//! Persistence of jobs and attempts (`docs/design.md`, §9).
//!
//! Three traits: one underneath, two above it side by side.
//!
//! - [`Records`]: what the store and every backend answer alike, declared
//!   once: reads (a job, its detail, by owner and key, the inbox of unknown
//!   jobs), lease renewal, purges, the watch mark, a ping.
//! - [`Store`]: `Records` and one method per domain operation (`begin_job`,
//!   `claim_attempt`, `commit`, …). The gateway holds an `Arc<dyn Store>`.
//! - [`Backend`]: `Records` and what a database must do to carry the domain:
//!   the arbiter insert, the compare-and-swap commit, "lock a job with its
//!   attempts, let the domain decide, write the change back", the lease
//!   sweep. PostgreSQL ([`postgres`]), SQLite ([`sqlite`]) and an in-memory
//!   reference ([`memory`]) implement it.
//!
//! [`Machine`] joins the two: it runs every transition of
//! [`idemgate_domain::transition`] on a backend and rings the [`Doorbell`] once per
//! change of a job's state. Every call it makes to the backend goes through
//! one measuring wrapper (`measured.rs`: `idemgate_store_seconds`,
//! `idemgate_store_errors_total`). No backend decides anything; the same
//! conformance suite (`tests/gateway/stores/conformance/`) holds all of them to:
//!
//! - a uniqueness constraint on `(owner, key)` is the only arbiter of "seen
//!   before" ([`Store::begin_job`]);
//! - the commit is one compare-and-swap on the job's `version` with
//!   `completed_by IS NULL` ([`transition::may_commit`]); the loser is
//!   `superseded`;
//! - the next attempt of an open job is claimed by a CAS on `version`, so two
//!   simultaneous retries make one attempt.

#![warn(unreachable_pub, missing_docs)]

pub(crate) mod codec;
mod doorbell;
pub mod fastpath;
mod machine;
mod measured;
pub mod memory;
pub mod postgres;
mod retry;
pub mod seal;
pub mod sqlite;

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use idemgate_domain::attempt::{Attempt, AttemptFailure, NewAttempt, Resolution};
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::job::{Job, JobDetail, NewJob};
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_domain::reconcile::Lookup;
use idemgate_domain::response::StoredResponse;
use idemgate_domain::transition::{self, Change, Refusal, Snapshot};
use idemgate_domain::BoxError;

pub use doorbell::{Bell, Doorbell, Observed};
pub use machine::Machine;
pub use retry::{at_least_until, retrying, LAPSES, WRITE_AT_LEAST};

/// How long a job past its expiry is still kept after it last changed (its
/// answer committed, an attempt claimed): for the duplicates held on it,
/// which read it again once woken, and so that a change racing its purge
/// is never lost with it (`docs/design.md` §11, "not forgotten").
pub const SETTLED_GRACE: Duration = Duration::from_secs(5);

/// Which store to use.
#[derive(Debug, Clone)]
pub enum StoreSettings {
    /// PostgreSQL: the production store, shared by any number of replicas
    /// (boxed: its certificates make it many times the other's size).
    Postgres(Box<postgres::PgSettings>),
    /// SQLite in a local file: zero set-up, one gateway.
    Embedded {
        /// The database file.
        path: PathBuf,
    },
}

/// What [`Store::begin_job`] found.
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "a few hundred bytes moved a few times a request; boxing the \
              attempt would cost every new key an allocation"
)]
pub enum Begin {
    /// The key was new: the job exists now, running its first attempt.
    Created(Job, Attempt),
    /// The key was seen before: here is its job as it stands.
    Existing(Job),
}

/// An attempt the sweeper made `unknown` (its lease lapsed), as reported
/// by [`Machine::reporting_lapsed`]: on a route that reconciles, it is
/// looked up on its upstream (`docs/design.md` §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lapsed {
    /// Its job.
    pub job: JobId,
    /// The attempt.
    pub attempt: AttemptId,
}

/// What [`Store::commit`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitOutcome {
    /// This attempt's response is the job's result.
    Committed,
    /// Another attempt won, or the job moved on (a resolution): this
    /// attempt's payload is discarded, and the attempt is `superseded`
    /// unless a lookup or an operator settled it first. A retried commit
    /// whose first try landed is `Committed`, not this (`docs/design.md`
    /// §7, "A commit whose reply was lost").
    Superseded,
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached (connection refused, pool exhausted,
    /// timed out). Nothing was recorded.
    #[error("the store is unavailable")]
    Unavailable(#[source] BoxError),
    /// No such job or attempt.
    #[error("{0} not found")]
    NotFound(&'static str),
    /// The domain does not allow the operation on the record as it stands.
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// Others kept changing the key while this request tried to begin it.
    #[error("the key kept changing under the request")]
    Contended,
    /// Something stored cannot be read back.
    #[error("stored {0} cannot be read")]
    Corrupt(&'static str),
    /// A sealed response cannot be opened (a key is missing, or it is damaged).
    #[error(transparent)]
    Sealed(#[from] crate::seal::SealError),
    /// The store answered with an error the gateway cannot act on.
    #[error("the store failed")]
    Internal(#[source] BoxError),
}

/// The cause of a [`StoreError::Unavailable`] for a call that reached no
/// database, so wrote nothing: a duplicate that followed a begin of its
/// key in a batch, when that begin failed. Its caller has no record to
/// settle ([`StoreError::surely_unwritten`]).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Unwritten(pub &'static str);

/// [`StoreError`]s grouped by what the caller can do about them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreErrorKind {
    /// Transient: nothing was recorded; trying again later may work.
    Unavailable,
    /// The record does not exist.
    NotFound,
    /// The record is not in a state the operation applies to.
    Conflict,
    /// A defect or corruption; trying again will not help.
    Internal,
}

impl StoreError {
    /// What kind of failure this is.
    pub fn kind(&self) -> StoreErrorKind {
        match self {
            StoreError::Unavailable(_) => StoreErrorKind::Unavailable,
            StoreError::NotFound(_) => StoreErrorKind::NotFound,
            StoreError::Refused(_) | StoreError::Contended => StoreErrorKind::Conflict,
            StoreError::Corrupt(_) | StoreError::Sealed(_) | StoreError::Internal(_) => {
                StoreErrorKind::Internal
            }
        }
    }

    /// Whether the same call may succeed later (the store was unreachable).
    pub fn is_transient(&self) -> bool {
        self.kind() == StoreErrorKind::Unavailable
    }

    /// Whether the call certainly wrote nothing ([`Unwritten`]):
    /// transient, but with no record of it to settle (`docs/design.md` §5,
    /// "A start whose reply was lost").
    pub fn surely_unwritten(&self) -> bool {
        matches!(self, StoreError::Unavailable(cause) if cause.is::<Unwritten>())
    }

    /// Whether the store is up but a job's row was held by another
    /// transaction past the lock timeout (`database_lock_timeout`):
    /// transient and nothing written, like any [`StoreError::Unavailable`],
    /// but the job, not the store, is what is busy (`docs/design.md` §13,
    /// "A lock waited for").
    pub fn is_lock_wait(&self) -> bool {
        postgres::is_lock_timeout(self)
    }

    /// An error with only a message for its cause.
    pub fn internal(message: impl Into<String>) -> Self {
        StoreError::Internal(message.into().into())
    }
}

/// What the store and every backend answer alike, declared once: reads,
/// lease upkeep and the watch mark. [`Machine`] answers them from its
/// backend (opening sealed responses on the way); each backend call is
/// measured once, by the wrapper every backend runs in.
#[async_trait]
pub trait Records: Send + Sync + 'static {
    /// Reads a job.
    async fn job(&self, id: JobId) -> Result<Option<Job>, StoreError>;

    /// Reads the committed response of a job, body and all: what reading
    /// the job leaves in the store when the body is larger than
    /// [`INLINE_ANSWER`](idemgate_domain::job::INLINE_ANSWER) (see
    /// [`Job::response_in_store`]).
    async fn response(&self, job: JobId) -> Result<Option<StoredResponse>, StoreError>;

    /// Reads a job with its attempts, as of one moment.
    async fn job_detail(&self, id: JobId) -> Result<Option<JobDetail>, StoreError>;

    /// Finds the job of an `(owner, key)` pair, with its attempts.
    async fn find_job(
        &self,
        owner: &Owner,
        key: &IdempotencyKey,
    ) -> Result<Option<JobDetail>, StoreError>;

    /// Jobs whose outcome is unknown (the operator's inbox), newest first:
    /// up to `limit` of them, after `after` when given.
    async fn unknown_jobs(&self, after: Option<Cursor>, limit: u32)
        -> Result<Vec<Job>, StoreError>;

    /// Attempts whose outcome is unknown that started after `since`,
    /// oldest first, at most `limit`: those still within their deadline,
    /// which their upstream may be asked about (`docs/design.md` §5).
    async fn unknown_attempts(
        &self,
        since: SystemTime,
        limit: u32,
    ) -> Result<Vec<(JobId, AttemptId)>, StoreError>;

    /// Extends the leases of attempts this instance is running, and the
    /// marks of their MCP calls at their servers ([`Records::mark_call`]).
    async fn renew_leases(
        &self,
        attempts: &[AttemptId],
        lease: Duration,
    ) -> Result<u64, StoreError>;

    /// Deletes up to `batch` jobs (and their attempts) past their expiry.
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError>;

    /// Checks that the store answers.
    async fn ping(&self) -> Result<(), StoreError>;

    /// Records one lookup made to reconcile an `unknown` attempt: counts
    /// it and keeps it as the attempt's last (`docs/design.md` §5).
    async fn record_lookup(&self, attempt: AttemptId, lookup: &Lookup) -> Result<(), StoreError>;

    /// Says someone is about to wait on `job`, so that changes of its state
    /// are announced to other replicas (only watched jobs pay for it). Call
    /// it before reading the job, then wait.
    async fn watch(&self, job: JobId) -> Result<(), StoreError>;

    /// Marks an MCP tool call at its server (`call`), for as long as
    /// `attempt` runs it from `instance` and at most `for_at_most` (a
    /// lease: [`Records::renew_leases`] renews the marks of the attempts
    /// it renews, up to each attempt's deadline, whatever their state): an
    /// agent's cancel of the call, or its session's end, reaching another
    /// replica is held back there too (`docs/design.md` §19, "An agent's
    /// cancel"). A resend of the call marks it under an id of its own,
    /// which no attempt has: renewed by nobody, it is good for
    /// `for_at_most`. A store one process holds has no other replica to
    /// tell: it marks nothing.
    async fn mark_call(
        &self,
        attempt: AttemptId,
        instance: uuid::Uuid,
        call: &CallAt,
        for_at_most: Duration,
    ) -> Result<(), StoreError>;

    /// Takes the mark of `attempt`'s call off (or a resend's, by its own
    /// id; none is no error).
    async fn unmark_call(&self, attempt: AttemptId) -> Result<(), StoreError>;

    /// Whether a call of `session` (the call `call`, or any without it) is
    /// marked at its server by an instance other than `except`, and its
    /// mark still good.
    async fn call_at_server(
        &self,
        session: &[u8; 32],
        call: Option<&[u8; 32]>,
        except: uuid::Uuid,
    ) -> Result<bool, StoreError>;
}

/// An MCP tool call, as its mark is found: digests of the route and the
/// session it was made in, and of those and its JSON-RPC `id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CallAt {
    /// Of the route and the session.
    pub session: [u8; 32],
    /// Of the route, the session and the call's `id`.
    pub call: [u8; 32],
}

/// One method per domain operation. See the module docs for the guarantees.
#[async_trait]
pub trait Store: Records {
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

    /// Adds an attempt to an `unknown` job with none in flight, without
    /// moving the version (a route with `on_unknown = "new_attempt"`): the
    /// job becomes `running`, so of two simultaneous callers one gets
    /// `Some`. `None` when the job moved on from `version` or is not
    /// `unknown` (an attempt runs, it settled, it completed).
    async fn move_on_attempt(
        &self,
        job: JobId,
        version: i64,
        attempt: NewAttempt,
    ) -> Result<Option<Attempt>, StoreError>;

    /// Waits until the outcome writes this store makes in the background
    /// (the settle of a hedge that was never sent, `docs/design.md` §5, "A
    /// start whose reply was lost") have landed or given up. The drain
    /// awaits it, within `shutdown_grace`, before the process exits: a
    /// write still being retried then would be lost with the process, and
    /// its attempt lapse into `unknown` (§12, "Termination"). No default:
    /// a store that wraps another forwards it, or the drain stops waiting.
    async fn finish_writes(&self);

    /// Commits the attempt's response as the job's result: one CAS on the
    /// version the attempt started under, with `completed_by IS NULL`.
    async fn commit(
        &self,
        attempt: &Attempt,
        response: &StoredResponse,
    ) -> Result<CommitOutcome, StoreError>;

    /// Records how an attempt ended without a result; the job's state is
    /// derived again from all its attempts. An attempt that was settled
    /// meanwhile (a commit, an operator) is left as it is: `false` says so,
    /// so that the end is not counted twice (`docs/design.md` §12).
    async fn fail_attempt(
        &self,
        attempt: AttemptId,
        failure: AttemptFailure,
    ) -> Result<bool, StoreError>;

    /// Applies an operator's resolution to an unsettled attempt. Moves the
    /// job's version, so the attempt's own late answer can no longer commit.
    async fn resolve_attempt(
        &self,
        attempt: AttemptId,
        resolution: Resolution,
    ) -> Result<JobDetail, StoreError>;

    /// [`resolve_attempt`](Store::resolve_attempt), recording on the attempt
    /// that `operator` (as the admin API knew them) decided it, and when
    /// (`docs/design.md` §14). A wrapper that does not forward it (a test's)
    /// resolves as an operator not named.
    async fn resolve_attempt_as(
        &self,
        attempt: AttemptId,
        resolution: Resolution,
        operator: &str,
    ) -> Result<JobDetail, StoreError> {
        let _ = operator;
        self.resolve_attempt(attempt, resolution).await
    }

    /// Applies what a lookup of the upstream found about an `unknown`
    /// attempt ([`transition::reconcile`]): the same writes, and the same
    /// CAS, as an operator's resolution, refused (`AttemptIs`) once the
    /// attempt is no longer unknown.
    async fn reconcile_attempt(
        &self,
        attempt: AttemptId,
        resolution: Resolution,
    ) -> Result<JobDetail, StoreError>;

    /// Turns started attempts whose lease lapsed into `unknown` (their
    /// gateway died holding them), in one transaction. Returns how many
    /// jobs changed, at most `batch`.
    async fn expire_leases(&self, batch: u32) -> Result<u64, StoreError>;
}

/// Where a page of a newest-first listing of jobs goes on from: the last
/// job of the page before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    /// That job's creation.
    pub created_at: SystemTime,
    /// That job.
    pub job: JobId,
}

impl Cursor {
    /// The cursor that goes on after `job`.
    pub fn after(job: &Job) -> Self {
        Cursor {
            created_at: job.created_at,
            job: job.id,
        }
    }
}

/// What a [`Backend::commit`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Committed {
    /// The attempt's answer is the job's result.
    pub won: bool,
    /// Someone in another process waits on the job (see [`Records::watch`]):
    /// the change must be announced beyond this one.
    pub watched: bool,
}

/// Which job a [`Backend::change`] locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lock {
    /// The job with this id.
    Job(JobId),
    /// The job this attempt belongs to.
    JobOf(AttemptId),
}

/// The decision a [`Backend::change`] asks for: given the locked job and the
/// backend's clock, the writes to make (see [`idemgate_domain::transition`]).
pub type Decide = Box<dyn FnOnce(&Snapshot, SystemTime) -> Result<Change, Refusal> + Send>;

/// A change as written.
#[derive(Debug)]
pub struct Applied {
    /// What was written.
    pub change: Change,
    /// The attempt the change started, as stored.
    pub started: Option<Attempt>,
}

/// What a database does to carry the domain. Every method is atomic; none
/// decides a transition itself.
#[async_trait]
pub trait Backend: Records {
    /// The arbiter: creates the job and its first attempt unless `(owner,
    /// key)` exists (an expired job is deleted first: the key starts afresh).
    async fn begin(&self, job: NewJob, attempt: NewAttempt) -> Result<Begin, StoreError>;

    /// The commit: applies [`transition::commit`] in one compare-and-swap.
    async fn commit(
        &self,
        attempt: &Attempt,
        response: &StoredResponse,
    ) -> Result<Committed, StoreError>;

    /// Locks a job with all its attempts, asks `decide` for the change, and
    /// writes it, in one transaction. A refusal writes nothing.
    async fn change(
        &self,
        lock: Lock,
        decide: Decide,
    ) -> Result<Result<Applied, Refusal>, StoreError>;

    /// Applies [`transition::expire`] to up to `batch` jobs with a lapsed
    /// lease, in one transaction; jobs another writer holds are left for the
    /// next sweep. Returns the changes written.
    async fn expire_lapsed(&self, batch: u32) -> Result<Vec<Change>, StoreError>;
}

/// The commit of a backend that locks the job (SQLite, memory): the CAS is
/// [`transition::commit`] run under the lock.
pub(crate) async fn commit_under_lock<B: Backend>(
    backend: &B,
    attempt: &Attempt,
    response: &StoredResponse,
) -> Result<Committed, StoreError> {
    let (id, response) = (attempt.id, response.clone());
    let decide: Decide = Box::new(move |s, _| transition::commit(s, id, &response));
    let applied = backend.change(Lock::JobOf(id), decide).await??;
    Ok(Committed {
        won: applied.change.commits(id),
        // Only PostgreSQL serves several processes, and a commit of its
        // that wins here (one whose job was locked when its CAS ran)
        // wakes the other replicas by its trigger's NOTIFY, not through
        // Redis: the job's mark is not read here.
        watched: false,
    })
}

/// Applies [`transition::expire`] to each snapshot, skipping (and logging)
/// any job whose change the domain refuses: one bad row must not stop the
/// sweep of the others.
pub(crate) fn expire_each(snapshots: &[Snapshot], now: SystemTime) -> Vec<Change> {
    snapshots
        .iter()
        .filter_map(|s| match transition::expire(s, now)? {
            Ok(change) => Some(change),
            Err(refusal) => {
                tracing::error!(job = %s.job.id, %refusal, "lapsed leases left alone: the domain refuses the change");
                None
            }
        })
        .collect()
}

/// A job state read back from a backend.
pub(crate) fn job_state(s: &str) -> Result<idemgate_domain::job::JobState, StoreError> {
    idemgate_domain::job::JobState::parse(s).ok_or(StoreError::Corrupt("job state"))
}

/// An attempt state read back from a backend.
pub(crate) fn attempt_state(s: &str) -> Result<idemgate_domain::attempt::AttemptState, StoreError> {
    idemgate_domain::attempt::AttemptState::parse(s).ok_or(StoreError::Corrupt("attempt state"))
}

/// Who resolved an attempt by hand and when, read back from a backend:
/// both or neither.
pub(crate) fn resolved_by(
    operator: Option<String>,
    at: Option<SystemTime>,
) -> Option<Box<idemgate_domain::attempt::ResolvedBy>> {
    Some(Box::new(idemgate_domain::attempt::ResolvedBy {
        operator: operator?,
        at: at?,
    }))
}

/// An attempt's lookups read back from a backend: the count, and the last
/// one's time, status and result (all three absent before the first).
pub(crate) fn lookups(
    count: i32,
    at: Option<SystemTime>,
    status: Option<u16>,
    result: Option<&str>,
) -> Result<idemgate_domain::reconcile::Lookups, StoreError> {
    use idemgate_domain::reconcile::{Lookup, LookupResult, Lookups};
    let last = match (at, result) {
        (Some(at), Some(result)) => Some(Lookup {
            at,
            status,
            result: LookupResult::parse(result).ok_or(StoreError::Corrupt("lookup result"))?,
        }),
        _ => None,
    };
    Ok(Lookups {
        count: u32::try_from(count).unwrap_or(0),
        last,
    })
}

/// Whole milliseconds, saturating.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
