//! The dispatch decisions, one event at a time, with paused time: no store,
//! no sockets.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use uuid::Uuid;

use super::*;
use crate::testing;
use idemgate_domain::attempt::AttemptState;
use idemgate_domain::id::JobId;
use idemgate_proxy::upstream::UpstreamError;

/// `upstreams = ["http://a:1", "http://b:1", "http://c:1"]`, one route.
fn three_upstreams() -> Arc<Route> {
    testing::route(&["http://a:1", "http://b:1", "http://c:1"], |_| {})
}

fn attempt(number: i32, version: i64) -> Attempt {
    Attempt {
        id: AttemptId::new(),
        job_id: JobId(Uuid::nil()),
        number,
        upstream: "a".into(),
        state: AttemptState::Started,
        job_version: version,
        started_at: SystemTime::now(),
        finished_at: None,
        lease_expires_at: SystemTime::now(),
        deadline_at: SystemTime::now(),
        upstream_status: None,
        detail: None,
        lookups: Default::default(),
        resolved_by: None,
    }
}

fn refused() -> Reply {
    Reply::Failed(Uncommitted::Error(
        UpstreamError::Refused("connection refused".into()).into(),
    ))
}

fn timed_out() -> Reply {
    Reply::Unknown(UpstreamError::TimedOut(Duration::from_secs(1)).into())
}

fn stored(tag: &str) -> StoredResponse {
    StoredResponse {
        status: 200,
        headers: vec![],
        body: Bytes::from(tag.to_owned()),
    }
}

fn all(_: &UpstreamSettings) -> bool {
    true
}

fn dispatch(route: Arc<Route>) -> (Dispatch, Attempt) {
    let first = attempt(1, 1);
    let d = Dispatch::new(route, &first, Instant::now(), Duration::from_secs(1));
    (d, first)
}

fn claim_target(steps: &[Step]) -> (String, Joining, i64) {
    match steps {
        [Step::Claim {
            target,
            how,
            version,
        }] => (target.name().to_owned(), *how, *version),
        other => panic!("expected one claim, got {other:?}"),
    }
}

