//! The Redis fast path: committed responses cached for replay, and job
//! changes announced to every replica.
//!
//! Redis is a cache and a doorbell, never the arbiter:
//!
//! - A lookup that hits serves a replay with one Redis round trip (asked
//!   only while replays are common: `docs/design.md` §2). A miss,
//!   an error, a timeout, or an entry that fails validation falls back to the
//!   store; nothing is ever created here (job creation stays the database's
//!   `INSERT … ON CONFLICT`).
//! - An entry is written after a commit, and again whenever the store path
//!   replays a job (which repairs entries lost to a flush or found corrupt),
//!   by one writer task that takes every entry waiting into one round trip
//!   ([`FastPath::write_entries`]).
//! - An entry names its job, the request fingerprint and the job's expiry,
//!   and is authenticated under the replay key for the `(owner, key)` it was
//!   written for (`docs/design.md` §17; sealed with `[encryption]`). One that
//!   does not verify is a miss, counted and logged, never served or kept in
//!   memory; a nearly expired one is ignored. A fingerprint that differs is
//!   not answered from here: the store confirms the 409 (or finds the entry
//!   stale, replays, and repairs it).
//! - Small responses are kept inline; larger ones (over `redis_inline_max`)
//!   as a reference to the job, read back by its primary key.
//! - Every call has a short timeout (`redis_timeout`), so a slow or dead
//!   Redis costs at most that much latency. The connection is a managed one
//!   that reconnects by itself after Redis restarts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use tokio::sync::mpsc;
use uuid::Uuid;

use crate::Doorbell;
use idemgate_domain::fingerprint::Fingerprint;
use idemgate_domain::id::JobId;
use idemgate_domain::job::EXPIRY_MARGIN;
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_domain::response::StoredResponse;
use idemgate_domain::BoxError;

mod connection;
mod contact;
mod entry;
pub mod keys;
mod settings;
pub mod stream;

use crate::codec::{decode_headers, encode_headers};
use connection::Redis;
use contact::{describe, hint};
use stream::{open_record, record, record_attempt, Part};

pub use entry::{decode, encode, redis_key, stream_key, Binding, Entry, Tag, Unusable};
pub use keys::{EntryKeys, Rejection};
pub use settings::{ClientCert, RedisSettings, RedisTls, Topology, TopologyError};
pub use stream::{Ending, Piece};

/// The pub/sub channel job changes are announced on, after the
/// deployment's key prefix; the payload is the job id.
pub const CHANNEL: &str = "jobs";

/// The head of a mirrored stream, and whose it is.
#[derive(Debug)]
pub struct MirroredHead {
    /// The number of the attempt whose answer streams.
    pub attempt: i32,
    /// Its status.
    pub status: u16,
    /// Its headers.
    pub headers: Vec<(String, Bytes)>,
}

/// What a lookup found.
#[derive(Debug)]
pub enum Lookup {
    /// A valid entry.
    Hit(Entry),
    /// Nothing cached.
    Miss,
    /// Something unusable (not believed, about to expire), or Redis did not
    /// answer in time.
    Unusable,
}

/// The Redis fast path of one gateway.
pub struct FastPath {
    redis: Redis,
    settings: RedisSettings,
    healthy: AtomicBool,
    /// When the last outage was logged (ms after `born`, plus a minute so
    /// that the first is).
    warned_at: std::sync::atomic::AtomicU64,
    /// When the last record not believed was logged (the same way).
    rejection_warned_at: std::sync::atomic::AtomicU64,
    born: std::time::Instant,
    /// This gateway: announcements carry it, so a replica ignores its own.
    instance: Uuid,
    /// Authenticate (and with `[encryption]`, seal) every record written,
    /// and verify every record read.
    keys: Arc<EntryKeys>,
    /// Jobs whose entry was written lately: a thousand duplicates released
    /// together write it once, not a thousand times.
    written: std::sync::Mutex<std::collections::HashMap<JobId, std::time::Instant>>,
    /// Entries on their way to Redis, written by [`FastPath::write_entries`].
    entries: mpsc::Sender<Pending>,
    /// The writer's end, kept here so that a restarted writer takes it up.
    pending: Arc<tokio::sync::Mutex<mpsc::Receiver<Pending>>>,
}

/// An entry waiting to be written, for whom, and its lifetime in ms. It is
/// encoded (authenticated, sealed) by the writer, off the request's path.
struct Pending {
    owner: Owner,
    key: IdempotencyKey,
    entry: Entry,
    ttl: u64,
}

/// Entries waiting past this many are dropped (and counted as errors): a
/// missing entry costs one read from the store, never an answer.
const PENDING_MAX: usize = 4096;

