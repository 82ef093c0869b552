//! Where a committed answer is replayed from, cheapest first
//! (`docs/design.md` §11, "Replay cache"):
//!
//! 1. this replica's memory ([`ReplayCache`]): no I/O at all;
//! 2. the Redis fast path, when configured: one round trip, asked only
//!    while replays are common ([`RedisFirst`]);
//! 3. the store, which is the arbiter: reached through the flow's decision
//!    on the job, never skipped when the tiers above miss.
//!
//! A copy read from Redis or the store counts against the memory budget
//! until it is sent; a replay from memory copies nothing (the cache's bytes
//! are bounded by `replay_cache_size`). An answer too large to be read with
//! its job is read only once the budget has room for it, and refused
//! (`503 …/overloaded`) when it has none (`docs/design.md` §18).
//!
//! The first two answer only the very request that made the answer (same
//! owner, key and fingerprint); anything else goes on to the store, which
//! decides a mismatch. An answer found in a lower tier is written back to the
//! ones above it.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::Response;

use super::redis_first::RedisFirst;
use super::{response, Framing, Kept, ReplayCache};
use crate::error::GatewayError;
use crate::keyed::{Intent, Keyed};
use idemgate_domain::id::JobId;
use idemgate_domain::job::Job;
use idemgate_domain::response::StoredResponse;
use idemgate_proxy::http::Body;
use idemgate_store::fastpath::{FastPath, Lookup};
use idemgate_store::Store;

/// What a large answer read from the store costs the memory budget per
/// byte: the copy handed to the client, and the one the store's client
/// reads it into (SQLite assembles a blob before it is copied out; the
/// PostgreSQL row is kept, not copied, but its read buffer is sized to it).
const READ_WEIGHT: usize = 2;

/// When a replay writes the job's fast-path entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Write {
    /// Always (a commit, a replay from the store that found none).
    Always,
    /// Unless another replay of the job wrote it within the last second (the
    /// duplicates one commit releases together).
    Once,
}

/// The replay tiers of one gateway.
pub(crate) struct Replays {
    cache: ReplayCache,
    fastpath: Option<Arc<FastPath>>,
    /// Whether Redis is asked before the store, as replays are common or not.
    redis_first: RedisFirst,
    store: Arc<dyn Store>,
    retry_after: Duration,
}

impl Replays {
    /// Replays from `cache_size` bytes of memory, then `fastpath`, then
    /// `store`.
    pub(crate) fn new(
        cache_size: usize,
        fastpath: Option<Arc<FastPath>>,
        store: Arc<dyn Store>,
        retry_after: Duration,
    ) -> Self {
        Replays {
            cache: ReplayCache::new(cache_size),
            fastpath,
            redis_first: RedisFirst::default(),
            store,
            retry_after,
        }
    }

    /// The Redis fast path, when configured.
    pub(crate) fn fastpath(&self) -> Option<&Arc<FastPath>> {
        self.fastpath.as_ref()
    }

    /// A replay from this replica's memory, for this very request only.
    pub(crate) fn in_memory(&self, request: &Keyed) -> Option<(JobId, Response<Body>)> {
        let kept = self.cache.get(
            &request.intent.owner,
            &request.intent.key,
            SystemTime::now(),
        )?;
        if kept.fingerprint != request.intent.fingerprint {
            return None;
        }
        metrics::counter!("idemgate_replays_total", "source" => "memory").increment(1);
        Some((kept.job, kept.replay()))
    }

