//! Each component built in one place, with its own small config taken
//! from the settings (no component reads the whole settings): the store,
//! the Redis fast path, the upkeep tasks, the idempotency layer and the
//! admin API, and what a gateway that stops must do.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::secrets::{owner_salt, replay_keys};
use super::StartError;
use crate::config::{BudgetSource, MemoryBudget, Settings, WorkerRuntime};
use idemgate_domain::contract::Contract;
use idemgate_idempotency::route::Route;
use idemgate_idempotency::{AttemptConfig, HoldConfig, Runtime, Shared};
use idemgate_operations::admin::{Admin, Reconciling};
use idemgate_operations::console::{self, Console};
use idemgate_proxy::budget::Budget;
use idemgate_proxy::upstream::UpstreamId;
use idemgate_proxy::upstream::Upstreams;
use idemgate_store::fastpath::{EntryKeys, FastPath};
use idemgate_store::postgres::Postgres;
use idemgate_store::seal::Sealer;
use idemgate_store::sqlite::Sqlite;
use idemgate_store::StoreSettings;
use idemgate_store::{Doorbell, Lapsed, Machine, Store, StoreError};
use idemgate_telemetry::{self as telemetry, Chain};
use idemgate_trust::Trust;
use idemgate_upkeep::health::{self, Dependencies, Ping};
use idemgate_upkeep::lease::Leases;
use idemgate_upkeep::probe::{self, ProbeBoard};
use idemgate_upkeep::supervise::{Beats, Supervisor};
use idemgate_upkeep::sweeper;
use tokio::sync::mpsc;

/// The runtime handles of a started gateway, shared by its two listeners.
pub(super) struct Gateway {
    instance: Uuid,
    doorbell: Arc<Doorbell>,
    store: Arc<dyn Store>,
    fastpath: Option<Arc<FastPath>>,
    leases: Arc<Leases>,
    probes: Arc<ProbeBoard>,
    pub(super) upstreams: Upstreams,
    tasks: Supervisor,
    /// The store's and Redis' health, watched and reported (§8).
    dependencies: Arc<Dependencies>,
    trust: Arc<Trust>,
    /// The bytes keyed requests may hold (docs/design.md §18).
    budget: Arc<Budget>,
    /// Stops the background tasks, which outlive the drain (leases are
    /// renewed while open requests finish).
    stop_tasks: CancellationToken,
    /// Attempts the sweeper made `unknown`, for the idempotency layer to
    /// count, and look up when a route has `[routes.reconcile]`.
    lapsed: std::sync::Mutex<Option<mpsc::UnboundedReceiver<Lapsed>>>,
}

impl Gateway {
    /// Opens the store, starts the fast path and the upkeep tasks.
    pub(super) async fn start(settings: &Settings) -> Result<Gateway, StartError> {
        // The recorder first: a component that looks its metrics' handles
        // up once (the budget's, the shedding's gauges) would otherwise
        // hold handles that record nothing.
        let _ = telemetry::metrics();
        let instance = Uuid::new_v4();
        let doorbell = Arc::new(Doorbell::default());
        let stop_tasks = CancellationToken::new();
        let tasks = Supervisor::new(stop_tasks.clone());
        let sealer = sealer(settings)?;
        // Attempts the sweeper makes unknown are counted (docs/design.md
        // §12, "Metrics"), and looked up on their upstreams where a route
        // says how (§5).
        let (lapsed_tx, lapsed) = mpsc::unbounded_channel();
        let store = open_store(
            settings,
            instance,
            &doorbell,
            &tasks,
            sealer.clone(),
            Some(lapsed_tx),
        )
        .await?;
        let runtime = tokio::runtime::Handle::current();
        tracing::info!(
            %instance,
            upstreams = ?settings.upstreams.iter().map(|u| u.base.to_string()).collect::<Vec<_>>(),
            runtime = ?runtime.runtime_flavor(),
            worker_threads = settings.worker_threads,
            worker_runtime = settings.worker_runtime.as_str(),
            "gateway starting"
        );
        let fastpath = match &settings.redis {
            None => None,
            Some(fast) => {
                let keys = match &settings.replay_keys {
                    Some(keys) => {
                        replay_keys(keys, settings.encryption.as_ref(), &fast.key_prefix)?
                    }
                    None => return Err(StartError::ReplayKey("is not configured".into())),
                };
                Some(start_fastpath(fast, instance, keys, &doorbell, &tasks)?)
            }
        };
        let Some(upstreams) = Upstreams::new(&settings.upstreams) else {
            return Err(StoreError::internal("no upstream configured").into());
        };
        warn_of_anonymous_owners(settings);
        let trust = Arc::new(Trust::new(
            owner_salt(&settings.owner_salt)?,
            settings.clients.clone(),
            settings.owner.clone(),
        ));
        let dependencies = dependencies(&store, fastpath.as_ref());
        let gateway = Gateway {
            instance,
            trust,
            dependencies,
            budget: memory_budget(settings.memory_budget, settings.max_response_size),
            doorbell,
            store,
            fastpath,
            leases: Arc::default(),
            probes: Arc::default(),
            upstreams,
            tasks,
            stop_tasks,
            lapsed: std::sync::Mutex::new(Some(lapsed)),
        };
        gateway.spawn_upkeep(settings);
        Ok(gateway)
    }

