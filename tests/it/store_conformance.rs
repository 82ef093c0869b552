//! One behavioural suite for every store: the same functions run against
//! each implementation (instantiated at the bottom), and drive the races the
//! gateway relies on directly, with barriers rather than timing.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use tokio::sync::Barrier;

use idemgate_domain::attempt::{AttemptFailure, AttemptState, NewAttempt, Resolution};
use idemgate_domain::fingerprint::Fingerprint;
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::job::{JobState, NewJob};
use idemgate_domain::key::{IdempotencyKey, Owner, OwnerSalt};
use idemgate_domain::reconcile::{Lookup, LookupResult};
use idemgate_domain::response::StoredResponse;
use idemgate_domain::transition::Refusal;
use idemgate_store::{Begin, CommitOutcome, Doorbell, Store, StoreError};

fn new_job(key: &str) -> NewJob {
    NewJob {
        id: JobId::new(),
        owner: Owner::of(
            &OwnerSalt::new(b"test salt, not a secret"),
            &[b"Bearer conformance"],
        ),
        key: IdempotencyKey::new(key).unwrap(),
        fingerprint: Fingerprint([7; 32]),
        route: "default".into(),
        ttl: Duration::from_secs(3600),
    }
}

fn new_attempt() -> NewAttempt {
    NewAttempt {
        id: AttemptId::new(),
        upstream: "primary".into(),
        instance: uuid::Uuid::new_v4(),
        lease: Duration::from_secs(30),
        deadline: Duration::from_secs(300),
    }
}

fn response(tag: &str) -> StoredResponse {
    StoredResponse {
        status: 200,
        headers: vec![
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
            ("x-tag".into(), Bytes::from(tag.to_owned())),
        ],
        body: Bytes::from(format!("{{\"winner\":\"{tag}\"}}")),
    }
}

async fn created(
    store: &dyn Store,
    key: &str,
) -> (idemgate_domain::job::Job, idemgate_domain::attempt::Attempt) {
    match store.begin_job(new_job(key), new_attempt()).await.unwrap() {
        Begin::Created(job, attempt) => (job, attempt),
        Begin::Existing(_) => panic!("key {key} already existed"),
    }
}

pub async fn begin_creates_once_then_finds(store: Arc<dyn Store>) {
    let (job, attempt) = created(store.as_ref(), "once").await;
    assert_eq!(job.state, JobState::Running);
    assert_eq!(attempt.number, 1);
    assert_eq!(attempt.state, AttemptState::Started);
    assert_eq!(attempt.job_version, job.version);
    match store
        .begin_job(new_job("once"), new_attempt())
        .await
        .unwrap()
    {
        Begin::Existing(existing) => {
            assert_eq!(existing.id, job.id);
            assert_eq!(existing.fingerprint, Fingerprint([7; 32]));
        }
        Begin::Created(..) => panic!("created twice"),
    }
    let found = store
        .find_job(
            &Owner::of(
                &OwnerSalt::new(b"test salt, not a secret"),
                &[b"Bearer conformance"],
            ),
            &IdempotencyKey::new("once").unwrap(),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found.job.id, job.id);
    assert_eq!(found.attempts.len(), 1);
    // Another owner, same key: another job.
    let mut other = new_job("once");
    other.owner = Owner::anonymous();
    assert!(matches!(
        store.begin_job(other, new_attempt()).await.unwrap(),
        Begin::Created(..)
    ));
}

pub async fn concurrent_begins_create_exactly_one_job(store: Arc<dyn Store>) {
    let n = 16;
    let barrier = Arc::new(Barrier::new(n));
    let results = join_all((0..n).map(|_| {
        let store = store.clone();
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            store
                .begin_job(new_job("contended"), new_attempt())
                .await
                .unwrap()
        })
    }))
    .await;
    let mut created = 0;
    let mut ids = std::collections::HashSet::new();
    for r in results {
        match r.unwrap() {
            Begin::Created(job, _) => {
                created += 1;
                ids.insert(job.id);
            }
            Begin::Existing(job) => {
                ids.insert(job.id);
            }
        }
    }
    assert_eq!(created, 1);
    assert_eq!(ids.len(), 1, "everyone sees the one job");
}