fn answer_status(steps: Vec<Step>) -> u16 {
    match steps.as_slice() {
        [Step::Answer(Ok(response))] => response.status().as_u16(),
        [Step::Answer(Err(e))] => e.status().as_u16(),
        other => panic!("expected an answer, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_safe_failure_fails_over_to_the_next_upstream_in_order() {
    let (mut d, first) = dispatch(three_upstreams());
    let steps = d.on(Event::Replied(first.id, refused()), Instant::now(), &all);
    assert_eq!(
        claim_target(&steps),
        ("fallback-1".into(), Joining::Claim, 1)
    );
    let second = attempt(2, 2);
    let steps = d.on(
        Event::Claimed(
            Joining::Claim,
            three_upstreams().fallbacks[0].clone(),
            Ok(Some(second.clone())),
        ),
        Instant::now(),
        &all,
    );
    assert!(steps.is_empty(), "wait for the new attempt");
    let steps = d.on(Event::Replied(second.id, refused()), Instant::now(), &all);
    assert_eq!(
        claim_target(&steps),
        ("fallback-2".into(), Joining::Claim, 2),
        "the next claim is a CAS on the version the last claim made"
    );
}

#[tokio::test(start_paused = true)]
async fn ineligible_upstreams_are_skipped_and_running_out_answers_the_last_failure() {
    let (mut d, first) = dispatch(three_upstreams());
    let none = |_: &UpstreamSettings| false;
    let steps = d.on(Event::Replied(first.id, refused()), Instant::now(), &none);
    assert_eq!(answer_status(steps), 502);
}

#[tokio::test(start_paused = true)]
async fn max_attempts_and_the_failover_deadline_stop_failover() {
    let one = testing::route(&["http://a:1", "http://b:1", "http://c:1"], |r| {
        r.max_attempts = 1
    });
    let (mut d, first) = dispatch(one);
    let steps = d.on(Event::Replied(first.id, refused()), Instant::now(), &all);
    assert_eq!(answer_status(steps), 502);

    let (mut d, first) = dispatch(three_upstreams());
    tokio::time::advance(Duration::from_secs(61)).await;
    let steps = d.on(Event::Replied(first.id, refused()), Instant::now(), &all);
    assert_eq!(answer_status(steps), 502, "past failover_deadline (60s)");
}

#[tokio::test(start_paused = true)]
async fn an_unknown_outcome_never_fails_over_on_a_route_with_side_effects() {
    let (mut d, first) = dispatch(three_upstreams());
    let steps = d.on(Event::Replied(first.id, timed_out()), Instant::now(), &all);
    assert_eq!(answer_status(steps), 504);
}

#[tokio::test(start_paused = true)]
async fn an_unknown_outcome_on_a_side_effect_free_route_is_followed_by_a_hedged_attempt() {
    let (mut d, first) = dispatch(testing::hedged());
    let steps = d.on(Event::Replied(first.id, timed_out()), Instant::now(), &all);
    assert_eq!(
        claim_target(&steps),
        ("fallback-1".into(), Joining::Hedge, 1),
        "joins beside the unknown attempt, keeping its version"
    );
}

/// The hedge past an unknown attempt, with nothing else running, that the
/// job no longer takes (the unknown attempt's late answer committed, or an
/// operator or a lookup settled it, and the version moved): the request
/// reads the job and decides afresh (a committed answer is replayed).
/// Before, it hedged again at once on the same version, refused again, in
/// a loop of store calls until the failover deadline, and then answered
/// the unknown attempt's error instead of the job's answer.
#[tokio::test(start_paused = true)]
async fn a_hedge_refused_past_an_unknown_attempt_reads_the_job_again() {
    let (mut d, first) = dispatch(testing::hedged());
    let steps = d.on(Event::Replied(first.id, timed_out()), Instant::now(), &all);
    assert_eq!(claim_target(&steps).1, Joining::Hedge);
    let target = testing::hedged().fallbacks[0].clone();
    let steps = d.on(
        Event::Claimed(Joining::Hedge, target, Ok(None)),
        Instant::now(),
        &all,
    );
    assert!(matches!(steps.as_slice(), [Step::Hold]), "{steps:?}");
}

#[tokio::test(start_paused = true)]
async fn hedging_starts_a_second_attempt_once_and_the_first_commit_wins() {
    let (mut d, first) = dispatch(testing::hedged());
    assert!(d.hedge_armed());
    let steps = d.on(Event::HedgeDue, Instant::now(), &all);
    let (name, how, _) = claim_target(&steps);
    assert_eq!((name.as_str(), how), ("fallback-1", Joining::Hedge));
    assert!(!d.hedge_armed(), "one hedge per request");
    let hedge = attempt(2, 1);
    let target = testing::hedged().fallbacks[0].clone();
    assert!(d
        .on(
            Event::Claimed(Joining::Hedge, target, Ok(Some(hedge.clone()))),
            Instant::now(),
            &all
        )
        .is_empty());
    let steps = d.on(
        Event::Replied(hedge.id, Reply::Committed(stored("hedge"))),
        Instant::now(),
        &all,
    );
    match steps.as_slice() {
        [Step::CancelAllBut(winner), Step::Committed(s)] => {
            assert_eq!(*winner, hedge.id);
            assert_eq!(s.body, "hedge");
        }
        other => panic!("{other:?}"),
    }
    let _ = first;
}

/// The hedge timer starts one more attempt beside the first, not a third:
/// not once a hedge already races beside an unknown attempt, and not past
/// the failover deadline. Before, the timer fired with the hedge running
/// (one attempt running, as it checked) and started another.
#[tokio::test(start_paused = true)]
async fn the_hedge_timer_never_starts_a_third_call_nor_one_past_the_deadline() {
    let route = testing::route(&["http://a:1", "http://b:1", "http://c:1"], |r| {
        r.side_effect_free = true;
        r.hedge_after = Some(Duration::from_millis(500));
    });
    let (mut d, first) = dispatch(route.clone());
    let steps = d.on(Event::Replied(first.id, timed_out()), Instant::now(), &all);
    let (_, how, _) = claim_target(&steps);
    assert_eq!(how, Joining::Hedge);
    let target = route.fallbacks[0].clone();
    let claimed = Event::Claimed(Joining::Hedge, target, Ok(Some(attempt(2, 1))));
    assert!(d.on(claimed, Instant::now(), &all).is_empty());
    assert!(!d.hedge_armed(), "the hedge is spent");
    assert!(d.on(Event::HedgeDue, Instant::now(), &all).is_empty());

    let (mut d, _) = dispatch(route);
    tokio::time::advance(Duration::from_secs(3600)).await;
    let steps = d.on(Event::HedgeDue, Instant::now(), &all);
    assert!(steps.is_empty(), "past the failover deadline: {steps:?}");
}

#[tokio::test(start_paused = true)]
async fn a_store_error_claiming_a_hedge_keeps_waiting_for_the_running_attempt() {
    let (mut d, first) = dispatch(testing::hedged());
    let steps = d.on(Event::HedgeDue, Instant::now(), &all);
    let (_, how, _) = claim_target(&steps);
    let target = testing::hedged().fallbacks[0].clone();
    let steps = d.on(
        Event::Claimed(how, target, Err(StoreError::Unavailable("down".into()))),
        Instant::now(),
        &all,
    );
    assert!(
        steps.is_empty(),
        "the primary is still running: wait for it"
    );
    let steps = d.on(
        Event::Replied(first.id, Reply::Committed(stored("primary"))),
        Instant::now(),
        &all,
    );
    assert!(
        matches!(steps.as_slice(), [Step::CancelAllBut(_), Step::Committed(s)] if s.body == "primary")
    );
}

#[tokio::test(start_paused = true)]
async fn a_store_error_claiming_a_failover_answers_with_what_the_upstream_said() {
    let (mut d, first) = dispatch(three_upstreams());
    let steps = d.on(Event::Replied(first.id, refused()), Instant::now(), &all);
    let (_, how, _) = claim_target(&steps);
    let target = three_upstreams().fallbacks[0].clone();
    let steps = d.on(
        Event::Claimed(how, target, Err(StoreError::Unavailable("down".into()))),
        Instant::now(),
        &all,
    );
    assert_eq!(
        answer_status(steps),
        502,
        "the safe failure, which a retry may follow"
    );
}

#[tokio::test(start_paused = true)]
async fn a_failover_claim_someone_else_beat_waits_like_a_duplicate() {
    let (mut d, first) = dispatch(three_upstreams());
    let steps = d.on(Event::Replied(first.id, refused()), Instant::now(), &all);
    let (_, how, _) = claim_target(&steps);
    let target = three_upstreams().fallbacks[0].clone();
    let steps = d.on(Event::Claimed(how, target, Ok(None)), Instant::now(), &all);
    assert!(matches!(steps.as_slice(), [Step::Hold]));
    // The hold ends on the winner's stream: join it, once. A job still
    // running after that (the stream gone before it was joined) is
    // answered with this request's own failure, not joined again.
    let running = || Job {
        id: first.job_id,
        owner: idemgate_domain::key::Owner::anonymous(),
        key: idemgate_domain::key::IdempotencyKey::new("k").unwrap(),
        fingerprint: idemgate_domain::fingerprint::Fingerprint([0; 32]),
        route: "route-0".into(),
        state: JobState::Running,
        version: 3,
        attempt_count: 2,
        completed_by: None,
        response: None,
        response_in_store: None,
        created_at: SystemTime::now(),
        expires_at: SystemTime::now(),
    };
    let steps = d.on(Event::Held(Ok(running())), Instant::now(), &all);
    assert!(matches!(steps.as_slice(), [Step::Join(_)]), "{steps:?}");
    let steps = d.on(Event::Held(Ok(running())), Instant::now(), &all);
    assert_eq!(answer_status(steps), 502, "its own failure");
}

#[tokio::test(start_paused = true)]
async fn a_hedge_refused_after_the_primary_failed_fails_over_to_the_same_upstream() {
    let (mut d, first) = dispatch(testing::hedged());
    let steps = d.on(Event::HedgeDue, Instant::now(), &all);
    let (hedge_target, _, _) = claim_target(&steps);
    // The primary fails while the hedge is being claimed…
    assert!(d
        .on(Event::Replied(first.id, refused()), Instant::now(), &all)
        .is_empty());
    // …so the job reopened and no longer takes a hedge: claim it instead.
    let target = testing::hedged().fallbacks[0].clone();
    let steps = d.on(
        Event::Claimed(Joining::Hedge, target, Ok(None)),
        Instant::now(),
        &all,
    );
    assert_eq!(claim_target(&steps), (hedge_target, Joining::Claim, 1));
}

#[tokio::test(start_paused = true)]
async fn a_lost_race_with_nothing_else_running_reads_the_winner() {
    let (mut d, first) = dispatch(three_upstreams());
    let steps = d.on(
        Event::Replied(first.id, Reply::Superseded),
        Instant::now(),
        &all,
    );
    assert!(matches!(steps.as_slice(), [Step::Reread]));
}

/// A hedge refused because the job moved on (an operator settled the
/// first attempt meanwhile, and its late commit lost), with nothing of
/// ours failed: the job is read, not answered with a failure nobody had.
/// Each of the three ways on answered 500: the hedge's upstream claimed
/// again (then refused, and held for an open job), none eligible any
/// more, the failover deadline passed.
#[tokio::test(start_paused = true)]
async fn a_hedge_refused_after_our_attempt_lost_its_commit_reads_the_job() {
    fn none(_: &UpstreamSettings) -> bool {
        false
    }
    /// Whether any upstream is eligible then, and the seconds passed.
    type Way = (fn(&UpstreamSettings) -> bool, u64);
    let ways: [Way; 3] = [(all, 0), (none, 0), (all, 3600)];
    for (eligible, later) in ways {
        let (mut d, first) = dispatch(testing::hedged());
        let steps = d.on(Event::HedgeDue, Instant::now(), &all);
        assert_eq!(claim_target(&steps).1, Joining::Hedge);
        let steps = d.on(
            Event::Replied(first.id, Reply::Superseded),
            Instant::now(),
            &all,
        );
        assert!(steps.is_empty(), "the hedge's claim is out: {steps:?}");
        tokio::time::advance(Duration::from_secs(later)).await;
        let target = testing::hedged().fallbacks[0].clone();
        let steps = d.on(
            Event::Claimed(Joining::Hedge, target, Ok(None)),
            Instant::now(),
            &eligible,
        );
        assert!(matches!(steps.as_slice(), [Step::Reread]), "{steps:?}");
    }
}

/// A hedge whose claim the store failed was not tried: when the running
/// attempt then fails safely, the failover takes that upstream, not the
/// one after it (nor none).
#[tokio::test(start_paused = true)]
async fn a_hedge_the_store_failed_to_claim_leaves_its_upstream_to_the_failover() {
    let (mut d, first) = dispatch(testing::hedged());
    let (target, how, _) = claim_target(&d.on(Event::HedgeDue, Instant::now(), &all));
    let upstream = testing::hedged().fallbacks[0].clone();
    let error = Err(StoreError::Unavailable("down".into()));
    assert!(d
        .on(Event::Claimed(how, upstream, error), Instant::now(), &all)
        .is_empty());
    let steps = d.on(Event::Replied(first.id, refused()), Instant::now(), &all);
    assert_eq!(claim_target(&steps), (target, Joining::Claim, 1));
}
