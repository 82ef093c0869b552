//! Recently committed answers, kept in this replica's memory for replay
//! (docs/design.md §11, "Replay cache").
//!
//! A committed answer never changes: a job that completed stays completed
//! until it expires. So a replica that has seen a job's answer (it committed
//! it, or replayed it from Redis or the store) may replay it again without
//! asking anyone, until the job's expiry. This is what makes a replay cost
//! less than a proxied request: no Redis round trip, no database read.
//!
//! - Keyed by `(owner, key)`; an entry names its job, the request's
//!   fingerprint and the job's expiry. A request with another fingerprint is
//!   not answered from here: the store decides the mismatch.
//! - Bounded by bytes (`replay_cache_size`); the least useful entries go
//!   first. An entry is not used within [`EXPIRY_MARGIN`] of its job's
//!   expiry, as a Redis entry is not.

use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::SystemTime;

use http::{HeaderMap, Response, StatusCode};
use quick_cache::sync::Cache;
use quick_cache::{Equivalent, Weighter};

use super::Framing;
use idemgate_domain::fingerprint::Fingerprint;
use idemgate_domain::id::JobId;
use idemgate_domain::job::EXPIRY_MARGIN;
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_domain::response::StoredResponse;
use idemgate_proxy::http::{Body, Outcome};

/// Bookkeeping counted against the budget besides an answer's own bytes.
const OVERHEAD: usize = 256;

/// A committed answer, as the replay cache keeps it: with the head of its
/// replay made once, when it is kept, rather than per replay.
#[derive(Debug)]
pub(crate) struct Kept {
    /// Its job.
    pub job: JobId,
    /// The fingerprint of the request that made it.
    pub fingerprint: Fingerprint,
    /// When the job expires.
    pub expires_at: SystemTime,
    response: StoredResponse,
    framing: Framing,
    status: StatusCode,
    headers: HeaderMap,
}

impl Kept {
    /// `response`, committed for `job`, replayed with `framing`.
    pub(crate) fn new(
        job: JobId,
        fingerprint: Fingerprint,
        expires_at: SystemTime,
        response: StoredResponse,
        framing: Framing,
    ) -> Self {
        let (head, _) = super::response(&response, job, true, framing).into_parts();
        Kept {
            job,
            fingerprint,
            expires_at,
            response,
            framing,
            status: head.status,
            headers: head.headers,
        }
    }

    /// Its replay, as [`super::response`] makes it.
    pub(crate) fn replay(&self) -> Response<Body> {
        let mut replay = Response::new(super::body(&self.response, self.framing));
        *replay.status_mut() = self.status;
        *replay.headers_mut() = self.headers.clone();
        replay.extensions_mut().insert(Outcome::Replayed);
        replay
    }
}

type Slot = (Owner, IdempotencyKey);

/// The answers kept here, at most `replay_cache_size` bytes of them.
pub(crate) struct ReplayCache {
    cache: Option<Cache<Slot, Arc<Kept>, ByBytes>>,
}

impl std::fmt::Debug for ReplayCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayCache")
            .field("entries", &self.cache.as_ref().map_or(0, |c| c.len()))
            .finish()
    }
}

impl ReplayCache {
    /// A cache of at most `bytes` of answers; none at all for 0.
    pub(crate) fn new(bytes: usize) -> Self {
        let cache = (bytes > 0).then(|| {
            // A guess at how many fit, which only sizes the table.
            let items = (bytes / 2048).clamp(64, 1 << 20);
            Cache::with_weighter(items, bytes as u64, ByBytes)
        });
        ReplayCache { cache }
    }

    /// Keeps the answer `make` makes of `job` for `(owner, key)`; one too
    /// large for the whole budget is not kept. The duplicates one commit
    /// releases all offer the same answer: it is made and kept once.
    pub(crate) fn insert(
        &self,
        owner: &Owner,
        key: &IdempotencyKey,
        job: JobId,
        make: impl FnOnce() -> Kept,
    ) {
        let Some(cache) = &self.cache else {
            return;
        };
        if cache
            .get(&Borrowed(owner, key))
            .is_some_and(|kept| kept.job == job)
        {
            return;
        }
        cache.insert((owner.clone(), key.clone()), Arc::new(make()));
    }

    /// The answer kept for `(owner, key)`, unless it is (nearly) expired at
    /// `now`.
    pub(crate) fn get(
        &self,
        owner: &Owner,
        key: &IdempotencyKey,
        now: SystemTime,
    ) -> Option<Arc<Kept>> {
        let cache = self.cache.as_ref()?;
        let slot = Borrowed(owner, key);
        let answer = cache.get(&slot)?;
        if answer.expires_at.checked_sub(EXPIRY_MARGIN)? <= now {
            cache.remove(&slot);
            return None;
        }
        Some(answer)
    }
}

/// An answer's weight: its bytes, with the bookkeeping around them.
#[derive(Clone)]
struct ByBytes;