/// The most entries one write carries.
const WRITE_BATCH: usize = 64;

impl FastPath {
    /// Prepares the connection without making it: a Redis that is down at
    /// start-up only means misses until it is up.
    pub fn new(
        settings: RedisSettings,
        instance: Uuid,
        keys: Arc<EntryKeys>,
    ) -> Result<Self, redis::RedisError> {
        let (entries, pending) = mpsc::channel(PENDING_MAX);
        Ok(FastPath {
            redis: Redis::new(&settings)?,
            settings,
            healthy: AtomicBool::new(true),
            warned_at: Default::default(),
            rejection_warned_at: Default::default(),
            born: std::time::Instant::now(),
            instance,
            keys,
            written: Default::default(),
            entries,
            pending: Arc::new(tokio::sync::Mutex::new(pending)),
        })
    }

    /// The cached replay for `(owner, key)`, if any and valid.
    pub async fn lookup(&self, owner: &Owner, key: &IdempotencyKey) -> Lookup {
        let mut conn = self.redis.conn();
        let binding = Binding::of(owner, key);
        let cmd = redis::cmd("GET")
            .arg(redis_key(&self.settings.key_prefix, &binding, owner, key))
            .clone();
        let found: Option<Vec<u8>> = match self.call(cmd.query_async(&mut conn)).await {
            Some(found) => found,
            None => {
                count("error");
                return Lookup::Unusable;
            }
        };
        let Some(bytes) = found else {
            count("miss");
            return Lookup::Miss;
        };
        match decode(
            Bytes::from(bytes),
            owner,
            key,
            &self.keys,
            SystemTime::now(),
        ) {
            Ok(entry) => {
                count("hit");
                Lookup::Hit(entry)
            }
            Err(Unusable::Expiring) => {
                count("invalid");
                Lookup::Unusable
            }
            Err(Unusable::Rejected(why)) => {
                count("invalid");
                self.rejected::<()>("replay entry", why);
                Lookup::Unusable
            }
        }
    }

    /// Counts a record read from Redis that is not believed, and logs it at
    /// most once a minute: it is served to nobody, and the store answers.
    fn rejected<T>(&self, what: &'static str, why: Rejection) -> Option<T> {
        metrics::counter!("idemgate_replay_entries_rejected_total", "reason" => why.reason())
            .increment(1);
        if self.may_warn(&self.rejection_warned_at) {
            tracing::warn!(
                record = what,
                reason = why.reason(),
                "a {what} in Redis did not verify ({why}) and was not served; the store answers instead. \
                 Check for a writer to Redis other than this deployment's gateways, and that every replica has \
                 the same replay keys (replay_key and replay_previous_keys, or the [encryption] keys they are \
                 derived from) and the same [encryption] setting. Further ones within a minute are only counted, \
                 in idemgate_replay_entries_rejected_total"
            );
        }
        None
    }

    /// Whether `job`'s entry should be written now: not when it was written
    /// in the last second (it is then noted as written).
    pub fn needs_entry(&self, job: JobId) -> bool {
        let now = std::time::Instant::now();
        let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        if written.len() >= 4096 {
            written.retain(|_, at| now.duration_since(*at) < Duration::from_secs(1));
        }
        match written.get(&job) {
            Some(at) if now.duration_since(*at) < Duration::from_secs(1) => false,
            _ => {
                written.insert(job, now);
                true
            }
        }
    }

    /// Caches a committed response until shortly before its job expires:
    /// queued here, encoded and written by [`FastPath::write_entries`] with
    /// the others waiting then, in one round trip.
    pub fn remember(
        &self,
        owner: &Owner,
        key: &IdempotencyKey,
        job: JobId,
        fingerprint: Fingerprint,
        expires_at: SystemTime,
        response: &StoredResponse,
    ) {
        let Some(ttl) = expires_at
            .checked_sub(EXPIRY_MARGIN)
            .and_then(|t| t.duration_since(SystemTime::now()).ok())
            .filter(|ttl| !ttl.is_zero())
        else {
            return;
        };
        let entry = Entry {
            job,
            fingerprint,
            expires_at,
            response: (response.body.len() <= self.settings.inline_max).then(|| response.clone()),
        };
        let pending = Pending {
            owner: owner.clone(),
            key: key.clone(),
            entry,
            ttl: ttl.as_millis() as u64,
        };
        if self.entries.try_send(pending).is_err() {
            metrics::counter!("idemgate_fastpath_errors_total").increment(1);
        }
    }

