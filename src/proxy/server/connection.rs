//! Driving one connection until it ends: closed gracefully when the
//! listener drains, and an HTTP/2 connection also once it has had no open
//! stream for the idle timeout (`docs/design.md` §18). HTTP/1.1 needs no
//! such clock: the header read timeout closes a connection idle between
//! requests.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Runs `conn` to its end. When `drain` is cancelled or `idle` resolves,
/// `shutdown` asks it to finish what it has open and close.
pub(super) async fn drive<C, F>(
    conn: C,
    drain: &CancellationToken,
    idle: impl Future<Output = ()>,
    shutdown: F,
) -> hyper::Result<()>
where
    C: Future<Output = hyper::Result<()>>,
    F: Fn(Pin<&mut C>),
{
    tokio::pin!(conn);
    tokio::pin!(idle);
    let mut closing = false;
    loop {
        tokio::select! {
            ended = conn.as_mut() => return ended,
            () = drain.cancelled(), if !closing => {
                closing = true;
                shutdown(conn.as_mut());
            }
            () = &mut idle, if !closing => {
                closing = true;
                shutdown(conn.as_mut());
            }
        }
    }
}

/// The streams open on one HTTP/2 connection: a stream is open from its
/// request's head until its answer's body is sent, or dropped.
#[derive(Clone)]
pub(super) struct Streams(Arc<watch::Sender<usize>>);

impl Streams {
    pub(super) fn new() -> Self {
        Streams(Arc::new(watch::Sender::new(0)))
    }

    /// Counts a stream open until the returned guard is dropped.
    pub(super) fn open(&self) -> OpenStream {
        self.0.send_modify(|n| *n += 1);
        OpenStream(self.clone())
    }

    /// Resolves once no stream has been open for `timeout`; never, with
    /// none.
    pub(super) async fn idle(self, timeout: Option<Duration>) {
        let Some(timeout) = timeout else {
            return std::future::pending().await;
        };
        let mut open = self.0.subscribe();
        loop {
            // The sender lives as long as `self`: waiting never fails.
            let _ = open.wait_for(|&n| n == 0).await;
            tokio::select! {
                // A stream opened (and maybe closed) meanwhile: start over.
                biased;
                _ = open.changed() => {}
                () = tokio::time::sleep(timeout) => return,
            }
        }
    }
}

/// One open stream, closed on drop.
pub(super) struct OpenStream(Streams);

impl Drop for OpenStream {
    fn drop(&mut self) {
        (self.0).0.send_modify(|n| *n -= 1);
    }
}

pin_project! {
    /// An answer's body that keeps its stream counted open until it is sent.
    pub(super) struct Counted<B> {
        #[pin]
        pub(super) inner: B,
        pub(super) open: OpenStream,
    }
}

impl<B: http_body::Body> http_body::Body for Counted<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
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

    #[tokio::test(start_paused = true)]
    async fn no_timeout_is_never_idle() {
        let idle = tokio::spawn(Streams::new().idle(None));
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert!(!idle.is_finished());
    }
}