    /// The idempotency layer's components.
    pub(super) fn idempotency(&self, settings: &Settings) -> Arc<Shared> {
        let shared = Arc::new(Shared::new(
            idempotency_config(settings),
            Runtime {
                store: self.store.clone(),
                doorbell: self.doorbell.clone(),
                fastpath: self.fastpath.clone(),
                probes: self.probes.clone(),
                leases: self.leases.clone(),
                instance: self.instance,
                trust: self.trust.clone(),
                budget: self.budget.clone(),
            },
        ));
        let lapsed = self.lapsed.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(lapsed) = lapsed {
            if settings.routes.iter().any(looks_up) {
                self.adopt_orphans(&shared, settings);
            }
            let upstream = tower::util::BoxCloneSyncService::new(self.upstreams.clone());
            let reconciling = shared.reconcile_lapsed(lapsed, upstream);
            let stop = self.stop_tasks.clone();
            tokio::spawn(async move {
                tokio::select! {
                    () = reconciling => {}
                    () = stop.cancelled() => {}
                }
            });
        }
        shared
    }

    /// Unknown attempts nobody asks about any more (their replica stopped
    /// or restarted) are adopted by a scan on every replica, every
    /// `sweep_interval` (docs/design.md §5).
    fn adopt_orphans(&self, shared: &Arc<Shared>, settings: &Settings) {
        let upstream = tower::util::BoxCloneSyncService::new(self.upstreams.clone());
        let (shared, interval) = (shared.clone(), settings.sweep_interval);
        // Bounded at start-up (src/config/bounds.rs); saturating all the same.
        let stuck_after = interval.saturating_mul(4).max(Duration::from_secs(60));
        self.tasks.spawn(
            "reconcile-orphans",
            Beats::Every(stuck_after),
            move |beat| shared.reconcile_orphans(upstream.clone(), interval, beat),
        );
    }

    /// The admin API.
    pub(super) fn admin(&self, settings: &Settings) -> Arc<Admin> {
        Arc::new(Admin {
            store: self.store.clone(),
            token: settings.admin_token.clone(),
            console: Console::new(console::Config {
                secure_cookie: settings.console_secure_cookie,
                sessions: console::Limits::default(),
            }),
            metrics: telemetry::metrics(),
            upstreams: settings.upstreams.clone(),
            probes: self.probes.clone(),
            tasks: self.tasks.clone(),
            dependencies: self.dependencies.clone(),
            trust: self.trust.clone(),
            reconciling: Reconciling {
                routes: settings
                    .routes
                    .iter()
                    .filter_map(|r| Some((r.name.clone(), reconcile_name(r.reconcile.as_ref()?))))
                    .collect(),
                deadline: settings.attempt_deadline,
            },
        })
    }

    /// The drain's last part: attempts still running here (a client that
    /// left does not stop its attempt) may end by `deadline`, so that a
    /// rollout records their outcomes rather than `unknown`; so may the
    /// outcome writes still being retried in the background (`shared`'s
    /// never-sent records, the store's settles), for at most `writes_for`
    /// more: past the lease those attempts lapse into `unknown` anyway, and
    /// a store down that long should not hold a rollout for the whole
    /// grace (`docs/design.md` §12, "Termination").
    ///
    /// The begins and claims still on their way (their clients gone) are
    /// among what `shared` waits for; one that lands starts its attempt,
    /// which may end by `deadline` too, rather than be abandoned as
    /// `unknown` with its upstream call just sent.
    pub(super) async fn finish_attempts(
        &self,
        deadline: tokio::time::Instant,
        writes_for: Duration,
        shared: &Shared,
    ) {
        self.attempts_ended(deadline).await;
        let writes_deadline = deadline.min(tokio::time::Instant::now() + writes_for);
        let written = tokio::time::timeout_at(writes_deadline, shared.finish_writes()).await;
        if written.is_err() {
            tracing::error!("outcome writes still being retried when the drain ended (shutdown_grace, or lease_ttl after the attempts): their attempts will lapse into unknown");
        }
        self.attempts_ended(deadline).await;
    }

