//! Assembling the gateway: its components (`components`), THE stack
//! (`stack`), and the two listeners.

mod access;
mod components;
mod secrets;
mod stack;

use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use idemgate_domain::contract::Contract;
use idemgate_idempotency::route::Route;
use idemgate_proxy::server;
use idemgate_proxy::upstream::UpstreamSettings;
use idemgate_store::StoreError;
use idemgate_upkeep::probe::{self, Patience, Silence};

pub use components::idempotency_config;

/// What `idemgate check` prints of valid settings: what the gateway would
/// run with, and where each secret comes from. Touches no file and
/// connects to nothing; a secret file that exists and does not read is
/// an error, as it would be at start-up.
pub fn check(settings: &Settings) -> Result<String, StartError> {
    let mut report = crate::config::summary::Summary(settings).to_string();
    for line in secrets::describe(settings)? {
        report.push_str(&line);
        report.push('\n');
    }
    Ok(report)
}
use components::Gateway;

/// `idemgate verify-providers`: every contract's probes against every
/// upstream, each giving up on a silent upstream when the route relying on
/// the contract would (its `first_byte_timeout` and `stream_idle_timeout`),
/// or after `timeout` (`--timeout`). True when every probe passed.
pub async fn verify_providers(
    settings: &Settings,
    timeout: Option<Duration>,
    print: probe::Print,
) -> bool {
    let patience = |contract: &Contract, upstream: &UpstreamSettings| match timeout {
        Some(limit) => Patience::uniform(limit, "--timeout"),
        None => patience(&settings.routes, contract, upstream),
    };
    probe::verify(&settings.upstreams, &settings.contracts, &patience, print).await
}

/// How long a probe of `contract` on `upstream` waits on silence: as the
/// routes naming the contract would (those that use the upstream, else any;
/// the most patient of them), else as the upstream's own silences say.
fn patience(
    routes: &[std::sync::Arc<Route>],
    contract: &Contract,
    upstream: &UpstreamSettings,
) -> Patience {
    let naming: Vec<&Route> = routes
        .iter()
        .filter(|r| r.contract.as_ref().is_some_and(|c| c.name == contract.name))
        .map(|r| &**r)
        .collect();
    let using: Vec<&Route> = naming
        .iter()
        .copied()
        .filter(|r| r.upstreams().any(|u| u.id == upstream.id))
        .collect();
    let relied = if using.is_empty() { naming } else { using };
    relied
        .into_iter()
        .map(|route| route_patience(route, upstream))
        .reduce(Patience::or_longer)
        .unwrap_or_else(|| Patience::of_upstream(upstream))
}

/// The silences an attempt of `route` on `upstream` allows
/// ([`Route::silences`]), named by the key that sets each.
fn route_patience(route: &Route, upstream: &UpstreamSettings) -> Patience {
    let own = Patience::of_upstream(upstream);
    let set = |limit: Option<Duration>, key: &str, otherwise: Silence| match limit {
        Some(limit) => Silence {
            limit,
            source: format!("route {}'s {key}", route.name),
        },
        None => otherwise,
    };
    Patience {
        head: set(route.first_byte_timeout, "first_byte_timeout", own.head),
        between: set(
            route.stream_idle_timeout,
            "stream_idle_timeout",
            own.between,
        ),
    }
}

/// The proxy `listener`, and a handle on its socket for each of `workers`
/// to accept on, registered with that worker's runtime: a socket that
/// cannot be shared stops start-up rather than leave a worker idle.
fn shared_with(
    listener: TcpListener,
    workers: Vec<tokio::runtime::Handle>,
) -> std::io::Result<server::Accept> {
    let mut accept = server::Accept {
        counted: true,
        listener,
        elsewhere: Vec::new(),
    };
    if workers.is_empty() {
        return Ok(accept);
    }
    let socket = accept.listener.into_std()?;
    accept.elsewhere = workers
        .into_iter()
        .map(|worker| {
            let _inside = worker.enter();
            let listener = TcpListener::from_std(socket.try_clone()?)?;
            Ok((worker, listener))
        })
        .collect::<std::io::Result<_>>()?;
    accept.listener = TcpListener::from_std(socket)?;
    Ok(accept)
}

/// The two listeners a gateway serves on; bound by the caller, so tests can
/// use OS-assigned ports.
pub struct Listeners {
    /// The proxy.
    pub proxy: TcpListener,
    /// The admin API, health and metrics.
    pub admin: TcpListener,
    /// The other workers' runtimes, each accepting on the proxy listener
    /// too (`worker_runtime = "per_thread"`); none with a shared runtime.
    pub workers: Vec<tokio::runtime::Handle>,
}

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The store refused to start.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The proxy listener cannot be shared with the other workers.
    #[error("listen: the listener cannot be shared with the worker threads: {0}")]
    Listener(#[source] std::io::Error),
    /// The Redis client could not be set up.
    #[error("redis_url: the Redis client cannot be set up")]
    Redis(#[source] redis::RedisError),
    /// The owner salt beside the embedded store is unusable.
    #[error("the owner salt file {0}; fix or remove it, or set IDEMGATE_OWNER_SALT")]
    OwnerSalt(String),
    /// The replay key cannot be had.
    #[error("replay_key: the replay key {0}; fix or remove the file, set IDEMGATE_REPLAY_KEY, or configure [encryption] to derive it")]
    ReplayKey(String),
    /// Several secrets are unusable: each is told.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  and "))]
    Secrets(Vec<StartError>),
}

/// Runs a gateway until `shutdown` is cancelled, then drains and returns:
/// the listeners stop accepting, open requests finish and attempts in
/// flight (whose clients may be gone) run to their end, all within
/// `shutdown_grace` (`docs/design.md` §12, "Termination").
/// `ready` is called once the store is open and the gateway is about to
/// serve (the binary announces its addresses then, so whoever waits for that
/// line knows the gateway holds its store).
pub async fn run(
    settings: Settings,
    listeners: Listeners,
    shutdown: CancellationToken,
    ready: impl FnOnce(),
) -> Result<(), StartError> {
    let proxy_accept =
        shared_with(listeners.proxy, listeners.workers).map_err(StartError::Listener)?;
    let admin_accept = server::Accept {
        counted: false,
        listener: listeners.admin,
        elsewhere: Vec::new(),
    };
    let gateway = Gateway::start(&settings).await?;
    let idempotency = gateway.idempotency(&settings);
    let proxy = stack::proxy(&settings, idempotency.clone(), gateway.upstreams.clone());
    let admin = gateway.admin(&settings);
    let admin = tower::service_fn(move |req| admin.clone().handle(req));
    ready();
    let (grace, limits) = (settings.shutdown_grace, settings.limits);
    let trusted = || settings.trusted_proxies.clone();
    let began = async {
        shutdown.cancelled().await;
        tracing::info!(shutdown_grace = ?grace, "draining: no new connections; requests and attempts in flight finish");
        tokio::time::Instant::now()
    };
    let ((), (), began) = tokio::join!(
        server::serve(
            proxy_accept,
            proxy,
            shutdown.clone(),
            grace,
            limits,
            trusted()
        ),
        server::serve(
            admin_accept,
            admin,
            shutdown.clone(),
            grace,
            limits,
            trusted()
        ),
        began,
    );
    gateway
        .finish_attempts(began + grace, settings.lease_ttl, &idempotency)
        .await;
    gateway.stop().await;
    tracing::info!("gateway stopped");
    Ok(())
}
