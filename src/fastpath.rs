//! The Redis fast path: committed responses cached for replay, and job
//! changes announced to every replica.
//!
//! Redis is a cache and a doorbell, never the arbiter:
//!
//! - A lookup that hits serves a replay with one Redis round trip. A miss,
//!   an error, a timeout, or an entry that fails validation falls back to the
//!   store; nothing is ever created here (job creation stays the database's
//!   `INSERT … ON CONFLICT`).
//! - An entry is written after a commit, and again whenever the store path
//!   replays a job (which repairs entries lost to a flush or found corrupt).
//! - An entry names its job, the request fingerprint, the `(owner, key)` it
//!   was written for and the job's expiry, and carries a checksum. A corrupt,
//!   misplaced or nearly expired entry is ignored. A fingerprint that differs
//!   is not answered from here: the store confirms the 409 (or finds the entry
//!   stale, replays, and repairs it).
//! - Small responses are kept inline; larger ones (over `redis_inline_max`)
//!   as a reference to the job, read back by its primary key.
//! - Every call has a short timeout (`redis_timeout`), so a slow or dead
//!   Redis costs at most that much latency. The connection is a managed one
//!   that reconnects by itself after Redis restarts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::fingerprint::Fingerprint;
use crate::job::{JobId, StoredResponse};
use crate::key::{IdempotencyKey, Owner};
use crate::recording::{End, Next, Recording};
use crate::seal::{self, Sealer};
use crate::store::codec::{decode_headers, encode_headers};
use crate::store::Doorbell;
use crate::BoxError;
use uuid::Uuid;

/// The pub/sub channel job changes are announced on; the payload is the job id.
pub const CHANNEL: &str = "idemgate:jobs";
const MAGIC: &[u8; 4] = b"IGR1";
/// Entries this close to their job's expiry are not trusted: the gateway's
/// clock and the database's may disagree by this much.
const EXPIRY_MARGIN: Duration = Duration::from_secs(5);

/// Fast-path settings.
#[derive(Debug, Clone)]
pub struct FastPathSettings {
    /// `redis://host:port/db`.
    pub url: String,
    /// Longest a Redis call may take before the request goes on without it.
    pub timeout: Duration,
    /// Largest response body kept inline; larger ones are kept by reference.
    pub inline_max: usize,
}

/// A cached entry, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The job it replays.
    pub job: JobId,
    /// The fingerprint of the request that made the job.
    pub fingerprint: Fingerprint,
    /// When the job expires.
    pub expires_at: SystemTime,
    /// The response, or `None` when kept by reference (read it from the store).
    pub response: Option<StoredResponse>,
}

/// What a lookup found.
#[derive(Debug)]
pub enum Lookup {
    /// A valid entry.
    Hit(Entry),
    /// Nothing cached.
    Miss,
    /// Something unusable (corrupt, for another key, about to expire), or
    /// Redis did not answer in time.
    Unusable,
}

/// The Redis fast path of one gateway.
pub struct FastPath {
    client: redis::Client,
    conn: ConnectionManager,
    settings: FastPathSettings,
    healthy: AtomicBool,
    /// This gateway: announcements carry it, so a replica ignores its own.
    instance: Uuid,
    /// Seals cached responses as the store seals stored ones.
    sealer: Option<Arc<Sealer>>,
    /// Jobs whose entry was written lately: a thousand duplicates released
    /// together write it once, not a thousand times.
    written: std::sync::Mutex<std::collections::HashMap<JobId, std::time::Instant>>,
}

