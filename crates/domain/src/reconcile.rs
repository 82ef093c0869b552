//! Reconciling an attempt of unknown outcome by asking its upstream
//! (`docs/design.md` §5, "Unknown attempts are looked up").
//!
//! A route with `[routes.reconcile]` names a lookup path on its upstream.
//! When an attempt becomes `unknown`, the gateway asks that path what became
//! of the job, and this module decides, from the answer alone, what the
//! answer means ([`verdict`]) and when to ask again ([`backoff`]). No I/O.

use std::fmt;
use std::time::{Duration, SystemTime};

/// What one lookup's answer means for the attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LookupResult {
    /// `2xx`: the attempt took effect; the lookup's answer is the job's
    /// result, committed by the same CAS as an operator's resolution.
    SettledSucceeded,
    /// `404`/`410`: the upstream never acted on the job; the attempt had no
    /// effect and the job reopens.
    SettledNoEffect,
    /// Any other status: the upstream does not know yet; asked again.
    StillUnknown,
    /// No answer (a timeout, a refused or broken connection, an answer too
    /// large to record): asked again.
    Error,
}

impl LookupResult {
    /// The name in storage, the admin API and the metric's `result` label.
    pub fn as_str(self) -> &'static str {
        match self {
            LookupResult::SettledSucceeded => "settled_succeeded",
            LookupResult::SettledNoEffect => "settled_no_effect",
            LookupResult::StillUnknown => "still_unknown",
            LookupResult::Error => "error",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "settled_succeeded" => LookupResult::SettledSucceeded,
            "settled_no_effect" => LookupResult::SettledNoEffect,
            "still_unknown" => LookupResult::StillUnknown,
            "error" => LookupResult::Error,
            _ => return None,
        })
    }

    /// Whether the lookup settles the attempt (no more lookups follow).
    pub fn settles(self) -> bool {
        matches!(
            self,
            LookupResult::SettledSucceeded | LookupResult::SettledNoEffect
        )
    }
}

impl fmt::Display for LookupResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the upstream's answer to a lookup means: `None` when it did not
/// answer (then [`LookupResult::Error`]).
pub fn verdict(status: Option<u16>) -> LookupResult {
    match status {
        None => LookupResult::Error,
        Some(200..=299) => LookupResult::SettledSucceeded,
        Some(404 | 410) => LookupResult::SettledNoEffect,
        Some(_) => LookupResult::StillUnknown,
    }
}

/// The first wait between two lookups.
pub const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// The longest wait between two lookups.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// How long to wait after the `n`th lookup (1, 2, …) before the next:
/// 1 s doubling, capped at 30 s. The first lookup is made at once.
pub fn backoff(n: u32) -> Duration {
    let doublings = n.saturating_sub(1).min(16);
    FIRST_BACKOFF
        .saturating_mul(1 << doublings)
        .min(MAX_BACKOFF)
}

/// How long a write of what was learned about an attempt (its answer's
/// commit above all) is retried at least, however near (or past) the
/// attempt's deadline it was learned: an answer that came a second before
/// the deadline is no less the attempt's, and the CAS that commits it is
/// as safe after the deadline as before (`docs/design.md` §5, "What the
/// gateway learned is written until the store takes it").
pub const WRITE_AT_LEAST: Duration = Duration::from_secs(60);

/// Past an attempt's recorded deadline, how long a replica that did not
/// start it still takes its call to be out (`docs/design.md` §5, "Not
/// while the call is out"): the replica that did gives the call up at
/// that deadline on its own clock, may then wait up to 2 s for its record
/// before it drops the call, may go on committing an answer that came by
/// then for [`WRITE_AT_LEAST`] (a "no record" must not settle the attempt
/// against it), and its timers may run late on a busy machine.
pub const CALL_OUT_GRACE: Duration = Duration::from_secs(WRITE_AT_LEAST.as_secs() + 5);

/// Whether `last`, a lookup of an attempt still unknown, found no record
/// of it while its call may have been out: asked once more as that call
/// ends, by the attempt's deadline and [`CALL_OUT_GRACE`].
pub fn held_back(last: &Lookup) -> bool {
    last.result == LookupResult::StillUnknown && matches!(last.status, Some(404 | 410))
}

/// How long until an unknown attempt is next asked about, as of `now`:
/// its next lookup ([`next_lookup`]), or past the lookups' schedule, the
/// one last ask of a "no record" held back while its call may have been
/// out ([`held_back`]), at `deadline_at` (the attempt's, as recorded) and
/// [`CALL_OUT_GRACE`], on a route that looks attempts up (`looks_up`).
/// What a duplicate's `Retry-After` and the admin view's `next_at` say.
pub fn next_ask(
    lookups: &Lookups,
    (started_at, deadline_at): (SystemTime, SystemTime),
    (deadline, looks_up): (Duration, bool),
    now: SystemTime,
) -> Option<Duration> {
    next_lookup(lookups, started_at, deadline, now).or_else(|| {
        // A resend's `404` is no lookup's "no record": never held back.
        let last = lookups
            .last
            .as_ref()
            .filter(|last| looks_up && held_back(last))?;
        let at = deadline_at + CALL_OUT_GRACE;
        (last.at < at).then(|| at.duration_since(now).unwrap_or(Duration::ZERO))
    })
}