    /// A replay from the Redis fast path, when it has a valid entry for this
    /// very request. Anything else (a miss, Redis down, an entry with another
    /// fingerprint, or Redis not asked while replays are rare) goes on to
    /// the store, and [`Replays::found`] is told what the store found.
    pub(crate) async fn in_redis(&self, request: &Keyed) -> Option<(JobId, Response<Body>)> {
        let fast = self.fastpath.as_ref()?;
        if !self.redis_first.ask() {
            metrics::counter!("idemgate_fastpath_lookups_total", "result" => "skipped")
                .increment(1);
            return None;
        }
        let Lookup::Hit(entry) = fast
            .lookup(&request.intent.owner, &request.intent.key)
            .await
        else {
            return None;
        };
        if entry.fingerprint != request.intent.fingerprint {
            return None;
        }
        let stored = match entry.response {
            Some(stored) => {
                // A copy, held until it is sent (docs/design.md §18).
                request.charge.add(stored.body.len());
                stored
            }
            // Kept by reference: one read by primary key instead of the
            // insert-or-select; it must still be this request's job.
            None => match self.store.job(entry.job).await {
                Ok(Some(job))
                    if job.owner == request.intent.owner
                        && job.key == request.intent.key
                        && job.fingerprint == request.intent.fingerprint =>
                {
                    // Past the budget, the store's answer refuses it too.
                    self.committed(request, &job).await.ok()?
                }
                _ => return None,
            },
        };
        metrics::counter!("idemgate_replays_total", "source" => "redis").increment(1);
        self.redis_first.found(true);
        self.keep(&request.intent, entry.job, entry.expires_at, &stored);
        let framing = Framing::of(&request.intent.route, &stored);
        Some((entry.job, response(&stored, entry.job, true, framing)))
    }

    /// What the store found for a request Redis did not answer: a finished
    /// job to replay, or not (a new key, a running job, anything else).
    pub(crate) fn found(&self, finished: bool) {
        if self.fastpath.is_some() {
            self.redis_first.found(finished);
        }
    }

    /// The replay of a completed job the store returned; written back to the
    /// tiers above (which also repairs a lost or unusable Redis entry).
    pub(crate) async fn of_job(
        &self,
        request: &Keyed,
        job: &Job,
        write: Write,
    ) -> Result<Response<Body>, GatewayError> {
        let stored = self.committed(request, job).await?;
        metrics::counter!("idemgate_replays_total", "source" => "store").increment(1);
        self.remember(&request.intent, job.id, job.expires_at, &stored, write);
        let framing = Framing::of(&request.intent.route, &stored);
        Ok(response(&stored, job.id, true, framing))
    }

    /// The committed answer of `job`, a copy held on the request's charge
    /// until it is sent (`docs/design.md` §18). One left in the store is
    /// read only once the budget has room for its body.
    async fn committed(&self, request: &Keyed, job: &Job) -> Result<StoredResponse, GatewayError> {
        if let Some(stored) = &job.response {
            request.charge.add(stored.body.len());
            return Ok(stored.clone());
        }
        let no_response =
            || GatewayError::internal(format!("completed job {} has no response", job.id));
        let len = job.response_in_store.ok_or_else(no_response)?;
        if !request.charge.try_add(len * READ_WEIGHT) {
            return Err(GatewayError::OverBudget {
                retry_after: self.retry_after,
            });
        }
        self.store.response(job.id).await?.ok_or_else(no_response)
    }

    /// Keeps a committed answer for `intent` in memory and, off the request
    /// path, on the fast path: what the attempt that committed it does at
    /// once (whoever is still waiting), and a replay from the store again.
    pub(crate) fn remember(
        &self,
        intent: &Intent,
        job: JobId,
        expires_at: SystemTime,
        stored: &StoredResponse,
        write: Write,
    ) {
        self.keep(intent, job, expires_at, stored);
        let Some(fast) = self.fastpath.clone() else {
            return;
        };
        if write == Write::Once && !fast.needs_entry(job) {
            return;
        }
        fast.remember(
            &intent.owner,
            &intent.key,
            job,
            intent.fingerprint,
            expires_at,
            stored,
        );
    }

    /// Keeps a committed answer in this replica's memory.
    fn keep(&self, intent: &Intent, job: JobId, expires_at: SystemTime, stored: &StoredResponse) {
        self.cache.insert(&intent.owner, &intent.key, job, || {
            Kept::new(
                job,
                intent.fingerprint,
                expires_at,
                stored.clone(),
                Framing::of(&intent.route, stored),
            )
        });
    }
}
