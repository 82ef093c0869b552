//! Assembling the gateway: its components (`components`), THE stack
//! (`stack`), and the two listeners.

mod components;
mod secrets;
mod stack;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::proxy::server;
use crate::store::StoreError;

pub use components::idempotency_config;
use components::Gateway;

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
    /// The owner salt beside the embedded store is unusable.
    #[error("the owner salt file {0}; fix or remove it, or set IDEMGATE_OWNER_SALT")]
    OwnerSalt(String),
    /// The replay key cannot be had.
    #[error("replay_key: the replay key {0}; fix or remove the file, set IDEMGATE_REPLAY_KEY, or configure [encryption] to derive it")]
    ReplayKey(String),
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
    let gateway = Gateway::start(&settings).await?;
    let proxy = stack::proxy(
        &settings,
        gateway.idempotency(&settings),
        gateway.upstreams.clone(),
    );
    let admin = gateway.admin(&settings);
    let admin = tower::service_fn(move |req| admin.clone().handle(req));
    ready();
    let (grace, limits) = (settings.shutdown_grace, settings.limits);
    let stopping = || shutdown.clone().cancelled_owned();
    let trusted = || settings.trusted_proxies.clone();
    tokio::join!(
        server::serve(listeners.proxy, proxy, stopping(), grace, limits, trusted()),
        server::serve(listeners.admin, admin, stopping(), grace, limits, trusted()),
    );
    gateway.stop().await;
    tracing::info!("gateway stopped");
    Ok(())
}
