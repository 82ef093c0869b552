//! The transitions' edges that need a backend to fail on cue: the memory
//! backend, wrapped.

use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use super::*;
use crate::memory::Memory;
use crate::{Applied, Committed};
use idemgate_domain::fingerprint::Fingerprint;
use idemgate_domain::job::JobState;
use idemgate_domain::key::OwnerSalt;

/// The memory backend, whose next change, once `overtake` names another
/// attempt of the job, is written, then followed by that attempt's commit
/// (completing the job), then answered as a lost reply; the `fails`
/// changes after that one fail as the store being down would, unwritten.
/// The next `unread` reads of a job's detail fail as a blip would.
#[derive(Default)]
struct LosesReply {
    inner: Memory,
    overtake: Mutex<Option<Attempt>>,
    fails: AtomicU32,
    unread: AtomicU32,
}

#[async_trait]
impl Records for LosesReply {
    async fn job(&self, id: JobId) -> Result<Option<Job>, StoreError> {
        self.inner.job(id).await
    }
    async fn response(&self, job: JobId) -> Result<Option<StoredResponse>, StoreError> {
        self.inner.response(job).await
    }
    async fn job_detail(&self, id: JobId) -> Result<Option<JobDetail>, StoreError> {
        if self
            .unread
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(StoreError::Unavailable("injected: a blip".into()));
        }
        self.inner.job_detail(id).await
    }
    async fn find_job(
        &self,
        owner: &Owner,
        key: &IdempotencyKey,
    ) -> Result<Option<JobDetail>, StoreError> {
        self.inner.find_job(owner, key).await
    }
    async fn unknown_jobs(
        &self,
        after: Option<Cursor>,
        limit: u32,
    ) -> Result<Vec<Job>, StoreError> {
        self.inner.unknown_jobs(after, limit).await
    }
    async fn unknown_attempts(
        &self,
        since: SystemTime,
        limit: u32,
    ) -> Result<Vec<(JobId, AttemptId)>, StoreError> {
        self.inner.unknown_attempts(since, limit).await
    }
    async fn renew_leases(
        &self,
        attempts: &[AttemptId],
        lease: Duration,
    ) -> Result<u64, StoreError> {
        self.inner.renew_leases(attempts, lease).await
    }
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.inner.purge_expired(batch).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }
    async fn record_lookup(&self, attempt: AttemptId, lookup: &Lookup) -> Result<(), StoreError> {
        self.inner.record_lookup(attempt, lookup).await
    }
    async fn watch(&self, job: JobId) -> Result<(), StoreError> {
        self.inner.watch(job).await
    }

    async fn mark_call(
        &self,
        attempt: AttemptId,
        instance: uuid::Uuid,
        call: &crate::CallAt,
        for_at_most: Duration,
    ) -> Result<(), StoreError> {
        self.inner
            .mark_call(attempt, instance, call, for_at_most)
            .await
    }

    async fn unmark_call(&self, attempt: AttemptId) -> Result<(), StoreError> {
        self.inner.unmark_call(attempt).await
    }

    async fn call_at_server(
        &self,
        session: &[u8; 32],
        call: Option<&[u8; 32]>,
        except: uuid::Uuid,
    ) -> Result<bool, StoreError> {
        self.inner.call_at_server(session, call, except).await
    }
}

#[async_trait]
impl Backend for LosesReply {
    async fn begin(&self, job: NewJob, attempt: NewAttempt) -> Result<Begin, StoreError> {
        self.inner.begin(job, attempt).await
    }
    async fn commit(
        &self,
        attempt: &Attempt,
        response: &StoredResponse,
    ) -> Result<Committed, StoreError> {
        self.inner.commit(attempt, response).await
    }
    async fn change(
        &self,
        lock: Lock,
        decide: Decide,
    ) -> Result<Result<Applied, Refusal>, StoreError> {
        let Some(overtake) = self.overtake.lock().unwrap().take() else {
            let down = self
                .fails
                .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1));
            return match down {
                Ok(_) => Err(StoreError::Unavailable(
                    "injected: the store is down".into(),
                )),
                Err(_) => self.inner.change(lock, decide).await,
            };
        };
        let written = self.inner.change(lock, decide).await;
        assert!(matches!(written, Ok(Ok(_))), "the hedge's start is written");
        let committed = self.inner.commit(&overtake, &answer()).await.unwrap();
        assert!(committed.won);
        Err(StoreError::Unavailable(
            "injected: the reply was lost".into(),
        ))
    }
    async fn expire_lapsed(&self, batch: u32) -> Result<Vec<Change>, StoreError> {
        self.inner.expire_lapsed(batch).await
    }
}

fn answer() -> StoredResponse {
    StoredResponse {
        status: 200,
        headers: Vec::new(),
        body: Bytes::from_static(b"primary"),
    }
}

fn attempt() -> NewAttempt {
    NewAttempt {
        id: AttemptId::new(),
        upstream: "primary".into(),
        instance: uuid::Uuid::nil(),
        lease: Duration::from_secs(30),
        deadline: Duration::from_secs(300),
    }
}

