//! Failed console sign-ins, counted per client address (`docs/design.md`
//! §14): past [`MAX_FAILURES`] within [`WINDOW`], an address is answered
//! `429` until its window ends, before its token is even compared, so the
//! admin token cannot be guessed at the speed of the listener. A sign-in
//! that succeeds clears its address's count.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Failed sign-ins an address may make within one window.
pub const MAX_FAILURES: u32 = 5;
/// How long an address's failures are remembered, from its first.
pub const WINDOW: Duration = Duration::from_secs(60);
/// Addresses remembered at most: past it, expired windows are dropped,
/// then the oldest, so a flood of addresses cannot grow the map unbounded.
const MAX_ADDRESSES: usize = 10_000;

/// An address's failures in its window, and its tries not yet decided.
#[derive(Debug, Clone, Copy)]
struct Window {
    began: Instant,
    failures: u32,
    /// Tries taken ([`Throttle::take`]) whose token is still to be
    /// compared: counted against the window, so that many sign-ins sent at
    /// once, their bodies held back, are not each let through.
    pending: u32,
}

/// The failures of each address, with when its window began.
#[derive(Debug, Default)]
pub(super) struct Throttle {
    windows: Mutex<HashMap<IpAddr, Window>>,
}

/// A try at the token taken by an address ([`Throttle::take`]): a failure
/// when [`Try::failed`], forgotten (neither counted nor pending) when
/// dropped undecided, the address's failures cleared when it
/// [`Try::succeeded`].
pub struct Try<'a> {
    throttle: &'a Throttle,
    addr: IpAddr,
}

impl Throttle {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, Window>> {
        self.windows.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How long `addr` must wait before it may try again, if it must.
    #[cfg(test)]
    pub(super) fn wait(&self, addr: IpAddr, now: Instant) -> Option<Duration> {
        let windows = self.lock();
        let window = windows.get(&addr)?;
        let ends = window.began + WINDOW;
        (window.failures >= MAX_FAILURES && ends > now).then(|| ends - now)
    }

    /// A try at the token for `addr`, or how long it must wait first: it
    /// may have [`MAX_FAILURES`] failures and tries pending in a window.
    pub(super) fn take(&self, addr: IpAddr, now: Instant) -> Result<Try<'_>, Duration> {
        let mut windows = self.lock();
        make_room(&mut windows, addr, now);
        let window = windows.entry(addr).or_insert(Window {
            began: now,
            failures: 0,
            pending: 0,
        });
        if window.began + WINDOW <= now {
            window.began = now;
            window.failures = 0;
        }
        if window.failures + window.pending >= MAX_FAILURES {
            // The window's end, or (with tries pending, which may yet
            // succeed) a second.
            let ends = window.began + WINDOW - now;
            return Err(match window.failures >= MAX_FAILURES {
                true => ends,
                false => ends.min(Duration::from_secs(1)),
            });
        }
        window.pending += 1;
        Ok(Try {
            throttle: self,
            addr,
        })
    }
}

impl Try<'_> {
    /// The token given was wrong: one failure more for the address.
    pub fn failed(self) {
        if let Some(window) = self.throttle.lock().get_mut(&self.addr) {
            window.failures += 1;
        }
    }

    /// The token given was right: the address's failures are forgotten
    /// (its other tries still pending stay counted until they end).
    pub fn succeeded(self) {
        if let Some(window) = self.throttle.lock().get_mut(&self.addr) {
            window.failures = 0;
        }
    }
}

impl Drop for Try<'_> {
    fn drop(&mut self) {
        let mut windows = self.throttle.lock();
        if let Some(window) = windows.get_mut(&self.addr) {
            window.pending = window.pending.saturating_sub(1);
            if window.pending == 0 && window.failures == 0 {
                windows.remove(&self.addr);
            }
        }
    }
}

/// Keeps the map within [`MAX_ADDRESSES`] before `addr` is added to it:
/// expired windows go first, then the oldest.
fn make_room(windows: &mut HashMap<IpAddr, Window>, addr: IpAddr, now: Instant) {
    if windows.len() < MAX_ADDRESSES || windows.contains_key(&addr) {
        return;
    }
    windows.retain(|_, w| w.began + WINDOW > now || w.pending > 0);
    if windows.len() >= MAX_ADDRESSES {
        let oldest = windows.iter().min_by_key(|(_, w)| w.began).map(|(a, _)| *a);
        if let Some(oldest) = oldest {
            windows.remove(&oldest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_waits_after_its_failures_until_its_window_ends() {
        let throttle = Throttle::default();
        let (a, b): (IpAddr, IpAddr) = ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
        let start = Instant::now();
        for i in 0..MAX_FAILURES {
            assert_eq!(throttle.wait(a, start), None, "failure {i}");
            throttle.take(a, start).unwrap().failed();
        }
        let later = start + Duration::from_secs(10);
        assert_eq!(
            throttle.wait(a, later),
            Some(WINDOW - Duration::from_secs(10))
        );
        assert_eq!(
            throttle.take(a, later).err(),
            Some(WINDOW - Duration::from_secs(10))
        );
        assert_eq!(throttle.wait(b, later), None, "another address is its own");
        assert_eq!(throttle.wait(a, start + WINDOW), None, "the window ended");
        throttle.take(a, start + WINDOW).unwrap().failed();
        assert_eq!(throttle.wait(a, start + WINDOW), None, "a new window");
        throttle.take(a, start + WINDOW).unwrap().succeeded();
        assert!(throttle.windows.lock().unwrap().is_empty());
    }

    /// Tries taken at once, none decided yet, count against the window:
    /// the sixth waits; one dropped undecided (its body never came) is
    /// neither a failure nor pending any more.
    #[test]
    fn tries_pending_count_against_the_window() {
        let throttle = Throttle::default();
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let now = Instant::now();
        let pending: Vec<_> = (0..MAX_FAILURES)
            .map(|_| throttle.take(a, now).unwrap())
            .collect();
        assert!(throttle.take(a, now).is_err(), "a sixth try at once");
        let mut pending = pending.into_iter();
        drop(pending.next());
        let again = throttle
            .take(a, now)
            .expect("room again once one was dropped");
        for try_ in pending {
            try_.failed();
        }
        again.failed();
        assert_eq!(throttle.wait(a, now), Some(WINDOW));
    }
}
