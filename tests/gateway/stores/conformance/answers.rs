//! Jobs begun, claimed, committed, resolved and reconciled, each race with
//! exactly one winner.

use super::*;

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

/// An unknown attempt resolved `failed` beside a hedge still running leaves
/// the hedge free to commit its answer: the resolution decides nothing
/// about who commits while another attempt may (`docs/design.md` §4).
pub async fn a_failed_resolution_beside_a_running_hedge_lets_the_hedge_commit(
    store: Arc<dyn Store>,
) {
    let (job, unknown) = created(store.as_ref(), "hedged").await;
    let hedge = store
        .hedge_attempt(job.id, job.version, new_attempt())
        .await
        .unwrap()
        .unwrap();
    let timeout = AttemptFailure::Unknown {
        detail: "timeout".into(),
    };
    store.fail_attempt(unknown.id, timeout).await.unwrap();
    let detail = store
        .resolve_attempt(unknown.id, Resolution::Failed)
        .await
        .unwrap();
    assert_eq!(detail.job.state, JobState::Running, "the hedge still runs");
    assert_eq!(
        store.commit(&hedge, &response("hedge")).await.unwrap(),
        CommitOutcome::Committed,
        "the hedge's answer, already paid for, was superseded"
    );
    let after = store.job(job.id).await.unwrap().unwrap();
    assert_eq!(after.completed_by, Some(hedge.id));
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

/// The same for an answer too large to be held in the job's row (over
/// `INLINE_ANSWER`, read only by `Records::response`): the retry compares
/// the answer kept in the store, and is told it committed; another answer
/// of the same size is still told it lost. Before, the job's row read
/// without the answer was never compared, and a large answer whose commit
/// reply was lost was told it lost: a stream of it was cut for every
/// reader though it had committed (docs/design.md §7, "A commit whose
/// reply was lost").
pub async fn a_large_commit_retried_after_it_landed_is_told_it_committed(store: Arc<dyn Store>) {
    let large = |fill: u8| {
        let mut answer = response("large");
        answer.body = Bytes::from(vec![fill; idemgate_domain::job::INLINE_ANSWER + 44 * 1024]);
        answer
    };
    let (job, attempt) = created(store.as_ref(), "landed-large").await;
    for _ in 0..2 {
        assert_eq!(
            store.commit(&attempt, &large(b'a')).await.unwrap(),
            CommitOutcome::Committed
        );
    }
    assert_eq!(
        store.commit(&attempt, &large(b'b')).await.unwrap(),
        CommitOutcome::Superseded
    );
    let after = store.job_detail(job.id).await.unwrap().unwrap();
    assert_eq!(after.job.version, job.version + 1, "written once");
    assert_eq!(
        store.response(job.id).await.unwrap(),
        Some(large(b'a')),
        "the first answer kept"
    );
}

/// A commit retried after its first try landed (the reply was lost with
/// the connection) meets its own commit: told it committed, not that it
/// lost, and the job is left as the first try wrote it; so does the late
/// answer of an attempt recorded `unknown`, which still carries that
/// record's detail (told it lost, a stream's readers would get a cut body
/// of the job's committed answer). The same attempt with another answer,
/// or with its own answer after an operator or a lookup settled it with
/// the same bytes, is still told it lost (docs/design.md §7, "A commit
/// whose reply was lost").
pub async fn a_commit_retried_after_it_landed_is_told_it_committed(store: Arc<dyn Store>) {
    let (job, attempt) = created(store.as_ref(), "landed").await;
    let answer = response("landed");
    for _ in 0..2 {
        assert_eq!(
            store.commit(&attempt, &answer).await.unwrap(),
            CommitOutcome::Committed
        );
    }
    assert_eq!(
        store.commit(&attempt, &response("another")).await.unwrap(),
        CommitOutcome::Superseded
    );
    let after = store.job_detail(job.id).await.unwrap().unwrap();
    assert_eq!(after.job.state, JobState::Completed);
    assert_eq!(after.job.version, job.version + 1, "written once");
    assert_eq!(after.job.response, Some(answer));
    assert_eq!(after.attempts[0].state, AttemptState::Succeeded);

    // An operator's answer, byte for byte the attempt's own: the attempt
    // did not commit it, so its late commit is still told it lost (and
    // not counted as a second end).
    let (_, settled) = created(store.as_ref(), "resolved-alike").await;
    let alike = response("alike");
    store
        .resolve_attempt(settled.id, Resolution::Succeeded(alike.clone()))
        .await
        .unwrap();
    assert_eq!(
        store.commit(&settled, &alike).await.unwrap(),
        CommitOutcome::Superseded
    );

    let silent = || AttemptFailure::Unknown {
        detail: "silent past the head timeout".into(),
    };
    let (_, late) = created(store.as_ref(), "late").await;
    store.fail_attempt(late.id, silent()).await.unwrap();
    let answer = response("late");
    for _ in 0..2 {
        let outcome = store.commit(&late, &answer).await.unwrap();
        assert_eq!(
            outcome,
            CommitOutcome::Committed,
            "an unknown's late answer"
        );
    }
    // A lookup's answer, byte for byte the attempt's own: not its commit.
    let (_, looked_up) = created(store.as_ref(), "reconciled-alike").await;
    store.fail_attempt(looked_up.id, silent()).await.unwrap();
    let found = response("found");
    store
        .reconcile_attempt(looked_up.id, Resolution::Succeeded(found.clone()))
        .await
        .unwrap();
    assert_eq!(
        store.commit(&looked_up, &found).await.unwrap(),
        CommitOutcome::Superseded
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
