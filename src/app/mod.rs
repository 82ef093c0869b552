//! Assembling the gateway: its components (`components`), THE stack
//! (`stack`), and the two listeners.

mod access;
mod components;
mod secrets;
mod stack;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use idemgate_proxy::server;
use idemgate_store::StoreError;

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
    let began = async {
        shutdown.cancelled().await;
        tracing::info!(shutdown_grace = ?grace, "draining: no new connections; requests and attempts in flight finish");
        tokio::time::Instant::now()
    };
    let ((), (), began) = tokio::join!(
        server::serve(listeners.proxy, proxy, stopping(), grace, limits, trusted()),
        server::serve(listeners.admin, admin, stopping(), grace, limits, trusted()),
        began,
    );
    gateway.finish_attempts(began + grace).await;
    gateway.stop().await;
    tracing::info!("gateway stopped");
    Ok(())
}