    /// Writes the entries [`FastPath::remember`] made, for as long as it runs
    /// (a supervised task): each write takes every entry waiting (up to
    /// 64), one pipeline on a node, one `SET` each at once on a cluster
    /// (whose keys live on different masters). Best effort, like every
    /// entry: one that fails is counted, and the store answers its replays.
    pub async fn write_entries(self: Arc<Self>) -> Result<(), BoxError> {
        let this = &*self;
        let mut pending = this.pending.lock().await;
        let mut batch = Vec::with_capacity(WRITE_BATCH);
        while pending.recv_many(&mut batch, WRITE_BATCH).await > 0 {
            let sets: Vec<redis::Cmd> = batch.drain(..).map(|p| this.set(p)).collect();
            let written = match this.settings.topology {
                Topology::Cluster(_) => {
                    let each = sets.iter().map(|set| async move {
                        let mut conn = this.redis.conn();
                        this.call(set.query_async::<()>(&mut conn)).await
                    });
                    let done = futures_util::future::join_all(each).await;
                    done.iter().filter(|d| d.is_some()).count()
                }
                _ => {
                    let count = sets.len();
                    let mut pipe = redis::pipe();
                    for set in sets {
                        pipe.add_command(set).ignore();
                    }
                    let mut conn = this.redis.conn();
                    let done = this.call(pipe.query_async::<()>(&mut conn)).await;
                    done.map_or(0, |()| count)
                }
            };
            metrics::counter!("idemgate_fastpath_writes_total").increment(written as u64);
        }
        Ok(())
    }

    /// The `SET` of one entry under its key, expiring with it.
    fn set(&self, pending: Pending) -> redis::Cmd {
        let Pending {
            owner,
            key,
            entry,
            ttl,
        } = pending;
        let binding = Binding::of(&owner, &key);
        redis::cmd("SET")
            .arg(redis_key(&self.settings.key_prefix, &binding, &owner, &key))
            .arg(encode(&entry, &owner, &key, &self.keys))
            .arg("PX")
            .arg(ttl)
            .clone()
    }

    /// Whether Redis answers a `PING`, for the health report (not counted
    /// as a fast-path error: nothing was asked of the fast path). The
    /// health watch bounds how long it may take.
    pub async fn ping(&self) -> Result<(), String> {
        let mut conn = self.redis.conn();
        let cmd = redis::cmd("PING");
        cmd.query_async::<String>(&mut conn)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }

    /// Runs a Redis call under the configured timeout; `None` on error or
    /// timeout (counted, and logged once per outage, at most once a
    /// minute: a Redis that flaps under load must not flood the logs).
    async fn call<T>(
        &self,
        fut: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Option<T> {
        let start = std::time::Instant::now();
        let result = tokio::time::timeout(self.settings.timeout, fut).await;
        metrics::histogram!("idemgate_fastpath_seconds").record(start.elapsed().as_secs_f64());
        let result = match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {:?}", self.settings.timeout)),
        };
        match result {
            Ok(value) => {
                if !self.healthy.swap(true, Ordering::Relaxed) {
                    tracing::info!("Redis is answering again; fast path back on");
                }
                Some(value)
            }
            Err(e) => {
                metrics::counter!("idemgate_fastpath_errors_total").increment(1);
                if self.healthy.swap(false, Ordering::Relaxed) && self.may_warn(&self.warned_at) {
                    tracing::warn!(error = %e, "Redis unavailable; serving from the store alone (further failures within a minute are only counted, in idemgate_fastpath_errors_total)");
                }
                None
            }
        }
    }