    /// Waits, until `deadline`, for the attempts running here to end.
    async fn attempts_ended(&self, deadline: tokio::time::Instant) {
        let running = self.leases.running();
        if running == 0 {
            return;
        }
        tracing::info!(running, "waiting for the attempts in flight to end");
        let ended = tokio::time::timeout_at(deadline, self.leases.all_ended()).await;
        if ended.is_err() {
            tracing::warn!(
                running = self.leases.running(),
                "attempts still running when shutdown_grace ended"
            );
        }
    }

    /// After the drain: attempts still in flight die with this process; say
    /// so now rather than leave duplicates waiting for their leases to lapse
    /// (a late answer that still arrives before exit commits as usual).
    pub(super) async fn stop(self) {
        self.leases.abandon(self.store.as_ref()).await;
        self.stop_tasks.cancel();
    }

    /// Lease renewal, the sweeper and the probes, under supervision.
    fn spawn_upkeep(&self, settings: &Settings) {
        let (renewing, lease) = (self.store.clone(), settings.lease_ttl);
        let held = self.leases.clone();
        self.tasks
            .spawn("lease-renewal", Beats::Every(lease), move |beat| {
                held.clone().renew(renewing.clone(), lease, beat)
            });
        let (sweeping, interval) = (self.store.clone(), settings.sweep_interval);
        // Bounded at start-up (src/config/bounds.rs); saturating all the same.
        let stuck_after = interval.saturating_mul(4).max(Duration::from_secs(60));
        self.tasks
            .spawn("sweeper", Beats::Every(stuck_after), move |beat| {
                sweeper::run(sweeping.clone(), interval, beat)
            });
        let watched = self.dependencies.clone();
        self.tasks.spawn(
            "dependency-health",
            Beats::Every(health::INTERVAL * 15),
            move |beat| watched.clone().watch(beat),
        );
        let config = Arc::new(probe::Config::new(
            settings.probe_interval,
            relied_on(&settings.routes),
        ));
        for contract in config.proving_only_the_shape() {
            // The seed's warning: valid JSON can still do the wrong thing
            // with the prompt (docs/design.md §6, "Proven providers").
            tracing::warn!(
                %contract,
                "contract's probes only prove the shape of answers: add `expect` (golden values) \
                 or `prompt_tokens` to a probe so a fallback is proven to answer right"
            );
        }
        if config.needed() {
            let (upstreams, board) = (self.upstreams.clone(), self.probes.clone());
            let stuck_after = config
                .interval
                .saturating_mul(3)
                .saturating_add(Duration::from_secs(300));
            self.tasks
                .spawn("probes", Beats::Every(stuck_after), move |beat| {
                    probe::run(config.clone(), upstreams.clone(), board.clone(), beat)
                });
        }
    }
}

/// The store and (when configured) Redis, as the health watch asks them.
fn dependencies(store: &Arc<dyn Store>, fastpath: Option<&Arc<FastPath>>) -> Arc<Dependencies> {
    let store = store.clone();
    let mut checks: Vec<(&'static str, Ping)> = vec![(
        "store",
        Arc::new(move || {
            let store = store.clone();
            Box::pin(async move { store.ping().await.map_err(|e| Chain(&e).to_string()) })
        }),
    )];
    if let Some(fastpath) = fastpath.cloned() {
        checks.push((
            "redis",
            Arc::new(move || {
                let fastpath = fastpath.clone();
                Box::pin(async move { fastpath.ping().await })
            }),
        ));
    }
    Arc::new(Dependencies::new(checks))
}

