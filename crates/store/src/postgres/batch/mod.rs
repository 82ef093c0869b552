//! Batched arbitration (`docs/design.md` §13, "Batched begins and
//! commits"): the begins and the commits of concurrent requests on this
//! replica go to PostgreSQL together, one statement, one round trip and one
//! commit for each batch, instead of each paying its own.
//!
//! No timer decides when a batch leaves. An idle queue sends a request at
//! once, alone, from the request's own task; requests collect only while a
//! batch of their kind is on its way ([`IN_FLIGHT`]), and the next batch
//! takes all that collected (up to [`MAX_BATCH`]). So a lone request waits
//! for nothing, and under load each database commit carries as many
//! requests as arrived during the last one.
//!
//! A batch holds each [`Batched::key`] once. A second request for it either
//! follows the first and is answered from the first's answer (begins: a
//! duplicate of a key is told the job its first request made or found, so
//! a storm of duplicates costs one batch, not one each), or waits for the
//! next batch (commits: a second attempt's CAS of a job must see the
//! first's). What a batch means, how it is sent and how a failing one is
//! split is each kind's own: `begin.rs` and `commit.rs`.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::hash::Hash;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use deadpool_postgres::Pool;
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::StoreError;

pub(super) mod begin;
mod commit;

pub(super) use begin::BeginRequest;
pub(super) use commit::{commit_alone, CommitRequest, BATCHED_BODY};

/// Batches of one kind on their way at once. One: with two, a slot freed
/// under load was taken at once by whatever had collected, often a lone
/// request, so the database made three times as many lone commits, each
/// paying its own flush; with one, all that arrives while a batch is out
/// rides the next (docs/performance.md, item 31). The begins' batch and
/// the commits' still overlap, so the database is not idle between them.
pub const IN_FLIGHT: usize = 1;

/// The most requests one statement carries.
pub(super) const MAX_BATCH: usize = 64;

/// The most bytes of answers one statement carries: what a connection may
/// carry and still go back to the pool (`Postgres::release`; a connection
/// that carried more keeps buffers that size, so it is closed). Without
/// it, eight commits of answers of 40 KiB would close their connection,
/// and under load most batches would pay a new session.
pub(super) const MAX_BATCH_BYTES: usize = idemgate_domain::job::INLINE_ANSWER;

/// A request that can go to the database in a batch of its kind.
pub(super) trait Batched: Sized + Send + 'static {
    /// What a batch holds once.
    type Key: Eq + Hash + Send;
    /// The request's answer.
    type Answer: Send + 'static;

    fn key(&self) -> Self::Key;

    /// Whether a second request for a key already in a batch follows the
    /// first ([`Batched::follow`]) rather than waiting for the next batch.
    const FOLLOWS: bool = false;

    /// What a request that followed one is told, from that one's answer.
    fn follow(_first: &Result<Self::Answer, StoreError>) -> Result<Self::Answer, StoreError> {
        Err(StoreError::Unavailable(
            "a request of this kind follows no other".into(),
        ))
    }

    /// The bytes of answers it adds to its batch's statement, counted
    /// against [`MAX_BATCH_BYTES`].
    fn weight(&self) -> usize {
        0
    }

    /// Sends `batch` and answers each of its requests through its `reply`.
    fn send(pool: Pool, batch: Vec<Waiting<Self>>) -> impl Future<Output = ()> + Send;
}

/// A request waiting for its batch, and where its answer goes.
pub(super) struct Waiting<T: Batched> {
    pub(super) request: T,
    pub(super) reply: oneshot::Sender<Result<T::Answer, StoreError>>,
    /// Requests for the same key, answered from this one's answer.
    followers: Vec<Waiting<T>>,
}

impl<T: Batched> Waiting<T> {
    fn new(request: T, reply: oneshot::Sender<Result<T::Answer, StoreError>>) -> Self {
        Waiting {
            request,
            reply,
            followers: Vec::new(),
        }
    }

    /// Answers the request, and its followers from its answer.
    pub(super) fn answer(self, answer: Result<T::Answer, StoreError>) {
        for follower in self.followers {
            follower.answer(T::follow(&answer));
        }
        // A request whose caller went away needs no answer.
        let _ = self.reply.send(answer);
    }

    /// This request and its followers.
    fn count(&self) -> usize {
        1 + self.followers.len()
    }
}

