//! Property tests of the state machine over the real stores: random
//! sequences of begin, claim, hedge, commit, fail, resolve, lease expiry and
//! purge, run against PostgreSQL or SQLite and, step by step, against the
//! in-memory reference. After every step the store must agree with the
//! reference, hold at most one winner, never show a completed job without
//! one, and have moved only along transitions the domain allows.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use uuid::Uuid;

use idemgate_domain::attempt::{AttemptFailure, AttemptState, NewAttempt, Resolution};
use idemgate_domain::fingerprint::Fingerprint;
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::job::{JobDetail, JobState, NewJob};
use idemgate_domain::key::{IdempotencyKey, Owner, OwnerSalt};
use idemgate_domain::response::StoredResponse;
use idemgate_store::memory::Memory;
use idemgate_store::{Begin, Doorbell, Machine, Store, StoreErrorKind};

#[derive(Debug, Clone)]
enum Op {
    Begin { lapsing: bool },
    Claim { stale: bool, lapsing: bool },
    Hedge { stale: bool, lapsing: bool },
    Commit { attempt: usize },
    Fail { attempt: usize, kind: u8 },
    Resolve { attempt: usize, kind: u8 },
    Expire,
    Purge,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        any::<bool>().prop_map(|lapsing| Op::Begin { lapsing }),
        (any::<bool>(), any::<bool>()).prop_map(|(stale, lapsing)| Op::Claim { stale, lapsing }),
        (any::<bool>(), any::<bool>()).prop_map(|(stale, lapsing)| Op::Hedge { stale, lapsing }),
        (0..4usize).prop_map(|attempt| Op::Commit { attempt }),
        (0..4usize, 0..4u8).prop_map(|(attempt, kind)| Op::Fail { attempt, kind }),
        (0..4usize, 0..3u8).prop_map(|(attempt, kind)| Op::Resolve { attempt, kind }),
        Just(Op::Expire),
        Just(Op::Purge),
    ]
}

/// What a step returned, comparable across stores.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    Created,
    Existing,
    Started(bool),
    Committed(bool),
    Done,
    Refused(StoreErrorKind),
}

/// A job and its attempts without timestamps, comparable across stores.
#[derive(Debug, Clone, PartialEq, Eq)]
struct View {
    state: JobState,
    version: i64,
    attempt_count: i32,
    completed_by: Option<AttemptId>,
    response: Option<Bytes>,
    attempts: Vec<(AttemptId, i32, AttemptState, Option<u16>)>,
}

fn view(detail: &JobDetail) -> View {
    View {
        state: detail.job.state,
        version: detail.job.version,
        attempt_count: detail.job.attempt_count,
        completed_by: detail.job.completed_by,
        response: detail.job.response.as_ref().map(|r| r.body.clone()),
        attempts: detail
            .attempts
            .iter()
            .map(|a| (a.id, a.number, a.state, a.upstream_status))
            .collect(),
    }
}

/// A case's job under one store.
struct Subject {
    store: Arc<dyn Store>,
    job: Option<JobId>,
    attempts: Vec<AttemptId>,
}

struct Case {
    key: IdempotencyKey,
    owner: Owner,
    /// Attempt ids are shared by both stores, so the views compare.
    next_attempt: u128,
    base: u128,
}

impl Case {
    fn new_attempt(&mut self, lapsing: bool) -> NewAttempt {
        self.next_attempt += 1;
        NewAttempt {
            id: AttemptId(Uuid::from_u128(self.base + self.next_attempt)),
            upstream: "primary".into(),
            instance: Uuid::nil(),
            lease: if lapsing {
                Duration::ZERO
            } else {
                Duration::from_secs(3600)
            },
            deadline: Duration::from_secs(3600),
        }
    }

    fn new_job(&self) -> NewJob {
        NewJob {
            id: JobId(Uuid::from_u128(self.base)),
            owner: self.owner.clone(),
            key: self.key.clone(),
            fingerprint: Fingerprint([9; 32]),
            route: "props".into(),
            ttl: Duration::from_secs(3600),
        }
    }
}

fn failure(kind: u8) -> AttemptFailure {
    match kind {
        0 => AttemptFailure::Failed {
            status: Some(503),
            detail: "busy".into(),
        },
        1 => AttemptFailure::Unknown {
            detail: "timeout".into(),
        },
        2 => AttemptFailure::Rejected {
            status: 200,
            detail: "contract".into(),
        },
        _ => AttemptFailure::Superseded {
            detail: "lost".into(),
        },
    }
}

