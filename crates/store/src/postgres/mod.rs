//! The PostgreSQL backend: the source of truth in production.
//!
//! The hot path is two single statements, each sent in batches with those
//! of concurrent requests (`batch/`): `Backend::begin` (a read, then
//! `INSERT … ON CONFLICT DO NOTHING` of the job and its first attempt) and
//! `Backend::commit` (the CAS). Every other change locks the job row
//! (`FOR UPDATE`), reads its attempts, and writes what the domain decided,
//! in one transaction; all writers of a job take its row lock first, so
//! they never interleave.
//!
//! Job-state changes are announced with `NOTIFY` (a trigger, see
//! `migrations/postgres`), tagged with the instance that made them, so a
//! replica ignores its own announcements: it has already rung its doorbell.
//!
//! The files, by seam: this one (the type, its pool and its sessions),
//! `backend.rs` (the writes: begin, the CAS commit, locked changes, lease
//! expiry), `records.rs` (reads and upkeep), `sql.rs` (the statements'
//! columns and the begin statement), `batch/` (begins and commits sent
//! together: the queue, `begin.rs`, `commit.rs` with the CAS), `rows.rs` (rows read back into the
//! domain), `write.rs` (a locked change written), `listen.rs` (`LISTEN`),
//! `migrate.rs`, `error.rs` (errors by what the caller can do; refusals
//! that name the setting to fix), `tls.rs` (TLS as `sslmode` says,
//! docs/design.md §16), and what the gateway checks of the server it
//! reaches (`replication.rs`, `budget.rs`, §13).

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres_rustls::MakeRustlsConnect;
use uuid::Uuid;

use super::StoreError;

mod backend;
mod batch;
mod budget;
mod error;
pub(crate) use error::is_lock_timeout;
mod listen;
mod migrate;
mod records;
mod replication;
mod rows;
mod settings;
mod sql;
mod tls;
mod write;

pub use batch::IN_FLIGHT as BATCHES_IN_FLIGHT;
pub use budget::Budget;
pub use replication::Replication;

pub use error::Refused;
use error::{at_start, map_pg};
pub use settings::{Check, ClientIdentity, PgSettings, PgTls, PgUrl, SslMode};

/// The PostgreSQL [`Backend`](crate::Backend).
#[derive(Clone)]
pub struct Postgres {
    /// Each worker's share of the pool and its batching queues
    /// ([`idemgate_domain::worker`]); one with a shared runtime.
    lanes: std::sync::Arc<[Lane]>,
    /// The pool's connection settings (`database_url`).
    pooled: Session,
    /// For sessions of their own: LISTEN and migrations
    /// (`database_direct_url`, or the pool's).
    direct: Session,
    instance: Uuid,
    /// `database_pool_size`: the lanes' pools together hold no more.
    pool_size: usize,
}

/// What one worker uses: its share of the pool, and its batching queues.
/// Begins and commits go to the database in batches (`batch/`); each queue
/// is started on first use, on the runtime that uses it, which is the
/// worker's own.
struct Lane {
    pool: Pool,
    begins: std::sync::OnceLock<batch::Queue<batch::BeginRequest>>,
    commits: std::sync::OnceLock<batch::Queue<batch::CommitRequest>>,
}

/// The fewest connections a worker's lane holds: a batch of begins and
/// one of commits on their way at once, and room beside them for a lone
/// settle or a large answer's commit (`batch/`), so that one slow
/// statement does not leave the worker's other requests waiting for the
/// pool.
const LANE_CONNECTIONS: usize = 4;

/// A pool of at most `size` connections opened as `pooled` says.
fn pool(pooled: &Session, settings: &PgSettings, size: usize) -> Result<Pool, StoreError> {
    let manager = Manager::from_config(
        pooled.config.clone(),
        pooled.tls.clone(),
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(settings.connect_timeout))
        .create_timeout(Some(settings.connect_timeout))
        .recycle_timeout(Some(settings.connect_timeout))
        .pre_recycle(replication::fence())
        .build()
        .map_err(|e| StoreError::Internal(Box::new(e)))
}

