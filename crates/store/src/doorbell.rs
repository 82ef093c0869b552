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
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use tokio::sync::{mpsc, Notify, OnceCell};

use idemgate_domain::id::JobId;
use idemgate_domain::job::Job;

/// One bell per job that someone waits on.
#[derive(Debug, Default)]
pub struct Doorbell {
    bells: Mutex<HashMap<JobId, Weak<Bell>>>,
    announcer: OnceLock<mpsc::UnboundedSender<JobId>>,
    rung: AtomicU64,
}

/// A job's bell, shared by everyone waiting on that job in this process.
///
/// Waiters share more than the wake-up: what one of them read after a ring
/// serves all of them ([`Bell::observe`]), and the job is marked watched
/// once ([`Bell::watched`]). A thousand duplicates of one job cost one read
/// per change, not a thousand.
#[derive(Debug, Default)]
pub struct Bell {
    notify: Notify,
    rings: AtomicU64,
    /// The last observation, and the ring count its read started at.
    seen: Mutex<Option<(u64, Observed)>>,
    /// Held by the one waiter reading; the others wait for its result.
    reading: tokio::sync::Mutex<()>,
    watched: OnceCell<()>,
}

/// What a waiter read of the job: the job, and whether its answer streams.
#[derive(Debug, Clone)]
pub struct Observed {
    /// The job as read.
    pub job: Job,
    /// Whether its answer is streaming (and can be joined).
    pub streaming: bool,
}

impl Bell {
    /// Resolves at the next ring; enable it before reading the job.
    pub fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.notify.notified()
    }

    /// How often it rang: a waiter notes this before it reads.
    pub fn rings(&self) -> u64 {
        self.rings.load(Ordering::Acquire)
    }

    /// What the job is now, as of ring `since` at least: the observation of
    /// another waiter when one was made since, else `read`'s, shared with
    /// the waiters after. One read runs at a time.
    pub async fn observe<E, F, Fut>(&self, since: u64, read: F) -> Result<Observed, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Observed, E>>,
    {
        if let Some(observed) = self.seen_since(since) {
            return Ok(observed);
        }
        let _reading = self.reading.lock().await;
        // Another waiter may have read while this one queued.
        if let Some(observed) = self.seen_since(since) {
            return Ok(observed);
        }
        // Every change rung before this read started is in what it reads.
        let at = self.rings();
        let observed = read().await?;
        *self.seen.lock().unwrap_or_else(|e| e.into_inner()) = Some((at, observed.clone()));
        Ok(observed)
    }

    fn seen_since(&self, since: u64) -> Option<Observed> {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.as_ref()
            .filter(|(at, _)| *at >= since)
            .map(|(_, observed)| observed.clone())
    }

    fn ring(&self) {
        // Counted before the wake-up: a woken waiter sees the new count.
        self.rings.fetch_add(1, Ordering::AcqRel);
        self.notify.notify_waiters();
    }

    /// Marks the job watched with `mark`, once for all its waiters here;
    /// every waiter waits until the mark is in.
    pub async fn watched<E, F, Fut>(&self, mark: F) -> Result<(), E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<(), E>>,
    {
        self.watched.get_or_try_init(mark).await.map(|_| ())
    }
}

impl Doorbell {
    /// The bell for a job. Hold the `Arc` while waiting; the entry goes away
    /// once nobody holds it.
    pub fn bell(&self, job: JobId) -> Arc<Bell> {
        let mut bells = self.bells.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(bell) = bells.get(&job).and_then(Weak::upgrade) {
            return bell;
        }
        if bells.len() >= 1024 && bells.len().is_power_of_two() {
            bells.retain(|_, b| b.strong_count() > 0);
        }
        let bell = Arc::new(Bell::default());
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
        self.rung.load(Ordering::Relaxed)
    }

    /// A job changed elsewhere: wakes its local waiters.
    pub fn ring_local(&self, job: JobId) {
        self.rung.fetch_add(1, Ordering::Relaxed);
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
        bell.ring();
    }

    /// Wakes every waiter, so each reads its job again.
    pub fn ring_all(&self) {
        let bells: Vec<_> = {
            let mut bells = self.bells.lock().unwrap_or_else(|e| e.into_inner());
            bells.retain(|_, b| b.strong_count() > 0);
            bells.values().filter_map(Weak::upgrade).collect()
        };
        for bell in bells {
            bell.ring();
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

    #[tokio::test]
    async fn waiters_share_one_read_per_ring() {
        let bell = Bell::default();
        let reads = std::sync::atomic::AtomicU32::new(0);
        let job = || {
            reads.fetch_add(1, Ordering::SeqCst);
            async {
                Ok::<_, ()>(Observed {
                    job: test_job(),
                    streaming: false,
                })
            }
        };
        let since = bell.rings();
        for _ in 0..100 {
            bell.observe(since, job).await.unwrap();
        }
        assert_eq!(
            reads.load(Ordering::SeqCst),
            1,
            "one read serves every waiter"
        );
        bell.ring();
        let since = bell.rings();
        bell.observe(since, job).await.unwrap();
        bell.observe(since, job).await.unwrap();
        assert_eq!(
            reads.load(Ordering::SeqCst),
            2,
            "a ring asks for a fresh read, once"
        );
    }

    #[tokio::test]
    async fn the_job_is_marked_watched_once() {
        let bell = Bell::default();
        let marks = std::sync::atomic::AtomicU32::new(0);
        for _ in 0..10 {
            bell.watched(|| async {
                marks.fetch_add(1, Ordering::SeqCst);
                Ok::<_, ()>(())
            })
            .await
            .unwrap();
        }
        assert_eq!(marks.load(Ordering::SeqCst), 1);
    }

    fn test_job() -> Job {
        Job {
            id: JobId::new(),
            owner: idemgate_domain::key::Owner::anonymous(),
            key: idemgate_domain::key::IdempotencyKey::new("k").unwrap(),
            fingerprint: idemgate_domain::fingerprint::Fingerprint([0; 32]),
            route: "r".into(),
            state: idemgate_domain::job::JobState::Running,
            version: 1,
            attempt_count: 1,
            completed_by: None,
            response: None,
            response_in_store: None,
            created_at: std::time::SystemTime::now(),
            expires_at: std::time::SystemTime::now(),
        }
    }
}
