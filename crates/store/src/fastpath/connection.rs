//! How the fast path reaches Redis, as it is deployed: one node, a Redis
//! Cluster, or a Redis managed by Sentinel (docs/design.md §13).
//!
//! Whatever the deployment, the fast path sees a [`Connection`] for its
//! commands (the same `query_async` calls on all three), a subscription for
//! announcements, and a connection of its own for blocking stream reads.
//! Every one of them is made lazily: Redis down at start-up only means
//! misses until it is up.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection, PubSub};
use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{ClientTlsConfig, Cmd, ConnectionInfo, RedisResult, TlsCertificates, TlsMode, Value};

use super::settings::RedisTls;
use super::settings::{RedisSettings, Topology};

/// The fast path's handle on Redis.
pub(super) struct Redis {
    reach: Reach,
    /// For connections of their own (blocking reads, subscriptions).
    timeout: Duration,
}

enum Reach {
    Node {
        client: redis::Client,
        conn: ConnectionManager,
    },
    Cluster {
        client: Box<ClusterClient>,
        conn: ClusterConnection,
        /// Subscriptions are made to one node (classic pub/sub is broadcast
        /// to every node of a cluster); the first that answers.
        seeds: Vec<redis::Client>,
    },
    Sentinel(Arc<Master>),
}

impl Redis {
    /// Prepares the connections without making them; every command answers
    /// within `timeout` or fails. Over TLS, every connection (commands,
    /// subscriptions, blocking reads, sentinels) checks the server's
    /// certificate against the configured roots (docs/design.md §16).
    pub(super) fn new(settings: &RedisSettings) -> RedisResult<Self> {
        let timeout = settings.timeout;
        let connect = timeout.max(Duration::from_millis(100));
        let managed = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(connect))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        let certs = settings.tls.as_ref().map(certificates);
        let reach = match &settings.topology {
            Topology::Node(info) => {
                let client = open(info, certs.as_ref())?;
                let conn = ConnectionManager::new_lazy_with_config(client.clone(), managed)?;
                Reach::Node { client, conn }
            }
            Topology::Cluster(seeds) => cluster(seeds, certs.as_ref(), timeout)?,
            Topology::Sentinel {
                sentinels,
                service,
                node,
                tls: _,
            } => {
                let mut builder = SentinelClientBuilder::new(
                    sentinels.clone(),
                    service,
                    SentinelServerType::Master,
                )?
                .set_client_to_redis_db(node.db());
                if let Some(user) = node.username() {
                    builder = builder.set_client_to_redis_username(user);
                }
                if let Some(password) = node.password() {
                    builder = builder.set_client_to_redis_password(password);
                }
                if let Some(certs) = certs {
                    // The same CA and client certificate for both: one
                    // deployment, one PKI (docs/design.md §16).
                    builder = builder
                        .set_client_to_sentinel_certificates(certs.clone())
                        .set_client_to_redis_tls_mode(TlsMode::Secure)
                        .set_client_to_redis_certificates(certs);
                }
                Reach::Sentinel(Arc::new(Master {
                    sentinel: tokio::sync::Mutex::new(builder.build()?),
                    current: RwLock::new(None),
                    resolving: AtomicBool::new(false),
                    config: managed,
                }))
            }
        };
        Ok(Redis { reach, timeout })
    }

    /// A connection for commands: cheap to take, shared underneath.
    pub(super) fn conn(&self) -> Connection {
        match &self.reach {
            Reach::Node { conn, .. } => Connection::Managed(conn.clone()),
            Reach::Cluster { conn, .. } => Connection::Cluster(conn.clone()),
            Reach::Sentinel(master) => Connection::Sentinel(master.clone()),
        }
    }

    /// A subscription on a node that hears every announcement.
    pub(super) async fn subscriber(&self) -> RedisResult<PubSub> {
        match &self.reach {
            Reach::Node { client, .. } => self.bounded(client.get_async_pubsub()).await,
            Reach::Cluster { seeds, .. } => {
                let mut last = None;
                for seed in seeds {
                    match self.bounded(seed.get_async_pubsub()).await {
                        Ok(pubsub) => return Ok(pubsub),
                        Err(e) => last = Some(e),
                    }
                }
                Err(last.unwrap_or_else(|| no_node("no seed node")))
            }
            Reach::Sentinel(master) => {
                let client = self.bounded(master.client()).await?;
                self.bounded(client.get_async_pubsub()).await
            }
        }
    }

    /// A connection of its own, for reads that block it.
    pub(super) async fn dedicated(&self) -> RedisResult<Connection> {
        match &self.reach {
            Reach::Node { client, .. } => self
                .bounded(client.get_multiplexed_async_connection())
                .await
                .map(Connection::Multiplexed),
            Reach::Cluster { client, .. } => {
                // Blocking reads need longer than a command may take.
                let config = ClusterConfig::new()
                    .set_connection_timeout(self.timeout.max(Duration::from_millis(100)))
                    .set_response_timeout(Duration::from_secs(3));
                self.bounded(client.get_async_connection_with_config(config))
                    .await
                    .map(Connection::Cluster)
            }
            Reach::Sentinel(master) => {
                let client = self.bounded(master.client()).await?;
                self.bounded(client.get_multiplexed_async_connection())
                    .await
                    .map(Connection::Multiplexed)
            }
        }
    }

    async fn bounded<T>(
        &self,
        fut: impl std::future::Future<Output = RedisResult<T>>,
    ) -> RedisResult<T> {
        let limit = self.timeout.max(Duration::from_millis(500));
        tokio::time::timeout(limit, fut)
            .await
            .unwrap_or_else(|_| Err(no_node("connecting to Redis timed out")))
    }
}