pub async fn concurrent_commits_have_exactly_one_winner(store: Arc<dyn Store>) {
    for round in 0..25 {
        let (job, a) = created(store.as_ref(), &format!("race-{round}")).await;
        let b = store
            .hedge_attempt(job.id, job.version, new_attempt())
            .await
            .unwrap()
            .expect("hedge on a running job");
        assert_eq!(b.number, 2);
        assert_eq!(
            b.job_version, a.job_version,
            "a hedge does not move the version"
        );
        let barrier = Arc::new(Barrier::new(2));
        let commit = |attempt: idemgate_domain::attempt::Attempt, tag: &'static str| {
            let store = store.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                store.commit(&attempt, &response(tag)).await.unwrap()
            })
        };
        let (ra, rb) = tokio::join!(commit(a.clone(), "a"), commit(b.clone(), "b"));
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        assert_ne!(ra, rb, "exactly one winner (round {round})");
        let (winner, loser, tag) = if ra == CommitOutcome::Committed {
            (&a, &b, "a")
        } else {
            (&b, &a, "b")
        };
        let detail = store.job_detail(job.id).await.unwrap().unwrap();
        assert_eq!(detail.job.state, JobState::Completed);
        assert_eq!(detail.job.completed_by, Some(winner.id));
        assert_eq!(
            detail.job.response,
            Some(response(tag)),
            "the job's result is the winner's"
        );
        let state_of = |id| detail.attempts.iter().find(|x| x.id == id).unwrap().state;
        assert_eq!(state_of(winner.id), AttemptState::Succeeded);
        assert_eq!(state_of(loser.id), AttemptState::Superseded);
    }
}

pub async fn concurrent_claims_of_an_open_job_make_one_attempt(store: Arc<dyn Store>) {
    let (job, first) = created(store.as_ref(), "claimed").await;
    store
        .fail_attempt(
            first.id,
            AttemptFailure::Failed {
                status: None,
                detail: "refused".into(),
            },
        )
        .await
        .unwrap();
    let open = store.job(job.id).await.unwrap().unwrap();
    assert_eq!(open.state, JobState::Open);
    let n = 8;
    let barrier = Arc::new(Barrier::new(n));
    let claims = join_all((0..n).map(|_| {
        let store = store.clone();
        let barrier = barrier.clone();
        let version = open.version;
        tokio::spawn(async move {
            barrier.wait().await;
            store
                .claim_attempt(job.id, version, new_attempt())
                .await
                .unwrap()
        })
    }))
    .await;
    let won: Vec<_> = claims.into_iter().filter_map(|c| c.unwrap()).collect();
    assert_eq!(won.len(), 1, "one claim wins the CAS");
    assert_eq!(won[0].number, 2);
    let after = store.job(job.id).await.unwrap().unwrap();
    assert_eq!(after.state, JobState::Running);
    assert_eq!(after.version, open.version + 1, "a claim moves the version");
    assert_eq!(won[0].job_version, after.version);
    // A stale version claims nothing.
    assert!(store
        .claim_attempt(job.id, open.version, new_attempt())
        .await
        .unwrap()
        .is_none());
}

pub async fn unknown_jobs_are_listed_newest_first_a_page_at_a_time(store: Arc<dyn Store>) {
    let mut unknown = Vec::new();
    for i in 0..5 {
        let (job, attempt) = created(store.as_ref(), &format!("inbox-{i}")).await;
        if i == 2 {
            // Completed jobs are not in the inbox; neither are running ones.
            store.commit(&attempt, &response("done")).await.unwrap();
            continue;
        }
        if i == 4 {
            continue;
        }
        let failure = AttemptFailure::Unknown {
            detail: "timeout".into(),
        };
        store.fail_attempt(attempt.id, failure).await.unwrap();
        unknown.push(store.job(job.id).await.unwrap().unwrap());
    }
    // Newest first: by creation, then by id, both descending.
    unknown.sort_by_key(|j| std::cmp::Reverse((j.created_at, j.id.0)));
    let first = store.unknown_jobs(None, 2).await.unwrap();
    let ids = |jobs: &[idemgate_domain::job::Job]| jobs.iter().map(|j| j.id).collect::<Vec<_>>();
    assert_eq!(ids(&first), ids(&unknown[..2]));
    assert!(first.iter().all(|j| j.state == JobState::Unknown));
    let cursor = idemgate_store::Cursor::after(&first[1]);
    let second = store.unknown_jobs(Some(cursor), 2).await.unwrap();
    assert_eq!(ids(&second), ids(&unknown[2..]));
    let cursor = idemgate_store::Cursor::after(&second[0]);
    assert!(store
        .unknown_jobs(Some(cursor), 2)
        .await
        .unwrap()
        .is_empty());
    // Resolved, a job leaves the inbox.
    let detail = store.job_detail(unknown[0].id).await.unwrap().unwrap();
    store
        .resolve_attempt(
            detail.attempts[0].id,
            idemgate_domain::attempt::Resolution::Failed,
        )
        .await
        .unwrap();
    let left = store.unknown_jobs(None, 10).await.unwrap();
    assert_eq!(ids(&left), ids(&unknown[1..]));
}

