//! What one connection is doing, for its clocks (`docs/design.md` §18): how
//! many requests (HTTP/2 streams) are open and since when none has been,
//! what of its answers waits to be sent and since when, and on HTTP/1.1
//! when the head being read began. Atomics, read lazily by
//! the clocks that need them ([`connection`](super::connection),
//! [`keepalive`](super::keepalive)): a request pays two atomic writes and a
//! clock read, no lock and no wake-up.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

/// The requests (HTTP/2 streams) open on one connection: one is open from
/// its head until its answer's body is sent, or dropped.
///
/// Counted with atomics and checked lazily: opening and closing one is two
/// atomic writes and a clock read, with no lock and no wake-up (a watch
/// channel here cost the fastest rows of the benchmark 5-9 %,
/// docs/performance.md item 19); the idle clock wakes at most once per
/// timeout and looks.
#[derive(Clone)]
pub(super) struct Streams(Arc<Counts>);

pub(super) struct Counts {
    /// What the times below count from.
    born: Instant,
    open: AtomicUsize,
    /// When the last one closed (or the connection opened), in ns from `born`.
    last_close: AtomicU64,
    /// What waits to be sent ([`Unsent`]).
    unsent: AtomicUsize,
    /// When the last of it began to wait, in ns from `born`.
    unsent_since: AtomicU64,
}

impl Streams {
    pub(super) fn new() -> Self {
        Streams(Arc::new(Counts {
            born: Instant::now(),
            open: AtomicUsize::new(0),
            last_close: AtomicU64::new(0),
            unsent: AtomicUsize::new(0),
            unsent_since: AtomicU64::new(0),
        }))
    }

    /// Whether none is open.
    pub(super) fn none_open(&self) -> bool {
        self.0.open.load(Ordering::Acquire) == 0
    }

    /// Counts a stream open until the returned guard is dropped.
    pub(super) fn open(&self) -> OpenStream {
        self.0.open.fetch_add(1, Ordering::AcqRel);
        OpenStream(self.clone())
    }