/// A session's connection, which its owner drives.
type Connection = tokio_postgres::Connection<
    tokio_postgres::Socket,
    <MakeRustlsConnect as tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket>>::Stream,
>;

/// How to open one connection, and the setting it came from.
#[derive(Clone)]
struct Session {
    config: tokio_postgres::Config,
    tls: MakeRustlsConnect,
    key: &'static str,
    mode: SslMode,
}

impl Session {
    fn new(url: &PgUrl, settings: &PgSettings, instance: Uuid) -> Result<Self, StoreError> {
        let mut config = session(&url.url, settings, instance)?;
        config.ssl_mode(tls::wire_mode(url.tls.mode));
        let describe = url.tls.describe();
        match (url.tls.mode, url.tls.check()) {
            (SslMode::Require, Check::Nothing) => {
                tracing::warn!(setting = url.key, "PostgreSQL TLS: {describe}")
            }
            _ => tracing::info!(setting = url.key, "PostgreSQL TLS: {describe}"),
        }
        Ok(Session {
            config,
            tls: tls::connector(&url.tls)?,
            key: url.key,
            mode: url.tls.mode,
        })
    }

    /// A connection of its own, outside the pool; a refusal that only a
    /// setting can fix names it ([`Refused`]).
    async fn connect(&self) -> Result<(tokio_postgres::Client, Connection), StoreError> {
        self.config
            .connect(self.tls.clone())
            .await
            .map_err(|e| at_start(self.key, self.mode, e))
    }
}

impl std::fmt::Debug for Postgres {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Postgres").finish_non_exhaustive()
    }
}

impl Postgres {
    /// Builds the pool for gateway `instance`. Connections are made lazily,
    /// so a database that is down at start-up makes requests answer 503
    /// rather than the gateway refuse to start.
    pub fn new(settings: &PgSettings, instance: Uuid) -> Result<Self, StoreError> {
        Postgres::for_workers(settings, instance, 1)
    }

