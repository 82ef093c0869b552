//! The idempotency layer: one intent, one job, exactly one committed result.
//!
//! For a request on an opted-in route that carries an `Idempotency-Key`:
//!
//! 1. parse the key and derive the owner; read the body (bounded) and
//!    fingerprint the request;
//! 2. [`Store::begin_job`](crate::store::Store::begin_job): the database's
//!    uniqueness constraint decides whether this request owns a new job;
//! 3. a new job runs its first attempt; an existing one is [decided
//!    on](flow) by its state: replay, hold, refuse, or claim the next attempt;
//! 4. the attempts of a request that owns its job are run as the
//!    [dispatch] state machine decides (failover, hedging);
//! 5. each attempt runs in [its own task](execute), so a client that hangs up
//!    cannot cut it short; its answer is committed by CAS before anyone sees it.
//!
//! Everything else (no key on a route that does not require one, methods or
//! paths that do not opt in) goes to the inner service untouched, streamed.

mod dispatch;
mod execute;
pub mod fastpath;
mod flow;
pub mod recording;
pub mod replay;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service};
use uuid::Uuid;

use crate::config::Settings;
use crate::idempotency::fastpath::FastPath;
use crate::idempotency::recording::Streams;
use crate::idempotency::replay::Answers;
use crate::proxy::error::GatewayError;
use crate::proxy::http::Body;
use crate::proxy::upstream::UpstreamError;
use crate::store::{Doorbell, Store};
use crate::upkeep::lease::Leases;
use crate::upkeep::probe::ProbeBoard;

/// What the layer needs at run time, shared by every request.
pub struct Shared {
    /// The settings.
    pub settings: Arc<Settings>,
    /// The store.
    pub store: Arc<dyn Store>,
    /// Wake-ups for held duplicates.
    pub doorbell: Arc<Doorbell>,
    /// The Redis fast path, when configured.
    pub fastpath: Option<Arc<FastPath>>,
    /// Which upstreams pass their contracts' probes.
    pub probes: Arc<ProbeBoard>,
    /// Leases of the attempts this instance runs.
    pub leases: Arc<Leases>,
    /// This gateway instance, recorded on the attempts it runs.
    pub instance: Uuid,
    /// The streamed answers being recorded here, for duplicates to join.
    pub streams: Arc<Streams>,
    /// Committed answers this replica has seen, for replay.
    pub answers: Arc<Answers>,
}

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

/// The upstream side of the layer, boxed at this boundary so that attempt
/// tasks need no generic parameters.
pub type UpstreamService = BoxCloneSyncService<Request<Body>, Response<Body>, UpstreamError>;

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
        match flow::Flow::classify(&self.shared.settings, req) {
            // Straight to the upstream: no clone of it, and none of the
            // opted-in flow's state (kilobytes) allocated for a request that
            // does not need it.
            flow::Classified::PassThrough(req) => match self.not_ready.take() {
                None => ResponseFuture::Passing(self.inner.call(req)),
                Some(e) => ResponseFuture::Ready(Some(GatewayError::from(e).into_response())),
            },
            flow::Classified::Refused(error) => ResponseFuture::Ready(Some(error.into_response())),
            flow::Classified::OptedIn(opted) => {
                let shared = self.shared.clone();
                let inner = self.inner.clone();
                ResponseFuture::Guarded(Box::pin(async move {
                    match flow::Flow::prepare(&shared, opted).await {
                        flow::Prepared::Refused(error) => error.into_response(),
                        flow::Prepared::Guarded(flow) => flow.run(inner).await,
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

#[cfg(test)]
mod tests;
