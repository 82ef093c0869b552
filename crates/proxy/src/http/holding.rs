//! A body that keeps something alive until it has been sent (or dropped
//! unsent): a budget charge, a count of open streams. The guard's `Drop`
//! does the work; the body only carries it.

use std::pin::Pin;
use std::task::{Context, Poll};

use http_body::{Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// `inner`, with `guard` dropped when the body is.
    pub struct Holding<B, G> {
        #[pin]
        inner: B,
        guard: G,
    }
}

impl<B, G> Holding<B, G> {
    /// `inner`, holding `guard` until it is sent.
    pub fn new(inner: B, guard: G) -> Self {
        Holding { inner, guard }
    }
}

impl<B: http_body::Body, G> http_body::Body for Holding<B, G> {
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
