//! Assembling the gateway: runtime handles, background tasks and THE stack.

use std::sync::Arc;

use http::Request;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::ServiceBuilder;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnFailure, TraceLayer};
use uuid::Uuid;

use crate::admin::Admin;
use crate::config::{Settings, StoreSettings};
use crate::fastpath::FastPath;
use crate::http::BodyError;
use crate::idempotency::{IdempotencyLayer, Shared};
use crate::lease::Leases;
use crate::probe::{self, ProbeBoard};
use crate::store::postgres::PgStore;
use crate::store::sqlite::SqliteStore;
use crate::store::{Doorbell, Store, StoreError};
use crate::upstream::Upstreams;
use crate::{server, sweeper, telemetry};

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
    #[error("redis_url: {0}")]
    Redis(String),
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
    let doorbell = Arc::new(Doorbell::default());
    let store = open_store(&settings, &doorbell, &shutdown).await?;
    let leases = Arc::new(Leases::default());
    let instance = Uuid::new_v4();
    tracing::info!(%instance, upstreams = ?settings.upstreams.iter().map(|u| u.base.to_string()).collect::<Vec<_>>(), "gateway starting");
    let fastpath = match &settings.fastpath {
        None => None,
        Some(fast) => {
            let fast = Arc::new(
                FastPath::new(fast.clone()).map_err(|e| StartError::Redis(e.to_string()))?,
            );
            let (changes, announced) = tokio::sync::mpsc::unbounded_channel();
            doorbell.announce_to(changes);
            tokio::spawn(
                fast.clone()
                    .announce(announced, shutdown.clone().cancelled_owned()),
            );
            tokio::spawn(
                fast.clone()
                    .listen(doorbell.clone(), shutdown.clone().cancelled_owned()),
            );
            tracing::info!("Redis fast path on");
            Some(fast)
        }
    };

    tokio::spawn(leases.clone().renew(
        store.clone(),
        settings.lease_ttl,
        shutdown.clone().cancelled_owned(),
    ));
    tokio::spawn(sweeper::run(
        store.clone(),
        settings.sweep_interval,
        shutdown.clone().cancelled_owned(),
    ));

    let probes = Arc::new(ProbeBoard::default());
    let probes_for_admin = probes.clone();
    let (leases_at_exit, store_at_exit) = (leases.clone(), store.clone());
    let shared = Arc::new(Shared {
        probes: probes.clone(),
        settings: settings.clone(),
        store: store.clone(),
        doorbell,
        fastpath,
        leases,
        instance,
    });
    let upstreams = Upstreams::new(&settings.upstreams);
    tokio::spawn(probe::run(
        settings.clone(),
        upstreams.clone(),
        probes,
        shutdown.clone().cancelled_owned(),
    ));

    // The request path, outermost first.
    let proxy = ServiceBuilder::new()
        // Every request gets an id (kept if the client sent one)…
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        // …which the request span carries, so all its logs can be joined…
        .layer(TraceLayer::new_for_http().make_span_with(|req: &Request<Incoming>| {
            let id = req
                .headers()
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            tracing::info_span!("request", method = %req.method(), path = %req.uri().path(), request_id = %id)
        })
        // A 5xx here is usually the upstream's, already explained by the
        // attempt's own log line: a warning, not an error of the gateway.
        .on_failure(DefaultOnFailure::new().level(tracing::Level::WARN)))
        // …and the response echoes.
        .layer(PropagateRequestIdLayer::x_request_id())
        .map_request(|req: Request<Incoming>| req.map(|b| b.map_err(BodyError::new).boxed()))
        // Opted-in requests become jobs and attempts; the rest stream through.
        .layer(IdempotencyLayer::new(shared))
        // Each request goes to the upstream its attempt chose, or the primary.
        .service(upstreams);

    let admin = Arc::new(Admin {
        store,
        token: settings.admin_token.clone(),
        metrics: telemetry::metrics(),
        upstreams: settings.upstreams.clone(),
        probes: probes_for_admin,
    });
    let admin = tower::service_fn(move |req| admin.clone().handle(req));

    ready();
    let grace = settings.shutdown_grace;
    tokio::join!(
        server::serve(
            listeners.proxy,
            proxy,
            shutdown.clone().cancelled_owned(),
            grace
        ),
        server::serve(
            listeners.admin,
            admin,
            shutdown.clone().cancelled_owned(),
            grace
        ),
    );
    // Attempts still in flight die with this process; say so now rather
    // than leave duplicates waiting for their leases to lapse. A late answer
    // that still arrives before exit commits as usual.
    leases_at_exit.abandon(store_at_exit.as_ref()).await;
    tracing::info!("gateway stopped");
    Ok(())
}

/// Opens the configured store and applies its migrations. PostgreSQL also
/// gets its notification listener; a PostgreSQL that is down at start-up
/// does not stop the gateway: requests answer 503 and migrations are retried
/// until it is up. An embedded store that cannot be opened stops start-up.
async fn open_store(
    settings: &Settings,
    doorbell: &Arc<Doorbell>,
    shutdown: &CancellationToken,
) -> Result<Arc<dyn Store>, StartError> {
    let pg = match &settings.store {
        StoreSettings::Postgres(pg) => pg,
        StoreSettings::Embedded { path } => {
            tracing::info!(path = %path.display(), "using the embedded store");
            return Ok(Arc::new(SqliteStore::open(path, doorbell.clone()).await?));
        }
    };
    let store = PgStore::new(pg, doorbell.clone())?;
    match store.migrate().await {
        Ok(()) => {}
        Err(StoreError::Unavailable(e)) => {
            tracing::warn!(error = %e, "database unreachable at start-up; opted-in requests answer 503 until it is up");
            let store = store.clone();
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(std::time::Duration::from_secs(2)) => {}
                    }
                    match store.migrate().await {
                        Ok(()) => {
                            tracing::info!("database reachable; migrations applied");
                            return;
                        }
                        Err(e) => tracing::debug!(error = %e, "database still unreachable"),
                    }
                }
            });
        }
        Err(e) => return Err(e.into()),
    }
    tokio::spawn(store.clone().listen(shutdown.clone().cancelled_owned()));
    Ok(Arc::new(store))
}
