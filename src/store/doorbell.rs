//! Wake-ups for held duplicates.
//!
//! A duplicate of a running job does not poll: it waits on the job's bell,
//! which the store rings whenever the job's state changes (its own writes at
//! once, other replicas' through the store's notification channel). When the
//! channel was interrupted and notifications may have been missed, every bell
//! rings so each waiter reads its job again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::Notify;

use crate::job::JobId;

/// One bell per job that someone waits on.
#[derive(Debug, Default)]
pub struct Doorbell {
    bells: Mutex<HashMap<JobId, Weak<Notify>>>,
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

    /// Wakes everyone waiting on `job`.
    pub fn ring(&self, job: JobId) {
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
