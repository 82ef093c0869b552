//! Assembling the gateway: runtime handles, background tasks and THE stack.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::ServiceBuilder;
use tower_http::request_id::{PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnFailure, TraceLayer};
use uuid::Uuid;

use crate::config::{Settings, StoreSettings};
use crate::idempotency::fastpath::FastPath;
use crate::idempotency::{execute, hold, IdempotencyLayer, Runtime, Shared};
use crate::operations::admin::Admin;
use crate::proxy::http::request_id::RequestIds;
use crate::proxy::http::{BodyError, IDEMPOTENCY_JOB, IDEMPOTENCY_KEY};
use crate::proxy::server;
use crate::proxy::shed::ShedLayer;
use crate::proxy::upstream::Upstreams;
use crate::store::postgres::Postgres;
use crate::store::seal::Sealer;
use crate::store::sqlite::Sqlite;
use crate::store::{Doorbell, Machine, Store, StoreError};
use crate::telemetry;
use crate::upkeep::lease::Leases;
use crate::upkeep::probe::{self, ProbeBoard};
use crate::upkeep::supervise::{Beats, Supervisor};
use crate::upkeep::sweeper;

/// The two listeners a gateway serves on; bound by the caller, so tests can
/// use OS-assigned ports.
pub struct Listeners {
    /// The proxy.
    pub proxy: TcpListener,
    /// The admin API, health and metrics.
    pub admin: TcpListener,
}

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The store refused to start.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The Redis client could not be set up.
    #[error("redis_url: the Redis client cannot be set up")]
    Redis(#[source] redis::RedisError),
}

/// A request's span at `$level` (a constant, as `tracing` needs it): its
/// method, path and id, with its status and job recorded when it is answered.
macro_rules! request_span {
    ($level:expr, $req:expr) => {
        tracing::span!(
            $level,
            "request",
            otel.kind = "server",
            http.request.method = %$req.method(),
            url.path = %$req.uri().path(),
            request_id = %$req
                .headers()
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default(),
            http.response.status_code = tracing::field::Empty,
            job.id = tracing::field::Empty,
        )
    };
}