/// Reconnections to a cluster node before it is dropped until the next
/// slot map (see [`cluster`]).
const RECONNECTIONS: std::num::NonZeroUsize = std::num::NonZeroUsize::new(3).unwrap();

/// A cluster found from its seeds; over TLS, every node it names is
/// reached with the same roots and client certificate.
fn cluster(
    seeds: &[ConnectionInfo],
    certs: Option<&TlsCertificates>,
    timeout: Duration,
) -> RedisResult<Reach> {
    let connect = timeout.max(Duration::from_millis(100));
    // A node that refuses three reconnections in a row is dropped, so the
    // next command for its slots asks the cluster for the slot map again
    // and finds the replica promoted in its place. Without the limit the
    // client kept reconnecting to a dead master's address, and its slots
    // stayed unreachable until some other command met a MOVED.
    let mut builder = ClusterClientBuilder::new(seeds.to_vec())
        .connection_timeout(connect)
        .response_timeout(timeout)
        .retries(2)
        .max_retry_wait(200)
        .max_connection_attempts(RECONNECTIONS);
    if let Some(certs) = certs {
        builder = builder.certs(certs.clone());
    }
    let client = builder.build()?;
    let config = ClusterConfig::new()
        .set_connection_timeout(connect)
        .set_response_timeout(timeout);
    let conn = client.get_pending_async_connection_with_config(config);
    let seeds = seeds
        .iter()
        .map(|s| open(s, certs))
        .collect::<RedisResult<_>>()?;
    Ok(Reach::Cluster {
        client: Box::new(client),
        conn,
        seeds,
    })
}

/// A client for one node, over TLS with `certs` when given.
fn open(info: &ConnectionInfo, certs: Option<&TlsCertificates>) -> RedisResult<redis::Client> {
    match certs {
        None => redis::Client::open(info.clone()),
        Some(certs) => redis::Client::build_with_tls(info.clone(), certs.clone()),
    }
}

/// The roots and client certificate, as the redis crate takes them. The
/// roots are always given (never left to the crate), so that the ones read
/// and checked at start-up are the ones used.
fn certificates(tls: &RedisTls) -> TlsCertificates {
    TlsCertificates {
        client_tls: tls.client.as_ref().map(|c| ClientTlsConfig {
            client_cert: c.chain_pem.clone(),
            client_key: c.key_pem.clone(),
        }),
        root_cert: Some(tls.roots_pem()),
    }
}