/// How long until the next lookup of an unknown attempt that started at
/// `started_at` and may be looked up for `deadline` (`attempt_deadline`),
/// as of `now`: what a duplicate's `Retry-After` says. `None` once no
/// lookup is left (an operator must settle it). The first lookup is made
/// at once, so with none yet made the answer is now.
pub fn next_lookup(
    lookups: &Lookups,
    started_at: SystemTime,
    deadline: Duration,
    now: SystemTime,
) -> Option<Duration> {
    let ends = started_at + deadline;
    let next = match &lookups.last {
        None => now,
        Some(last) => last.at + backoff(lookups.count),
    };
    (next < ends && now < ends).then(|| next.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Whether nobody is asking about an unknown attempt any more (the
/// process that asked stopped): its next lookup (or, for a "no record"
/// held back, its one last ask at `deadline_at` and [`CALL_OUT_GRACE`],
/// whichever comes first) is overdue by a whole `interval` (a scan's), or,
/// with none made yet, it was already waiting for its first one a scan ago
/// (`first_awaited`); the process that makes an attempt unknown asks at
/// once. Then any replica may adopt it (`docs/design.md` §5). Never once
/// nothing is left to ask.
pub fn orphaned(
    lookups: &Lookups,
    first_awaited: bool,
    (interval, deadline_at): (Duration, SystemTime),
    now: SystemTime,
) -> bool {
    match &lookups.last {
        None => first_awaited,
        Some(last) => {
            let next = last.at + backoff(lookups.count);
            let last_ask = deadline_at + CALL_OUT_GRACE;
            let due = match held_back(last) {
                // The backoff's next lookup while the schedule lasts, else
                // the last ask (the grace outlasts any schedule's step).
                true if last.at < last_ask && next < deadline_at => next,
                true if last.at < last_ask => last_ask,
                _ if next < deadline_at => next,
                // Nothing is left to ask: nobody need adopt it.
                _ => return false,
            };
            now >= due + interval
        }
    }
}

/// The lookup path for `job`: the route's template with `{job}` replaced.
pub fn lookup_path(template: &str, job: &str) -> String {
    template.replace(JOB_PLACEHOLDER, job)
}

/// What a lookup path template must hold.
pub const JOB_PLACEHOLDER: &str = "{job}";

/// One lookup, as recorded on its attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    /// When the answer (or its absence) was known.
    pub at: SystemTime,
    /// The upstream's status, when it answered.
    pub status: Option<u16>,
    /// What it meant.
    pub result: LookupResult,
}

/// The lookups made for one attempt: how many, and the last.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lookups {
    /// How many were made.
    pub count: u32,
    /// The last one.
    pub last: Option<Lookup>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_lookup_follows_the_backoff_until_the_deadline() {
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let deadline = Duration::from_secs(60);
        let after = |s: u64| start + Duration::from_secs(s);
        let made = |count: u32, at: u64| Lookups {
            count,
            last: Some(Lookup {
                at: after(at),
                status: Some(500),
                result: LookupResult::StillUnknown,
            }),
        };
        let none = Lookups::default();
        assert_eq!(
            next_lookup(&none, start, deadline, after(1)),
            Some(Duration::ZERO)
        );
        // After the third lookup, at 10 s: the next waits 4 s.
        assert_eq!(
            next_lookup(&made(3, 10), start, deadline, after(11)),
            Some(Duration::from_secs(3))
        );
        // Capped at 30 s between lookups.
        assert_eq!(
            next_lookup(&made(9, 20), start, deadline, after(20)),
            Some(Duration::from_secs(30))
        );
        // None past the attempt's deadline, or when the next would be.
        assert_eq!(next_lookup(&made(9, 40), start, deadline, after(41)), None);
        assert_eq!(next_lookup(&none, start, deadline, after(61)), None);
    }

    /// Past the lookups' schedule, a "no record" held back is asked once
    /// more at the recorded deadline and the grace; a `500`, or a "no
    /// record" that proved no effect, is not.
    #[test]
    fn a_held_back_no_record_is_asked_once_more_past_the_deadline() {
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let (deadline, after) = (Duration::from_secs(60), |s: u64| {
            start + Duration::from_secs(s)
        });
        let recorded = (start, after(60));
        let last = |status, result| Lookups {
            count: 7,
            last: Some(Lookup {
                at: after(50),
                status: Some(status),
                result,
            }),
        };
        let held = last(404, LookupResult::StillUnknown);
        // Asked at the deadline (60 s) and the grace.
        let grace = CALL_OUT_GRACE.as_secs();
        assert_eq!(
            next_ask(&held, recorded, (deadline, true), after(61)),
            Some(Duration::from_secs(60 + grace - 61))
        );
        // Due and not yet made: due now; once made, none.
        assert_eq!(
            next_ask(&held, recorded, (deadline, true), after(60 + grace + 1)),
            Some(Duration::ZERO)
        );
        let made = Lookups {
            last: Some(Lookup {
                at: after(60 + grace + 1),
                ..held.last.clone().unwrap()
            }),
            ..held.clone()
        };
        let later = after(60 + grace + 2);
        assert_eq!(next_ask(&made, recorded, (deadline, true), later), None);
        assert!(!orphaned(
            &made,
            false,
            (Duration::from_secs(5), after(60)),
            after(60 + grace + 34)
        ));
        // A resend's `404` (a route that resends) promises no last ask.
        assert_eq!(
            next_ask(&held, recorded, (deadline, false), after(61)),
            None
        );
        // Nobody made it a scan after it was due: orphaned then, not at
        // the backoff's next lookup (at 80 s, past the schedule).
        let interval = Duration::from_secs(5);
        let due = 60 + grace;
        assert!(!orphaned(&held, false, (interval, after(60)), after(85)));
        assert!(!orphaned(
            &held,
            false,
            (interval, after(60)),
            after(due + 4)
        ));
        assert!(orphaned(
            &held,
            false,
            (interval, after(60)),
            after(due + 5)
        ));
        // Within the schedule, a scan after the backoff's next lookup.
        let young = Lookups {
            count: 2,
            ..held.clone()
        };
        assert!(!orphaned(&young, false, (interval, after(60)), after(56)));
        assert!(orphaned(&young, false, (interval, after(60)), after(57)));
        let erred = last(500, LookupResult::StillUnknown);
        assert!(!orphaned(&erred, false, (interval, after(60)), after(70)));
        assert_eq!(
            next_ask(&erred, recorded, (deadline, true), after(61)),
            None
        );
        let proved = last(404, LookupResult::SettledNoEffect);
        assert_eq!(
            next_ask(&proved, recorded, (deadline, true), after(61)),
            None
        );
        // Within the schedule, the schedule's: its next lookup 2 s after
        // its second, at 52 s.
        let early = Lookups { count: 2, ..held };
        assert_eq!(
            next_ask(&early, recorded, (deadline, true), after(51)),
            Some(Duration::from_secs(1))
        );
    }

    #[test]
    fn an_attempt_is_orphaned_once_its_next_lookup_is_a_scan_overdue() {
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let after = |s: u64| start + Duration::from_secs(s);
        let interval = Duration::from_secs(5);
        let none = Lookups::default();
        // None made: only once it was already waiting a scan ago.
        assert!(!orphaned(&none, false, (interval, after(60)), after(100)));
        assert!(orphaned(&none, true, (interval, after(60)), after(100)));
        // Two made, the last at 10 s: the next is due at 12 s, so it is
        // orphaned from 17 s, not before.
        let two = Lookups {
            count: 2,
            last: Some(Lookup {
                at: after(10),
                status: Some(503),
                result: LookupResult::StillUnknown,
            }),
        };
        assert!(!orphaned(&two, true, (interval, after(60)), after(16)));
        assert!(orphaned(&two, false, (interval, after(60)), after(17)));
    }

    #[test]
    fn statuses_mean_what_the_design_says() {
        for status in [200, 201, 204, 299] {
            assert_eq!(verdict(Some(status)), LookupResult::SettledSucceeded);
        }
        assert_eq!(verdict(Some(404)), LookupResult::SettledNoEffect);
        assert_eq!(verdict(Some(410)), LookupResult::SettledNoEffect);
        for status in [100, 301, 400, 409, 429, 500, 502, 503, 504] {
            assert_eq!(verdict(Some(status)), LookupResult::StillUnknown);
        }
        assert_eq!(verdict(None), LookupResult::Error);
    }

    #[test]
    fn only_a_2xx_or_a_404_or_410_settles() {
        assert!(LookupResult::SettledSucceeded.settles());
        assert!(LookupResult::SettledNoEffect.settles());
        assert!(!LookupResult::StillUnknown.settles());
        assert!(!LookupResult::Error.settles());
    }

    #[test]
    fn backoff_doubles_from_one_second_to_thirty() {
        let waits: Vec<u64> = (1..=8).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(backoff(u32::MAX), MAX_BACKOFF);
        assert_eq!(backoff(0), FIRST_BACKOFF);
    }

    #[test]
    fn names_round_trip() {
        for r in [
            LookupResult::SettledSucceeded,
            LookupResult::SettledNoEffect,
            LookupResult::StillUnknown,
            LookupResult::Error,
        ] {
            assert_eq!(LookupResult::parse(r.as_str()), Some(r));
        }
    }

    #[test]
    fn the_job_replaces_the_placeholder() {
        assert_eq!(
            lookup_path("/v1/charges/lookup/{job}", "abc"),
            "/v1/charges/lookup/abc"
        );
    }
}
