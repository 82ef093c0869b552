//! Whether a keyed request asks Redis before the store (`docs/design.md`
//! §2, "Redis only while replays are common").
//!
//! A Redis lookup answers a replay in one round trip, but every request it
//! misses pays that round trip for nothing, and most keyed requests are
//! first tries: a new key pays the lookup, then its begin. So the replica
//! keeps a running share of the requests past its memory that found a
//! finished job (from Redis, or from the store when Redis was not asked),
//! and asks Redis only while that share is at least [`ASK_FROM`].
//!
//! Skipping a lookup is always safe: it is what a miss does, and the store
//! decides. The share is learnt either way, so a burst of retries turns the
//! lookups back on within about ten replays.

use std::sync::atomic::{AtomicU32, Ordering};

/// The share (in thousandths) from which Redis is asked first: a lookup
/// that misses costs about a third of what one that hits saves (the
/// store's read of a finished job), so asking pays from a quarter on.
const ASK_FROM: u32 = 250;

/// Each request moves the share this fraction of the way to 0 or 1000.
const STEP: i64 = 32;

/// The running share of requests past memory that found a finished job.
#[derive(Debug)]
pub(crate) struct RedisFirst {
    /// Thousandths. Updated without a lock: a lost update moves an average
    /// by a thirty-second, which matters to nobody.
    share: AtomicU32,
}

impl Default for RedisFirst {
    /// Asks from the start: a replica begins with no evidence that its
    /// replays are rare.
    fn default() -> Self {
        RedisFirst {
            share: AtomicU32::new(1000),
        }
    }
}

impl RedisFirst {
    /// Whether to ask Redis before the store now.
    pub(crate) fn ask(&self) -> bool {
        self.share.load(Ordering::Relaxed) >= ASK_FROM
    }

    /// Notes what one request past memory found: a finished job to replay
    /// (`true`), or a new key, a running job or anything else (`false`).
    pub(crate) fn found(&self, finished: bool) {
        let share = i64::from(self.share.load(Ordering::Relaxed));
        let target = if finished { 1000 } else { 0 };
        let moved = share + (target - share).div_euclid(STEP);
        // Never stuck short of an end by the rounding.
        let moved = if finished {
            moved.max(share + 1)
        } else {
            moved
        };
        self.share
            .store(moved.clamp(0, 1000) as u32, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Requests until `first` stops (or starts) asking after a run of
    /// `finished` findings.
    fn until_it_turns(first: &RedisFirst, finished: bool) -> usize {
        let asked = first.ask();
        (1..=1000)
            .find(|_| {
                first.found(finished);
                first.ask() != asked
            })
            .expect("it turns within a thousand requests")
    }

    #[test]
    fn new_keys_stop_the_lookups_and_a_few_replays_bring_them_back() {
        let first = RedisFirst::default();
        assert!(first.ask(), "a new replica asks");
        let new_keys = until_it_turns(&first, false);
        assert!(
            (30..=60).contains(&new_keys),
            "{new_keys} new keys in a row stop the lookups"
        );
        // However long new keys have run, replays bring lookups back soon.
        for _ in 0..10_000 {
            first.found(false);
        }
        assert!(!first.ask());
        let replays = until_it_turns(&first, true);
        assert!(
            (5..=12).contains(&replays),
            "{replays} replays in a row bring them back"
        );
    }

    #[test]
    fn a_third_of_replays_keeps_asking_and_a_tenth_does_not() {
        for (every, asks) in [(3, true), (10, false)] {
            let first = RedisFirst::default();
            let mut asked = 0;
            for n in 0..3000 {
                first.found(n % every == 0);
                asked += usize::from(n >= 1000 && first.ask());
            }
            assert_eq!(
                asked > 1900,
                asks,
                "one replay in {every}: asked {asked} of the last 2000"
            );
            assert_eq!(asked < 100, !asks, "one replay in {every}: {asked}");
        }
    }
}
