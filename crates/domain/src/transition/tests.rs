//! Every operation against every job state and every attempt state,
//! including the ones that must be refused.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use uuid::Uuid;

use super::*;
use AttemptState::*;

const ALL_ATTEMPT_STATES: [AttemptState; 7] = [
    Started, Succeeded, Failed, Unknown, Cancelled, Superseded, Rejected,
];

fn now() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000)
}

fn new_attempt() -> NewAttempt {
    NewAttempt {
        id: AttemptId::new(),
        upstream: "primary".into(),
        instance: Uuid::nil(),
        lease: Duration::from_secs(30),
        deadline: Duration::from_secs(300),
    }
}

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("x".into(), Bytes::from_static(b"1"))],
        body: Bytes::from_static(b"ok"),
    }
}

/// A consistent job over attempts in `states` (all started under version 1,
/// leases lapsed when `lapsed`): completed by its succeeded attempt if it has
/// one, otherwise in the state derived from its attempts.
fn snapshot(states: &[AttemptState], lapsed: bool) -> Snapshot {
    let lease = if lapsed {
        now() - Duration::from_secs(1)
    } else {
        now() + Duration::from_secs(30)
    };
    let attempts: Vec<AttemptHead> = states
        .iter()
        .enumerate()
        .map(|(i, &state)| AttemptHead {
            id: AttemptId(Uuid::from_u128(i as u128 + 1)),
            number: i as i32 + 1,
            state,
            job_version: 1,
            lease_expires_at: lease,
        })
        .collect();
    let winner = attempts.iter().find(|a| a.state == Succeeded).map(|a| a.id);
    let state = match winner {
        Some(_) => JobState::Completed,
        None => JobState::derive(states.iter().copied()),
    };
    Snapshot {
        job: JobHead {
            id: JobId(Uuid::from_u128(99)),
            state,
            version: if winner.is_some() { 2 } else { 1 },
            attempt_count: states.len() as i32,
            completed_by: winner,
        },
        attempts,
    }
}

/// Every consistent job with one or two attempts (at most one succeeded).
fn every_snapshot() -> Vec<Snapshot> {
    let mut out = Vec::new();
    for a in ALL_ATTEMPT_STATES {
        out.push(snapshot(&[a], false));
        out.push(snapshot(&[a], true));
        for b in ALL_ATTEMPT_STATES {
            if a == Succeeded && b == Succeeded {
                continue;
            }
            out.push(snapshot(&[a, b], false));
            out.push(snapshot(&[a, b], true));
        }
    }
    out
}

fn first(s: &Snapshot) -> AttemptId {
    s.attempts[0].id
}

/// What must hold after any change: the job's state agrees with its
/// attempts, moved only along an allowed transition, and a completed job
/// names exactly one succeeded attempt.
fn assert_sound(s: &Snapshot, change: &Change) {
    let states: Vec<AttemptState> = s
        .attempts
        .iter()
        .map(|a| {
            change
                .settled
                .iter()
                .find(|x| x.attempt == a.id)
                .map_or(a.state, |x| x.state)
        })
        .chain(change.started.as_ref().map(|_| Started))
        .collect();
    assert!(
        change.before == change.job.state || change.before.can_become(change.job.state),
        "{:?} -> {:?}",
        change.before,
        change.job.state
    );
    let winners = states.iter().filter(|s| **s == Succeeded).count();
    if change.job.state == JobState::Completed {
        assert_eq!(winners, 1, "a completed job has exactly one winner");
        assert!(change.job.completed_by.is_some());
    } else {
        assert_eq!(winners, 0);
        assert_eq!(change.job.state, JobState::derive(states.iter().copied()));
    }
    for settled in &change.settled {
        let was = s.attempts.iter().find(|a| a.id == settled.attempt).unwrap();
        assert!(
            was.state.can_become(settled.state),
            "attempt {:?} -> {:?}",
            was.state,
            settled.state
        );
    }
}

#[test]
fn claim_applies_only_to_an_open_job_at_its_version() {
    for s in every_snapshot() {
        let result = claim(&s, s.job.version, new_attempt());
        if s.job.state == JobState::Open {
            let change = result.unwrap();
            assert_sound(&s, &change);
            assert_eq!(change.job.state, JobState::Running);
            assert_eq!(
                change.job.version,
                s.job.version + 1,
                "a claim moves the version"
            );
            let started = change.started.unwrap();
            assert_eq!(started.number, s.job.attempt_count + 1);
            assert_eq!(started.job_version, s.job.version + 1);
        } else {
            assert!(
                matches!(result, Err(Refusal::JobIs { .. })),
                "{:?}",
                s.job.state
            );
        }
        assert!(matches!(
            claim(&s, s.job.version - 1, new_attempt()),
            Err(Refusal::Stale { .. })
        ));
    }
}

