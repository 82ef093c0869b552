//! The Tower layer: a request that does not opt in goes straight to the
//! inner service, streamed and untouched; one that does is answered by the
//! [flow] (`docs/design.md` §2).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service};

use super::execute::UpstreamService;
use super::flow;
use super::opt_in::{self, Classified};
use super::shared::Shared;
use crate::proxy::error::GatewayError;
use crate::proxy::http::Body;
use crate::proxy::upstream::UpstreamError;

/// Wraps an upstream service with the idempotency flow.
#[derive(Clone)]
pub struct IdempotencyLayer {
    shared: Arc<Shared>,
}

impl IdempotencyLayer {
    /// A layer over the given runtime handles.
    pub fn new(shared: Arc<Shared>) -> Self {
        IdempotencyLayer { shared }
    }
}

impl<S> Layer<S> for IdempotencyLayer
where
    S: Service<Request<Body>, Response = Response<Body>, Error = UpstreamError>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    type Service = Idempotency;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner: BoxCloneSyncService::new(inner),
            shared: self.shared.clone(),
            not_ready: None,
        }
    }
}

/// The service built by [`IdempotencyLayer`].
pub struct Idempotency {
    inner: UpstreamService,
    shared: Arc<Shared>,
    /// The upstream handle's readiness error, answered to the request that
    /// follows (the pooled clients are always ready: this is for a service
    /// that is not).
    not_ready: Option<UpstreamError>,
}

impl Clone for Idempotency {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
            not_ready: None,
        }
    }
}

impl Service<Request<Body>> for Idempotency {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Only a pass-through request calls this service's own upstream
        // handle; an opted-in request's attempts call clones of it from their
        // own tasks (`oneshot`), so a client hanging up cannot cut them short.
        match self.inner.poll_ready(cx) {
            Poll::Ready(Err(e)) => {
                self.not_ready = Some(e);
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Ok(())) => Poll::Ready(Ok(())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        match opt_in::classify(&self.shared.config.routes, req) {
            // Straight to the upstream: no clone of it, and none of the
            // opted-in flow's state (kilobytes) allocated for a request that
            // does not need it.
            Classified::PassThrough(req) => match self.not_ready.take() {
                None => ResponseFuture::Passing(self.inner.call(req)),
                Some(e) => ResponseFuture::Ready(Some(GatewayError::from(e).into_response())),
            },
            Classified::Refused(error) => ResponseFuture::Ready(Some(error.into_response())),
            Classified::OptedIn(opted) => {
                let shared = self.shared.clone();
                let inner = self.inner.clone();
                ResponseFuture::Guarded(Box::pin(async move {
                    match opt_in::prepare(&shared.config.owner_header, opted).await {
                        Ok(request) => flow::run(shared, request, inner).await,
                        Err(error) => error.into_response(),
                    }
                }))
            }
        }
    }
}

/// The answer to one request: streamed from the upstream, decided by the
/// opted-in flow, or known at once.
pub enum ResponseFuture {
    /// Not opted in: the upstream's answer, errors mapped to problems.
    Passing(Pin<Box<dyn Future<Output = Result<Response<Body>, UpstreamError>> + Send>>),
    /// Opted in: the flow's answer.
    Guarded(Pin<Box<dyn Future<Output = Response<Body>> + Send>>),
    /// Refused before anything was sent.
    Ready(Option<Response<Body>>),
}

impl Future for ResponseFuture {
    type Output = Result<Response<Body>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let response = match self.get_mut() {
            ResponseFuture::Passing(answer) => match std::task::ready!(answer.as_mut().poll(cx)) {
                Ok(response) => response,
                Err(e) => GatewayError::from(e).into_response(),
            },
            ResponseFuture::Guarded(answer) => std::task::ready!(answer.as_mut().poll(cx)),
            ResponseFuture::Ready(response) => response
                .take()
                .expect("a ResponseFuture is not polled after it completed"),
        };
        Poll::Ready(Ok(response))
    }
}