pub async fn unknown_blocks_but_a_late_answer_still_commits(store: Arc<dyn Store>) {
    let (job, attempt) = created(store.as_ref(), "late").await;
    store
        .fail_attempt(
            attempt.id,
            AttemptFailure::Unknown {
                detail: "timeout".into(),
            },
        )
        .await
        .unwrap();
    let unknown = store.job(job.id).await.unwrap().unwrap();
    assert_eq!(unknown.state, JobState::Unknown);
    assert!(store
        .claim_attempt(job.id, unknown.version, new_attempt())
        .await
        .unwrap()
        .is_none());
    assert_eq!(
        store.commit(&attempt, &response("late")).await.unwrap(),
        CommitOutcome::Committed
    );
    let done = store.job(job.id).await.unwrap().unwrap();
    assert_eq!(done.state, JobState::Completed);
    assert_eq!(done.response, Some(response("late")));
}

pub async fn resolution_moves_the_version_so_the_late_answer_is_superseded(store: Arc<dyn Store>) {
    let (job, attempt) = created(store.as_ref(), "resolved").await;
    store
        .fail_attempt(
            attempt.id,
            AttemptFailure::Unknown {
                detail: "timeout".into(),
            },
        )
        .await
        .unwrap();
    let detail = store
        .resolve_attempt(attempt.id, Resolution::Failed)
        .await
        .unwrap();
    assert_eq!(detail.job.state, JobState::Open);
    assert_eq!(detail.job.version, job.version + 1);
    assert_eq!(detail.attempts[0].state, AttemptState::Failed);
    assert_eq!(
        store.commit(&attempt, &response("late")).await.unwrap(),
        CommitOutcome::Superseded
    );
    let after = store.job(job.id).await.unwrap().unwrap();
    assert_eq!(after.state, JobState::Open);
    assert_eq!(after.response, None);
    // Settled attempts cannot be resolved again.
    assert!(matches!(
        store
            .resolve_attempt(attempt.id, Resolution::Cancelled)
            .await,
        Err(StoreError::Refused(_))
    ));
    assert!(matches!(
        store
            .resolve_attempt(AttemptId::new(), Resolution::Cancelled)
            .await,
        Err(StoreError::NotFound(_))
    ));
}

pub async fn resolution_as_succeeded_commits_through_the_cas(store: Arc<dyn Store>) {
    let (job, attempt) = created(store.as_ref(), "manual").await;
    let detail = store
        .resolve_attempt(attempt.id, Resolution::Succeeded(response("operator")))
        .await
        .unwrap();
    assert_eq!(detail.job.state, JobState::Completed);
    assert_eq!(detail.job.completed_by, Some(attempt.id));
    assert_eq!(detail.job.response, Some(response("operator")));
    // The attempt's own answer arriving afterwards is discarded.
    assert_eq!(
        store.commit(&attempt, &response("late")).await.unwrap(),
        CommitOutcome::Superseded
    );
    assert_eq!(
        store.job(job.id).await.unwrap().unwrap().response,
        Some(response("operator"))
    );
}