    /// Whether a minute has passed since the last warning noted in
    /// `warned_at` (and if so, notes this one).
    fn may_warn(&self, warned_at: &std::sync::atomic::AtomicU64) -> bool {
        let now = self.born.elapsed().as_millis() as u64 + 60_000;
        let last = warned_at.load(Ordering::Relaxed);
        now >= last + 60_000
            && warned_at
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// Publishes the job changes rung on this replica (`<job> <instance>`),
    /// for as long as it runs (a supervised task, stopped at shutdown).
    pub async fn announce(
        self: Arc<Self>,
        changes: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<JobId>>>,
    ) -> Result<(), BoxError> {
        let mut changes = changes.lock().await;
        while let Some(job) = changes.recv().await {
            let mut conn = self.redis.conn();
            let cmd = redis::cmd("PUBLISH")
                .arg(format!("{}{CHANNEL}", self.settings.key_prefix))
                .arg(format!("{job} {}", self.instance))
                .clone();
            let _ = self.call(cmd.query_async::<i64>(&mut conn)).await;
        }
        Ok(())
    }

    /// Rings the local doorbell for changes announced by other replicas,
    /// until the subscription is lost (the supervisor subscribes again);
    /// rings every bell once subscribed, since announcements made while
    /// nobody listened were lost.
    pub async fn listen(self: Arc<Self>, doorbell: Arc<Doorbell>) -> Result<(), BoxError> {
        let mut pubsub = self.redis.subscriber().await?;
        pubsub
            .subscribe(format!("{}{CHANNEL}", self.settings.key_prefix))
            .await?;
        doorbell.ring_all();
        let mut messages = pubsub.into_on_message();
        while let Some(message) = messages.next().await {
            let payload: String = message.get_payload()?;
            let mut parts = payload.split(' ');
            let job = parts.next().and_then(|j| j.parse().ok());
            let origin = parts.next().and_then(|i| i.parse::<Uuid>().ok());
            if let Some(job) = job {
                if origin != Some(self.instance) {
                    metrics::counter!("idemgate_wakeups_total", "source" => "redis").increment(1);
                    doorbell.ring_local(JobId(job));
                }
            }
        }
        Err("the Redis subscription ended".into())
    }

    /// Connects once and logs how that went.
    pub async fn first_contact(self: Arc<Self>) {
        let reached = async {
            let mut conn = self.redis.dedicated().await?;
            redis::cmd("PING").query_async::<String>(&mut conn).await
        }
        .await;
        let what = describe(&self.settings);
        match reached {
            Ok(_) => tracing::info!(redis = %what, "Redis reached"),
            Err(e) => tracing::warn!(
                error = %e,
                "redis_url: Redis not reached ({what}): {}; requests go on from the store",
                hint(&e, &self.settings)
            ),
        }
    }

    /// Mirrors the streamed answer of attempt number `attempt` of `job` on
    /// the job's Redis Stream as it grows (the head, each piece), in a task
    /// of its own and off every client's path, so duplicates on other
    /// replicas can join it live; announces the job once the head is there.
    /// The stream is emptied as the head is written: an earlier attempt's
    /// answer (one that failed in-band, say, and left the job open) is never
    /// read as this one's, and its records name their attempt, which a
    /// reader checks (`docs/design.md` §10). Best effort: if Redis fails
    /// the mirror stops, and those duplicates complete the answer from the
    /// store.
    #[allow(clippy::too_many_arguments)] // the stream's own: job, head, pieces
    pub fn mirror(
        self: &Arc<Self>,
        tag: &Tag,
        (job, attempt): (JobId, i32),
        (status, headers): (u16, &[(String, Bytes)]),
        pieces: impl Stream<Item = Piece> + Send + 'static,
        ttl: Duration,
        doorbell: Arc<Doorbell>,
    ) {
        let fast = self.clone();
        let key = stream_key(&self.settings.key_prefix, tag, job);
        let mut head = status.to_be_bytes().to_vec();
        head.extend_from_slice(&encode_headers(headers));
        tokio::spawn(async move {
            let mut conn = fast.redis.conn();
            let start = redis::pipe()
                .cmd("DEL")
                .arg(&key)
                .ignore()
                .cmd("XADD")
                .arg(&key)
                .arg("*")
                .arg(Part::Head.field())
                .arg(record(&fast.keys, (job, attempt), Part::Head, 0, &head))
                .ignore()
                .cmd("PEXPIRE")
                .arg(&key)
                .arg(ttl.as_millis() as u64)
                .ignore()
                .clone();
            if fast
                .call(start.query_async::<()>(&mut conn))
                .await
                .is_none()
            {
                return;
            }
            doorbell.ring(job);
            let mut pieces = std::pin::pin!(pieces);
            let mut chunks = 0u64;
            while let Some(piece) = pieces.next().await {
                let (part, index, value) = match piece {
                    Piece::Chunk(chunk) => {
                        chunks += 1;
                        (Part::Chunk, chunks - 1, chunk)
                    }
                    // The end counts the chunks before it.
                    Piece::End(ending) => (Part::End, chunks, Bytes::from(vec![ending.byte()])),
                };
                let value = record(&fast.keys, (job, attempt), part, index, &value);
                let field = part.field();
                let add = redis::cmd("XADD")
                    .arg(&key)
                    .arg("*")
                    .arg(field)
                    .arg(value)
                    .clone();
                if fast
                    .call(add.query_async::<String>(&mut conn))
                    .await
                    .is_none()
                {
                    return;
                }
            }
        });
    }

    /// The head of the stream another replica mirrors for `job`, and the
    /// number of the attempt whose answer it is (each record is bound to
    /// it, so Redis cannot pass one attempt's head off as another's);
    /// `None` when Redis has none (or does not answer). Whether that
    /// attempt is one to join is the caller's to decide.
    pub async fn stream_head(&self, tag: &Tag, job: JobId) -> Option<MirroredHead> {
        let mut conn = self.redis.conn();
        let first = redis::cmd("XRANGE")
            .arg(stream_key(&self.settings.key_prefix, tag, job))
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1)
            .clone();
        let reply: redis::streams::StreamRangeReply =
            self.call(first.query_async(&mut conn)).await?;
        let entry = reply.ids.first()?;
        let found = entry.get::<Vec<u8>>(Part::Head.field())?;
        let attempt = record_attempt(&found)?;
        let head = match open_record(&self.keys, (job, attempt), Part::Head, &found) {
            Ok((0, head)) => head,
            Ok(_) => return self.rejected("mirrored stream part", Rejection::Truncated),
            Err(why) => return self.rejected("mirrored stream part", why),
        };
        let (status, headers) = head.split_at_checked(2)?;
        Some(MirroredHead {
            attempt,
            status: u16::from_be_bytes(status.try_into().ok()?),
            headers: decode_headers(headers)?,
        })
    }