#[test]
fn hedge_joins_a_running_or_unknown_job_without_moving_the_version() {
    for s in every_snapshot() {
        let result = hedge(&s, s.job.version, new_attempt());
        match s.job.state {
            JobState::Running | JobState::Unknown => {
                let change = result.unwrap();
                assert_sound(&s, &change);
                assert_eq!(change.job.version, s.job.version);
                // An attempt in flight makes the job running.
                assert_eq!(change.job.state, JobState::Running);
                assert_eq!(change.started.unwrap().job_version, s.job.version);
            }
            JobState::Open | JobState::Completed => {
                assert!(matches!(result, Err(Refusal::JobIs { .. })))
            }
        }
        assert!(matches!(
            hedge(&s, s.job.version + 1, new_attempt()),
            Err(Refusal::Stale { .. })
        ));
    }
}

#[test]
fn move_on_starts_one_attempt_beside_an_unknown_one_and_only_then() {
    for s in every_snapshot() {
        let result = move_on(&s, s.job.version, new_attempt());
        if s.job.state == JobState::Unknown {
            let change = result.unwrap();
            assert_sound(&s, &change);
            assert_eq!(
                change.job.version, s.job.version,
                "the late answer may commit"
            );
            assert_eq!(change.job.state, JobState::Running);
            assert_eq!(change.job.attempt_count, s.job.attempt_count + 1);
        } else {
            assert!(matches!(result, Err(Refusal::JobIs { .. })), "{s:?}");
        }
        assert!(matches!(
            move_on(&s, s.job.version - 1, new_attempt()),
            Err(Refusal::Stale { .. })
        ));
    }
}

/// Two duplicates that read the job `unknown` at once: the second finds the
/// first's attempt in flight, and is refused.
#[test]
fn of_two_duplicates_moving_on_only_one_starts_an_attempt() {
    let s = snapshot(&[Unknown], false);
    let first = move_on(&s, s.job.version, new_attempt()).unwrap();
    let after = snapshot(&[Unknown, Started], false);
    assert_eq!(after.job.state, first.job.state);
    assert!(matches!(
        move_on(&after, s.job.version, new_attempt()),
        Err(Refusal::JobIs { .. })
    ));
}

#[test]
fn commit_wins_only_for_an_unsettled_attempt_of_an_uncompleted_job() {
    for s in every_snapshot() {
        for attempt in &s.attempts {
            let change = commit(&s, attempt.id, &response()).unwrap();
            assert_sound(&s, &change);
            let should_win = attempt.state.is_unsettled() && s.job.completed_by.is_none();
            assert_eq!(change.commits(attempt.id), should_win, "{s:?} {attempt:?}");
            if should_win {
                assert_eq!(change.job.state, JobState::Completed);
                assert_eq!(change.job.version, s.job.version + 1);
            } else {
                assert_eq!(change.job.version, s.job.version);
                assert_eq!(change.job.completed_by, s.job.completed_by);
                let expected: Vec<_> = if attempt.state.is_unsettled() {
                    vec![Superseded]
                } else {
                    vec![]
                };
                assert_eq!(
                    change.settled.iter().map(|x| x.state).collect::<Vec<_>>(),
                    expected,
                    "a loser is superseded; a settled attempt is left alone"
                );
            }
        }
    }
}

#[test]
fn commit_under_a_moved_version_loses() {
    let mut s = snapshot(&[Unknown], false);
    s.job.version = 2; // an operator resolved, then reopened and the job ran on
    let change = commit(&s, first(&s), &response()).unwrap();
    assert!(!change.commits(first(&s)));
    assert_eq!(change.settled[0].state, Superseded);
}