impl FastPath {
    /// Prepares the connection without making it: a Redis that is down at
    /// start-up only means misses until it is up.
    pub fn new(
        settings: FastPathSettings,
        instance: Uuid,
        sealer: Option<Arc<Sealer>>,
    ) -> Result<Self, redis::RedisError> {
        let client = redis::Client::open(settings.url.as_str())?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(settings.timeout.max(Duration::from_millis(100))))
            .set_response_timeout(Some(settings.timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), config)?;
        Ok(FastPath {
            client,
            conn,
            settings,
            healthy: AtomicBool::new(true),
            instance,
            sealer,
            written: Default::default(),
        })
    }

    /// The cached replay for `(owner, key)`, if any and valid.
    pub async fn lookup(&self, owner: &Owner, key: &IdempotencyKey) -> Lookup {
        let mut conn = self.conn.clone();
        let cmd = redis::cmd("GET").arg(redis_key(owner, key)).clone();
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
        let entry = decode(&bytes, owner, key, SystemTime::now()).and_then(|mut entry| {
            if let Some(response) = entry.response.take() {
                entry.response =
                    Some(seal::open(self.sealer.as_deref(), entry.job, response).ok()?);
            }
            Some(entry)
        });
        match entry {
            Some(entry) => {
                count("hit");
                Lookup::Hit(entry)
            }
            None => {
                count("invalid");
                tracing::warn!(%owner, key = %key, "ignoring an unusable fast-path entry; the store answers and it is rewritten");
                Lookup::Unusable
            }
        }
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

    /// Caches a committed response until shortly before its job expires.
    pub async fn remember(
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
            response: (response.body.len() <= self.settings.inline_max).then(|| {
                match &self.sealer {
                    Some(sealer) => sealer.seal(job, response),
                    None => response.clone(),
                }
            }),
        };
        let bytes = encode(&entry, owner, key);
        let mut conn = self.conn.clone();
        let cmd = redis::cmd("SET")
            .arg(redis_key(owner, key))
            .arg(bytes)
            .arg("PX")
            .arg(ttl.as_millis() as u64)
            .clone();
        if self.call(cmd.query_async::<()>(&mut conn)).await.is_some() {
            metrics::counter!("idemgate_fastpath_writes_total").increment(1);
        }
    }

    /// Runs a Redis call under the configured timeout; `None` on error or
    /// timeout (counted, and logged once per outage).
    async fn call<T>(
        &self,
        fut: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Option<T> {
        let result = match tokio::time::timeout(self.settings.timeout, fut).await {
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
                if self.healthy.swap(false, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "Redis unavailable; serving from the store alone");
                }
                None
            }
        }
    }

    /// Publishes the job changes rung on this replica (`<job> <instance>`),
    /// for as long as it runs (a supervised task, stopped at shutdown).
    pub async fn announce(
        self: Arc<Self>,
        changes: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<JobId>>>,
    ) -> Result<(), BoxError> {
        let mut changes = changes.lock().await;
        while let Some(job) = changes.recv().await {
            let mut conn = self.conn.clone();
            let cmd = redis::cmd("PUBLISH")
                .arg(CHANNEL)
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
        let connect = tokio::time::timeout(
            self.settings.timeout.max(Duration::from_millis(500)),
            self.client.get_async_pubsub(),
        );
        let mut pubsub = connect
            .await
            .map_err(|_| "connecting to Redis timed out")??;
        pubsub.subscribe(CHANNEL).await?;
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
}

/// The Redis Stream a streamed answer of `job` is mirrored on.
pub fn stream_key(job: JobId) -> String {
    format!("idemgate:stream:{job}")
}

/// Stream entry fields: the head, a chunk, the verdict.
const HEAD: &str = "h";
const CHUNK: &str = "c";
const VERDICT: &str = "e";

impl FastPath {
    /// Mirrors `recording` on its Redis Stream as it grows (the head, each
    /// chunk, the verdict), in a task of its own and off every client's
    /// path, so duplicates on other replicas can join it live; announces the
    /// job once the head is there. Best effort: if Redis fails the mirror
    /// stops, and those duplicates complete the answer from the store.
    pub fn mirror(
        self: &Arc<Self>,
        recording: &Arc<Recording>,
        ttl: Duration,
        doorbell: Arc<Doorbell>,
    ) {
        let (fast, recording) = (self.clone(), recording.clone());
        tokio::spawn(async move {
            let job = recording.job();
            let key = stream_key(job);
            let (status, headers) = recording.head();
            let mut head = status.to_be_bytes().to_vec();
            head.extend_from_slice(&encode_headers(headers));
            let mut conn = fast.conn.clone();
            let start = redis::pipe()
                .cmd("XADD")
                .arg(&key)
                .arg("*")
                .arg(HEAD)
                .arg(fast.seal_bytes(job, &head))
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
            let mut follow = std::pin::pin!(recording.follow());
            while let Some(next) = follow.next().await {
                let (field, value) = match next {
                    Next::Chunk(chunk) => (CHUNK, fast.seal_bytes(job, &chunk)),
                    Next::End(end) => (VERDICT, verdict(end).as_bytes().to_vec()),
                };
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

    /// The head (status, headers) of a stream another replica mirrors for
    /// `job`; `None` when Redis has none (or does not answer).
    pub async fn stream_head(&self, job: JobId) -> Option<(u16, Vec<(String, Bytes)>)> {
        let mut conn = self.conn.clone();
        let first = redis::cmd("XRANGE")
            .arg(stream_key(job))
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1)
            .clone();
        let reply: redis::streams::StreamRangeReply =
            self.call(first.query_async(&mut conn)).await?;
        let entry = reply.ids.first()?;
        let head = self.open_bytes(job, &entry.get::<Vec<u8>>(HEAD)?)?;
        let (status, headers) = head.split_at_checked(2)?;
        Some((
            u16::from_be_bytes(status.try_into().ok()?),
            decode_headers(headers)?,
        ))
    }

    /// Feeds `recording` from the Redis Stream its job is mirrored on, from
    /// the start, until the verdict, which it returns. Fails when Redis fails
    /// or nothing arrives for `stall` (the replica recording it may have
    /// died): the caller then completes the answer from the store.
    pub async fn feed(&self, recording: &Recording, stall: Duration) -> Result<End, BoxError> {
        let job = recording.job();
        let key = stream_key(job);
        // Blocking reads hold their connection: one of its own.
        let mut conn = tokio::time::timeout(
            self.settings.timeout.max(Duration::from_millis(500)),
            self.client.get_multiplexed_async_connection(),
        )
        .await
        .map_err(|_| "connecting to Redis timed out")??;
        let mut last = "0".to_owned();
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
                if let Some(chunk) = entry.get::<Vec<u8>>(CHUNK) {
                    let chunk = self
                        .open_bytes(job, &chunk)
                        .ok_or("a mirrored chunk does not open")?;
                    recording.push(Bytes::from(chunk));
                } else if let Some(end) = entry.get::<String>(VERDICT) {
                    return Ok(if end == verdict(End::Committed) {
                        End::Committed
                    } else {
                        End::Cut
                    });
                }
            }
            if any {
                quiet_since = tokio::time::Instant::now();
            } else if quiet_since.elapsed() > stall {
                return Err("the mirrored stream went quiet".into());
            }
        }
    }

    fn seal_bytes(&self, job: JobId, plain: &[u8]) -> Vec<u8> {
        match &self.sealer {
            Some(sealer) => {
                let mut sealed = vec![sealer.active().len() as u8];
                sealed.extend_from_slice(sealer.active().as_bytes());
                sealed.extend_from_slice(&sealer.seal_bytes(job, plain));
                sealed
            }
            None => plain.to_vec(),
        }
    }

    fn open_bytes(&self, job: JobId, value: &[u8]) -> Option<Vec<u8>> {
        match &self.sealer {
            Some(sealer) => {
                let (&len, rest) = value.split_first()?;
                let (key, sealed) = rest.split_at_checked(len as usize)?;
                sealer
                    .open_bytes(std::str::from_utf8(key).ok()?, job, sealed)
                    .ok()
            }
            None => Some(value.to_vec()),
        }
    }
}

fn verdict(end: End) -> &'static str {
    match end {
        End::Committed => "committed",
        End::Live | End::Cut => "cut",
    }
}

fn count(result: &'static str) {
    metrics::counter!("idemgate_fastpath_lookups_total", "result" => result).increment(1);
}

/// The Redis key of a replay: owner (`anonymous` or `sha256:<hex>`, never a
/// colon beyond that) and key.
pub fn redis_key(owner: &Owner, key: &IdempotencyKey) -> String {
    format!("idemgate:replay:{owner}:{key}")
}

/// Binds an entry to the `(owner, key)` it was written for.
fn slot(owner: &Owner, key: &IdempotencyKey) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(owner.as_str().as_bytes());
    h.update([0]);
    h.update(key.as_str().as_bytes());
    h.finalize().into()
}

