//! Leases on running attempts.
//!
//! Each attempt this instance runs is registered here for as long as its task
//! lives; one background task renews all of them in a single statement every
//! third of the lease. If the instance dies, renewals stop and the sweeper of
//! any surviving instance turns the attempt `unknown`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::supervise::Heartbeat;
use idemgate_domain::attempt::AttemptFailure;
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::BoxError;
use idemgate_store::Store;
use idemgate_telemetry::ends::{self, By};
use idemgate_telemetry::Chain;

/// The attempts this instance holds leases on, each with its route and
/// upstream (the labels its end is counted with, should it be abandoned).
#[derive(Debug)]
pub struct Leases {
    held: Mutex<HashMap<AttemptId, Held>>,
    /// How many are held, for a drain waiting for the last to end.
    count: watch::Sender<usize>,
}

impl Default for Leases {
    fn default() -> Self {
        Leases {
            held: Mutex::default(),
            count: watch::Sender::new(0),
        }
    }
}

/// Who a held attempt is, for the metrics.
#[derive(Debug, Clone)]
pub struct Held {
    /// Its job.
    pub job: JobId,
    /// Its job's route.
    pub route: String,
    /// Its upstream.
    pub upstream: String,
    /// When its call is dropped, answered or not (its recorded deadline).
    pub deadline: tokio::time::Instant,
}

/// Releases the lease registration when the attempt's task ends.
#[derive(Debug)]
pub struct LeaseGuard {
    leases: Arc<Leases>,
    attempt: AttemptId,
}

impl Leases {
    /// Registers `attempt` until the guard is dropped.
    pub fn hold(self: &Arc<Self>, attempt: AttemptId, who: Held) -> LeaseGuard {
        let mut held = self.lock();
        held.insert(attempt, who);
        self.count.send_replace(held.len());
        drop(held);
        LeaseGuard {
            leases: self.clone(),
            attempt,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<AttemptId, Held>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn snapshot(&self) -> Vec<AttemptId> {
        self.lock().keys().copied().collect()
    }

    /// Until when this instance may still be calling for `job`: the
    /// latest deadline of the attempts of it it runs, their calls out from
    /// here (an attempt gone `unknown` at its `first_byte_timeout` among
    /// them, until its late answer or that deadline); `None` for none.
    pub fn calling(&self, job: JobId) -> Option<tokio::time::Instant> {
        let held = self.lock();
        let of_job = held.values().filter(|held| held.job == job);
        of_job.map(|held| held.deadline).max()
    }

    /// How many attempts this instance is running.
    pub fn running(&self) -> usize {
        *self.count.borrow()
    }

    /// Resolves once no attempt is running here (at once if none is): the
    /// drain waits for it (`docs/design.md` §8).
    pub async fn all_ended(&self) {
        let mut count = self.count.subscribe();
        // The sender lives in `self`, so the channel cannot close under us.
        let _ = count.wait_for(|n| *n == 0).await;
    }

    /// Records every attempt still held as `unknown`: this instance is going
    /// away and can no longer tell how they end.
    pub async fn abandon(&self, store: &dyn Store) {
        let held: Vec<(AttemptId, Held)> =
            self.lock().iter().map(|(a, h)| (*a, h.clone())).collect();
        for (attempt, who) in held {
            let failure = AttemptFailure::Unknown {
                detail: "the gateway shut down while this attempt was in flight".into(),
            };
            match store.fail_attempt(attempt, failure).await {
                // The gateway stopped waiting: counted once, as any end
                // (docs/design.md §12, "Metrics").
                Ok(true) => {
                    ends::ended(&who.route, &who.upstream, "unknown", By::Deadline);
                    tracing::warn!(%attempt, route = %who.route, upstream = %who.upstream, "attempt in flight at shutdown; outcome unknown")
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(error = %Chain(&e), %attempt, "could not record an attempt abandoned at shutdown; its lease will lapse")
                }
            }
        }
    }

    /// Renews every held lease each `lease / 3`, for as long as it runs (a
    /// supervised task, stopped at shutdown).
    pub async fn renew(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        lease: Duration,
        beat: Heartbeat,
    ) -> Result<(), BoxError> {
        let mut tick = tokio::time::interval(lease / 3);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            beat.beat();
            let held = self.snapshot();
            if held.is_empty() {
                continue;
            }
            if let Err(e) = store.renew_leases(&held, lease).await {
                tracing::warn!(error = %Chain(&e), attempts = held.len(), "could not renew attempt leases");
            }
        }
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        let mut held = self.leases.lock();
        held.remove(&self.attempt);
        self.leases.count.send_replace(held.len());
    }
}
