//! What of a connection's answers waits on its client, for the send clock
//! (`send_timeout`, `docs/design.md` §18): a client that stops reading
//! stops the gateway's writes, and nothing else would end its connection
//! (TCP answers zero-window probes for ever, an HTTP/2 client answers
//! pings). Two places see it: the socket, whose write stays pending
//! ([`Sending`]), and on HTTP/2 an answer's body, whose chunk the protocol
//! does not ask past while the stream's window is shut ([`Handed`]).
//!
//! Only what waits is noted, so the fast path pays one branch: a write that
//! completes, with nothing pending before it, touches no clock and no
//! atomic.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http_body::{Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::activity::{Streams, Unsent};

/// Notes a write that is pending (from its first pending poll), and forgets
/// it once the socket takes bytes again.
fn noted<T>(polled: Poll<T>, waiting: &mut Option<Unsent>, connection: &Streams) -> Poll<T> {
    match (&polled, waiting.is_some()) {
        (Poll::Pending, false) => *waiting = Some(connection.unsent()),
        (Poll::Ready(_), true) => *waiting = None,
        _ => {}
    }
    polled
}

pin_project! {
    /// A connection's transport, noting how long its writes wait.
    pub(super) struct Sending<I> {
        #[pin]
        io: I,
        connection: Streams,
        waiting: Option<Unsent>,
    }
}

impl<I> Sending<I> {
    /// `io`, whose pending writes are counted on `connection`.
    pub(super) fn new(io: I, connection: Streams) -> Self {
        Sending {
            io,
            connection,
            waiting: None,
        }
    }
}

impl<I: AsyncRead> AsyncRead for Sending<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.project().io.poll_read(cx, buf)
    }
}

impl<I: AsyncWrite> AsyncWrite for Sending<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.project();
        noted(this.io.poll_write(cx, buf), this.waiting, this.connection)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.project();
        let polled = this.io.poll_write_vectored(cx, bufs);
        noted(polled, this.waiting, this.connection)
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

pin_project! {
    /// An answer's body on HTTP/2: from a chunk handed over until the
    /// protocol asks for the next, the chunk waits on the client's window.
    /// On HTTP/1.1 (`connection` is `None`) the socket shows it alone:
    /// hyper asks for the next chunk whenever its buffer has room.
    pub(super) struct Handed<B> {
        #[pin]
        inner: B,
        connection: Option<Streams>,
        waiting: Option<Unsent>,
    }
}

impl<B> Handed<B> {
    /// `inner`, its chunks counted unsent on `connection` (if any).
    pub(super) fn new(inner: B, connection: Option<Streams>) -> Self {
        Handed {
            inner,
            connection,
            waiting: None,
        }
    }
}

impl<B: http_body::Body> http_body::Body for Handed<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        // Asked again: the last chunk was taken on.
        *this.waiting = None;
        let frame = ready!(this.inner.poll_frame(cx));
        if let (Some(connection), Some(Ok(_))) = (this.connection.as_ref(), &frame) {
            *this.waiting = Some(connection.unsent());
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
