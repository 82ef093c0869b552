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
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tower::{Layer, Service};

use crate::http::Body;
use crate::problem::problem_response;

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

/// A `DELETE`'s place among the requests in progress, in its extensions:
/// a layer above that goes on with the request past its client (an MCP
/// session's end, held until the session's calls end, `docs/design.md`
/// §19, "An agent's cancel") takes it, and the request stays counted until
/// that work drops it, not only until its client stops waiting. Only
/// `DELETE`s carry one: the other requests' work ends with their answer's
/// future, and they pay for no shared count.
#[derive(Clone)]
pub struct Admitted(#[allow(dead_code)] Arc<InFlight>);

/// How a request in progress is counted: by its answer's future alone, or
/// shared with an [`Admitted`] in its extensions.
enum Counted {
    Alone(#[allow(dead_code)] InFlight),
    Shared(#[allow(dead_code)] Admitted),
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
        self.1.decrement(1.0);
    }
}

impl<S, B> Service<Request<B>> for Shed<S>
where
    S: Service<Request<B>, Response = Response<Body>, Error = Infallible>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let counter = &self.layer.in_flight;
        if counter.fetch_add(1, Ordering::AcqRel) >= self.layer.limit {
            counter.fetch_sub(1, Ordering::AcqRel);
            metrics::counter!("idemgate_requests_shed_total").increment(1);
            let shed = problem_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                "Gateway overloaded; nothing was done",
                "the gateway has too many requests in progress; retry later",
                Some(self.layer.retry_after),
            );
            return ResponseFuture {
                kind: Kind::Shed {
                    response: Some(shed),
                },
            };
        }
        self.layer.gauge.increment(1.0);
        let guard = InFlight(counter.clone(), self.layer.gauge.clone());
        let guard = if req.method() == http::Method::DELETE {
            let admitted = Admitted(Arc::new(guard));
            req.extensions_mut().insert(admitted.clone());
            Counted::Shared(admitted)
        } else {
            Counted::Alone(guard)
        };
        ResponseFuture {
            kind: Kind::Admitted {
                answer: self.inner.call(req),
                guard: Some(guard),
            },
        }
    }
}

pin_project! {
    /// The answer to one request: `503` at once, or the inner service's,
    /// counted in progress until it resolves. Named rather than boxed, so
    /// shedding allocates nothing per request.
    pub struct ResponseFuture<F> {
        #[pin]
        kind: Kind<F>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F> {
        /// Refused: the gateway is saturated.
        Shed { response: Option<Response<Body>> },
        /// Admitted: the inner service's answer.
        Admitted {
            #[pin]
            answer: F,
            guard: Option<Counted>,
        },
    }
}

impl<F> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<Body>, Infallible>>,
{
    type Output = Result<Response<Body>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Shed { response } => Poll::Ready(Ok(response
                .take()
                .expect("a ResponseFuture is not polled after it completed"))),
            KindProj::Admitted { answer, guard } => {
                let answer = ready!(answer.poll(cx));
                // In progress until its answer's head: a body still
                // streaming out is the connection's to bound, not the shed's.
                guard.take();
                Poll::Ready(answer)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tower::{service_fn, ServiceExt};

    use super::*;

    /// At the limit a request is shed at once; once one in progress is
    /// answered, the next is admitted again.
    #[tokio::test]
    async fn past_the_limit_a_request_is_shed_until_one_is_answered() {
        let (release, held) = tokio::sync::watch::channel(false);
        let inner = service_fn(move |_req: Request<()>| {
            let mut held = held.clone();
            async move {
                let _ = held.wait_for(|go| *go).await;
                Ok::<_, Infallible>(Response::new(crate::http::full("ok")))
            }
        });
        let mut shed = ShedLayer::new(2, Duration::from_secs(1)).layer(inner);
        let first = shed.ready().await.unwrap().call(Request::new(()));
        let second = shed.ready().await.unwrap().call(Request::new(()));
        let refused = shed.ready().await.unwrap().call(Request::new(())).await;
        let refused = refused.unwrap();
        assert_eq!(refused.status(), http::StatusCode::SERVICE_UNAVAILABLE);
        assert!(refused.headers().contains_key(http::header::RETRY_AFTER));
        release.send(true).unwrap();
        assert_eq!(first.await.unwrap().status(), http::StatusCode::OK);
        let third = shed.ready().await.unwrap().call(Request::new(())).await;
        assert_eq!(third.unwrap().status(), http::StatusCode::OK);
        assert_eq!(second.await.unwrap().status(), http::StatusCode::OK);
    }

    /// A request whose future is dropped unanswered (the client hung up)
    /// is no longer counted.
    #[tokio::test]
    async fn a_request_dropped_unanswered_is_no_longer_counted() {
        let inner = service_fn(|_req: Request<()>| std::future::pending());
        let mut shed = ShedLayer::new(1, Duration::from_secs(1)).layer(inner);
        let held = shed.ready().await.unwrap().call(Request::new(()));
        assert_eq!(shed.layer.in_flight.load(Ordering::Acquire), 1);
        drop(held);
        assert_eq!(shed.layer.in_flight.load(Ordering::Acquire), 0);
    }

    /// A `DELETE` whose work a layer above carries on past its client
    /// (holding its [`Admitted`]) stays counted after its answer's future
    /// is dropped, and is shed against, until that work lets go; a request
    /// of another method carries none.
    #[tokio::test]
    async fn a_delete_whose_work_outlives_its_client_stays_counted() {
        let (sender, mut kept) = tokio::sync::mpsc::unbounded_channel();
        let inner = service_fn(move |req: Request<()>| {
            let _ = sender.send(req.extensions().get::<Admitted>().cloned());
            std::future::pending()
        });
        let mut shed = ShedLayer::new(1, Duration::from_secs(1)).layer(inner);
        let delete = Request::delete("/mcp").body(()).unwrap();
        let held = shed.ready().await.unwrap().call(delete);
        let admitted = kept.recv().await.unwrap().expect("a DELETE carries one");
        drop(held);
        assert_eq!(shed.layer.in_flight.load(Ordering::Acquire), 1);
        let refused = shed.ready().await.unwrap().call(Request::new(())).await;
        assert_eq!(
            refused.unwrap().status(),
            http::StatusCode::SERVICE_UNAVAILABLE
        );
        drop(admitted);
        assert_eq!(shed.layer.in_flight.load(Ordering::Acquire), 0);
        let other = shed.ready().await.unwrap().call(Request::new(()));
        assert!(kept.recv().await.unwrap().is_none(), "a GET carries none");
        drop(other);
        assert_eq!(shed.layer.in_flight.load(Ordering::Acquire), 0);
    }
}