    /// Hands each chunk of the Redis Stream the answer of attempt number
    /// `attempt` of `job` is mirrored on to `push`, from the start, until
    /// the verdict: how the stream ended. Fails when Redis fails, nothing arrives for `stall` (the
    /// replica recording it may have died), or a part does not verify or
    /// comes out of order (counted as a rejection): the caller then
    /// completes the answer from the store, which only appends to what was
    /// pushed, all of it verified.
    pub async fn feed(
        &self,
        tag: &Tag,
        (job, attempt): (JobId, i32),
        stall: Duration,
        mut push: impl FnMut(Bytes),
    ) -> Result<Ending, BoxError> {
        let key = stream_key(&self.settings.key_prefix, tag, job);
        // Blocking reads hold their connection: one of its own.
        let mut conn = self.redis.dedicated().await?;
        let mut last = "0".to_owned();
        let mut chunks = 0u64;
        let mut quiet_since = tokio::time::Instant::now();
        loop {
            let read = redis::cmd("XREAD")
                .arg("COUNT")
                .arg(256)
                .arg("BLOCK")
                .arg(1000)
                .arg("STREAMS")
                .arg(&key)
                .arg(&last)
                .clone();
            let reply: Option<redis::streams::StreamReadReply> =
                tokio::time::timeout(Duration::from_secs(3), read.query_async(&mut conn))
                    .await
                    .map_err(|_| "reading the stream from Redis timed out")??;
            let entries = reply.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids);
            let mut any = false;
            for entry in entries {
                any = true;
                last = entry.id.clone();
                let (part, value) = match (
                    entry.get::<Vec<u8>>(Part::Chunk.field()),
                    entry.get::<Vec<u8>>(Part::End.field()),
                ) {
                    (Some(chunk), _) => (Part::Chunk, chunk),
                    (None, Some(end)) => (Part::End, end),
                    // The head (read by `stream_head`), or a field no
                    // release writes: nothing to take.
                    (None, None) => continue,
                };
                // Emptied by a later attempt's mirror, or a late part of an
                // earlier one's: not this stream's, and not forged either.
                if record_attempt(&value).is_some_and(|other| other != attempt) {
                    return Err("the mirrored stream is another attempt's now".into());
                }
                let (index, payload) = open_record(&self.keys, (job, attempt), part, &value)
                    .map_err(|why| self.refuse(why))?;
                if index != chunks {
                    return Err(self.refuse(Rejection::Truncated));
                }
                if part == Part::End {
                    return match payload.as_slice() {
                        [byte] => {
                            Ending::of_byte(*byte).ok_or_else(|| self.refuse(Rejection::Malformed))
                        }
                        _ => Err(self.refuse(Rejection::Malformed)),
                    };
                }
                chunks += 1;
                push(Bytes::from(payload));
            }
            if any {
                quiet_since = tokio::time::Instant::now();
            } else if quiet_since.elapsed() > stall {
                return Err("the mirrored stream went quiet".into());
            }
        }
    }

    /// Counts and logs a part of a mirrored stream not believed, and says
    /// why the copy is completed from the store instead.
    fn refuse(&self, why: Rejection) -> BoxError {
        self.rejected::<()>("mirrored stream part", why);
        format!("a part of the mirrored stream was not believed ({why})").into()
    }
}

fn count(result: &'static str) {
    metrics::counter!("idemgate_fastpath_lookups_total", "result" => result).increment(1);
}
