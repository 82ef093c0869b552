//! One memory budget for the bytes requests make the gateway hold
//! (`docs/design.md` §18): the bodies of keyed requests, the answers their
//! attempts record, and replays copied out of Redis or the store.
//!
//! A keyed request is [admitted](Budget::admit) only while the budget has
//! room for the first of what it declares it will send
//! ([`TAKEN_AHEAD`](crate::http::TAKEN_AHEAD)); its [`Charge`] then grows
//! as its body is read, as its attempts' answers arrive and as a replay is copied,
//! and gives every byte back when the last holder drops it: the request,
//! each attempt it started (which may outlive the client) and the answer's
//! body until it is sent. Past the budget a *new* keyed request is refused
//! (`503 …/overloaded`) before any job exists; bytes already acted on (an
//! answer the upstream sent) are counted but never refused, so they may run
//! the total past the limit until they are sent, and new requests wait for
//! that.
//!
//! One owner may hold at most its share of the budget
//! ([`Budget::with_owner_limit`]): uploads that trickle, or large answers,
//! of one caller cannot take every other caller's room. Requests with no
//! owner to tell apart (one anonymous owner for everyone) are not capped.
//!
//! A counter rather than a semaphore of permits: an answer must be able to
//! take more than is left, and a semaphore cannot go below zero.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use http_body_util::BodyExt;

use crate::http::{Body, Holding};

/// The gateway's memory budget: bytes held for requests, at most `limit`
/// for new ones.
#[derive(Debug)]
pub struct Budget {
    limit: usize,
    owner_limit: usize,
    used: AtomicUsize,
    /// Bytes held by each owner that holds any.
    owners: Mutex<HashMap<Arc<str>, usize>>,
    in_use: metrics::Gauge,
    refused: metrics::Counter,
}

impl Budget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<Budget> {
        Self::with_owner_limit(limit, limit)
    }

    /// A budget of `limit` bytes, of which one owner may hold `owner_limit`.
    pub fn with_owner_limit(limit: usize, owner_limit: usize) -> Arc<Budget> {
        metrics::gauge!("idemgate_memory_budget_bytes").set(limit as f64);
        Arc::new(Budget {
            limit,
            owner_limit,
            used: AtomicUsize::new(0),
            owners: Mutex::default(),
            in_use: metrics::gauge!("idemgate_memory_budget_in_use_bytes"),
            refused: metrics::counter!("idemgate_memory_budget_refusals_total"),
        })
    }

    /// Its size in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The most one request of `owner` (`None`: not capped) could ever
    /// hold: the whole budget, or an owner's share of it.
    pub fn room_for(&self, owner: Option<&str>) -> usize {
        match owner {
            Some(_) => self.owner_limit.min(self.limit),
            None => self.limit,
        }
    }

    /// Bytes held now (past the limit while answers overdraw it).
    pub fn in_use(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// A charge for a new request that needs `bytes` now (its declared
    /// length, or nothing when it declares none), if they fit; `None` past
    /// the budget. Refusals, here and by [`Charge::try_add`], are counted
    /// in `idemgate_memory_budget_refusals_total`.
    pub fn admit(self: &Arc<Self>, bytes: usize) -> Option<Arc<Charge>> {
        self.admit_for(None, bytes)
    }

    /// [`admit`](Self::admit) for a request of `owner`, within the owner's
    /// share as well; `None` for requests whose owners cannot be told apart.
    pub fn admit_for(self: &Arc<Self>, owner: Option<&str>, bytes: usize) -> Option<Arc<Charge>> {
        let charge = Charge {
            budget: self.clone(),
            bytes: AtomicUsize::new(0),
            owner: owner.map(Arc::from),
        };
        charge.try_add(bytes.max(1)).then(|| Arc::new(charge))
    }

    /// Bytes `owner` holds now.
    pub fn held_by(&self, owner: &str) -> usize {
        self.owners().get(owner).copied().unwrap_or(0)
    }

    fn owners(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, usize>> {
        // A panic elsewhere leaves the counts whole: each is one write.
        self.owners
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An empty charge that is not refused: for bytes held on behalf of
    /// requests already taken (a copy of another replica's stream).
    pub fn open(self: &Arc<Self>) -> Arc<Charge> {
        Arc::new(Charge {
            budget: self.clone(),
            bytes: AtomicUsize::new(0),
            owner: None,
        })
    }

    /// Takes `bytes` if the total stays within the limit.
    fn try_take(&self, bytes: usize) -> bool {
        let fits = |used: usize| used.checked_add(bytes).filter(|&total| total <= self.limit);
        let taken = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, fits)
            .is_ok();
        if taken {
            self.in_use.increment(bytes as f64);
        }
        taken
    }

    /// Takes `bytes` whatever the total.
    fn take(&self, bytes: usize) {
        self.used.fetch_add(bytes, Ordering::AcqRel);
        self.in_use.increment(bytes as f64);
    }

    fn give_back(&self, bytes: usize) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
        self.in_use.decrement(bytes as f64);
    }
}

