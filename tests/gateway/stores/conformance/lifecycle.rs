//! Jobs over time: hedges, lapsed leases, expiry and sweeps, the doorbell,
//! and the listings of unknown jobs and attempts.

use super::*;

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

/// Begins `key` with a key lifetime of 50 ms and settles its attempt
/// `failed`: a job nothing can still answer, to expire.
async fn settled_with_short_ttl(store: &dyn Store, key: &str) -> idemgate_domain::job::Job {
    let mut short = new_job(key);
    short.ttl = Duration::from_millis(50);
    let Begin::Created(job, attempt) = store.begin_job(short, new_attempt()).await.unwrap() else {
        panic!("key {key} already existed");
    };
    let failed = AttemptFailure::Failed {
        status: Some(503),
        detail: "busy".into(),
    };
    store.fail_attempt(attempt.id, failed).await.unwrap();
    job
}

/// Past its expiry and the grace after its last change
/// (`SETTLED_GRACE`), a job nothing can still answer is forgotten.
async fn past_the_grace() {
    tokio::time::sleep(idemgate_store::SETTLED_GRACE + Duration::from_millis(200)).await;
}

pub async fn expired_jobs_are_purged_and_their_keys_start_afresh(store: Arc<dyn Store>) {
    let first = settled_with_short_ttl(store.as_ref(), "expiring").await;
    let gone = settled_with_short_ttl(store.as_ref(), "expiring-2").await;
    let mut kept = new_job("kept");
    kept.ttl = Duration::from_secs(3600);
    store.begin_job(kept, new_attempt()).await.unwrap();
    // Expired, but answered a moment ago: kept for the grace.
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(
        store.purge_expired(100).await.unwrap(),
        0,
        "within the grace"
    );
    past_the_grace().await;
    // Before any purge, the expired key is already forgotten on use.
    match store
        .begin_job(new_job("expiring"), new_attempt())
        .await
        .unwrap()
    {
        Begin::Created(job, _) => assert_ne!(job.id, first.id),
        Begin::Existing(_) => panic!("an expired key must start afresh"),
    }
    assert_eq!(store.purge_expired(100).await.unwrap(), 1);
    assert!(store.job(gone.id).await.unwrap().is_none());
    assert!(store.job_detail(gone.id).await.unwrap().is_none());
    assert_eq!(store.purge_expired(100).await.unwrap(), 0);
}

/// Past its key's lifetime, a job one of whose attempts may still answer
/// (`started`, or `unknown` before its deadline) is kept: by the purge, and
/// for a retry of its key, which joins it instead of calling the upstream a
/// second time; the attempt's answer then commits. An `unknown` attempt
/// past its deadline no longer keeps its job; a job that changed within
/// `SETTLED_GRACE` is kept too (docs/design.md §11, "not forgotten").
pub async fn a_job_is_not_forgotten_while_an_attempt_may_still_answer(store: Arc<dyn Store>) {
    let begin = |key: &'static str, deadline: Duration| {
        let store = store.clone();
        async move {
            let mut short = new_job(key);
            short.ttl = Duration::from_millis(50);
            let mut attempt = new_attempt();
            attempt.deadline = deadline;
            let Begin::Created(job, attempt) = store.begin_job(short, attempt).await.unwrap()
            else {
                panic!("key {key} already existed");
            };
            (job, attempt)
        }
    };
    let (running, at_upstream) = begin("running", Duration::from_secs(300)).await;
    let (unknown, late) = begin("unknown", Duration::from_secs(300)).await;
    let (lapsed, past) = begin("unknown-past-deadline", Duration::from_millis(50)).await;
    let unknown_failure = AttemptFailure::Unknown {
        detail: "timeout".into(),
    };
    for attempt in [late.id, past.id] {
        store
            .fail_attempt(attempt, unknown_failure.clone())
            .await
            .unwrap();
    }
    past_the_grace().await;

    assert_eq!(
        store.purge_expired(100).await.unwrap(),
        1,
        "only the one past its deadline"
    );
    assert!(store.job(lapsed.id).await.unwrap().is_none());
    for (key, job) in [("running", &running), ("unknown", &unknown)] {
        match store.begin_job(new_job(key), new_attempt()).await.unwrap() {
            Begin::Existing(found) => assert_eq!(found.id, job.id, "{key}"),
            Begin::Created(..) => panic!("{key}: a retry began a second job beside the first"),
        }
    }
    assert_eq!(
        store.commit(&at_upstream, &response("slow")).await.unwrap(),
        CommitOutcome::Committed
    );
    assert_eq!(
        store.commit(&late, &response("late")).await.unwrap(),
        CommitOutcome::Committed
    );
    // Answered, the jobs expire as any other, once the grace is over.
    assert_eq!(
        store.purge_expired(100).await.unwrap(),
        0,
        "within the grace"
    );
    past_the_grace().await;
    assert_eq!(store.purge_expired(100).await.unwrap(), 2);
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
    assert!(store.fail_attempt(a.id, unknown.clone()).await.unwrap());
    assert_eq!(rings(), 1, "running -> unknown");
    // The same settle again, as when its reply was lost and it is retried:
    // refused (not recorded twice), and rung here, where nobody else rings
    // the job's holders for it (docs/design.md §7, "A settle whose reply
    // was lost").
    assert!(!store.fail_attempt(a.id, unknown).await.unwrap());
    assert_eq!(
        rings(),
        1,
        "a settle that met its own landed try rings here"
    );
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
    // The same commit again, as when its reply was lost and it is retried:
    // its compare-and-swap fails, it meets its own commit (told it
    // committed), and it is rung here, where nobody else rings the job's
    // holders for it (docs/design.md §7, "A commit whose reply was lost").
    assert_eq!(
        store.commit(&c, &response("c")).await.unwrap(),
        CommitOutcome::Committed
    );
    assert_eq!(rings(), 1, "a lost compare-and-swap rings here");
}

/// An operator says a hedge had no effect while the first attempt still
/// runs: the job stays running, its version where it was, and the first
/// attempt's answer commits. (Before the resolution left the version alone
/// beside an unsettled sibling, this answer lost the compare-and-swap and
/// the job reopened; `docs/design.md` §4.)
pub async fn a_hedge_resolved_failed_leaves_the_job_to_the_first_attempt(store: Arc<dyn Store>) {
    let (job, a) = created(store.as_ref(), "last-loser").await;
    let b = store
        .hedge_attempt(job.id, job.version, new_attempt())
        .await
        .unwrap()
        .unwrap();
    let resolved = store
        .resolve_attempt(b.id, Resolution::Failed)
        .await
        .unwrap();
    assert_eq!(
        (resolved.job.state, resolved.job.version),
        (JobState::Running, job.version)
    );
    assert_eq!(
        store.commit(&a, &response("a")).await.unwrap(),
        CommitOutcome::Committed
    );
    let after = store.job_detail(job.id).await.unwrap().unwrap();
    assert_eq!(after.job.state, JobState::Completed);
    assert_eq!(after.job.completed_by, Some(a.id));
    assert_eq!(after.attempts[1].state, AttemptState::Failed);
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
    past_the_grace().await;
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