/// Lookups of an unknown attempt are counted, the last one kept; what a
/// lookup finds applies only while the attempt is unknown, by the
/// resolution's CAS.
pub async fn lookups_are_recorded_and_reconcile_applies_only_to_an_unknown_attempt(
    store: Arc<dyn Store>,
) {
    let (job, attempt) = created(store.as_ref(), "looked-up").await;
    // Still started: a lookup's finding does not apply.
    let refused = store
        .reconcile_attempt(attempt.id, Resolution::Succeeded(response("lookup")))
        .await;
    assert!(
        matches!(
            refused,
            Err(StoreError::Refused(Refusal::AttemptIs {
                state: AttemptState::Started,
                ..
            }))
        ),
        "{refused:?}"
    );
    let unknown = AttemptFailure::Unknown {
        detail: "timeout".into(),
    };
    store.fail_attempt(attempt.id, unknown).await.unwrap();
    let at = std::time::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    for (n, (status, result)) in [
        (None, LookupResult::Error),
        (Some(503), LookupResult::StillUnknown),
    ]
    .into_iter()
    .enumerate()
    {
        let lookup = Lookup {
            at: at + Duration::from_secs(n as u64),
            status,
            result,
        };
        store.record_lookup(attempt.id, &lookup).await.unwrap();
        let detail = store.job_detail(job.id).await.unwrap().unwrap();
        let lookups = &detail.attempts[0].lookups;
        assert_eq!(lookups.count, n as u32 + 1);
        assert_eq!(lookups.last.as_ref(), Some(&lookup));
    }
    assert!(matches!(
        store
            .record_lookup(
                AttemptId::new(),
                &Lookup {
                    at,
                    status: None,
                    result: LookupResult::Error
                }
            )
            .await,
        Err(StoreError::NotFound(_))
    ));
    let detail = store
        .reconcile_attempt(attempt.id, Resolution::Succeeded(response("lookup")))
        .await
        .unwrap();
    assert_eq!(detail.job.state, JobState::Completed);
    assert_eq!(detail.job.completed_by, Some(attempt.id));
    assert_eq!(detail.job.response, Some(response("lookup")));
    assert_eq!(detail.attempts[0].state, AttemptState::Succeeded);
    assert_eq!(detail.attempts[0].lookups.count, 2);
    // The attempt's own late answer is discarded; a second finding too.
    assert_eq!(
        store.commit(&attempt, &response("late")).await.unwrap(),
        CommitOutcome::Superseded
    );
    assert!(store
        .reconcile_attempt(attempt.id, Resolution::Failed)
        .await
        .is_err());

    // A finding of no effect reopens the job.
    let (job, attempt) = created(store.as_ref(), "looked-up-404").await;
    let unknown = AttemptFailure::Unknown {
        detail: "timeout".into(),
    };
    store.fail_attempt(attempt.id, unknown).await.unwrap();
    let detail = store
        .reconcile_attempt(attempt.id, Resolution::Failed)
        .await
        .unwrap();
    assert_eq!(detail.job.id, job.id);
    assert_eq!(detail.job.state, JobState::Open);
    assert_eq!(detail.job.version, job.version + 1);
    assert_eq!(detail.attempts[0].state, AttemptState::Failed);
}

pub async fn a_hedge_failing_next_to_an_unknown_attempt_keeps_the_job_blocked(
    store: Arc<dyn Store>,
) {
    let (job, a) = created(store.as_ref(), "mixed").await;
    let b = store
        .hedge_attempt(job.id, job.version, new_attempt())
        .await
        .unwrap()
        .unwrap();
    store
        .fail_attempt(
            a.id,
            AttemptFailure::Unknown {
                detail: "timeout".into(),
            },
        )
        .await
        .unwrap();
    store
        .fail_attempt(
            b.id,
            AttemptFailure::Failed {
                status: Some(503),
                detail: "busy".into(),
            },
        )
        .await
        .unwrap();
    assert_eq!(
        store.job(job.id).await.unwrap().unwrap().state,
        JobState::Unknown
    );
}

pub async fn lapsed_leases_turn_attempts_unknown(store: Arc<dyn Store>) {
    let mut short = new_attempt();
    short.lease = Duration::from_millis(50);
    let (job, attempt) = match store.begin_job(new_job("lapsing"), short).await.unwrap() {
        Begin::Created(job, attempt) => (job, attempt),
        Begin::Existing(_) => unreachable!(),
    };
    let mut renewed = new_attempt();
    renewed.lease = Duration::from_millis(50);
    let (kept_job, kept) = match store.begin_job(new_job("renewed"), renewed).await.unwrap() {
        Begin::Created(job, attempt) => (job, attempt),
        Begin::Existing(_) => unreachable!(),
    };
    assert_eq!(
        store
            .renew_leases(&[kept.id], Duration::from_secs(60))
            .await
            .unwrap(),
        1
    );
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(store.expire_leases(100).await.unwrap(), 1);
    let detail = store.job_detail(job.id).await.unwrap().unwrap();
    assert_eq!(detail.job.state, JobState::Unknown);
    assert_eq!(detail.attempts[0].state, AttemptState::Unknown);
    assert!(detail.attempts[0]
        .detail
        .as_deref()
        .unwrap()
        .contains("lease"));
    assert_eq!(
        store.job(kept_job.id).await.unwrap().unwrap().state,
        JobState::Running
    );
    let _ = attempt;
    assert_eq!(store.expire_leases(100).await.unwrap(), 0, "only once");
}

