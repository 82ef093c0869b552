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
mod flow;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service, ServiceExt};
use uuid::Uuid;

use crate::config::Settings;
use crate::error::GatewayError;
use crate::fastpath::FastPath;
use crate::http::Body;
use crate::lease::Leases;
use crate::probe::ProbeBoard;
use crate::recording::Streams;
use crate::store::{Doorbell, Store};
use crate::upstream::UpstreamError;

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
        }
    }
}

/// The upstream side of the layer, boxed at this boundary so that attempt
/// tasks need no generic parameters.
pub type UpstreamService = BoxCloneSyncService<Request<Body>, Response<Body>, UpstreamError>;

/// The service built by [`IdempotencyLayer`].
#[derive(Clone)]
pub struct Idempotency {
    inner: UpstreamService,
    shared: Arc<Shared>,
}

impl Service<Request<Body>> for Idempotency {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is checked per call on a clone (`oneshot`): an attempt's
        // upstream call runs in its own task, detached from this service.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let shared = self.shared.clone();
        let inner = self.inner.clone();
        Box::pin(async move {
            let response = match flow::Flow::prepare(&shared, req).await {
                flow::Prepared::PassThrough(req) => pass_through(inner, req).await,
                flow::Prepared::Refused(error) => error.into_response(),
                flow::Prepared::Guarded(flow) => flow.run(inner).await,
            };
            Ok(response)
        })
    }
}

/// Forwards a request that did not opt in, streaming both ways.
async fn pass_through(inner: UpstreamService, req: Request<Body>) -> Response<Body> {
    match inner.oneshot(req).await {
        Ok(response) => response,
        Err(e) => GatewayError::from(e).into_response(),
    }
}

#[cfg(test)]
mod tests;
