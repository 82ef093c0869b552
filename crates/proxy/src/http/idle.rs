//! The body-read timeout (`docs/design.md` §18): a request body whose
//! client pauses in the middle of it for longer than the timeout fails with
//! [`BodyTimedOut`]. The clock runs between pieces of the body, not over the
//! whole of it, so a large upload that keeps coming, however slowly, is
//! never cut; one that stops is, and releases what it held.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::Sleep;

use super::{BodyError, BoxError};

/// Why a body failed: its client sent nothing more for the timeout.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the client sent no more of the request body for {}", humantime::format_duration(*.0))]
pub struct BodyTimedOut(pub Duration);

impl BodyTimedOut {
    /// The timeout, when `error` or one of its sources is one.
    pub fn within(error: &(dyn std::error::Error + 'static)) -> Option<BodyTimedOut> {
        let mut next = Some(error);
        while let Some(e) = next {
            if let Some(timed_out) = e.downcast_ref::<BodyTimedOut>() {
                return Some(*timed_out);
            }
            next = e.source();
        }
        None
    }
}

/// Why a request body failed as its client sent it (a malformed chunk, a
/// connection cut mid-body): the client's doing, so a request passed through
/// is answered `400`, not as if the upstream had failed (`docs/design.md`
/// §2).
#[derive(Debug, thiserror::Error)]
#[error("the client's request body could not be read: {0}")]
pub struct ClientBodyFailed(#[source] BoxError);

impl ClientBodyFailed {
    /// Whether `error` or one of its sources is one, and why, if so.
    pub fn within(error: &(dyn std::error::Error + 'static)) -> Option<String> {
        let mut next = Some(error);
        while let Some(e) = next {
            if let Some(failed) = e.downcast_ref::<ClientBodyFailed>() {
                return Some(failed.to_string());
            }
            next = e.source();
        }
        None
    }
}

pin_project! {
    /// A client's request body, that fails when its client pauses for
    /// longer than `timeout`; its own errors are [`ClientBodyFailed`].
    pub struct IdleTimeout<B> {
        #[pin]
        inner: B,
        // Made only once the body waits for its client: a body that never
        // waits (an empty one, one already in the buffer) costs no timer.
        #[pin]
        pause: Option<Sleep>,
        timeout: Duration,
    }
}

impl<B> IdleTimeout<B> {
    /// `inner`, failing after a pause of `timeout`.
    pub fn new(inner: B, timeout: Duration) -> Self {
        IdleTimeout {
            inner,
            pause: None,
            timeout,
        }
    }
}

impl<B> http_body::Body for IdleTimeout<B>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let mut this = self.project();
        if let Poll::Ready(frame) = this.inner.poll_frame(cx) {
            // Something came: the next pause starts from nothing.
            this.pause.set(None);
            return Poll::Ready(
                frame.map(|f| f.map_err(|e| BodyError::new(ClientBodyFailed(e.into())))),
            );
        }
        if this.pause.is_none() {
            this.pause.set(Some(tokio::time::sleep(*this.timeout)));
        }
        match this.pause.as_pin_mut().map(|pause| pause.poll(cx)) {
            Some(Poll::Ready(())) => {
                Poll::Ready(Some(Err(BodyError::new(BodyTimedOut(*this.timeout)))))
            }
            _ => Poll::Pending,
        }
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
    use http_body_util::{BodyExt, StreamBody};
    use tokio::sync::mpsc;

    use super::*;
    use crate::http::Body;

    fn channel() -> (mpsc::Sender<Result<Frame<Bytes>, BodyError>>, Body) {
        let (tx, rx) = mpsc::channel(4);
        let frames = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        let body = IdleTimeout::new(StreamBody::new(frames), Duration::from_secs(2));
        (tx, body.boxed())
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_body_that_keeps_coming_is_read_whole() {
        let (tx, mut body) = channel();
        let sender = tokio::spawn(async move {
            for _ in 0..5 {
                // Ten seconds in all, never two at once without a piece.
                tokio::time::sleep(Duration::from_millis(1900)).await;
                tx.send(Ok(Frame::data(Bytes::from_static(b"x"))))
                    .await
                    .unwrap();
            }
        });
        let mut read = 0;
        while let Some(frame) = body.frame().await {
            read += frame.unwrap().into_data().unwrap().len();
        }
        assert_eq!(read, 5);
        sender.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_whose_client_stops_fails_after_the_timeout() {
        let (tx, mut body) = channel();
        tx.send(Ok(Frame::data(Bytes::from_static(b"half"))))
            .await
            .unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        let started = tokio::time::Instant::now();
        let error = body.frame().await.unwrap().unwrap_err();
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        let timed_out = BodyTimedOut::within(&error).expect("a timeout, found in the chain");
        assert_eq!(timed_out.0, Duration::from_secs(2));
        drop(tx);
    }
}