fn no_node(why: &'static str) -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::Io, why))
}

/// A connection to Redis however deployed, usable wherever the `redis` crate
/// takes one (`cmd.query_async(&mut conn)`).
#[derive(Clone)]
pub(super) enum Connection {
    /// One node, reconnecting by itself.
    Managed(ConnectionManager),
    /// One node, a connection of its own.
    Multiplexed(MultiplexedConnection),
    /// A cluster: each command goes to the node that holds its slot.
    Cluster(ClusterConnection),
    /// Whichever node Sentinel says is the master now.
    Sentinel(Arc<Master>),
}

impl redis::aio::ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Connection::Managed(c) => c.req_packed_command(cmd),
            Connection::Multiplexed(c) => c.req_packed_command(cmd),
            Connection::Cluster(c) => c.req_packed_command(cmd),
            Connection::Sentinel(master) => {
                let master = master.clone();
                Box::pin(async move {
                    let mut conn = master.current()?;
                    master.check(conn.req_packed_command(cmd).await)
                })
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Managed(c) => c.req_packed_commands(pipeline, offset, count),
            Connection::Multiplexed(c) => c.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Connection::Sentinel(master) => {
                let master = master.clone();
                Box::pin(async move {
                    let mut conn = master.current()?;
                    master.check(conn.req_packed_commands(pipeline, offset, count).await)
                })
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Managed(c) => c.get_db(),
            Connection::Multiplexed(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
            Connection::Sentinel(_) => 0,
        }
    }
}

/// The master Sentinel names, found again whenever it stops answering as
/// one (gone, or come back as a replica after a failover: `READONLY`).
pub(super) struct Master {
    sentinel: tokio::sync::Mutex<SentinelClient>,
    current: RwLock<Option<(redis::Client, ConnectionManager)>>,
    /// A lookup is on its way (requests do not wait for it: they go on
    /// without Redis, as when it is down).
    resolving: AtomicBool,
    config: ConnectionManagerConfig,
}

impl Master {
    /// The connection to the master as last found; starts finding it when
    /// none is known.
    fn current(self: &Arc<Self>) -> RedisResult<ConnectionManager> {
        let current = self.current.read().unwrap_or_else(|e| e.into_inner());
        match &*current {
            Some((_, conn)) => Ok(conn.clone()),
            None => {
                drop(current);
                self.find();
                Err(no_node("asking Sentinel for the master"))
            }
        }
    }

    /// Forgets the master when an answer shows it is no longer one.
    fn check<T>(self: &Arc<Self>, result: RedisResult<T>) -> RedisResult<T> {
        if let Err(e) = &result {
            let demoted = e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly);
            if demoted || e.is_io_error() || e.is_connection_dropped() {
                *self.current.write().unwrap_or_else(|e| e.into_inner()) = None;
                self.find();
            }
        }
        result
    }

    /// Asks Sentinel in a task of its own, so that a caller giving up does
    /// not abandon the lookup.
    fn find(self: &Arc<Self>) {
        if self.resolving.swap(true, Ordering::AcqRel) {
            return;
        }
        let master = self.clone();
        tokio::spawn(async move {
            if let Err(e) = master.client().await {
                tracing::debug!(error = %e, "Sentinel did not name a master");
            }
            master.resolving.store(false, Ordering::Release);
        });
    }

    /// The master's client, asking Sentinel when none is known.
    async fn client(&self) -> RedisResult<redis::Client> {
        if let Some((client, _)) = &*self.current.read().unwrap_or_else(|e| e.into_inner()) {
            return Ok(client.clone());
        }
        let mut sentinel = self.sentinel.lock().await;
        if let Some((client, _)) = &*self.current.read().unwrap_or_else(|e| e.into_inner()) {
            return Ok(client.clone());
        }
        let client = sentinel.async_get_client().await?;
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), self.config.clone())?;
        tracing::info!(master = ?client.get_connection_info().addr(), "Sentinel named the Redis master");
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Some((client.clone(), conn));
        Ok(client)
    }
}