    /// Nanoseconds from the connection's opening to now.
    pub(super) fn now(&self) -> u64 {
        u64::try_from(self.0.born.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The instant `ns` nanoseconds after the connection opened.
    pub(super) fn at(&self, ns: u64) -> Instant {
        self.0.born + Duration::from_nanos(ns)
    }

    /// Resolves once no stream has been open for `timeout`; never, with
    /// none.
    pub(super) async fn idle(self, timeout: Option<Duration>) {
        let Some(timeout) = timeout else {
            return std::future::pending().await;
        };
        loop {
            if !self.none_open() {
                tokio::time::sleep(timeout).await;
                continue;
            }
            let quiet_from = self.at(self.0.last_close.load(Ordering::Acquire));
            if Instant::now() >= quiet_from + timeout && self.none_open() {
                return;
            }
            tokio::time::sleep_until(quiet_from + timeout).await;
        }
    }
}

/// What of a connection's answers waits to be sent, for the send clock
/// (`send_timeout`, `docs/design.md` §18): bytes its socket did not take
/// (a write pending: the client's TCP window is shut), and on HTTP/2 a
/// chunk handed to the protocol that it has not asked past (the client
/// does not open the stream's flow-control window). Each counts from when
/// it began to wait until its [`Unsent`] is dropped; counted lazily, as
/// the streams are: a write that completes touches nothing.
impl Streams {
    /// Counts something unsent from now until the returned guard is dropped.
    pub(super) fn unsent(&self) -> Unsent {
        // The time first: a clock that sees it waiting sees since when.
        let now = self.now();
        self.0.unsent_since.store(now, Ordering::Release);
        self.0.unsent.fetch_add(1, Ordering::AcqRel);
        Unsent(self.clone())
    }

    /// `None` once something has waited to be sent for `timeout` with
    /// nothing else beginning to wait meanwhile (a chunk taken on, a
    /// write that went through before the next one stuck): the client
    /// reads nothing. Otherwise when to look again: when what waits now
    /// will have waited `timeout`, or a `timeout` from now while nothing
    /// waits.
    pub(super) fn stuck(&self, timeout: Duration) -> Option<Instant> {
        let now = Instant::now();
        if self.0.unsent.load(Ordering::Acquire) == 0 {
            return Some(now + timeout);
        }
        let due = self.at(self.0.unsent_since.load(Ordering::Acquire)) + timeout;
        if now >= due && self.0.unsent.load(Ordering::Acquire) > 0 {
            return None;
        }
        Some(due.max(now))
    }
}

/// Something waiting to be sent, no longer once dropped.
pub(super) struct Unsent(Streams);

impl Drop for Unsent {
    fn drop(&mut self) {
        (self.0).0.unsent.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One open stream, closed on drop.
pub(super) struct OpenStream(Streams);

impl Drop for OpenStream {
    fn drop(&mut self) {
        // The time first: a clock that sees none open sees when it closed.
        let now = self.0.now();
        (self.0).0.last_close.store(now, Ordering::Release);
        (self.0).0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// When the head of the request being read began to arrive: nothing between
/// requests and while one is served. Atomics, checked lazily, as the
/// request count is ([`Streams`]).
#[derive(Clone)]
pub(super) struct Head {
    clock: Streams,
    /// Nanoseconds from the connection's opening to the head's first byte,
    /// plus one; 0 when no head is being read.
    begun: Arc<AtomicU64>,
}

impl Head {
    /// A connection's first head, whose first bytes have just been seen.
    pub(super) fn started_now(clock: Streams) -> Self {
        let begun = Arc::new(AtomicU64::new(clock.now() + 1));
        Head { clock, begun }
    }

    /// Bytes arrived with no request open: a head has begun (if it had not).
    pub(super) fn begun(&self) {
        if self.begun.load(Ordering::Acquire) == 0 {
            let now = self.clock.now() + 1;
            let _ = self
                .begun
                .compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// The head is complete: its request is being served.
    pub(super) fn complete(&self) {
        self.begun.store(0, Ordering::Release);
    }

    /// Resolves once a head has taken longer than `timeout` to complete;
    /// looks once a `timeout` while none is being read.
    pub(super) async fn overdue(self, timeout: Duration) {
        loop {
            let begun = self.begun.load(Ordering::Acquire);
            if begun == 0 {
                tokio::time::sleep(timeout).await;
                continue;
            }
            let due = self.clock.at(begun - 1) + timeout;
            if Instant::now() >= due {
                return;
            }
            tokio::time::sleep_until(due).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn idle_only_after_the_timeout_with_no_stream_open() {
        let streams = Streams::new();
        let idle = tokio::spawn(streams.clone().idle(Some(Duration::from_secs(10))));
        tokio::time::sleep(Duration::from_secs(5)).await;
        let open = streams.open();
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!idle.is_finished(), "a stream is open");
        drop(open);
        let closed = tokio::time::Instant::now();
        idle.await.unwrap();
        assert_eq!(
            closed.elapsed(),
            Duration::from_secs(10),
            "counted from the last stream's end"
        );
    }

    /// Looks as the connection's clock does, until stuck.
    async fn stuck(connection: Streams, timeout: Duration) {
        while let Some(next) = connection.stuck(timeout) {
            tokio::time::sleep_until(next).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn stuck_only_once_something_has_waited_the_timeout_with_nothing_new_waiting() {
        let connection = Streams::new();
        let stuck = tokio::spawn(stuck(connection.clone(), Duration::from_secs(10)));
        // Nothing waits: an idle connection, or one whose writes go through.
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert!(!stuck.is_finished(), "nothing waited");
        let first = connection.unsent();
        tokio::time::sleep(Duration::from_secs(9)).await;
        drop(first);
        tokio::time::sleep(Duration::from_secs(2)).await;
        // A chunk taken on, the next stuck: counted from the new wait.
        let second = connection.unsent();
        let since = Instant::now();
        tokio::time::sleep(Duration::from_secs(5)).await;
        let third = connection.unsent();
        let newest = Instant::now();
        drop(second);
        stuck.await.unwrap();
        assert_eq!(newest.elapsed(), Duration::from_secs(10));
        assert_eq!(since.elapsed(), Duration::from_secs(15));
        drop(third);
    }

    #[tokio::test(start_paused = true)]
    async fn no_timeout_is_never_idle() {
        let idle = tokio::spawn(Streams::new().idle(None));
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert!(!idle.is_finished());
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_is_overdue_only_when_it_takes_longer_than_the_timeout_from_its_first_byte() {
        let head = Head::started_now(Streams::new());
        head.complete();
        let overdue = tokio::spawn(head.clone().overdue(Duration::from_secs(10)));
        // Idle between requests: no head clock at all.
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert!(!overdue.is_finished(), "idle is not a slow head");
        head.begun();
        let begun = Instant::now();
        tokio::time::sleep(Duration::from_secs(9)).await;
        head.complete();
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!overdue.is_finished(), "completed within 10 s");
        head.begun();
        let second = Instant::now();
        overdue.await.unwrap();
        assert_eq!(second.elapsed(), Duration::from_secs(10));
        assert!(begun.elapsed() > Duration::from_secs(60));
    }
}