pub async fn expired_jobs_are_purged_and_their_keys_start_afresh(store: Arc<dyn Store>) {
    let mut short = new_job("expiring");
    short.ttl = Duration::from_millis(50);
    let first = match store.begin_job(short, new_attempt()).await.unwrap() {
        Begin::Created(job, _) => job,
        Begin::Existing(_) => unreachable!(),
    };
    let mut kept = new_job("kept");
    kept.ttl = Duration::from_secs(3600);
    store.begin_job(kept, new_attempt()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(120)).await;
    // Before any purge, the expired key is already forgotten on use.
    match store
        .begin_job(new_job("expiring"), new_attempt())
        .await
        .unwrap()
    {
        Begin::Created(job, _) => assert_ne!(job.id, first.id),
        Begin::Existing(_) => panic!("an expired key must start afresh"),
    }
    let mut again = new_job("expiring-2");
    again.ttl = Duration::from_millis(50);
    let gone = match store.begin_job(again, new_attempt()).await.unwrap() {
        Begin::Created(job, _) => job,
        Begin::Existing(_) => unreachable!(),
    };
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(store.purge_expired(100).await.unwrap(), 1);
    assert!(store.job(gone.id).await.unwrap().is_none());
    assert!(store.job_detail(gone.id).await.unwrap().is_none());
    assert_eq!(store.purge_expired(100).await.unwrap(), 0);
}

pub async fn every_change_of_a_jobs_state_rings_once(
    store: Arc<dyn Store>,
    doorbell: Arc<Doorbell>,
) {
    let (announced, mut announcements) = tokio::sync::mpsc::unbounded_channel();
    doorbell.announce_to(announced);
    let mut last = doorbell.rung();
    let mut rings = || {
        let now = doorbell.rung();
        let n = now - last;
        last = now;
        n
    };
    let (job, a) = created(store.as_ref(), "rings").await;
    assert_eq!(rings(), 0, "a new job has nobody to wake");
    let b = store
        .hedge_attempt(job.id, job.version, new_attempt())
        .await
        .unwrap()
        .unwrap();
    let failed = AttemptFailure::Failed {
        status: Some(503),
        detail: "busy".into(),
    };
    store.fail_attempt(b.id, failed.clone()).await.unwrap();
    assert_eq!(rings(), 0, "a hedge and its failure leave the job running");
    let unknown = AttemptFailure::Unknown {
        detail: "timeout".into(),
    };
    store.fail_attempt(a.id, unknown).await.unwrap();
    assert_eq!(rings(), 1, "running -> unknown");
    let open = store
        .resolve_attempt(a.id, Resolution::Failed)
        .await
        .unwrap();
    assert_eq!(rings(), 1, "unknown -> open");
    let c = store
        .claim_attempt(job.id, open.job.version, new_attempt())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rings(), 1, "open -> running");
    while announcements.try_recv().is_ok() {}
    assert_eq!(
        store.commit(&c, &response("c")).await.unwrap(),
        CommitOutcome::Committed
    );
    assert_eq!(rings(), 1, "running -> completed");
    assert!(
        announcements.try_recv().is_err(),
        "a commit nobody elsewhere waits on is not announced beyond this process"
    );
    store.fail_attempt(c.id, failed).await.unwrap();
    assert_eq!(rings(), 0, "a settled attempt changes nothing");
}

pub async fn a_losing_commit_of_the_last_running_attempt_reopens_the_job(store: Arc<dyn Store>) {
    let (job, a) = created(store.as_ref(), "last-loser").await;
    let b = store
        .hedge_attempt(job.id, job.version, new_attempt())
        .await
        .unwrap()
        .unwrap();
    // An operator says the hedge had no effect: the version moves, so the
    // first attempt's answer can no longer commit…
    store
        .resolve_attempt(b.id, Resolution::Failed)
        .await
        .unwrap();
    assert_eq!(
        store.commit(&a, &response("a")).await.unwrap(),
        CommitOutcome::Superseded
    );
    // …and with nothing left running, the job is open for a retry, not
    // stuck running forever.
    let after = store.job_detail(job.id).await.unwrap().unwrap();
    assert_eq!(after.job.state, JobState::Open);
    assert_eq!(after.attempts[0].state, AttemptState::Superseded);
}

