//! Load shedding: past `max_in_flight` requests in progress, a request is
//! answered `503 …/overloaded` with `Retry-After` at once, before it reads a
//! body, takes a job or reaches an upstream. A gateway that queues without
//! bound under overload answers everyone late; one that refuses a few early
//! answers the rest on time.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use tower::{Layer, Service};

use crate::proxy::error::GatewayError;
use crate::proxy::http::Body;

/// Wraps a service with load shedding.
#[derive(Clone)]
pub struct ShedLayer {
    in_flight: Arc<AtomicUsize>,
    limit: usize,
    retry_after: Duration,
    /// `idemgate_requests_in_flight`, looked up once rather than per request.
    gauge: metrics::Gauge,
}

impl ShedLayer {
    /// Sheds past `limit` requests in progress, telling clients to come back
    /// after `retry_after`.
    pub fn new(limit: usize, retry_after: Duration) -> Self {
        ShedLayer {
            in_flight: Arc::default(),
            limit,
            retry_after,
            gauge: metrics::gauge!("idemgate_requests_in_flight"),
        }
    }
}

impl<S> Layer<S> for ShedLayer {
    type Service = Shed<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Shed {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service built by [`ShedLayer`].
#[derive(Clone)]
pub struct Shed<S> {
    inner: S,
    layer: ShedLayer,
}

/// Counts a request in progress until dropped.
struct InFlight(Arc<AtomicUsize>, metrics::Gauge);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
        self.1.decrement(1.0);
    }
}

impl<S, B> Service<Request<B>> for Shed<S>
where
    S: Service<Request<B>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let counter = &self.layer.in_flight;
        if counter.fetch_add(1, Ordering::AcqRel) >= self.layer.limit {
            counter.fetch_sub(1, Ordering::AcqRel);
            metrics::counter!("idemgate_requests_shed_total").increment(1);
            let shed = GatewayError::Overloaded {
                retry_after: self.layer.retry_after,
            };
            return Box::pin(async move { Ok(shed.into_response()) });
        }
        self.layer.gauge.increment(1.0);
        let guard = InFlight(counter.clone(), self.layer.gauge.clone());
        let answer = self.inner.call(req);
        Box::pin(async move {
            let answer = answer.await;
            drop(guard);
            answer
        })
    }
}
