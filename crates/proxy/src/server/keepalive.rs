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
use std::task::{ready, Context, Poll};

use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::activity::{Head, Streams};

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
