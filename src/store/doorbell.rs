//! Wake-ups for held duplicates (`docs/design.md`, §7).
//!
//! A duplicate of a running job does not poll: it waits on the job's bell.
//! The store [rings](Doorbell::ring) it whenever it changes a job's state;
//! that also announces the change to other replicas when an announcer is
//! attached (the Redis fast path). Announcements heard from other replicas
//! (PostgreSQL `NOTIFY`, Redis pub/sub) ring only [locally](Doorbell::ring_local).
//! When a channel was interrupted and announcements may have been missed,
//! every bell rings so each waiter reads its job again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use tokio::sync::{mpsc, Notify};

use crate::job::JobId;

/// One bell per job that someone waits on.
#[derive(Debug, Default)]
pub struct Doorbell {
    bells: Mutex<HashMap<JobId, Weak<Notify>>>,
    announcer: OnceLock<mpsc::UnboundedSender<JobId>>,
    rung: std::sync::atomic::AtomicU64,
}

impl Doorbell {
    /// The bell for a job. Hold the `Arc` while waiting; the entry goes away
    /// once nobody holds it.
    pub fn bell(&self, job: JobId) -> Arc<Notify> {
        let mut bells = self.bells.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(bell) = bells.get(&job).and_then(Weak::upgrade) {
            return bell;
        }
        if bells.len() >= 1024 && bells.len().is_power_of_two() {
            bells.retain(|_, b| b.strong_count() > 0);
        }
        let bell = Arc::new(Notify::new());
        bells.insert(job, Arc::downgrade(&bell));
        bell
    }

    /// Sends every local change on to `announcer` too (set once, at start-up).
    pub fn announce_to(&self, announcer: mpsc::UnboundedSender<JobId>) {
        let _ = self.announcer.set(announcer);
    }

    /// A job changed here: wakes its local waiters and announces the change.
    pub fn ring(&self, job: JobId) {
        self.ring_local(job);
        if let Some(announcer) = self.announcer.get() {
            let _ = announcer.send(job);
        }
    }

    /// How many times a job's bell was rung here, in all.
    pub fn rung(&self) -> u64 {
        self.rung.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A job changed elsewhere: wakes its local waiters.
    pub fn ring_local(&self, job: JobId) {
        self.rung.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let bell = {
            let mut bells = self.bells.lock().unwrap_or_else(|e| e.into_inner());
            match bells.get(&job).map(Weak::upgrade) {
                Some(Some(bell)) => bell,
                Some(None) => {
                    bells.remove(&job);
                    return;
                }
                None => return,
            }
        };
        bell.notify_waiters();
    }

    /// Wakes every waiter, so each reads its job again.
    pub fn ring_all(&self) {
        let bells: Vec<_> = {
            let mut bells = self.bells.lock().unwrap_or_else(|e| e.into_inner());
            bells.retain(|_, b| b.strong_count() > 0);
            bells.values().filter_map(Weak::upgrade).collect()
        };
        for bell in bells {
            bell.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn ring_wakes_only_that_job() {
        let doorbell = Doorbell::default();
        let a = JobId::new();
        let b = JobId::new();
        let bell_a = doorbell.bell(a);
        let bell_b = doorbell.bell(b);
        let wait_a = bell_a.notified();
        let wait_b = bell_b.notified();
        tokio::pin!(wait_a, wait_b);
        wait_a.as_mut().enable();
        wait_b.as_mut().enable();
        doorbell.ring(a);
        wait_a.await;
        assert!(futures_util::poll!(wait_b.as_mut()).is_pending());
        doorbell.ring_all();
        wait_b.await;
    }
}
