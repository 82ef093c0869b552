//! Driving one connection until it ends: closed gracefully when the
//! listener drains, and an HTTP/2 connection also once it has had no open
//! stream for the idle timeout (`docs/design.md` §18). HTTP/1.1 needs no
//! such clock: the header read timeout closes a connection idle between
//! requests.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

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

/// When a connection is idle: an HTTP/2 connection with no open stream for
/// its timeout; an HTTP/1 one never (its header read timeout sees to it).
pub(super) struct Idle {
    streams: Option<Streams>,
    timeout: Option<Duration>,
    /// How long a peer told to go away may take to answer.
    grace: Duration,
}

impl Idle {
    /// Never idle.
    pub(super) fn never() -> Self {
        Idle {
            streams: None,
            timeout: None,
            grace: Duration::ZERO,
        }
    }

    /// Idle once no stream of `streams` has been open for `timeout` (never
    /// without one); given `grace` to go.
    pub(super) fn after(streams: Streams, timeout: Option<Duration>, grace: Duration) -> Self {
        Idle {
            streams: Some(streams),
            timeout,
            grace,
        }
    }

    async fn elapsed(&self) {
        match &self.streams {
            Some(streams) => streams.clone().idle(self.timeout).await,
            None => std::future::pending().await,
        }
    }

    fn is_idle(&self) -> bool {
        self.streams.as_ref().is_some_and(|s| *s.0.borrow() == 0)
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