/// Runs a gateway until `shutdown` is cancelled, then drains and returns.
/// `ready` is called once the store is open and the gateway is about to
/// serve (the binary announces its addresses then, so whoever waits for that
/// line knows the gateway holds its store).
pub async fn run(
    settings: Settings,
    listeners: Listeners,
    shutdown: CancellationToken,
    ready: impl FnOnce(),
) -> Result<(), StartError> {
    let settings = Arc::new(settings);
    let instance = Uuid::new_v4();
    let doorbell = Arc::new(Doorbell::default());
    // Background tasks outlive the drain (leases are renewed while open
    // requests finish) and stop once the gateway is done.
    let stop_tasks = CancellationToken::new();
    let tasks = Supervisor::new(stop_tasks.clone());
    let sealer = match &settings.encryption {
        None => None,
        Some(e) => {
            let sealer = Sealer::new(&e.active, e.keys.clone()).ok_or_else(|| {
                StoreError::internal("the active encryption key is not configured")
            })?;
            tracing::info!(active = %e.active, keys = e.keys.len(), "stored responses are sealed (AES-256-GCM)");
            Some(Arc::new(sealer))
        }
    };
    let store = open_store(&settings, instance, &doorbell, &tasks, sealer.clone()).await?;
    let leases = Arc::new(Leases::default());
    let runtime = tokio::runtime::Handle::current();
    tracing::info!(
        %instance,
        upstreams = ?settings.upstreams.iter().map(|u| u.base.to_string()).collect::<Vec<_>>(),
        runtime = ?runtime.runtime_flavor(),
        worker_threads = runtime.metrics().num_workers(),
        "gateway starting"
    );
    let fastpath = match &settings.redis {
        None => None,
        Some(fast) => Some(start_fastpath(fast, instance, sealer, &doorbell, &tasks)?),
    };
    let Some(upstreams) = Upstreams::new(&settings.upstreams) else {
        return Err(StoreError::internal("no upstream configured").into());
    };
    let probes = Arc::new(ProbeBoard::default());
    spawn_upkeep(&settings, &tasks, &store, &leases, &upstreams, &probes);

    let shared = Arc::new(Shared::new(
        idempotency_config(&settings),
        Runtime {
            store: store.clone(),
            doorbell,
            fastpath,
            probes: probes.clone(),
            leases: leases.clone(),
            instance,
        },
    ));

    // The request path, outermost first.
    let proxy = ServiceBuilder::new()
        // Every request gets an id (kept if the client sent one)…
        .layer(SetRequestIdLayer::x_request_id(RequestIds))
        // …which the request span carries, so all its logs can be joined;
        // exported over OTLP when configured, continuing the client's trace…
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(|req: &Request<Incoming>| {
                    // A request without a key is only proxied, and its span
                    // is context for the rare line it logs: made at `debug`
                    // unless spans are exported, it costs nothing at the
                    // default `info` (docs/performance.md, item 16).
                    let span = if req.headers().contains_key(IDEMPOTENCY_KEY)
                        || crate::telemetry::trace::exporting()
                    {
                        request_span!(tracing::Level::INFO, req)
                    } else {
                        request_span!(tracing::Level::DEBUG, req)
                    };
                    crate::telemetry::trace::continue_from(&span, req.headers());
                    span
                })
                .on_response(|response: &Response<_>, _latency, span: &tracing::Span| {
                    span.record("http.response.status_code", response.status().as_u16());
                    let job = response
                        .headers()
                        .get(IDEMPOTENCY_JOB)
                        .and_then(|v| v.to_str().ok());
                    if let Some(job) = job {
                        span.record("job.id", job);
                    }
                    count_request(response, job.is_some());
                })
                // A 5xx here is usually the upstream's, already explained by the
                // attempt's own log line: a warning, not an error of the gateway.
                .on_failure(DefaultOnFailure::new().level(tracing::Level::WARN)),
        )
        // …and the response echoes.
        .layer(PropagateRequestIdLayer::x_request_id())
        .map_request(|req: Request<Incoming>| req.map(|b| b.map_err(BodyError::new).boxed()))
        // Saturated: answer 503 at once rather than queue without bound.
        .layer(ShedLayer::new(settings.max_in_flight, settings.retry_after))
        // Opted-in requests become jobs and attempts; the rest stream through.
        .layer(IdempotencyLayer::new(shared))
        // Each request goes to the upstream its attempt chose, or the first.
        .service(upstreams);

    let admin = Arc::new(Admin {
        store: store.clone(),
        token: settings.admin_token.clone(),
        metrics: telemetry::metrics(),
        upstreams: settings.upstreams.clone(),
        probes,
        tasks,
    });
    let admin = tower::service_fn(move |req| admin.clone().handle(req));

    ready();
    let grace = settings.shutdown_grace;
    tokio::join!(
        server::serve(
            listeners.proxy,
            proxy,
            shutdown.clone().cancelled_owned(),
            grace,
            settings.limits,
        ),
        server::serve(
            listeners.admin,
            admin,
            shutdown.clone().cancelled_owned(),
            grace,
            settings.limits,
        ),
    );
    // Attempts still in flight die with this process; say so now rather
    // than leave duplicates waiting for their leases to lapse. A late answer
    // that still arrives before exit commits as usual.
    leases.abandon(store.as_ref()).await;
    stop_tasks.cancel();
    tracing::info!("gateway stopped");
    Ok(())
}

/// The idempotency layer's configuration, and its components', from the
/// settings: no component reads the whole settings.
pub fn idempotency_config(settings: &Settings) -> crate::idempotency::Config {
    crate::idempotency::Config {
        routes: settings.routes.clone(),
        owner_header: settings.owner_header.clone(),
        mismatch_status: settings.mismatch_status,
        key_ttl: settings.key_ttl,
        retry_after: settings.retry_after,
        hold: hold::Config {
            timeout: settings.hold_timeout,
            retry_after: settings.retry_after,
        },
        attempt: execute::Config {
            deadline: settings.attempt_deadline,
            lease_ttl: settings.lease_ttl,
            max_response_size: settings.max_response_size,
            forward_key_header: settings.forward_key_header.clone(),
            forward_attempt_header: settings.forward_attempt_header.clone(),
        },
        stream_stall: settings.upstream_timeout + settings.lease_ttl,
        replay_cache_size: settings.replay_cache_size,
    }
}