pub async fn job_detail_is_one_consistent_read(store: Arc<dyn Store>) {
    for round in 0..20 {
        let (job, attempt) = created(store.as_ref(), &format!("detail-{round}")).await;
        let barrier = Arc::new(Barrier::new(5));
        let readers = (0..4).map(|_| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let mut views = Vec::new();
                for _ in 0..10 {
                    views.push(store.job_detail(job.id).await.unwrap().unwrap());
                }
                views
            })
        });
        let readers: Vec<_> = readers.collect();
        barrier.wait().await;
        store.commit(&attempt, &response("r")).await.unwrap();
        for reader in readers {
            for view in reader.await.unwrap() {
                let completed = view.job.state == JobState::Completed;
                let succeeded = view.attempts[0].state == AttemptState::Succeeded;
                assert_eq!(
                    completed, succeeded,
                    "a job and its attempts are read as of one moment (round {round})"
                );
            }
        }
    }
}

pub async fn one_sweep_expires_a_batch_of_jobs(store: Arc<dyn Store>) {
    for i in 0..3 {
        let mut short = new_attempt();
        short.lease = Duration::from_millis(50);
        store
            .begin_job(new_job(&format!("sweep-{i}")), short)
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(store.expire_leases(2).await.unwrap(), 2, "at most a batch");
    assert_eq!(store.expire_leases(100).await.unwrap(), 1, "the rest");
    assert_eq!(store.expire_leases(100).await.unwrap(), 0, "each once");
}

pub async fn evidence_of_a_safe_failure_settles_an_attempt_its_lapsed_lease_made_unknown(
    store: Arc<dyn Store>,
) {
    let mut short = new_attempt();
    short.lease = Duration::from_millis(50);
    let (job, attempt) = match store.begin_job(new_job("evidence"), short).await.unwrap() {
        Begin::Created(job, attempt) => (job, attempt),
        Begin::Existing(_) => unreachable!(),
    };
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(store.expire_leases(100).await.unwrap(), 1);
    assert_eq!(
        store.job(job.id).await.unwrap().unwrap().state,
        JobState::Unknown
    );
    // The gateway that ran it was only cut off from the store: it knows the
    // upstream answered a retryable 503, and says so once it can.
    store
        .fail_attempt(
            attempt.id,
            AttemptFailure::Failed {
                status: Some(503),
                detail: "busy".into(),
            },
        )
        .await
        .unwrap();
    let open = store.job(job.id).await.unwrap().unwrap();
    assert_eq!(open.state, JobState::Open, "the retry may make attempt 2");
    let next = store
        .claim_attempt(job.id, open.version, new_attempt())
        .await
        .unwrap()
        .expect("attempt 2");
    assert_eq!(next.number, 2);
}

/// `on_unknown = "new_attempt"` (docs/design.md §5): of simultaneous
/// retries of an unknown job, exactly one starts an attempt; the job is
/// then running, and the unknown attempt's late answer may still commit.
pub async fn concurrent_moves_on_from_an_unknown_job_make_one_attempt(store: Arc<dyn Store>) {
    let (job, first) = created(store.as_ref(), "moved-on").await;
    let unknown = AttemptFailure::Unknown {
        detail: "timeout".into(),
    };
    store.fail_attempt(first.id, unknown).await.unwrap();
    let blocked = store.job(job.id).await.unwrap().unwrap();
    assert_eq!(blocked.state, JobState::Unknown);
    let n = 8;
    let barrier = Arc::new(Barrier::new(n));
    let moves = join_all((0..n).map(|_| {
        let (store, barrier, version) = (store.clone(), barrier.clone(), blocked.version);
        tokio::spawn(async move {
            barrier.wait().await;
            store
                .move_on_attempt(job.id, version, new_attempt())
                .await
                .unwrap()
        })
    }))
    .await;
    let won: Vec<_> = moves.into_iter().filter_map(|m| m.unwrap()).collect();
    assert_eq!(won.len(), 1, "one retry moves on");
    assert_eq!(won[0].number, 2);
    assert_eq!(won[0].job_version, blocked.version);
    assert_eq!(
        store.job(job.id).await.unwrap().unwrap().state,
        JobState::Running
    );
    let late = store.commit(&first, &response("late")).await.unwrap();
    assert_eq!(
        late,
        CommitOutcome::Committed,
        "the first answer still wins"
    );
}

/// The unknown attempts still within their deadline, oldest first: what
/// every replica's scan adopts lookups from (docs/design.md §5).
pub async fn unknown_attempts_are_listed_by_start_after_a_time(store: Arc<dyn Store>) {
    let unknown = || AttemptFailure::Unknown {
        detail: "timeout".into(),
    };
    let (_, running) = created(store.as_ref(), "running").await;
    let before = std::time::SystemTime::now() - Duration::from_secs(1);
    let mut made = Vec::new();
    for key in ["old", "settled", "new"] {
        // Distinct start times, at the stores' millisecond precision.
        tokio::time::sleep(Duration::from_millis(5)).await;
        let (job, attempt) = created(store.as_ref(), key).await;
        store.fail_attempt(attempt.id, unknown()).await.unwrap();
        made.push((job.id, attempt));
    }
    store
        .resolve_attempt(made[1].1.id, Resolution::Failed)
        .await
        .unwrap();
    let listed = store.unknown_attempts(before, 10).await.unwrap();
    assert_eq!(
        listed,
        vec![(made[0].0, made[0].1.id), (made[2].0, made[2].1.id)],
        "unknown ones only, oldest first; not {running:?}"
    );
    let since_old = made[0].1.started_at;
    let listed = store.unknown_attempts(since_old, 10).await.unwrap();
    assert_eq!(listed, vec![(made[2].0, made[2].1.id)], "started after");
    assert_eq!(store.unknown_attempts(before, 1).await.unwrap().len(), 1);
}

/// Instantiates every conformance test for one store. `$make` is an async
/// expression giving `(Arc<dyn Store>, Arc<Doorbell>, guard)`; the guard
/// lives as long as the test.
macro_rules! conformance_suite {
    ($module:ident, $make:path) => {
        mod $module {
            use super::*;
            conformance_suite!(@tests $make;
                begin_creates_once_then_finds,
                concurrent_begins_create_exactly_one_job,
                concurrent_commits_have_exactly_one_winner,
                concurrent_claims_of_an_open_job_make_one_attempt,
                unknown_blocks_but_a_late_answer_still_commits,
                unknown_jobs_are_listed_newest_first_a_page_at_a_time,
                resolution_moves_the_version_so_the_late_answer_is_superseded,
                resolution_as_succeeded_commits_through_the_cas,
                a_hedge_failing_next_to_an_unknown_attempt_keeps_the_job_blocked,
                lapsed_leases_turn_attempts_unknown,
                expired_jobs_are_purged_and_their_keys_start_afresh,
                job_detail_is_one_consistent_read,
                a_losing_commit_of_the_last_running_attempt_reopens_the_job,
                one_sweep_expires_a_batch_of_jobs,
                evidence_of_a_safe_failure_settles_an_attempt_its_lapsed_lease_made_unknown,
                lookups_are_recorded_and_reconcile_applies_only_to_an_unknown_attempt,
                concurrent_moves_on_from_an_unknown_job_make_one_attempt,
                unknown_attempts_are_listed_by_start_after_a_time,
            );
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn every_change_of_a_jobs_state_rings_once() {
                let (store, doorbell, _guard) = $make().await;
                super::every_change_of_a_jobs_state_rings_once(store, doorbell).await;
            }
        }
    };
    (@tests $make:path; $($test:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                let (store, _doorbell, _guard) = $make().await;
                super::$test(store).await;
            }
        )*
    };
}

