//! Lingering on a request's unread body, as nginx's lingering close does
//! (`docs/design.md` §18, "A refusal is read"): an HTTP/1.1 request
//! answered before its body was read (a `413`, a `503`, a `401`, an
//! upstream's early answer) has the rest of its body read and dropped
//! after the answer, rather than its connection closed on unread bytes.
//! A close with unread bytes makes the kernel reset the connection, the
//! reset can destroy the answer before the client reads it, and a client
//! that writes its whole body before it reads (Python's `requests`) sees
//! only the reset.
//!
//! The listener hands each HTTP/1.1 request a [`Linger`] (in its
//! extensions): the request kept counted open while its body is read, so
//! the connection's clocks do not take the body's bytes, read after the
//! answer went out, for the next request's head. The stack's entry wraps
//! the body in [`Lingering`], which lets that go once the body ends and,
//! dropped before its end, reads the rest in a task of its own. HTTP/2
//! needs none of it: a stream answered early is reset on its own, the
//! connection and the answer untouched.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::BodyExt;

use super::{Body, BodyError};

/// The most of an unread body read after its answer: a client that sends
/// its whole body before it reads still reads the answer to a body of up
/// to this size. A body that declares more is not read at all (its client
/// would be reset all the same, after the bytes were spent).
const LINGER_BYTES: u64 = 64 << 20;

/// How long an unread body is read after its answer, at most, whatever
/// its client's pace: nginx's `lingering_time`.
const LINGER_TIME: Duration = Duration::from_secs(30);

/// The longest pause between two reads of it: nginx's
/// `lingering_timeout`.
const LINGER_PAUSE: Duration = Duration::from_secs(5);

/// What keeps a request counted open on its connection until its body has
/// been read: put in the request's extensions by the listener, taken by
/// [`Lingering::new`].
#[derive(Clone)]
pub struct Linger(Arc<Mutex<Option<Box<dyn Send + Sync>>>>);

impl Linger {
    /// Holds `open` (dropped when the request's body has been read).
    pub(crate) fn new(open: impl Send + Sync + 'static) -> Self {
        Linger(Arc::new(Mutex::new(Some(Box::new(open)))))
    }

    fn take(&self) -> Option<Box<dyn Send + Sync>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// A request's body whose rest is read after its answer if it is dropped
/// unread (see the module docs).
pub struct Lingering {
    body: Option<Body>,
    /// Keeps the request counted open; dropped once the body has ended.
    open: Option<Box<dyn Send + Sync>>,
    /// Whether anything asked for the body: a client that sent `Expect:
    /// 100-continue` has sent none until then, and none is read.
    polled: bool,
    expects_continue: bool,
}

impl Lingering {
    /// `body`, lingered on after its answer when `linger` says its
    /// connection wants that (HTTP/1.1); `expects_continue` when its
    /// request carried `Expect: 100-continue`.
    pub fn wrap(body: Body, linger: Option<&Linger>, expects_continue: bool) -> Body {
        let open = linger.and_then(Linger::take);
        if open.is_none() || body.is_end_stream() {
            return body;
        }
        Lingering {
            body: Some(body),
            open,
            polled: false,
            expects_continue,
        }
        .boxed()
    }
}

impl http_body::Body for Lingering {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.polled = true;
        let Some(body) = self.body.as_mut() else {
            return Poll::Ready(None);
        };
        let frame = ready!(Pin::new(body).poll_frame(cx));
        if !matches!(frame, Some(Ok(_))) {
            // Ended or failed: nothing left to linger on.
            self.body = None;
            self.open = None;
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.body
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

impl Drop for Lingering {
    fn drop(&mut self) {
        let (Some(body), Some(open)) = (self.body.take(), self.open.take()) else {
            return;
        };
        let unsent = self.expects_continue && !self.polled;
        if unsent || body.is_end_stream() || body.size_hint().lower() > LINGER_BYTES {
            return;
        }
        // No runtime (it is shutting down): nothing to read with.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            let _ = tokio::time::timeout(LINGER_TIME, read_out(body)).await;
            drop(open);
        });
    }
}

/// Reads `body` to its end, [`LINGER_BYTES`] at most, each pause
/// [`LINGER_PAUSE`] at most, and drops what it reads.
async fn read_out(mut body: Body) {
    let mut left = LINGER_BYTES;
    while let Ok(Some(Ok(frame))) = tokio::time::timeout(LINGER_PAUSE, body.frame()).await {
        let n = frame.data_ref().map_or(0, |d| d.len() as u64);
        let Some(rest) = left.checked_sub(n) else {
            return;
        };
        left = rest;
    }
}