/// The Redis fast path, with its announcer and listener.
fn start_fastpath(
    settings: &crate::config::RedisSettings,
    instance: Uuid,
    sealer: Option<Arc<Sealer>>,
    doorbell: &Arc<Doorbell>,
    tasks: &Supervisor,
) -> Result<Arc<FastPath>, StartError> {
    let fast = FastPath::new(settings.clone(), instance, sealer).map_err(StartError::Redis)?;
    let fast = Arc::new(fast);
    let (changes, announced) = tokio::sync::mpsc::unbounded_channel();
    doorbell.announce_to(changes);
    let announced = Arc::new(tokio::sync::Mutex::new(announced));
    let announcer = fast.clone();
    tasks.spawn("redis-announcer", Beats::Never, move |_| {
        announcer.clone().announce(announced.clone())
    });
    let (listener, doorbell) = (fast.clone(), doorbell.clone());
    tasks.spawn("redis-listener", Beats::Never, move |_| {
        listener.clone().listen(doorbell.clone())
    });
    tracing::info!("Redis fast path on");
    Ok(fast)
}

/// Lease renewal, the sweeper and the probes, under supervision.
fn spawn_upkeep(
    settings: &Arc<Settings>,
    tasks: &Supervisor,
    store: &Arc<dyn Store>,
    leases: &Arc<Leases>,
    upstreams: &Upstreams,
    probes: &Arc<ProbeBoard>,
) {
    let (renewing, lease) = (store.clone(), settings.lease_ttl);
    let held = leases.clone();
    tasks.spawn("lease-renewal", Beats::Every(lease), move |beat| {
        held.clone().renew(renewing.clone(), lease, beat)
    });
    let (sweeping, interval) = (store.clone(), settings.sweep_interval);
    let stuck_after = (interval * 4).max(Duration::from_secs(60));
    tasks.spawn("sweeper", Beats::Every(stuck_after), move |beat| {
        sweeper::run(sweeping.clone(), interval, beat)
    });
    if probe::needed(settings) {
        let (settings, upstreams, board) = (settings.clone(), upstreams.clone(), probes.clone());
        let stuck_after = settings.probe_interval * 3 + Duration::from_secs(300);
        tasks.spawn("probes", Beats::Every(stuck_after), move |beat| {
            probe::run(settings.clone(), upstreams.clone(), board.clone(), beat)
        });
    }
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
) -> Result<Arc<dyn Store>, StartError> {
    let pg = match &settings.store {
        StoreSettings::Postgres(pg) => pg,
        StoreSettings::Embedded { path } => {
            tracing::info!(path = %path.display(), "using the embedded store");
            let backend = Sqlite::open(path).await?;
            return Ok(Arc::new(
                Machine::new(backend, doorbell.clone()).sealed_with(sealer),
            ));
        }
    };
    let backend = Postgres::new(pg, instance)?;
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
    let (listening, bell) = (backend.clone(), doorbell.clone());
    tasks.spawn("postgres-listener", Beats::Never, move |_| {
        let (backend, doorbell) = (listening.clone(), bell.clone());
        async move { Ok(backend.listen(&doorbell).await?) }
    });
    Ok(Arc::new(
        Machine::new(backend, doorbell.clone()).sealed_with(sealer),
    ))
}

/// Counts a request by how it was answered (`idemgate_requests_total{outcome,
/// status}`): `replayed` (a recorded answer), `executed` (an attempt's
/// answer), `problem` (the gateway refused or failed it, with a problem
/// answer), `passed_through` (not opted in); the status by class.
fn count_request<B>(response: &Response<B>, has_job: bool) {
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    const OUTCOMES: [&str; 4] = ["problem", "replayed", "executed", "passed_through"];
    const STATUSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];
    let outcome = if response
        .extensions()
        .get::<crate::proxy::error::GatewayProblem>()
        .is_some()
    {
        0
    } else if replayed {
        1
    } else if has_job {
        2
    } else {
        3
    };
    let class = usize::from(response.status().as_u16() / 100).clamp(1, 5) - 1;
    // The handle is looked up once per series, not once per request (a
    // lookup hashes the name and labels under the registry's lock).
    static COUNTERS: [[std::sync::OnceLock<metrics::Counter>; 5]; 4] =
        [const { [const { std::sync::OnceLock::new() }; 5] }; 4];
    COUNTERS[outcome][class]
        .get_or_init(|| {
            metrics::counter!("idemgate_requests_total",
                "outcome" => OUTCOMES[outcome], "status" => STATUSES[class])
        })
        .increment(1);
}