fn resolution(kind: u8) -> Resolution {
    match kind {
        0 => Resolution::Failed,
        1 => Resolution::Cancelled,
        _ => Resolution::Succeeded(response("operator")),
    }
}

fn response(tag: &str) -> StoredResponse {
    StoredResponse {
        status: 200,
        headers: vec![("x-tag".into(), Bytes::from(tag.to_owned()))],
        body: Bytes::from(tag.to_owned()),
    }
}

/// Applies one step to one store. `version` is the job version the caller
/// read (from the reference), so a claim can be made deliberately stale.
async fn step(
    s: &mut Subject,
    op: &Op,
    new_job: NewJob,
    new_attempt: NewAttempt,
    version: i64,
) -> Outcome {
    let refused = |e: idemgate_store::StoreError| Outcome::Refused(e.kind());
    let pick = |i: usize| (!s.attempts.is_empty()).then(|| s.attempts[i % s.attempts.len()]);
    match op {
        Op::Begin { .. } => match s.store.begin_job(new_job, new_attempt).await {
            Ok(Begin::Created(job, attempt)) => {
                s.job = Some(job.id);
                s.attempts.push(attempt.id);
                Outcome::Created
            }
            Ok(Begin::Existing(_)) => Outcome::Existing,
            Err(e) => refused(e),
        },
        Op::Claim { stale, .. } | Op::Hedge { stale, .. } => {
            let Some(job) = s.job else {
                return Outcome::Done;
            };
            let version = if *stale { version - 1 } else { version };
            let started = match op {
                Op::Claim { .. } => s.store.claim_attempt(job, version, new_attempt).await,
                _ => s.store.hedge_attempt(job, version, new_attempt).await,
            };
            match started {
                Ok(Some(attempt)) => {
                    s.attempts.push(attempt.id);
                    Outcome::Started(true)
                }
                Ok(None) => Outcome::Started(false),
                Err(e) => refused(e),
            }
        }
        Op::Commit { attempt } => {
            let Some(id) = pick(*attempt) else {
                return Outcome::Done;
            };
            let detail = s.store.job_detail(s.job.unwrap()).await.unwrap().unwrap();
            let attempt = detail.attempts.into_iter().find(|a| a.id == id).unwrap();
            match s.store.commit(&attempt, &response(&id.to_string())).await {
                Ok(outcome) => {
                    Outcome::Committed(outcome == idemgate_store::CommitOutcome::Committed)
                }
                Err(e) => refused(e),
            }
        }
        Op::Fail { attempt, kind } => {
            let Some(id) = pick(*attempt) else {
                return Outcome::Done;
            };
            match s.store.fail_attempt(id, failure(*kind)).await {
                Ok(_) => Outcome::Done,
                Err(e) => refused(e),
            }
        }
        Op::Resolve { attempt, kind } => {
            let Some(id) = pick(*attempt) else {
                return Outcome::Done;
            };
            match s.store.resolve_attempt(id, resolution(*kind)).await {
                Ok(_) => Outcome::Done,
                Err(e) => refused(e),
            }
        }
        // The store is shared by many cases, so the counts are not this
        // case's: its job's view, compared after the step, says what changed.
        Op::Expire => {
            // Leases of zero lapse at once; step past the stores' clock
            // resolution so every store sees them lapsed.
            tokio::time::sleep(Duration::from_millis(3)).await;
            s.store
                .expire_leases(1000)
                .await
                .map_or_else(refused, |_| Outcome::Done)
        }
        Op::Purge => s
            .store
            .purge_expired(1000)
            .await
            .map_or_else(refused, |_| Outcome::Done),
    }
}