/// The bytes one request holds against the budget; all given back when the
/// last clone of its `Arc` is dropped.
#[derive(Debug)]
pub struct Charge {
    budget: Arc<Budget>,
    bytes: AtomicUsize,
    owner: Option<Arc<str>>,
}

impl Charge {
    /// Counts `bytes` more if the budget has room for them (a body still
    /// being read: past the budget the request is refused).
    pub fn try_add(&self, bytes: usize) -> bool {
        if bytes == 0 {
            return true;
        }
        let taken = match &self.owner {
            None => self.budget.try_take(bytes),
            Some(owner) => {
                let mut owners = self.budget.owners();
                let held = owners.get(owner).copied().unwrap_or(0);
                let fits = held + bytes <= self.budget.owner_limit && self.budget.try_take(bytes);
                if fits {
                    *owners.entry(owner.clone()).or_default() += bytes;
                }
                fits
            }
        };
        if taken {
            self.bytes.fetch_add(bytes, Ordering::AcqRel);
        } else {
            // Refused: a new request, or one whose body outgrew the room.
            self.budget.refused.increment(1);
        }
        taken
    }

    /// Counts `bytes` more whatever the budget says: bytes the gateway must
    /// hold anyway (an answer already acted on, a replay being sent).
    pub fn add(&self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        self.budget.take(bytes);
        if let Some(owner) = &self.owner {
            *self.budget.owners().entry(owner.clone()).or_default() += bytes;
        }
        self.bytes.fetch_add(bytes, Ordering::AcqRel);
    }

    /// The bytes it holds.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        let bytes = *self.bytes.get_mut();
        if bytes == 0 {
            return;
        }
        self.budget.give_back(bytes);
        if let Some(owner) = &self.owner {
            let mut owners = self.budget.owners();
            if let Some(held) = owners.get_mut(owner) {
                *held = held.saturating_sub(bytes);
                if *held == 0 {
                    owners.remove(owner);
                }
            }
        }
    }
}

/// `body`, holding `charge` until it is sent: the bytes stay counted until
/// the answer is sent, or dropped unsent.
pub fn until_sent(body: Body, charge: Arc<Charge>) -> Body {
    Holding::new(body, charge).boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_admitted_only_while_its_declared_bytes_fit() {
        let budget = Budget::new(100);
        let first = budget.admit(60).expect("60 of 100 fit");
        assert!(budget.admit(41).is_none(), "60 + 41 > 100");
        let second = budget.admit(40).expect("60 + 40 fit");
        assert_eq!(budget.in_use(), 100);
        assert!(budget.admit(0).is_none(), "a full budget admits nothing");
        drop(first);
        assert_eq!(budget.in_use(), 40, "given back on drop");
        assert!(budget.admit(60).is_some());
        drop(second);
        assert_eq!(budget.in_use(), 0);
    }

    #[test]
    fn a_body_grows_within_the_budget_and_an_answer_past_it() {
        let budget = Budget::new(100);
        let charge = budget.admit(0).unwrap();
        assert!(charge.try_add(90));
        assert!(!charge.try_add(20), "a body may not grow past the budget");
        charge.add(50);
        assert_eq!(budget.in_use(), 141, "an answer is counted past it");
        assert!(budget.admit(0).is_none(), "and new requests wait for it");
        let held = charge.clone();
        drop(charge);
        assert_eq!(budget.in_use(), 141, "a clone (an attempt) still holds it");
        drop(held);
        assert_eq!(budget.in_use(), 0);
        assert!(budget.admit(100).is_some());
    }

    #[test]
    fn one_owner_holds_at_most_its_share_and_others_are_still_admitted() {
        let budget = Budget::with_owner_limit(100, 50);
        let first = budget.admit_for(Some("a"), 30).unwrap();
        assert!(
            budget.admit_for(Some("a"), 30).is_none(),
            "30 + 30 > a's 50"
        );
        assert!(!first.try_add(21), "nor may a body grow past it");
        let other = budget
            .admit_for(Some("b"), 50)
            .expect("b has its own share");
        assert_eq!((budget.held_by("a"), budget.held_by("b")), (30, 50));
        let anonymous = budget.admit(20).expect("not capped, within the budget");
        assert!(budget.admit(1).is_none(), "the budget is full");
        drop((first, other, anonymous));
        assert_eq!((budget.in_use(), budget.held_by("a")), (0, 0));
        assert!(budget.admit_for(Some("a"), 50).is_some());
    }

    #[tokio::test]
    async fn an_answer_holds_its_charge_until_it_is_sent() {
        let budget = Budget::new(100);
        let charge = budget.admit(10).unwrap();
        let body = until_sent(crate::http::full("answer"), charge);
        assert_eq!(budget.in_use(), 10);
        let sent = body.collect().await.unwrap().to_bytes();
        assert_eq!(sent, "answer");
        assert_eq!(budget.in_use(), 0, "given back once sent");
    }
}
