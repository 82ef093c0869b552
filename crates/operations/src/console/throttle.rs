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

/// The failures of each address, with when its window began.
#[derive(Debug, Default)]
pub(super) struct Throttle {
    failures: Mutex<HashMap<IpAddr, (Instant, u32)>>,
}

impl Throttle {
    /// How long `addr` must wait before it may try again, if it must.
    pub(super) fn wait(&self, addr: IpAddr, now: Instant) -> Option<Duration> {
        let failures = self
            .failures
            .lock()
            .expect("the throttle's lock is never poisoned");
        let (began, count) = failures.get(&addr)?;
        let ends = *began + WINDOW;
        (*count >= MAX_FAILURES && ends > now).then(|| ends - now)
    }

    /// Counts a failed sign-in of `addr`.
    pub(super) fn failed(&self, addr: IpAddr, now: Instant) {
        let mut failures = self
            .failures
            .lock()
            .expect("the throttle's lock is never poisoned");
        if failures.len() >= MAX_ADDRESSES && !failures.contains_key(&addr) {
            failures.retain(|_, (began, _)| *began + WINDOW > now);
            if failures.len() >= MAX_ADDRESSES {
                let oldest = failures
                    .iter()
                    .min_by_key(|(_, (began, _))| *began)
                    .map(|(a, _)| *a);
                if let Some(oldest) = oldest {
                    failures.remove(&oldest);
                }
            }
        }
        let entry = failures.entry(addr).or_insert((now, 0));
        if entry.0 + WINDOW <= now {
            *entry = (now, 0);
        }
        entry.1 += 1;
    }

    /// Forgets `addr`'s failures: it signed in.
    pub(super) fn succeeded(&self, addr: IpAddr) {
        self.failures
            .lock()
            .expect("the throttle's lock is never poisoned")
            .remove(&addr);
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
            throttle.failed(a, start);
        }
        let later = start + Duration::from_secs(10);
        assert_eq!(
            throttle.wait(a, later),
            Some(WINDOW - Duration::from_secs(10))
        );
        assert_eq!(throttle.wait(b, later), None, "another address is its own");
        assert_eq!(throttle.wait(a, start + WINDOW), None, "the window ended");
        throttle.failed(a, start + WINDOW);
        assert_eq!(throttle.wait(a, start + WINDOW), None, "a new window");
        throttle.succeeded(a);
        assert!(throttle.failures.lock().unwrap().is_empty());
    }
}