impl Weighter<Slot, Arc<Kept>> for ByBytes {
    fn weight(&self, (owner, key): &Slot, answer: &Arc<Kept>) -> u64 {
        let response = &answer.response;
        let headers: usize = response
            .headers
            .iter()
            .map(|(name, value)| name.len() + value.len())
            .sum();
        (OVERHEAD + owner.as_str().len() + key.as_str().len() + headers + response.body.len())
            as u64
    }
}

/// `(owner, key)` by reference, so a lookup copies nothing. Hashes as the
/// tuple does: each field in order.
struct Borrowed<'a>(&'a Owner, &'a IdempotencyKey);

impl Hash for Borrowed<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.hash(state);
        self.1.hash(state);
    }
}

impl Equivalent<Slot> for Borrowed<'_> {
    fn equivalent(&self, (owner, key): &Slot) -> bool {
        self.0 == owner && self.1 == key
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use idemgate_domain::key::OwnerSalt;
    use std::time::Duration;

    fn owner() -> Owner {
        Owner::anonymous()
    }

    fn key(k: &str) -> IdempotencyKey {
        IdempotencyKey::new(k).unwrap()
    }

    fn answer(body: &'static [u8], expires_in: Duration) -> Kept {
        Kept::new(
            JobId::new(),
            Fingerprint([7; 32]),
            SystemTime::now() + expires_in,
            StoredResponse {
                status: 201,
                headers: vec![
                    (
                        "content-type".into(),
                        Bytes::from_static(b"application/json"),
                    ),
                    ("set-cookie".into(), Bytes::from_static(b"a=1")),
                    ("set-cookie".into(), Bytes::from_static(b"b=2")),
                ],
                body: Bytes::from_static(body),
            },
            Framing::Whole,
        )
    }

    #[tokio::test]
    async fn a_kept_answer_replays_as_the_stored_response_does() {
        use http_body_util::BodyExt;
        let kept = answer(b"{\"ok\":1}", Duration::from_secs(60));
        let expected = super::super::response(&kept.response, kept.job, true, Framing::Whole);
        for _ in 0..2 {
            let replay = kept.replay();
            assert_eq!(replay.status(), expected.status());
            assert_eq!(replay.headers(), expected.headers());
            let body = replay.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], b"{\"ok\":1}");
        }
    }

    #[test]
    fn an_answer_is_found_by_its_owner_and_key_only() {
        let answers = ReplayCache::new(1 << 20);
        let kept = answer(b"{}", Duration::from_secs(3600));
        let job = kept.job;
        keep(&answers, "a", kept);
        let now = SystemTime::now();
        assert_eq!(answers.get(&owner(), &key("a"), now).unwrap().job, job);
        assert!(answers.get(&owner(), &key("b"), now).is_none());
        let other = Owner::of(
            &OwnerSalt::new(b"test salt, not a secret"),
            &[b"someone else"],
        );
        assert!(answers.get(&other, &key("a"), now).is_none());
    }

    fn keep(answers: &ReplayCache, k: &str, answer: Kept) {
        answers.insert(&owner(), &key(k), answer.job, || answer);
    }

    #[test]
    fn an_answer_already_kept_is_not_made_again_and_another_job_replaces_it() {
        let answers = ReplayCache::new(1 << 20);
        let first = answer(b"{}", Duration::from_secs(3600));
        let job = first.job;
        keep(&answers, "a", first);
        answers.insert(&owner(), &key("a"), job, || {
            panic!("made again although it is kept")
        });
        let next = answer(b"{}", Duration::from_secs(3600));
        let replaced = next.job;
        keep(&answers, "a", next);
        let now = SystemTime::now();
        assert_eq!(answers.get(&owner(), &key("a"), now).unwrap().job, replaced);
    }

    #[test]
    fn an_answer_near_its_expiry_is_not_used() {
        let answers = ReplayCache::new(1 << 20);
        keep(&answers, "a", answer(b"{}", Duration::from_secs(60)));
        let now = SystemTime::now();
        assert!(answers.get(&owner(), &key("a"), now).is_some());
        let late = now + Duration::from_secs(56);
        assert!(answers.get(&owner(), &key("a"), late).is_none());
    }

    #[test]
    fn the_budget_bounds_what_is_kept_and_zero_keeps_nothing() {
        let none = ReplayCache::new(0);
        keep(&none, "a", answer(b"{}", Duration::from_secs(60)));
        assert!(none.get(&owner(), &key("a"), SystemTime::now()).is_none());

        let small = ReplayCache::new(4096);
        for i in 0..100 {
            keep(
                &small,
                &format!("k{i}"),
                answer(b"0123456789", Duration::from_secs(60)),
            );
        }
        let kept = (0..100)
            .filter(|i| {
                small
                    .get(&owner(), &key(&format!("k{i}")), SystemTime::now())
                    .is_some()
            })
            .count();
        assert!(kept > 0 && kept <= 4096 / OVERHEAD, "kept {kept}");
    }
}
