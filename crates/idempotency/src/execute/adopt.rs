//! Adopting attempts of unknown outcome to ask their upstream about
//! (`docs/design.md` §5, "Lookups outlive the process that asked"): those
//! the sweeper makes `unknown` (their gateway died), at once; and, on every
//! replica, every `sweep_interval`, those nobody asks about any more (the
//! replica that asked stopped or restarted). The asking itself is
//! [`super::reconcile`].

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::reconcile::{Ask, Reconciler};
use super::UpstreamService;
use crate::route::{Reconcile, Route};
use idemgate_domain::id::AttemptId;
use idemgate_domain::job::JobDetail;
use idemgate_domain::reconcile::orphaned;
use idemgate_domain::BoxError;
use idemgate_proxy::http::ProvenClient;
use idemgate_store::{Lapsed, StoreError};
use idemgate_telemetry::Chain;
use idemgate_upkeep::supervise::Heartbeat;

/// Most unknown attempts one scan reads.
const SCAN_LIMIT: u32 = 1000;

impl super::Runner {
    /// Looks up, on their upstreams, the attempts the sweeper makes
    /// `unknown` (their gateway died), on routes that look up; runs until
    /// `lapsed` closes. A route that resends cannot: the request died with
    /// its gateway (`docs/design.md` §5).
    pub(crate) async fn reconcile_lapsed(
        self: Arc<Self>,
        mut lapsed: tokio::sync::mpsc::UnboundedReceiver<Lapsed>,
        routes: Vec<Arc<Route>>,
        upstream: UpstreamService,
    ) {
        while let Some(l) = lapsed.recv().await {
            match self.reconciler_for(l, &routes, &upstream).await {
                Ok(Some(reconciler)) => reconciler.spawn(),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(attempt = %l.attempt, error = %Chain(&e), "could not read an attempt whose lease lapsed; it is not looked up")
                }
            }
        }
    }

    /// The lookup task for a lapsed attempt, when its route looks up and
    /// its upstream is still configured.
    async fn reconciler_for(
        &self,
        lapsed: Lapsed,
        routes: &[Arc<Route>],
        upstream: &UpstreamService,
    ) -> Result<Option<Reconciler>, StoreError> {
        let Some(detail) = self.store.job_detail(lapsed.job).await? else {
            return Ok(None);
        };
        let Some(route) = routes.iter().find(|r| r.name == detail.job.route) else {
            return Ok(None);
        };
        if route.reconcile == Some(Reconcile::Resend) {
            tracing::info!(attempt = %lapsed.attempt, job = %lapsed.job, "an attempt whose gateway died cannot be resent (its request died with it); it waits for an operator");
            return Ok(None);
        }
        Ok(self.reconciler_of(&detail, lapsed.attempt, route, upstream))
    }

    /// The lookup task for `attempt` of `detail`'s job on `route`, when the
    /// route looks up and the attempt's upstream is still configured.
    fn reconciler_of(
        &self,
        detail: &JobDetail,
        attempt: AttemptId,
        route: &Arc<Route>,
        upstream: &UpstreamService,
    ) -> Option<Reconciler> {
        let attempt = detail.attempts.iter().find(|a| a.id == attempt)?;
        let path = route
            .reconcile
            .as_ref()?
            .lookup_path(&detail.job.id.to_string())?;
        let target = route.upstreams().find(|u| u.name() == attempt.upstream)?;
        // Only proven clients use a route whose upstream holds a
        // credential (docs/design.md §15): the attempt was sent with it.
        let proven = route
            .require_client
            .then(|| ProvenClient(Arc::from("reconcile")));
        let ask = Ask::Lookup(path);
        Some(self.asking_about(upstream, route, target, attempt, ask, proven))
    }

    /// Every `interval`, adopts the unknown attempts on routes that look
    /// up that nobody asks about any more (the replica that asked stopped,
    /// or restarted): read from the store, so any replica may (a
    /// supervised task, stopped at shutdown).
    pub(crate) async fn reconcile_orphans(
        self: Arc<Self>,
        routes: Vec<Arc<Route>>,
        upstream: UpstreamService,
        interval: Duration,
        beat: Heartbeat,
    ) -> Result<(), BoxError> {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut awaiting_first = HashSet::new();
        loop {
            tick.tick().await;
            beat.beat();
            awaiting_first = self
                .adopt_orphans(&routes, &upstream, interval, &awaiting_first)
                .await;
        }
    }

    /// One scan; returns the attempts found waiting for their first lookup
    /// (orphaned if still waiting at the next scan).
    async fn adopt_orphans(
        &self,
        routes: &[Arc<Route>],
        upstream: &UpstreamService,
        interval: Duration,
        awaited: &HashSet<AttemptId>,
    ) -> HashSet<AttemptId> {
        let now = SystemTime::now();
        let since = now.checked_sub(self.config.deadline).unwrap_or(UNIX_EPOCH);
        let pending = match self.store.unknown_attempts(since, SCAN_LIMIT).await {
            Ok(pending) => pending,
            Err(e) => {
                tracing::debug!(error = %Chain(&e), "could not list unknown attempts to look up");
                return awaited.clone();
            }
        };
        let mut awaiting = HashSet::new();
        for (job, attempt) in pending {
            if self.asking.has(attempt) {
                continue;
            }
            let Ok(Some(detail)) = self.store.job_detail(job).await else {
                continue;
            };
            let Some(route) = routes.iter().find(|r| r.name == detail.job.route) else {
                continue;
            };
            let Some(record) = detail.attempts.iter().find(|a| a.id == attempt) else {
                continue;
            };
            if record.lookups.count == 0 {
                awaiting.insert(attempt);
            }
            let first_awaited = awaited.contains(&attempt);
            if orphaned(&record.lookups, first_awaited, interval, now) {
                if let Some(reconciler) = self.reconciler_of(&detail, attempt, route, upstream) {
                    tracing::info!(%attempt, %job, lookups = record.lookups.count, "adopting the lookups of an unknown attempt nobody asks about");
                    reconciler.spawn();
                }
            }
        }
        awaiting
    }
}