/// The memory budget, its size and where it came from said at start-up,
/// with the largest answer recorded whole, which a small budget lowers
/// (`docs/design.md` §18).
fn memory_budget(budget: MemoryBudget, max_response_size: usize) -> Arc<Budget> {
    let size = bytesize::ByteSize(budget.bytes as u64).to_string_as(true);
    let answers = bytesize::ByteSize(max_response_size as u64).to_string_as(true);
    match budget.from {
        BudgetSource::Configured => tracing::info!(
            memory_budget = %size, max_response_size = %answers,
            "memory budget as configured"
        ),
        BudgetSource::Container(limit) => tracing::info!(
            memory_budget = %size, max_response_size = %answers,
            container_limit = %bytesize::ByteSize(limit).to_string_as(true),
            "memory budget: half the container's memory limit"
        ),
        BudgetSource::Default => tracing::info!(
            memory_budget = %size, max_response_size = %answers,
            "memory budget: the default (no container memory limit found; set memory_budget)"
        ),
    }
    Budget::with_owner_limit(budget.bytes, budget.per_owner)
}

/// Says at start-up what allowing anonymous owners means, naming the
/// routes (`docs/design.md` §15).
fn warn_of_anonymous_owners(settings: &Settings) {
    let anonymous: Vec<&str> = settings
        .routes
        .iter()
        .filter(|r| r.owner.allow_anonymous)
        .map(|r| r.name.as_str())
        .collect();
    if !anonymous.is_empty() {
        tracing::warn!(
            routes = ?anonymous,
            "keyed requests without an owner are allowed on these routes: they all share the owner `anonymous`, \
             so any caller who sends the same Idempotency-Key gets the answer stored under it; \
             use this for a trial or a single trusted caller, and name owner sources ([owner]) otherwise"
        );
    }
}

/// Seals stored responses when `[encryption]` is configured.
fn sealer(settings: &Settings) -> Result<Option<Arc<Sealer>>, StartError> {
    let Some(e) = &settings.encryption else {
        return Ok(None);
    };
    let sealer = Sealer::new(&e.active, e.keys.clone())
        .ok_or_else(|| StoreError::internal("the active encryption key is not configured"))?;
    tracing::info!(active = %e.active, keys = e.keys.len(), "stored responses are sealed (AES-256-GCM)");
    Ok(Some(Arc::new(sealer)))
}

/// The idempotency layer's configuration, and its components', from the
/// settings: no component reads the whole settings.
pub fn idempotency_config(settings: &Settings) -> idemgate_idempotency::Config {
    idemgate_idempotency::Config {
        routes: settings.routes.clone(),
        mismatch_status: settings.mismatch_status,
        key_ttl: settings.key_ttl,
        retry_after: settings.retry_after,
        hold: HoldConfig {
            timeout: settings.hold_timeout,
            retry_after: settings.retry_after,
        },
        attempt: AttemptConfig {
            deadline: settings.attempt_deadline,
            lease_ttl: settings.lease_ttl,
            max_response_size: settings.max_response_size,
            forward_key_header: settings.forward_key_header.clone(),
            forward_attempt_header: settings.forward_attempt_header.clone(),
        },
        // A mirrored stream is quiet this long only if its recorder is
        // gone: the longest silence any route allows between chunks, and
        // the lease that outlives it (docs/design.md §10).
        stream_stall: longest_stream_silence(settings) + settings.lease_ttl,
        replay_cache_size: settings.replay_cache_size,
        respond_async_path: settings.respond_async_path.clone(),
    }
}

/// The longest silence between a stream's chunks any route allows on any
/// of its upstreams (at least `upstream_timeout`).
fn longest_stream_silence(settings: &Settings) -> std::time::Duration {
    let routes = settings.routes.iter();
    let idle = routes.flat_map(|r| r.upstreams().map(move |u| r.silences(u).stream_idle));
    idle.fold(settings.upstream_timeout, std::cmp::max)
}

/// The Redis fast path, with its announcer and listener; its entries
/// authenticated with `keys`.
fn start_fastpath(
    settings: &idemgate_store::fastpath::RedisSettings,
    instance: Uuid,
    keys: EntryKeys,
    doorbell: &Arc<Doorbell>,
    tasks: &Supervisor,
) -> Result<Arc<FastPath>, StartError> {
    // The redis crate builds its rustls configs with the process's default
    // provider: name the gateway's (ring), so that another crate enabling a
    // second provider cannot leave it without one (docs/design.md §16).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let fast =
        FastPath::new(settings.clone(), instance, Arc::new(keys)).map_err(StartError::Redis)?;
    let fast = Arc::new(fast);
    let (changes, announced) = tokio::sync::mpsc::unbounded_channel();
    doorbell.announce_to(changes);
    let announced = Arc::new(tokio::sync::Mutex::new(announced));
    let announcer = fast.clone();
    tasks.spawn("redis-announcer", Beats::Never, move |_| {
        announcer.clone().announce(announced.clone())
    });
    let writer = fast.clone();
    tasks.spawn("redis-writer", Beats::Never, move |_| {
        writer.clone().write_entries()
    });
    let (listener, doorbell) = (fast.clone(), doorbell.clone());
    tasks.spawn("redis-listener", Beats::Never, move |_| {
        listener.clone().listen(doorbell.clone())
    });
    tokio::spawn(fast.clone().first_contact());
    tracing::info!("Redis fast path on");
    Ok(fast)
}

