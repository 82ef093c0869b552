//! Driving one connection until it ends: closed gracefully when the
//! listener drains, or once it has had no open request (stream) for its
//! idle timeout (`http2_idle_timeout`, HTTP/1.1's `keepalive_timeout`); an
//! HTTP/1.1 connection is also closed when a request's head is slower than
//! `header_read_timeout`; and any connection, when what it has to send
//! waits on a client that reads nothing for `send_timeout`
//! (`docs/design.md` §18).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::activity::{Head, OpenStream, Streams};
use super::sending::Handed;
use crate::http::Holding;

/// Runs `conn` to its end. When `drain` is cancelled, `shutdown` asks it
/// to finish what it has open and close. When it has been idle for its
/// timeout, the same; and an HTTP/2 peer that is then still idle after
/// `idle.grace` is closed without waiting for it (a graceful HTTP/2
/// shutdown waits for the peer to answer a ping, RFC 9113 §6.8, and a
/// peer that never does would keep the connection). When its answers have
/// waited on a client that reads nothing for `idle.send`, it is closed at
/// once, draining or not: a graceful close would wait on the same client.
///
/// `conn` comes boxed: it lasts as long as the connection, and an `async`
/// function keeps what it is given beside what it pins it as (hyper's
/// connection twice over, in the connection's task; docs/performance.md,
/// "Per held duplicate").
pub(super) async fn drive<C, F>(
    mut conn: Pin<Box<C>>,
    drain: &CancellationToken,
    idle: Idle,
    shutdown: F,
) -> hyper::Result<()>
where
    C: Future<Output = hyper::Result<()>>,
    F: Fn(Pin<&mut C>),
{
    let elapsed = idle.elapsed();
    tokio::pin!(elapsed);
    let slow_head = idle.slow_head();
    tokio::pin!(slow_head);
    // One timer, moved on as the clock looks (`Streams::stuck`).
    let stuck = tokio::time::sleep(idle.send);
    tokio::pin!(stuck);
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
            () = &mut stuck => match idle.streams.stuck(idle.send) {
                Some(next) => stuck.as_mut().reset(next),
                None => {
                    tracing::debug!("connection closed: its client read nothing for send_timeout");
                    return Ok(());
                }
            },
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
/// when its client has read nothing for the send timeout, and for
/// HTTP/1.1, when a request's head is too slow.
pub(super) struct Idle {
    streams: Streams,
    timeout: Option<Duration>,
    /// How long what it has to send may wait on its client.
    send: Duration,
    /// How long a peer told to go away may take to answer.
    grace: Duration,
    /// HTTP/1.1: the head being read, and how long it may take.
    head: Option<(Head, Duration)>,
}

impl Idle {
    /// Idle once no stream of `streams` has been open for `timeout` (never
    /// without one); given `grace` to go. Stuck once what it has to send
    /// has waited `send`.
    pub(super) fn after(
        streams: Streams,
        timeout: Option<Duration>,
        grace: Duration,
        send: Duration,
    ) -> Self {
        Idle {
            streams,
            timeout,
            send,
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

/// An answer's body that keeps its stream counted open until it is sent
/// (on HTTP/2, its chunks counted unsent until taken on).
pub(super) type Counted<B> = Holding<Handed<B>, OpenStream>;
