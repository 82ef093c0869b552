//! Driving one connection until it ends: closed gracefully when the
//! listener drains, or once it has had no open request (stream) for its
//! idle timeout (`http2_idle_timeout`, HTTP/1.1's `keepalive_timeout`); an
//! HTTP/1.1 connection is also closed when a request's head is slower than
//! `header_read_timeout` (`docs/design.md` §18).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::keepalive::Head;
use crate::proxy::http::Holding;

/// Runs `conn` to its end. When `drain` is cancelled, `shutdown` asks it
/// to finish what it has open and close. When it has been idle for its
/// timeout, the same; and an HTTP/2 peer that is then still idle after
/// `idle.grace` is closed without waiting for it (a graceful HTTP/2
/// shutdown waits for the peer to answer a ping, RFC 9113 §6.8, and a
/// peer that never does would keep the connection).
pub(super) async fn drive<C, F>(
    conn: C,
    drain: &CancellationToken,
    idle: Idle,
    shutdown: F,
) -> hyper::Result<()>
where
    C: Future<Output = hyper::Result<()>>,
    F: Fn(Pin<&mut C>),
{
    tokio::pin!(conn);
    let elapsed = idle.elapsed();
    tokio::pin!(elapsed);
    let slow_head = idle.slow_head();
    tokio::pin!(slow_head);
    let given_up = tokio::time::sleep(Duration::MAX);
    tokio::pin!(given_up);
    let (mut closing, mut idle_closing) = (false, false);
    loop {
        tokio::select! {
            ended = conn.as_mut() => return ended,
            () = drain.cancelled(), if !closing => {
                closing = true;
                shutdown(conn.as_mut());
            }
            // hyper's own header timeout answers nothing either.
            () = &mut slow_head, if !closing => return Ok(()),
            () = &mut elapsed, if !closing => {
                (closing, idle_closing) = (true, true);
                shutdown(conn.as_mut());
                given_up.as_mut().reset(tokio::time::Instant::now() + idle.grace);
            }
            () = &mut given_up, if idle_closing => {
                if idle.is_idle() {
                    return Ok(());
                }
                // A stream opened as it went away: it is let finish.
                given_up.as_mut().reset(tokio::time::Instant::now() + idle.grace);
            }
        }
    }
}

/// When a connection is idle (no request or stream open for its timeout),
/// and for HTTP/1.1, when a request's head is too slow.
pub(super) struct Idle {
    streams: Streams,
    timeout: Option<Duration>,
    /// How long a peer told to go away may take to answer.
    grace: Duration,
    /// HTTP/1.1: the head being read, and how long it may take.
    head: Option<(Head, Duration)>,
}

impl Idle {
    /// Idle once no stream of `streams` has been open for `timeout` (never
    /// without one); given `grace` to go.
    pub(super) fn after(streams: Streams, timeout: Option<Duration>, grace: Duration) -> Self {
        Idle {
            streams,
            timeout,
            grace,
            head: None,
        }
    }

    /// Also closed when `head` takes longer than `timeout` to arrive.
    pub(super) fn with_head(self, head: Head, timeout: Duration) -> Self {
        Idle {
            head: Some((head, timeout)),
            ..self
        }
    }

    async fn elapsed(&self) {
        self.streams.clone().idle(self.timeout).await;
    }

    async fn slow_head(&self) {
        match &self.head {
            Some((head, timeout)) => head.clone().overdue(*timeout).await,
            None => std::future::pending().await,
        }
    }

    fn is_idle(&self) -> bool {
        self.streams.none_open()
    }
}

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
}

impl Streams {
    pub(super) fn new() -> Self {
        Streams(Arc::new(Counts {
            born: Instant::now(),
            open: AtomicUsize::new(0),
            last_close: AtomicU64::new(0),
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

/// An answer's body that keeps its stream counted open until it is sent.
pub(super) type Counted<B> = Holding<B, OpenStream>;

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

    #[tokio::test(start_paused = true)]
    async fn no_timeout_is_never_idle() {
        let idle = tokio::spawn(Streams::new().idle(None));
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert!(!idle.is_finished());
    }
}