fn machine<B: idemgate_store::Backend>(backend: B) -> (Arc<dyn Store>, Arc<Doorbell>) {
    let doorbell = Arc::new(Doorbell::default());
    (
        Arc::new(idemgate_store::Machine::new(backend, doorbell.clone())),
        doorbell,
    )
}

async fn postgres_store() -> (Arc<dyn Store>, Arc<Doorbell>, crate::support::TestDb) {
    let db = crate::support::TestDb::new().await;
    let backend = idemgate_store::postgres::Postgres::new(
        &idemgate_store::postgres::PgSettings {
            pool_size: 20,
            connect_timeout: Duration::from_secs(5),
            ..idemgate::config::store::pg_settings(&db.url).unwrap()
        },
        uuid::Uuid::new_v4(),
    )
    .unwrap();
    backend.migrate().await.unwrap();
    let (store, doorbell) = machine(backend);
    (store, doorbell, db)
}

conformance_suite!(postgres, postgres_store);

/// On PostgreSQL, a commit of a job someone in another process waits on is
/// announced (NOTIFY and the announcer), and one nobody waits on is not.
#[tokio::test]
async fn on_postgres_only_watched_commits_are_announced() {
    let (store, doorbell, db) = postgres_store().await;
    let (announced, mut announcements) = tokio::sync::mpsc::unbounded_channel();
    doorbell.announce_to(announced);
    let (_, quiet) = created(store.as_ref(), "quiet").await;
    store.commit(&quiet, &response("q")).await.unwrap();
    assert!(announcements.try_recv().is_err());
    let (job, watched) = created(store.as_ref(), "watched").await;
    store.watch(job.id).await.unwrap();
    store.commit(&watched, &response("w")).await.unwrap();
    assert_eq!(announcements.try_recv().ok(), Some(job.id));
    let rows = db
        .connect()
        .await
        .query("SELECT key FROM jobs WHERE watched ORDER BY key", &[])
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "only the watched job was marked");
}

