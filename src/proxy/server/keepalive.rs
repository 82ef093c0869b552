//! HTTP/1.1's two clocks, kept apart (`docs/design.md` §18): how long a
//! client may take to send a request's head once it has begun
//! (`header_read_timeout`, short: a slow sender holds a connection slot),
//! and how long a connection may sit idle between requests
//! (`keepalive_timeout`, long: the balancers and client pools in front keep
//! idle connections 60-90 s, and a connection closed under them meets
//! their next request with a reset).
//!
//! hyper has one timer for both (its header read timeout runs while a
//! connection waits for the next request), so it is off, and these two
//! take its place: the idle clock is the count of open requests
//! ([`Streams`]), the head clock starts at the first byte read while no
//! request is open ([`Watched`]) and stops when the head is complete.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use super::connection::Streams;

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
    fn begun(&self) {
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

pin_project! {
    /// An HTTP/1.1 connection's transport, noting when a request head
    /// begins to arrive.
    pub(super) struct Watched<I> {
        #[pin]
        io: I,
        head: Head,
        requests: Streams,
    }
}

impl<I> Watched<I> {
    /// `io`, whose reads with none of `requests` open begin a `head`.
    pub(super) fn new(io: I, head: Head, requests: Streams) -> Self {
        Watched { io, head, requests }
    }
}

impl<I: AsyncRead> AsyncRead for Watched<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        ready!(this.io.poll_read(cx, buf))?;
        if buf.filled().len() > before && this.requests.none_open() {
            this.head.begun();
        }
        Poll::Ready(Ok(()))
    }
}

impl<I: AsyncWrite> AsyncWrite for Watched<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.project().io.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.project().io.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().io.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().io.poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