/// A hedge whose start was written, but whose reply was lost, and whose
/// job another attempt completed before it was read back: not run
/// (`None`), and settled failed as never sent, instead of left `started`
/// to lapse into `unknown` on a completed job. The job is as its winner
/// left it.
#[tokio::test(start_paused = true)]
async fn a_hedge_overtaken_while_its_reply_was_lost_is_settled_as_never_sent() {
    overtaken_hedge(0, Wait::Sleep).await;
}

/// The same, with the store down for the settle's first three writes:
/// what the gateway learned (the hedge was never sent) is written once
/// the store is back, not dropped after one try.
#[tokio::test(start_paused = true)]
async fn a_never_sent_settle_is_retried_while_the_store_is_down() {
    overtaken_hedge(3, Wait::Sleep).await;
}

/// The same, with the gateway draining while the store is down: the
/// drain's `finish_writes` returns only once the retried settle landed,
/// so a rollout does not drop it and let the attempt lapse into `unknown`.
#[tokio::test(start_paused = true)]
async fn the_drain_waits_for_a_never_sent_settle_still_being_retried() {
    overtaken_hedge(3, Wait::Drain).await;
}

/// How a test of a background write waits for it.
enum Wait {
    /// Longer than every backoff the write could need.
    Sleep,
    /// For the store's writes to finish, as the drain does.
    Drain,
}

/// A hedge overtaken while its reply was lost, with the store down for
/// `fails` writes after; asserts how the job and the hedge end once
/// `wait` is over.
async fn overtaken_hedge(fails: u32, wait: Wait) {
    let machine = Machine::new(LosesReply::default(), Arc::new(Doorbell::default()));
    let job = NewJob {
        id: JobId::new(),
        owner: Owner::of(&OwnerSalt::new(b"test salt, not a secret"), &[b"Bearer t"]),
        key: IdempotencyKey::new("overtaken").unwrap(),
        fingerprint: Fingerprint([7; 32]),
        route: "default".into(),
        ttl: Duration::from_secs(3600),
    };
    let Begin::Created(job, primary) = machine.begin_job(job, attempt()).await.unwrap() else {
        panic!("a new key");
    };
    *machine.backend.0.overtake.lock().unwrap() = Some(primary.clone());
    machine.backend.0.fails.store(fails, SeqCst);
    let hedge = attempt();
    let started = machine
        .hedge_attempt(job.id, job.version, hedge.clone())
        .await;
    assert!(started.unwrap().is_none(), "the hedge is not run");

    match wait {
        // The settle is written in the background: on paused time, this
        // sleep returns once every backoff shorter than it has run.
        Wait::Sleep => tokio::time::sleep(Duration::from_secs(10)).await,
        Wait::Drain => machine.finish_writes().await,
    }
    assert_eq!(
        machine.backend.0.fails.load(SeqCst),
        0,
        "every failure was met"
    );
    let detail = machine.job_detail(job.id).await.unwrap().unwrap();
    assert_eq!(detail.job.state, JobState::Completed);
    assert_eq!(detail.job.completed_by, Some(primary.id));
    assert_eq!(detail.job.response, Some(answer()));
    let written = detail.attempts.iter().find(|a| a.id == hedge.id).unwrap();
    assert_eq!(written.state, AttemptState::Failed);
    assert_eq!(written.detail.as_deref(), Some(NEVER_SENT_OVERTAKEN));
}

/// An operator's resolution, written, whose read of the job it left the
/// store does not answer at first: answered as the resolution it is (the
/// job reopened, the attempt failed and the operator's), so the admin API
/// answers 200 and counts it, rather than a 503 for a change that took.
#[tokio::test(start_paused = true)]
async fn a_resolution_whose_read_back_fails_is_answered_as_written() {
    let machine = Machine::new(LosesReply::default(), Arc::new(Doorbell::default()));
    let job = NewJob {
        id: JobId::new(),
        owner: Owner::of(&OwnerSalt::new(b"test salt, not a secret"), &[b"Bearer t"]),
        key: IdempotencyKey::new("read-back").unwrap(),
        fingerprint: Fingerprint([7; 32]),
        route: "default".into(),
        ttl: Duration::from_secs(3600),
    };
    let Begin::Created(job, primary) = machine.begin_job(job, attempt()).await.unwrap() else {
        panic!("a new key");
    };
    let unknown = AttemptFailure::Unknown {
        detail: "no answer".into(),
    };
    assert!(machine.fail_attempt(primary.id, unknown).await.unwrap());
    machine.backend.0.unread.store(2, SeqCst);

    let detail = machine
        .resolve_attempt_as(primary.id, Resolution::Failed, "alice (admin token)")
        .await
        .expect("a resolution written is answered as done");
    assert_eq!(machine.backend.0.unread.load(SeqCst), 0, "both blips met");
    assert_eq!(detail.job.id, job.id);
    assert_eq!(detail.job.state, JobState::Open);
    let resolved = detail.attempts.iter().find(|a| a.id == primary.id).unwrap();
    assert_eq!(resolved.state, AttemptState::Failed);
    assert_eq!(
        resolved.resolved_by.as_ref().map(|by| by.operator.as_str()),
        Some("alice (admin token)")
    );
}