/// The invariants every store holds after every step.
fn check(before: Option<&View>, after: &View) -> Result<(), String> {
    let winners: Vec<_> = after
        .attempts
        .iter()
        .filter(|a| a.2 == AttemptState::Succeeded)
        .collect();
    if winners.len() > 1 {
        return Err(format!("two winners: {after:?}"));
    }
    let completed = after.state == JobState::Completed;
    if completed != (winners.len() == 1) || completed != after.completed_by.is_some() {
        return Err(format!(
            "completed without exactly one named winner: {after:?}"
        ));
    }
    if completed && (after.completed_by != Some(winners[0].0) || after.response.is_none()) {
        return Err(format!(
            "the winner is not the one named, or no response: {after:?}"
        ));
    }
    if !completed && after.state != JobState::derive(after.attempts.iter().map(|a| a.2)) {
        return Err(format!("state not derived from the attempts: {after:?}"));
    }
    let Some(before) = before else {
        return Ok(());
    };
    if before.state != after.state && !before.state.can_become(after.state) {
        return Err(format!(
            "forbidden move {} -> {}",
            before.state, after.state
        ));
    }
    if after.version < before.version {
        return Err(format!("version went back: {before:?} -> {after:?}"));
    }
    for (was, now) in before.attempts.iter().zip(&after.attempts) {
        if was.2 != now.2 && !was.2.can_become(now.2) {
            return Err(format!("attempt moved {} -> {}", was.2, now.2));
        }
    }
    Ok(())
}

async fn run_case(store: Arc<dyn Store>, ops: &[Op], base: u128) -> Result<(), TestCaseError> {
    let reference: Arc<dyn Store> = Arc::new(Machine::new(
        Memory::default(),
        Arc::new(Doorbell::default()),
    ));
    let mut case = Case {
        key: IdempotencyKey::new(format!("props-{base:x}")).unwrap(),
        owner: Owner::of(&OwnerSalt::new(b"test salt, not a secret"), &[b"props"]),
        next_attempt: 0,
        base,
    };
    let mut subject = Subject {
        store,
        job: None,
        attempts: Vec::new(),
    };
    let mut model = Subject {
        store: reference,
        job: None,
        attempts: Vec::new(),
    };
    let mut last: Option<View> = None;
    for (i, op) in ops.iter().enumerate() {
        let lapsing = matches!(
            op,
            Op::Begin { lapsing: true }
                | Op::Claim { lapsing: true, .. }
                | Op::Hedge { lapsing: true, .. }
        );
        let new_attempt = case.new_attempt(lapsing);
        let version = last.as_ref().map_or(1, |v| v.version);
        let expected = step(&mut model, op, case.new_job(), new_attempt.clone(), version).await;
        let got = step(&mut subject, op, case.new_job(), new_attempt, version).await;
        prop_assert_eq!(
            &got,
            &expected,
            "step {} {:?} answered differently from the reference",
            i,
            op
        );
        let Some(job) = subject.job else { continue };
        let seen = view(&subject.store.job_detail(job).await.unwrap().unwrap());
        let wanted = view(&model.store.job_detail(job).await.unwrap().unwrap());
        prop_assert_eq!(
            &seen,
            &wanted,
            "after step {} {:?} the store differs from the reference",
            i,
            op
        );
        check(last.as_ref(), &seen)
            .map_err(|e| TestCaseError::fail(format!("after step {i} {op:?}: {e}")))?;
        last = Some(seen);
    }
    Ok(())
}

fn run_property(cases: u32, make: impl Fn() -> Arc<dyn Store>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = make();
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let counter = std::sync::atomic::AtomicU64::new(1);
    runner
        .run(&proptest::collection::vec(op(), 1..24), |ops| {
            let base = u128::from(counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst)) << 64;
            rt.block_on(run_case(store.clone(), &ops, base))
        })
        .unwrap();
}

fn machine(backend: impl idemgate_store::Backend) -> Arc<dyn Store> {
    Arc::new(Machine::new(backend, Arc::new(Doorbell::default())))
}

#[test]
fn sqlite_follows_the_reference_and_never_breaks_the_rules() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("props.db");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let backend = rt
        .block_on(idemgate_store::sqlite::Sqlite::open(&path))
        .unwrap();
    drop(rt);
    run_property(128, move || machine(backend.clone()));
}

#[test]
fn postgres_follows_the_reference_and_never_breaks_the_rules() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let db = rt.block_on(crate::support::TestDb::new());
    let backend = idemgate_store::postgres::Postgres::new(
        &idemgate_store::postgres::PgSettings {
            pool_size: 4,
            connect_timeout: Duration::from_secs(5),
            ..idemgate::config::store::pg_settings(&db.url).unwrap()
        },
        Uuid::new_v4(),
    )
    .unwrap();
    rt.block_on(backend.migrate()).unwrap();
    drop(rt);
    run_property(64, move || machine(backend.clone()));
    drop(db);
}