#[test]
fn settle_moves_each_attempt_state_as_the_table_says() {
    let failures = [
        AttemptFailure::Failed {
            status: Some(503),
            detail: "retryable".into(),
        },
        AttemptFailure::Unknown {
            detail: "timeout".into(),
        },
        AttemptFailure::Rejected {
            status: 200,
            detail: "contract".into(),
        },
        AttemptFailure::Superseded {
            detail: "lost".into(),
        },
    ];
    for s in every_snapshot() {
        for attempt in &s.attempts {
            for failure in &failures {
                let result = settle(&s, attempt.id, failure);
                let allowed = match failure {
                    AttemptFailure::Unknown { .. } => attempt.state == Started,
                    _ => matches!(attempt.state, Started | Unknown),
                };
                match result {
                    Ok(change) => {
                        assert!(allowed, "{:?} from {:?}", failure.state(), attempt.state);
                        assert_sound(&s, &change);
                        assert_eq!(
                            change.job.version, s.job.version,
                            "settling keeps the version"
                        );
                    }
                    Err(Refusal::AttemptIs { state, .. }) => {
                        assert!(!allowed);
                        assert_eq!(state, attempt.state);
                    }
                    Err(other) => panic!("unexpected refusal {other}"),
                }
            }
        }
    }
}

#[test]
fn evidence_of_a_safe_failure_reopens_a_job_a_lapsed_lease_made_unknown() {
    let s = snapshot(&[Unknown], true);
    assert_eq!(s.job.state, JobState::Unknown);
    let change = settle(
        &s,
        first(&s),
        &AttemptFailure::Failed {
            status: Some(503),
            detail: "503".into(),
        },
    )
    .unwrap();
    assert_eq!(change.job.state, JobState::Open);
}

#[test]
fn a_failed_hedge_beside_an_unknown_attempt_keeps_the_job_blocked() {
    let s = snapshot(&[Unknown, Started], false);
    let change = settle(
        &s,
        s.attempts[1].id,
        &AttemptFailure::Failed {
            status: None,
            detail: "refused".into(),
        },
    )
    .unwrap();
    assert_eq!(change.job.state, JobState::Unknown);
}

#[test]
fn resolve_applies_to_unsettled_attempts_and_moves_the_version() {
    let resolutions = [
        Resolution::Failed,
        Resolution::Cancelled,
        Resolution::Succeeded(response()),
    ];
    for s in every_snapshot() {
        for attempt in &s.attempts {
            for resolution in &resolutions {
                let result = resolve(&s, attempt.id, resolution);
                if !attempt.state.is_unsettled() {
                    assert!(matches!(result, Err(Refusal::AttemptIs { .. })));
                    continue;
                }
                if matches!(resolution, Resolution::Succeeded(_))
                    && s.job.state == JobState::Completed
                {
                    assert!(matches!(result, Err(Refusal::JobIs { .. })));
                    continue;
                }
                let change = result.unwrap();
                assert_sound(&s, &change);
                assert_eq!(change.settled[0].state, resolution.state());
                let sibling_unsettled = s
                    .attempts
                    .iter()
                    .any(|a| a.id != attempt.id && a.state.is_unsettled());
                let decides = matches!(resolution, Resolution::Succeeded(_)) || !sibling_unsettled;
                if s.job.state == JobState::Completed || !decides {
                    assert_eq!(change.job.version, s.job.version);
                } else {
                    assert_eq!(change.job.version, s.job.version + 1);
                }
                // The attempt's own late answer no longer commits.
                let late = commit(&applied(&s, &change), attempt.id, &response()).unwrap();
                assert!(late.response.is_none(), "{s:?} {resolution:?}");
            }
        }
    }
}

/// `s` with `change` written, as a store writes it.
fn applied(s: &Snapshot, change: &Change) -> Snapshot {
    let mut after = s.clone();
    after.job.state = change.job.state;
    after.job.version = change.job.version;
    after.job.attempt_count = change.job.attempt_count;
    after.job.completed_by = change.job.completed_by;
    for settle in &change.settled {
        if let Some(a) = after.attempts.iter_mut().find(|a| a.id == settle.attempt) {
            a.state = settle.state;
        }
    }
    after
}