/// The handle requests of one kind are sent through; its task forms and
/// sends the batches.
pub(super) struct Queue<T: Batched> {
    arrivals: mpsc::UnboundedSender<Waiting<T>>,
    /// Requests sent and not yet in a batch on its way.
    waiting: Arc<AtomicUsize>,
    /// The batches on their way: [`IN_FLIGHT`] slots, shared with the task.
    slots: Arc<Semaphore>,
    pool: Pool,
}

impl<T: Batched> Queue<T> {
    /// Starts the batching task on the current runtime.
    pub(super) fn start(pool: Pool) -> Self {
        let (arrivals, receiver) = mpsc::unbounded_channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        let slots = Arc::new(Semaphore::new(IN_FLIGHT));
        tokio::spawn(collect(
            pool.clone(),
            receiver,
            waiting.clone(),
            slots.clone(),
        ));
        Queue {
            arrivals,
            waiting,
            slots,
            pool,
        }
    }

    /// Requests sent and not yet in a batch on its way.
    pub(super) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Sends `request` in the next batch and waits for its answer. With
    /// nothing waiting and a slot free, it goes at once as a batch of one
    /// from the caller's own task: what the batching task would do, without
    /// the two hand-offs between tasks that cost a request at low load more
    /// than its statement's encoding (docs/performance.md, item 28).
    pub(super) async fn ask(&self, request: T) -> Result<T::Answer, StoreError> {
        let (reply, answer) = oneshot::channel();
        let stopped = || StoreError::Unavailable("the batching task stopped".into());
        if self.waiting.load(Ordering::Relaxed) == 0 {
            if let Ok(slot) = self.slots.clone().try_acquire_owned() {
                // Boxed: the statement's future would otherwise widen every
                // caller's, a held duplicate's among them.
                Box::pin(T::send(
                    self.pool.clone(),
                    vec![Waiting::new(request, reply)],
                ))
                .await;
                drop(slot);
                return answer.await.map_err(|_| stopped())?;
            }
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        self.arrivals
            .send(Waiting::new(request, reply))
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

/// The batching loop: waits for a request, then for a batch slot (while
/// it waits, requests collect), then sends what collected.
async fn collect<T: Batched>(
    pool: Pool,
    mut arrivals: mpsc::UnboundedReceiver<Waiting<T>>,
    waiting: Arc<AtomicUsize>,
    slots: Arc<Semaphore>,
) {
    let mut carried = VecDeque::new();
    loop {
        let first = match carried.pop_front() {
            Some(first) => first,
            None => match arrivals.recv().await {
                Some(first) => first,
                None => return,
            },
        };
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let batch = gather(first, &mut carried, &mut arrivals);
        let sent = batch.iter().map(Waiting::count).sum();
        waiting.fetch_sub(sent, Ordering::Relaxed);
        let pool = pool.clone();
        tokio::spawn(async move {
            T::send(pool, batch).await;
            drop(slot);
        });
    }
}

/// `first` and what waits after it, each key once, at most [`MAX_BATCH`]
/// requests and [`MAX_BATCH_BYTES`] (the first goes whatever it weighs); a
/// second request for a key in the batch follows the first where its kind
/// allows ([`Batched::FOLLOWS`]). What is left (other requests for a key
/// in the batch, what would pass the bytes) is carried to the next batch,
/// in the order it came.
fn gather<T: Batched>(
    first: Waiting<T>,
    carried: &mut VecDeque<Waiting<T>>,
    arrivals: &mut mpsc::UnboundedReceiver<Waiting<T>>,
) -> Vec<Waiting<T>> {
    let mut keys = HashMap::from([(first.request.key(), 0)]);
    let mut bytes = first.request.weight();
    let mut batch = vec![first];
    let mut later = Vec::new();
    let mut queued = std::mem::take(carried);
    while batch.len() < MAX_BATCH {
        let Some(next) = queued.pop_front().or_else(|| arrivals.try_recv().ok()) else {
            break;
        };
        let key = next.request.key();
        if let Some(&at) = keys.get(&key) {
            match T::FOLLOWS {
                true => batch[at].followers.push(next),
                false => later.push(next),
            }
            continue;
        }
        let weight = next.request.weight();
        if bytes + weight > MAX_BATCH_BYTES {
            queued.push_front(next);
            break;
        }
        keys.insert(key, batch.len());
        bytes += weight;
        batch.push(next);
    }
    carried.extend(later);
    carried.extend(queued);
    batch
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request of the test: its key and the bytes it weighs.
    struct Weighed(u32, usize);

    impl Batched for Weighed {
        type Key = u32;
        type Answer = ();

        fn key(&self) -> u32 {
            self.0
        }

        fn weight(&self) -> usize {
            self.1
        }

        async fn send(_: Pool, _: Vec<Waiting<Self>>) {}
    }

    fn waiting(key: u32, weight: usize) -> Waiting<Weighed> {
        Waiting::new(Weighed(key, weight), oneshot::channel().0)
    }

    fn keys(batch: &[Waiting<Weighed>]) -> Vec<u32> {
        batch.iter().map(|w| w.request.0).collect()
    }

    /// Answers of 40 KiB: a batch takes six (240 KiB), not all twelve, so
    /// its connection goes back to the pool; the rest wait, in order, for
    /// the next; a key twice still waits; and one answer over the budget
    /// goes alone rather than never.
    #[test]
    fn a_batch_stops_at_its_bytes_and_the_rest_keep_their_order() {
        let (sender, mut arrivals) = mpsc::unbounded_channel();
        for key in 1..12 {
            sender.send(waiting(key, 40 << 10)).ok().unwrap();
        }
        sender.send(waiting(7, 1)).ok().unwrap();
        let mut carried = VecDeque::new();
        let first = gather(waiting(0, 40 << 10), &mut carried, &mut arrivals);
        assert_eq!(keys(&first), [0, 1, 2, 3, 4, 5]);
        let weight: usize = first.iter().map(|w| w.request.1).sum();
        assert!(weight <= MAX_BATCH_BYTES, "{weight}");
        let next = carried.pop_front().unwrap();
        let second = gather(next, &mut carried, &mut arrivals);
        assert_eq!(keys(&second), [6, 7, 8, 9, 10, 11]);
        assert_eq!(keys(&carried.drain(..).collect::<Vec<_>>()), [7]);

        let alone = gather(waiting(1, MAX_BATCH_BYTES * 2), &mut carried, &mut arrivals);
        assert_eq!(keys(&alone), [1]);
    }

    /// A request of a kind whose duplicates follow: told its first's
    /// answer plus a hundred.
    struct Following(u32);

    impl Batched for Following {
        type Key = u32;
        type Answer = u32;
        const FOLLOWS: bool = true;

        fn key(&self) -> u32 {
            self.0
        }

        fn follow(first: &Result<u32, StoreError>) -> Result<u32, StoreError> {
            Ok(first.as_ref().map_or(0, |n| n + 100))
        }

        async fn send(_: Pool, _: Vec<Waiting<Self>>) {}
    }

    /// Duplicates of a key follow its first request in the same batch
    /// (however many: they add no row), and are answered from its answer
    /// when it is answered; a kind that does not follow carries them
    /// (the test above).
    #[test]
    fn duplicates_follow_their_first_and_hear_its_answer() {
        let (sender, mut arrivals) = mpsc::unbounded_channel();
        let mut answers = Vec::new();
        for key in [2, 1, 1, 3, 1, 2] {
            let (reply, answer) = oneshot::channel();
            sender
                .send(Waiting::new(Following(key), reply))
                .ok()
                .unwrap();
            answers.push((key, answer));
        }
        let (reply, first_answer) = oneshot::channel();
        let mut carried = VecDeque::new();
        let batch = gather(
            Waiting::new(Following(1), reply),
            &mut carried,
            &mut arrivals,
        );
        assert!(carried.is_empty());
        let firsts: Vec<u32> = batch.iter().map(|w| w.request.0).collect();
        assert_eq!(firsts, [1, 2, 3]);
        assert_eq!(batch.iter().map(Waiting::count).sum::<usize>(), 7);
        for (n, waiting) in batch.into_iter().enumerate() {
            waiting.answer(Ok(n as u32));
        }
        assert_eq!(first_answer.blocking_recv().unwrap().unwrap(), 0);
        let heard: Vec<(u32, u32)> = answers
            .into_iter()
            .map(|(key, answer)| (key, answer.blocking_recv().unwrap().unwrap()))
            .collect();
        assert_eq!(
            heard,
            [(2, 1), (1, 100), (1, 100), (3, 2), (1, 100), (2, 101)]
        );
    }
}
