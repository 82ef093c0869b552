//! The most each timing and count may be, checked at start-up.
//!
//! A value past its bound is a slip (`24d` for `24h`, a digit too many), and
//! a huge one does not fail where it is read: it overflows the arithmetic
//! done on it later (`interval * 4`, `Instant + shutdown_grace`, a semaphore
//! of `max_connections` permits), panicking, or PostgreSQL's timestamps
//! (`now() + key_ttl`), failing every request. Refused here instead, naming
//! the key. The bounds are listed in `docs/configuration.md`.

use std::time::Duration;

use super::{bad, ConfigError};

/// An upper bound, as the error writes it.
pub(super) struct Bound {
    max: Duration,
    written: &'static str,
}

const fn days(n: u64, written: &'static str) -> Bound {
    Bound {
        max: Duration::from_secs(n * 24 * 3600),
        written,
    }
}

/// A silence or an interval: past a day the upstream or the replica is
/// gone, not slow.
pub(super) const DAY: Bound = days(1, "24h");
/// How long a duplicate is held: a day's silence, then some.
pub(super) const WEEK: Bound = days(7, "7d");
/// How long an attempt may run, and the drain that waits for it.
pub(super) const MONTH: Bound = days(30, "30d");
/// How long a key is remembered: far inside PostgreSQL's timestamps.
pub(super) const DECADE: Bound = days(3650, "3650d");

/// Open connections per listener: far past what one process's file
/// descriptors allow, far below a semaphore's limit.
pub(super) const MAX_CONNECTIONS: usize = 1_000_000;

/// `d`, unless it is past `bound`; then an error naming `key`, the bound
/// and `why` the key has one.
pub(super) fn at_most(
    key: &str,
    d: Duration,
    bound: &Bound,
    why: &str,
) -> Result<Duration, ConfigError> {
    if d > bound.max {
        return Err(bad(
            key,
            format!(
                "{} is too long: set at most {}; {why}",
                humantime::format_duration(d),
                bound.written
            ),
        ));
    }
    Ok(d)
}

/// A count `n`, unless it is past `max`.
pub(super) fn count_at_most(
    key: &str,
    n: usize,
    max: usize,
    why: &str,
) -> Result<usize, ConfigError> {
    if n > max {
        return Err(bad(
            key,
            format!("{n} is too many: set at most {max}; {why}"),
        ));
    }
    Ok(n)
}

/// A silence an attempt allows (an upstream's or a route's), which must end
/// by `attempt_deadline`: the attempt is abandoned then, so a longer one
/// would be cut short at the deadline without a word.
pub(super) fn within_deadline(
    key: &str,
    silence: Duration,
    attempt_deadline: Duration,
) -> Result<Duration, ConfigError> {
    if silence > attempt_deadline {
        let silence = humantime::format_duration(silence);
        return Err(bad(
            key,
            format!(
                "{silence} is longer than attempt_deadline ({}), when the attempt is abandoned, \
                 so it would never be waited for whole: raise attempt_deadline to at least \
                 {silence}, or lower this",
                humantime::format_duration(attempt_deadline)
            ),
        ));
    }
    Ok(silence)
}
