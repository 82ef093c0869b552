//! Connections spread evenly over the workers that accept on one listener
//! (`worker_runtime = "per_thread"`, `docs/design.md` §12, "Threads").
//!
//! Every worker's runtime is woken for each new connection, and the first
//! to call `accept` takes it: left to that race, the main thread took 26
//! of 32 connections opened at once, and served them while the other
//! thread idled. So a worker that holds more connections than another
//! waits for its turn before it accepts, and the others take the next
//! ones. A worker already waiting in `accept` stops waiting when it falls
//! ahead (a connection of another's closed). It waits [`PATIENCE`] at
//! most: a worker held up by one request's CPU work delays new
//! connections by no more than that.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

/// The longest a worker ahead of another waits before it accepts anyway.
pub(super) const PATIENCE: Duration = Duration::from_millis(5);

/// Each worker's open connections, and a bell rung when one changes.
pub(super) struct Balance {
    open: Box<[AtomicUsize]>,
    changed: Notify,
}

impl Balance {
    pub(super) fn new(workers: usize) -> Arc<Self> {
        Arc::new(Balance {
            open: (0..workers).map(|_| AtomicUsize::new(0)).collect(),
            changed: Notify::new(),
        })
    }

    /// Returns once `worker` holds no more connections than any other
    /// worker (true), or after [`PATIENCE`] (false).
    pub(super) async fn turn(&self, worker: usize) -> bool {
        if self.open.len() == 1 {
            return true;
        }
        let patience = tokio::time::sleep(PATIENCE);
        tokio::pin!(patience);
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Listening before looking: a change between the two is heard.
            changed.as_mut().enable();
            if !self.ahead(worker) {
                return true;
            }
            tokio::select! {
                () = changed => {}
                () = &mut patience => return false,
            }
        }
    }

    /// Returns once `worker` holds more connections than another (one of
    /// another's closed): a worker waiting in `accept` then gives the
    /// next connection to the others. Never, with one worker.
    pub(super) async fn overtaken(&self, worker: usize) {
        if self.open.len() == 1 {
            return std::future::pending().await;
        }
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.ahead(worker) {
                return;
            }
            changed.await;
        }
    }

    /// Whether `worker` holds more connections than some other worker.
    fn ahead(&self, worker: usize) -> bool {
        let mine = self.open[worker].load(Ordering::Relaxed);
        self.open
            .iter()
            .any(|other| other.load(Ordering::Relaxed) < mine)
    }

    /// Counts a connection `worker` accepted until the guard is dropped.
    pub(super) fn hold(self: &Arc<Self>, worker: usize) -> Held {
        self.open[worker].fetch_add(1, Ordering::Relaxed);
        self.changed.notify_waiters();
        Held {
            balance: self.clone(),
            worker,
        }
    }
}

/// One open connection of a worker's.
pub(super) struct Held {
    balance: Arc<Balance>,
    worker: usize,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.balance.open[self.worker].fetch_sub(1, Ordering::Relaxed);
        self.balance.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker one connection ahead waits until the other catches up
    /// (accepts) or one of its own closes, and never longer than
    /// [`PATIENCE`]; a worker not ahead goes at once.
    #[tokio::test(start_paused = true)]
    async fn a_worker_ahead_waits_for_the_others() {
        let balance = Balance::new(2);
        let first = balance.hold(0);
        // Worker 1 is behind: no wait.
        let started = tokio::time::Instant::now();
        assert!(balance.turn(1).await);
        assert_eq!(started.elapsed(), Duration::ZERO);

        // Worker 0 is ahead: it waits, and goes once worker 1 has one too.
        let waiting = tokio::spawn({
            let balance = balance.clone();
            async move { balance.turn(0).await }
        });
        tokio::time::sleep(PATIENCE / 5).await;
        assert!(!waiting.is_finished());
        let second = balance.hold(1);
        waiting.await.unwrap();
        assert!(started.elapsed() < PATIENCE);

        // Ahead by one again; its connection closing lets it go.
        let third = balance.hold(1);
        let waiting = tokio::spawn({
            let balance = balance.clone();
            async move { balance.turn(1).await }
        });
        tokio::time::sleep(PATIENCE / 5).await;
        assert!(!waiting.is_finished());
        drop(third);
        waiting.await.unwrap();
        drop(first);

        // Ahead, with nothing changing: it goes after PATIENCE.
        let started = tokio::time::Instant::now();
        assert!(!balance.turn(1).await);
        assert_eq!(started.elapsed(), PATIENCE);

        // Even again, worker 0 waiting in `accept` is told when it falls
        // ahead: worker 1's connection closed.
        let zero = balance.hold(0);
        let overtaken = tokio::spawn({
            let balance = balance.clone();
            async move { balance.overtaken(0).await }
        });
        tokio::time::sleep(PATIENCE * 4).await;
        assert!(!overtaken.is_finished());
        drop(second);
        overtaken.await.unwrap();
        drop(zero);
    }
}