/// An unknown attempt resolved `failed` or `cancelled` (by an operator, or
/// a lookup's "no effect") beside a sibling that still runs or is unknown
/// itself (a hedge, a failover past it) leaves the version: the sibling's
/// answer still commits. Moving it superseded that answer, already paid
/// for, and the request called the upstream a third time.
#[test]
fn a_failed_resolution_leaves_a_siblings_answer_free_to_commit() {
    for sibling in [Started, Unknown] {
        for resolution in [Resolution::Failed, Resolution::Cancelled] {
            let s = snapshot(&[Unknown, sibling], false);
            let (unknown, other) = (s.attempts[0].id, s.attempts[1].id);
            let after = applied(&s, &resolve(&s, unknown, &resolution).unwrap());
            let change = commit(&after, other, &response()).unwrap();
            assert_eq!(
                (change.job.state, change.job.completed_by),
                (JobState::Completed, Some(other)),
                "{sibling:?} beside {resolution:?}"
            );
        }
    }
}

#[test]
fn reconcile_settles_only_an_unknown_attempt_as_a_resolution_would() {
    let resolutions = [Resolution::Failed, Resolution::Succeeded(response())];
    for s in every_snapshot() {
        for attempt in &s.attempts {
            for resolution in &resolutions {
                let result = reconcile(&s, attempt.id, resolution);
                if attempt.state != Unknown {
                    assert!(matches!(result, Err(Refusal::AttemptIs { .. })));
                    continue;
                }
                if matches!(resolution, Resolution::Succeeded(_))
                    && s.job.state == JobState::Completed
                {
                    assert!(matches!(result, Err(Refusal::JobIs { .. })));
                    continue;
                }
                let change = result.unwrap();
                assert_sound(&s, &change);
                assert_eq!(change.settled[0].state, resolution.state());
                assert!(change.settled[0]
                    .detail
                    .as_deref()
                    .unwrap()
                    .starts_with("reconciled"));
                if matches!(resolution, Resolution::Succeeded(_)) {
                    assert!(change.commits(attempt.id));
                }
                if s.job.state != JobState::Completed {
                    let moves = decides_who_commits(&s, attempt.id, resolution);
                    assert_eq!(change.job.version, s.job.version + i64::from(moves));
                }
            }
        }
    }
}

#[test]
fn expire_turns_only_lapsed_started_attempts_unknown() {
    for s in every_snapshot() {
        let lapsed: Vec<AttemptId> = s
            .attempts
            .iter()
            .filter(|a| a.state == Started && a.lease_expires_at < now())
            .map(|a| a.id)
            .collect();
        match expire(&s, now()) {
            None => assert!(lapsed.is_empty()),
            Some(result) => {
                let change = result.unwrap();
                assert_sound(&s, &change);
                assert_eq!(
                    change.settled.iter().map(|x| x.attempt).collect::<Vec<_>>(),
                    lapsed
                );
                if s.job.state != JobState::Completed {
                    assert_eq!(change.job.state, JobState::Unknown);
                }
            }
        }
    }
}

#[test]
fn an_unknown_attempt_blocks_until_evidence_or_resolution() {
    let s = snapshot(&[Unknown], false);
    assert!(claim(&s, s.job.version, new_attempt()).is_err());
    let change = resolve(&s, first(&s), &Resolution::Failed).unwrap();
    assert_eq!(change.job.state, JobState::Open);
}

#[test]
fn operations_on_a_foreign_attempt_are_refused() {
    let s = snapshot(&[Started], false);
    let stranger = AttemptId::new();
    assert_eq!(
        commit(&s, stranger, &response()),
        Err(Refusal::NoSuchAttempt(stranger))
    );
    assert_eq!(
        resolve(&s, stranger, &Resolution::Failed),
        Err(Refusal::NoSuchAttempt(stranger))
    );
}

/// Issue 38: an operator's answer is the operator's, never an upstream
/// status; a lookup's answer is the upstream's.
#[test]
fn an_operators_answer_is_recorded_as_theirs_and_a_lookups_as_the_upstreams() {
    let s = snapshot(&[Unknown], false);
    let typed = Resolution::Succeeded(response());
    let by_hand = resolve_as(&s, first(&s), &typed, "alice (admin token)").unwrap();
    assert_eq!(by_hand.settled[0].status, None);
    assert_eq!(
        by_hand.settled[0].resolved_by.as_deref(),
        Some("alice (admin token)")
    );
    let failed = resolve_as(&s, first(&s), &Resolution::Failed, "console session").unwrap();
    assert_eq!(
        failed.settled[0].resolved_by.as_deref(),
        Some("console session")
    );
    let looked_up = reconcile(&s, first(&s), &typed).unwrap();
    assert_eq!(looked_up.settled[0].status, Some(response().status));
    assert_eq!(looked_up.settled[0].resolved_by, None);
}