/// The entry for `(owner, key)`: `IGR1 | slot 32 | job 16 | fingerprint 32 |
/// expires ms 8 | kind 1 | [status 2 | headers len 4 | headers | body] |
/// checksum 8`, where the slot binds it to that `(owner, key)`.
pub fn encode(entry: &Entry, owner: &Owner, key: &IdempotencyKey) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&slot(owner, key));
    out.extend_from_slice(entry.job.0.as_bytes());
    out.extend_from_slice(&entry.fingerprint.0);
    let ms = entry
        .expires_at
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    out.extend_from_slice(&ms.to_be_bytes());
    match &entry.response {
        None => out.push(0),
        Some(r) => {
            out.push(1);
            out.extend_from_slice(&r.status.to_be_bytes());
            let headers = encode_headers(&r.headers);
            out.extend_from_slice(&(headers.len() as u32).to_be_bytes());
            out.extend_from_slice(&headers);
            out.extend_from_slice(&r.body);
        }
    }
    let checksum = Sha256::digest(&out);
    out.extend_from_slice(&checksum[..8]);
    out
}

/// Reads an entry back, refusing anything corrupt, written for another
/// `(owner, key)`, or within the expiry margin at `now`.
pub fn decode(bytes: &[u8], owner: &Owner, key: &IdempotencyKey, now: SystemTime) -> Option<Entry> {
    let (payload, checksum) = bytes.split_at_checked(bytes.len().checked_sub(8)?)?;
    if Sha256::digest(payload)[..8] != *checksum {
        return None;
    }
    let rest = payload.strip_prefix(MAGIC)?;
    let (written_for, rest) = rest.split_at_checked(32)?;
    if written_for != slot(owner, key) {
        return None;
    }
    let (job, rest) = rest.split_at_checked(16)?;
    let (fingerprint, rest) = rest.split_at_checked(32)?;
    let (ms, rest) = rest.split_at_checked(8)?;
    let expires_at = UNIX_EPOCH + Duration::from_millis(u64::from_be_bytes(ms.try_into().ok()?));
    if expires_at.checked_sub(EXPIRY_MARGIN)? <= now {
        return None;
    }
    let (&kind, rest) = rest.split_first()?;
    let response = match kind {
        0 if rest.is_empty() => None,
        1 => {
            let (status, rest) = rest.split_at_checked(2)?;
            let (len, rest) = rest.split_at_checked(4)?;
            let len = u32::from_be_bytes(len.try_into().ok()?) as usize;
            let (headers, body) = rest.split_at_checked(len)?;
            Some(StoredResponse {
                status: u16::from_be_bytes(status.try_into().ok()?),
                headers: decode_headers(headers)?,
                body: Bytes::copy_from_slice(body),
            })
        }
        _ => return None,
    };
    Some(Entry {
        job: JobId(uuid::Uuid::from_slice(job).ok()?),
        fingerprint: Fingerprint::from_slice(fingerprint)?,
        expires_at,
        response,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(response: Option<StoredResponse>) -> Entry {
        Entry {
            job: JobId::new(),
            fingerprint: Fingerprint([3; 32]),
            // Whole milliseconds, as stored.
            expires_at: UNIX_EPOCH
                + Duration::from_millis(
                    SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .unwrap()
                        .as_millis() as u64
                        + 3_600_000,
                ),
            response,
        }
    }

    fn at() -> (Owner, IdempotencyKey) {
        (Owner::from_header(None), IdempotencyKey::new("k").unwrap())
    }

    #[test]
    fn entries_round_trip_inline_and_by_reference() {
        let (o, k) = at();
        let inline = entry(Some(StoredResponse {
            status: 201,
            headers: vec![("x-a".into(), Bytes::from_static(b"1"))],
            body: Bytes::from_static(b"\x00body\xff"),
        }));
        assert_eq!(
            decode(&encode(&inline, &o, &k), &o, &k, SystemTime::now()),
            Some(inline)
        );
        let reference = entry(None);
        assert_eq!(
            decode(&encode(&reference, &o, &k), &o, &k, SystemTime::now()),
            Some(reference)
        );
    }

    #[test]
    fn corrupt_misplaced_or_expiring_entries_are_refused() {
        let (o, k) = at();
        let now = SystemTime::now();
        let e = entry(None);
        let mut bytes = encode(&e, &o, &k);
        let other = IdempotencyKey::new("other").unwrap();
        assert!(
            decode(&bytes, &o, &other, now).is_none(),
            "another key's entry"
        );
        bytes[40] ^= 1;
        assert!(decode(&bytes, &o, &k, now).is_none(), "flipped bit");
        assert!(decode(b"garbage", &o, &k, now).is_none());
        assert!(decode(b"", &o, &k, now).is_none());
        let later = now + Duration::from_secs(3600);
        assert!(
            decode(&encode(&e, &o, &k), &o, &k, later).is_none(),
            "past its expiry margin"
        );
    }

    mod props {
        use super::super::*;
        use super::{at, entry};
        use proptest::prelude::*;

        proptest! {
            /// Whatever Redis holds, reading it never panics (a panic fails the test).
            #[test]
            fn any_bytes_decode_or_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
                let (o, k) = at();
                let _ = decode(&bytes, &o, &k, SystemTime::now());
            }

            #[test]
            fn a_flipped_byte_is_always_refused(index in any::<prop::sample::Index>(), flip in 1..=255u8) {
                let (o, k) = at();
                let e = entry(Some(StoredResponse { status: 200, headers: vec![], body: Bytes::from_static(b"body") }));
                let mut bytes = encode(&e, &o, &k);
                let i = index.index(bytes.len());
                bytes[i] ^= flip;
                prop_assert!(decode(&bytes, &o, &k, SystemTime::now()).is_none());
            }
        }
    }
}