/// Rows damaged behind the gateway's back are typed errors, never a panic
/// or a silently different response.
#[tokio::test]
async fn corrupt_rows_are_typed_errors_on_both_stores() {
    use crate::support::TestStore;
    for store in [TestStore::postgres().await, TestStore::embedded()] {
        let (subject, damage): (Arc<dyn Store>, &[&str]) = match &store {
            TestStore::Postgres(db) => {
                let backend = idemgate_store::postgres::Postgres::new(
                    &idemgate_store::postgres::PgSettings {
                        pool_size: 2,
                        connect_timeout: Duration::from_secs(5),
                        ..idemgate::config::store::pg_settings(&db.url).unwrap()
                    },
                    uuid::Uuid::new_v4(),
                )
                .unwrap();
                backend.migrate().await.unwrap();
                (
                    machine(backend).0,
                    &[
                        "UPDATE jobs SET fingerprint = '\\x010203' WHERE id = '{id}'",
                        "UPDATE jobs SET response_header_names = ARRAY['a'] WHERE id = '{id}'",
                    ],
                )
            }
            TestStore::Embedded(dir) => {
                let backend = idemgate_store::sqlite::Sqlite::open(&dir.path().join("idemgate.db"))
                    .await
                    .unwrap();
                (
                    machine(backend).0,
                    &[
                        "UPDATE jobs SET fingerprint = x'010203' WHERE id = '{id}'",
                        "UPDATE jobs SET response_headers = x'000000ff61' WHERE id = '{id}'",
                        "UPDATE jobs SET completed_by = 'not-a-uuid' WHERE id = '{id}'",
                    ],
                )
            }
            TestStore::External(_) => unreachable!(),
        };
        for (n, sql) in damage.iter().enumerate() {
            let (job, attempt) = created(subject.as_ref(), &format!("damaged-{n}")).await;
            subject.commit(&attempt, &response("ok")).await.unwrap();
            assert!(subject.job(job.id).await.unwrap().is_some());
            store
                .execute(&sql.replace("{id}", &job.id.to_string()))
                .await;
            let read = subject.job(job.id).await;
            assert!(
                matches!(read, Err(StoreError::Corrupt(_))),
                "{sql}: {read:?}"
            );
        }
    }
}

async fn embedded_store() -> (Arc<dyn Store>, Arc<Doorbell>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let backend = idemgate_store::sqlite::Sqlite::open(&dir.path().join("idemgate.db"))
        .await
        .unwrap();
    let (store, doorbell) = machine(backend);
    (store, doorbell, dir)
}

conformance_suite!(embedded, embedded_store);

async fn memory_store() -> (Arc<dyn Store>, Arc<Doorbell>, ()) {
    let (store, doorbell) = machine(idemgate_store::memory::Memory::default());
    (store, doorbell, ())
}

conformance_suite!(memory, memory_store);