    /// [`Postgres::new`] for `workers` worker threads that each run a
    /// runtime of their own: each gets a lane, its share of
    /// `database_pool_size` and queues of its own ([`idemgate_domain::worker`]). A
    /// lane holds [`LANE_CONNECTIONS`] at least; with fewer connections
    /// than that for each worker, workers share lanes (told at start-up).
    pub fn for_workers(
        settings: &PgSettings,
        instance: Uuid,
        workers: usize,
    ) -> Result<Self, StoreError> {
        let pooled = Session::new(&settings.url, settings, instance)?;
        let direct = match &settings.direct_url {
            Some(url) => Session::new(url, settings, instance)?,
            None => pooled.clone(),
        };
        let lanes = workers.clamp(1, (settings.pool_size / LANE_CONNECTIONS).max(1));
        if lanes < workers {
            tracing::warn!(
                workers,
                lanes,
                database_pool_size = settings.pool_size,
                "worker_runtime per_thread: {workers} worker threads share {lanes} lanes of the database pool (one lane holds {LANE_CONNECTIONS} connections at least); raise database_pool_size to {} to give each its own",
                workers * LANE_CONNECTIONS
            );
        }
        let workers = lanes;
        let lanes = (0..workers)
            .map(|n| {
                // The remainder goes to the first lanes: the sizes add up
                // to the pool size.
                let share =
                    settings.pool_size / workers + usize::from(n < settings.pool_size % workers);
                Ok(Lane {
                    pool: pool(&pooled, settings, share)?,
                    begins: std::sync::OnceLock::new(),
                    commits: std::sync::OnceLock::new(),
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(Postgres {
            lanes: lanes.into(),
            pooled,
            direct,
            instance,
            pool_size: settings.pool_size,
        })
    }

    /// With `database_direct_url` set, the migrations proved only it: opens
    /// one pooled connection too, so that a pool the server refuses for
    /// good (a certificate, `pg_hba.conf`) stops start-up naming
    /// `database_url`. A server that is away is not an error here.
    pub async fn check_pool(&self) -> Result<(), StoreError> {
        if self.direct.key == self.pooled.key {
            return Ok(());
        }
        match self.lane().pool.get().await {
            Err(deadpool_postgres::PoolError::Backend(e)) => {
                match at_start(self.pooled.key, self.pooled.mode, e) {
                    refused if !refused.is_transient() => Err(refused),
                    _ => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }

    /// Gives `client` back to the pool, unless it just carried a body
    /// larger than [`INLINE_ANSWER`](idemgate_domain::job::INLINE_ANSWER):
    /// its connection then keeps buffers that size (the encoder's and the
    /// socket's, which never shrink), so it is closed instead, and its
    /// memory returns (`docs/design.md` §18).
    fn release(client: deadpool_postgres::Client, carried: usize) {
        if carried > idemgate_domain::job::INLINE_ANSWER {
            drop(deadpool_postgres::Object::take(client));
        }
    }

    /// Begins sent and not yet in a batch on its way: they wait for one of
    /// the [`BATCHES_IN_FLIGHT`] batches of begins to return.
    pub fn begins_waiting(&self) -> usize {
        let waiting = |lane: &Lane| lane.begins.get().map_or(0, batch::Queue::waiting);
        self.lanes.iter().map(waiting).sum()
    }

    /// Begins a read answered before the begin statement (batches read
    /// first while most begins find their job: `batch/begin.rs`), in this
    /// process, whichever store they were sent to.
    pub fn begins_answered_by_read() -> u64 {
        batch::begin::answered_by_read()
    }

    /// Commits sent and not yet in a batch on its way.
    pub fn commits_waiting(&self) -> usize {
        let waiting = |lane: &Lane| lane.commits.get().map_or(0, batch::Queue::waiting);
        self.lanes.iter().map(waiting).sum()
    }

    /// The connections each worker's lane of the pool holds now, worker 0
    /// first (one lane with a shared runtime).
    pub fn connections_by_worker(&self) -> Vec<usize> {
        self.lanes
            .iter()
            .map(|lane| lane.pool.status().size)
            .collect()
    }

    /// The calling thread's worker's lane.
    fn lane(&self) -> &Lane {
        &self.lanes[idemgate_domain::worker::current() % self.lanes.len()]
    }

    /// The calling thread's worker's share of the pool.
    fn pool(&self) -> &Pool {
        &self.lane().pool
    }

    fn begins(&self) -> &batch::Queue<batch::BeginRequest> {
        let lane = self.lane();
        lane.begins
            .get_or_init(|| batch::Queue::start(lane.pool.clone()))
    }

    fn commits(&self) -> &batch::Queue<batch::CommitRequest> {
        let lane = self.lane();
        lane.commits
            .get_or_init(|| batch::Queue::start(lane.pool.clone()))
    }

    /// A pooled connection; an error says the store is unavailable.
    async fn pooled(pool: &Pool) -> Result<deadpool_postgres::Client, StoreError> {
        pool.get()
            .await
            .map_err(|e| StoreError::Unavailable(Box::new(e)))
    }

    async fn client(&self) -> Result<deadpool_postgres::Client, StoreError> {
        Postgres::pooled(self.pool()).await
    }
}

/// The session settings that keep cached plans on the indexes however
/// small a table was when they were made, and plan each statement once on
/// a connection rather than once a batch (`docs/design.md` §13, "Plans
/// made on a small table" and "One plan a statement").
const INDEXED_PLANS: &str = "-c enable_seqscan=off -c plan_cache_mode=force_generic_plan";

/// How often an idle connection's peer is probed once keep-alives start
/// (after 10 s of quiet), and how many unanswered probes end it.
const SILENCE_PROBE: Duration = Duration::from_secs(5);
const SILENCE_PROBES: u32 = 3;
/// How long data sent may go unacknowledged before the connection ends.
const UNACKNOWLEDGED: Duration = Duration::from_secs(30);

/// The connection settings for `url`: the gateway's defaults where the URL
/// says nothing, and this instance's name for the NOTIFY trigger.
fn session(
    url: &str,
    settings: &PgSettings,
    instance: Uuid,
) -> Result<tokio_postgres::Config, StoreError> {
    let mut config: tokio_postgres::Config =
        url.parse().map_err(|e| StoreError::Internal(Box::new(e)))?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(settings.connect_timeout);
    }
    config.keepalives_idle(Duration::from_secs(10));
    // A server gone silent (a VM lost, an address moved in a failover)
    // ends the connection within half a minute, not the operating
    // system's quarter of an hour: one hung batch holds up every begin,
    // or every commit, on this replica (docs/design.md §13, "A dead
    // connection ends its batch"). The URL's own values win.
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(SILENCE_PROBE);
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(SILENCE_PROBES);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(UNACKNOWLEDGED);
    }
    if config.get_application_name().is_none() {
        config.application_name("idemgate");
    }
    // The request path and the sweeps find their rows by an index (a key,
    // an id, an expiry); a plan cached while `jobs` was small would scan it
    // whole, per batch, until autovacuum's next pass (docs/design.md §13,
    // "Plans made on a small table"). A lock is waited for only so long: a
    // transaction left open on a job would otherwise keep every connection
    // that waits on it, and the pool with them ("A lock waited for"). Both
    // first, so the URL's `options` can undo them. `idemgate.instance` is
    // read by the NOTIFY trigger, so announcements name their origin.
    let locks = format!(
        "-c lock_timeout={}ms",
        settings.lock_timeout.as_millis().max(1)
    );
    let instance = format!("-c idemgate.instance={instance}");
    let options = [
        INDEXED_PLANS,
        &locks,
        config.get_options().unwrap_or_default(),
        &instance,
    ]
    .into_iter()
    .filter(|o| !o.is_empty())
    .collect::<Vec<_>>()
    .join(" ");
    config.options(&options);
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Settings of a test: what `session` reads of them.
    fn settings() -> PgSettings {
        let url = "postgres://u@h/db";
        PgSettings {
            url: PgUrl {
                key: "database_url",
                url: url.into(),
                tls: PgTls {
                    mode: SslMode::Disable,
                    roots: Vec::new(),
                    roots_from: String::new(),
                    identity: None,
                },
            },
            direct_url: None,
            pool_size: 1,
            connect_timeout: Duration::from_secs(1),
            lock_timeout: Duration::from_millis(1500),
        }
    }

    /// The gateway's session options go first and the URL's after them,
    /// so an operator's `enable_seqscan=on` is the one the server keeps.
    #[test]
    fn the_urls_options_are_applied_after_the_gateways() {
        let instance = Uuid::nil();
        let plain = session("postgres://u@h/db", &settings(), instance).unwrap();
        assert_eq!(
            plain.get_options(),
            Some(
                format!(
                    "-c enable_seqscan=off -c plan_cache_mode=force_generic_plan \
                     -c lock_timeout=1500ms -c idemgate.instance={instance}"
                )
                .as_str()
            )
        );
        let undone = "postgres://u@h/db?options=-c%20enable_seqscan%3Don";
        let undone = session(undone, &settings(), instance).unwrap();
        let options = undone.get_options().unwrap();
        let ours = options.find("enable_seqscan=off").unwrap();
        let theirs = options.find("enable_seqscan=on").unwrap();
        assert!(ours < theirs, "{options}");
        assert!(options.ends_with(&format!("-c idemgate.instance={instance}")));
    }

    /// A silent server ends a connection in seconds by default; the URL's
    /// own values are kept.
    #[test]
    fn a_silent_server_ends_the_connection_unless_the_url_says_otherwise() {
        let instance = Uuid::nil();
        let plain = session("postgres://u@h/db", &settings(), instance).unwrap();
        assert_eq!(plain.get_keepalives_interval(), Some(SILENCE_PROBE));
        assert_eq!(plain.get_keepalives_retries(), Some(SILENCE_PROBES));
        assert_eq!(plain.get_tcp_user_timeout(), Some(&UNACKNOWLEDGED));
        let url =
            "postgres://u@h/db?keepalives_interval=20&keepalives_retries=9&tcp_user_timeout=120";
        let theirs = session(url, &settings(), instance).unwrap();
        assert_eq!(
            theirs.get_keepalives_interval(),
            Some(Duration::from_secs(20))
        );
        assert_eq!(theirs.get_keepalives_retries(), Some(9));
        assert_eq!(
            theirs.get_tcp_user_timeout(),
            Some(&Duration::from_secs(120))
        );
    }
}
