//! Driving one connection until it ends: closed gracefully when the
//! listener drains, or once it has had no open request (stream) for its
//! idle timeout (`http2_idle_timeout`, HTTP/1.1's `keepalive_timeout`); an
//! HTTP/1.1 connection is also closed when a request's head is slower than
//! `header_read_timeout` (`docs/design.md` §18).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
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
#[derive(Clone)]
pub(super) struct Streams(Arc<watch::Sender<usize>>);

impl Streams {
    pub(super) fn new() -> Self {
        Streams(Arc::new(watch::Sender::new(0)))
    }

    /// Whether none is open.
    pub(super) fn none_open(&self) -> bool {
        *self.0.borrow() == 0
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
