//! What every opted-in request shares: the layer's configuration, built by
//! the app from the settings, and the components it drives, each with its
//! own small config.

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use uuid::Uuid;

use super::execute::{self, Runner};
use super::hold::{self, Holds};
use super::recording::join::Live;
use super::replay::tiers::Replays;
use crate::route::Route;
use idemgate_proxy::budget::Budget;
use idemgate_store::fastpath::FastPath;
use idemgate_store::{Doorbell, Store};
use idemgate_trust::Trust;
use idemgate_upkeep::lease::Leases;
use idemgate_upkeep::probe::ProbeBoard;

/// How the idempotency layer runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// Opt-in routes, most specific prefix first.
    pub routes: Vec<Arc<Route>>,
    /// 409 (default) or 422 (the IETF draft) for a key reused with another
    /// request.
    pub mismatch_status: StatusCode,
    /// How long a key is remembered.
    pub key_ttl: Duration,
    /// `Retry-After` on 409 answers.
    pub retry_after: Duration,
    /// How duplicates are held.
    pub hold: hold::Config,
    /// How attempts run.
    pub attempt: execute::Config,
    /// Silence on a stream mirrored from another replica after which a
    /// copy here is completed from the store.
    pub stream_stall: Duration,
    /// Bytes of committed answers kept in memory for replay; 0 keeps none.
    pub replay_cache_size: usize,
    /// Where a request answered `202` polls its job, on the proxy
    /// listener: `{respond_async_path}/{job}` (`Prefer: respond-async`).
    pub respond_async_path: String,
}

/// The handles the layer is given by the app.
pub struct Runtime {
    /// The store: the arbiter.
    pub store: Arc<dyn Store>,
    /// Wake-ups for held duplicates.
    pub doorbell: Arc<Doorbell>,
    /// The Redis fast path, when configured.
    pub fastpath: Option<Arc<FastPath>>,
    /// Which upstreams pass their contracts' probes.
    pub probes: Arc<ProbeBoard>,
    /// Leases of the attempts this instance runs.
    pub leases: Arc<Leases>,
    /// This gateway instance, recorded on the attempts it runs.
    pub instance: Uuid,
    /// Who is asking: clients proven, owners established.
    pub trust: Arc<Trust>,
    /// The memory budget keyed requests are held against.
    pub budget: Arc<Budget>,
}

/// The layer's configuration and components, shared by every request.
pub struct Shared {
    pub(super) config: Config,
    pub(super) store: Arc<dyn Store>,
    pub(super) probes: Arc<ProbeBoard>,
    pub(super) trust: Arc<Trust>,
    pub(super) holds: Arc<Holds>,
    pub(super) live: Arc<Live>,
    pub(super) replays: Arc<Replays>,
    pub(super) runner: Arc<Runner>,
    pub(super) budget: Arc<Budget>,
}

impl Shared {
    /// Looks up, on their upstreams, the attempts the sweeper makes
    /// `unknown`, on routes with `[routes.reconcile]` (`docs/design.md` §5);
    /// runs until `lapsed` closes.
    pub fn reconcile_lapsed(
        &self,
        lapsed: tokio::sync::mpsc::UnboundedReceiver<idemgate_store::Lapsed>,
        upstream: super::execute::UpstreamService,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        self.runner
            .clone()
            .reconcile_lapsed(lapsed, self.config.routes.clone(), upstream)
    }

    /// Adopts the lookups of unknown attempts nobody asks about any more,
    /// every `interval` (`docs/design.md` §5); a supervised task.
    pub fn reconcile_orphans(
        &self,
        upstream: super::execute::UpstreamService,
        interval: std::time::Duration,
        beat: idemgate_upkeep::supervise::Heartbeat,
    ) -> impl std::future::Future<Output = Result<(), idemgate_domain::BoxError>> + Send + 'static
    {
        self.runner
            .clone()
            .reconcile_orphans(self.config.routes.clone(), upstream, interval, beat)
    }

    /// Waits until the outcome writes that outlive their requests have
    /// landed or given up: the drain's last wait, after the attempts in
    /// flight (`docs/design.md` §12, "Termination").
    pub async fn finish_writes(&self) {
        self.runner.finish_writes().await;
    }

    /// Builds the layer's components on `runtime`.
    pub fn new(config: Config, runtime: Runtime) -> Self {
        let Runtime {
            store,
            doorbell,
            fastpath,
            probes,
            leases,
            instance,
            trust,
            budget,
        } = runtime;
        crate::execute::zero(&config.routes);
        crate::error::zero_refusals();
        let holds = Arc::new(Holds::new(store.clone(), doorbell.clone(), config.hold));
        let live = Arc::new(Live::new(
            fastpath.clone(),
            holds.clone(),
            (config.stream_stall, config.attempt.deadline),
            budget.clone(),
        ));
        let replays = Arc::new(Replays::new(
            config.replay_cache_size,
            fastpath,
            store.clone(),
            config.retry_after,
        ));
        let runner = Arc::new(Runner::new(
            config.attempt.clone(),
            store.clone(),
            leases,
            doorbell,
            replays.clone(),
            live.clone(),
            instance,
        ));
        Shared {
            config,
            store,
            probes,
            trust,
            holds,
            live,
            replays,
            runner,
            budget,
        }
    }
}
