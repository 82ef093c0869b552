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
use tokio::time::{Instant, Sleep};

use super::{BodyError, BoxError};

/// Why a body failed: its client paused for longer than the timeout, or
/// sent it slower than the minimum rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BodyTimedOut {
    /// Nothing more came for this long.
    #[error("the client sent no more of the request body for {}", humantime::format_duration(*.0))]
    Paused(Duration),
    /// Past the first `grace`, it came slower than `min_rate` bytes a
    /// second on average.
    #[error("the client sent the request body slower than {min_rate} bytes a second")]
    TooSlow {
        /// Bytes a second, averaged since the body started.
        min_rate: u64,
    },
}

impl BodyTimedOut {
    /// The timeout, when `error` or one of its sources is one.
    pub fn within(error: &(dyn std::error::Error + 'static)) -> Option<BodyTimedOut> {
        found::<BodyTimedOut>(error).copied()
    }
}

/// How fast a request body must come (`docs/design.md` §18).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    /// The longest pause between two pieces; also the grace before the
    /// minimum rate applies.
    pub timeout: Duration,
    /// Bytes a second a body must average once past `timeout` (0: any).
    pub min_rate: u64,
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
        found::<ClientBodyFailed>(error).map(ToString::to_string)
    }
}

/// The first `E` in `error`'s chain of sources, itself included.
fn found<'a, E: std::error::Error + 'static>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a E> {
    std::iter::successors(Some(error), |e| e.source()).find_map(|e| e.downcast_ref::<E>())
}

pin_project! {
    /// A client's request body, that fails when its client pauses for
    /// longer than its pace's timeout or sends it slower than its minimum
    /// rate; its own errors are [`ClientBodyFailed`].
    pub struct IdleTimeout<B> {
        #[pin]
        inner: B,
        // Made only once the body waits for its client: a body that never
        // waits (an empty one, one already in the buffer) costs no timer.
        #[pin]
        pause: Option<Sleep>,
        pace: Pace,
        // When the body was first asked for, and how much of it came.
        started: Option<Instant>,
        received: u64,
    }
}

impl<B> IdleTimeout<B> {
    /// `inner`, failing after a pause of `timeout`.
    pub fn new(inner: B, timeout: Duration) -> Self {
        Self::paced(
            inner,
            Pace {
                timeout,
                min_rate: 0,
            },
        )
    }

    /// `inner`, failing when it falls behind `pace`.
    pub fn paced(inner: B, pace: Pace) -> Self {
        IdleTimeout {
            inner,
            pause: None,
            pace,
            started: None,
            received: 0,
        }
    }
}

impl Pace {
    /// When a body that started at `started` and brought `received` bytes
    /// falls behind the minimum rate, if one is set.
    fn behind(&self, started: Instant, received: u64) -> Option<Instant> {
        if self.min_rate == 0 {
            return None;
        }
        let earned = Duration::from_secs_f64(received as f64 / self.min_rate as f64);
        Some(started + self.timeout + earned)
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
        let started = *this.started.get_or_insert_with(Instant::now);
        if let Poll::Ready(frame) = this.inner.poll_frame(cx) {
            // Something came: the next pause starts from nothing.
            this.pause.set(None);
            if let Some(Ok(data)) = frame.as_ref().map(|f| f.as_ref().map(Frame::data_ref)) {
                *this.received += data.map_or(0, |d| d.len() as u64);
            }
            return Poll::Ready(
                frame.map(|f| f.map_err(|e| BodyError::new(ClientBodyFailed(e.into())))),
            );
        }
        let behind = this.pace.behind(started, *this.received);
        if this.pause.is_none() {
            let paused = Instant::now() + this.pace.timeout;
            let at = behind.map_or(paused, |behind| behind.min(paused));
            this.pause.set(Some(tokio::time::sleep_until(at)));
        }
        match this.pause.as_pin_mut().map(|pause| pause.poll(cx)) {
            Some(Poll::Ready(())) => {
                let failed = match behind {
                    Some(behind) if Instant::now() >= behind => BodyTimedOut::TooSlow {
                        min_rate: this.pace.min_rate,
                    },
                    _ => BodyTimedOut::Paused(this.pace.timeout),
                };
                Poll::Ready(Some(Err(BodyError::new(failed))))
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
        assert_eq!(timed_out, BodyTimedOut::Paused(Duration::from_secs(2)));
        drop(tx);
    }

    /// A body fed by a channel, paced at 100 B/s after a 2 s grace.
    fn paced_channel() -> (mpsc::Sender<Result<Frame<Bytes>, BodyError>>, Body) {
        let (tx, rx) = mpsc::channel(4);
        let frames = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        let pace = Pace {
            timeout: Duration::from_secs(2),
            min_rate: 100,
        };
        (
            tx,
            IdleTimeout::paced(StreamBody::new(frames), pace).boxed(),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_trickles_fails_once_it_falls_behind_the_minimum_rate() {
        let (tx, mut body) = paced_channel();
        let started = tokio::time::Instant::now();
        let sender = tokio::spawn(async move {
            // 10 bytes a second, each pause within the timeout.
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let frame = Ok::<_, BodyError>(Frame::data(Bytes::from_static(&[7; 10])));
                if tx.send(frame).await.is_err() {
                    return;
                }
            }
        });
        let error = loop {
            match body.frame().await.unwrap() {
                Ok(_) => continue,
                Err(e) => break e,
            }
        };
        let failed = BodyTimedOut::within(&error).expect("a timeout");
        assert_eq!(failed, BodyTimedOut::TooSlow { min_rate: 100 });
        // 2 s of grace, then 10 bytes earn a tenth of a second each: at
        // 10 B/s it falls behind 100 B/s a little after the grace.
        let took = started.elapsed();
        assert!(
            took >= Duration::from_secs(2) && took < Duration::from_secs(4),
            "{took:?}"
        );
        sender.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_at_the_minimum_rate_is_read_whole() {
        let (tx, mut body) = paced_channel();
        tokio::spawn(async move {
            for _ in 0..20 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let frame = Ok::<_, BodyError>(Frame::data(Bytes::from_static(&[7; 100])));
                tx.send(frame).await.unwrap();
            }
        });
        let mut read = 0;
        while let Some(frame) = body.frame().await {
            read += frame.unwrap().into_data().unwrap().len();
        }
        assert_eq!(read, 2000, "20 s at the minimum rate is never cut");
    }
}