/// Opens the configured store. PostgreSQL also gets its migrations and its
/// notification listener as supervised tasks: a PostgreSQL that is down at
/// start-up does not stop the gateway (requests answer 503 and `/readyz`
/// fails until the migrations are in). An embedded store that cannot be
/// opened stops start-up.
async fn open_store(
    settings: &Settings,
    instance: Uuid,
    doorbell: &Arc<Doorbell>,
    tasks: &Supervisor,
    sealer: Option<Arc<Sealer>>,
    lapsed: Option<mpsc::UnboundedSender<Lapsed>>,
) -> Result<Arc<dyn Store>, StartError> {
    let pg = match &settings.store {
        StoreSettings::Postgres(pg) => pg,
        StoreSettings::Embedded { path } => {
            tracing::info!(path = %path.display(), "using the embedded store");
            let backend = Sqlite::open(path).await?;
            return Ok(Arc::new(
                Machine::new(backend, doorbell.clone())
                    .sealed_with(sealer)
                    .reporting_lapsed(lapsed),
            ));
        }
    };
    // A runtime per worker thread: a lane of the pool each (worker.rs).
    let workers = match settings.worker_runtime {
        WorkerRuntime::PerThread => settings.worker_threads,
        WorkerRuntime::Shared => 1,
    };
    let backend = Postgres::for_workers(pg, instance, workers)?;
    match backend.migrate().await {
        Ok(()) => {}
        Err(e) if e.is_transient() => {
            tracing::warn!(error = %telemetry::Chain(&e), "database unreachable at start-up; opted-in requests answer 503 until it is up");
            let migrating = backend.clone();
            tasks.spawn("migrations", Beats::Never, move |_| {
                let backend = migrating.clone();
                async move {
                    backend.migrate().await?;
                    tracing::info!("database reachable; migrations applied");
                    // Done: nothing more to do until the gateway stops.
                    std::future::pending::<()>().await;
                    Ok(())
                }
            });
        }
        Err(e) => return Err(e.into()),
    }
    backend.check_pool().await?;
    let (listening, bell) = (backend.clone(), doorbell.clone());
    tasks.spawn("postgres-listener", Beats::Never, move |_| {
        let (backend, doorbell) = (listening.clone(), bell.clone());
        async move { Ok(backend.listen(&doorbell).await?) }
    });
    Ok(Arc::new(
        Machine::new(backend, doorbell.clone())
            .sealed_with(sealer)
            .reporting_lapsed(lapsed),
    ))
}

/// Whether a route asks its upstream about unknown attempts by a lookup
/// (a resend needs the request, which only the attempt's own process has).
fn looks_up(route: &Arc<Route>) -> bool {
    matches!(
        route.reconcile,
        Some(idemgate_idempotency::route::Reconcile::Lookup { .. })
    )
}

/// What the routes rely on probes for: each upstream a route may use,
/// against the route's contract, waiting on silence as the route would.
fn relied_on(
    routes: &[Arc<Route>],
) -> impl Iterator<Item = (UpstreamId, Arc<Contract>, probe::Patience)> + '_ {
    routes.iter().flat_map(|route| {
        route.contract.iter().flat_map(move |contract| {
            route.upstreams().map(move |upstream| {
                let patience = super::route_patience(route, upstream);
                (upstream.id.clone(), contract.clone(), patience)
            })
        })
    })
}

/// How a route asks its upstream about an unknown attempt, as the job API
/// names it.
fn reconcile_name(how: &idemgate_idempotency::route::Reconcile) -> &'static str {
    match how {
        idemgate_idempotency::route::Reconcile::Lookup { .. } => "lookup",
        idemgate_idempotency::route::Reconcile::Resend => "resend",
    }
}
