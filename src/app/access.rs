//! Each proxied request timed once, from its arrival: counted and timed to
//! its answer's head (`idemgate_requests_total`,
//! `idemgate_request_duration_seconds`), and, with `access_log` on, logged
//! in one line once its answer is sent or its client went away
//! (`docs/design.md` §12, "Access log").
//!
//! The line is a line at `info` with the target `idemgate::access`, written
//! by the log's own formatter for it (`idemgate_telemetry::logs::record`)
//! among the log's other lines: `RUST_LOG=idemgate::access=off` silences it
//! and `IDEMGATE_LOG_FORMAT=json` makes it JSON, as for any event. It names
//! no key, owner, header, query or body: the path is logged without its query,
//! which can carry secrets. Off (or filtered out), a request costs what it
//! did without the log: nothing is cloned or allocated for it.

use std::borrow::Cow;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Buf;
use http::{HeaderValue, Method, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tower::{Layer, Service};

use idemgate_domain::id::JobId;
use idemgate_idempotency::route::{self, Route};
use idemgate_proxy::http::{AnsweredBy, Outcome};
use idemgate_proxy::upstream::UpstreamId;
use idemgate_telemetry::logs::record;

/// Times, counts and (when on) logs every request of the inner service.
#[derive(Clone)]
pub(super) struct AccessLogLayer {
    log: Option<Arc<Routing>>,
}

/// What a line needs besides the request: where requests go.
struct Routing {
    routes: Arc<[Arc<Route>]>,
    /// Where a request on no route goes.
    default_upstream: UpstreamId,
}

impl AccessLogLayer {
    /// A layer that logs when `on`, reading routes as the idempotency layer
    /// does (a request on no route goes to `default_upstream`).
    pub(super) fn new(on: bool, routes: Arc<[Arc<Route>]>, default_upstream: UpstreamId) -> Self {
        AccessLogLayer {
            log: on.then(|| {
                Arc::new(Routing {
                    routes,
                    default_upstream,
                })
            }),
        }
    }
}

impl<S> Layer<S> for AccessLogLayer {
    type Service = AccessLog<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AccessLog {
            inner,
            log: self.log.clone(),
        }
    }
}

/// The service built by [`AccessLogLayer`].
#[derive(Clone)]
pub(super) struct AccessLog<S> {
    inner: S,
    log: Option<Arc<Routing>>,
}

impl<S, B, R> Service<Request<B>> for AccessLog<S>
where
    S: Service<Request<Counted<B>>, Response = Response<R>, Error = Infallible>,
    R: Body,
{
    type Response = Response<Logged<R>>;
    type Error = Infallible;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let arrived = Instant::now();
        // `RUST_LOG=idemgate::access=off` saves the clones too.
        let log = self.log.as_ref().filter(|_| record::access_on());
        let (request, received) = match log {
            Some(log) => {
                let received = Arc::new(AtomicU64::new(0));
                let request = Requested {
                    context: log.clone(),
                    method: req.method().clone(),
                    uri: req.uri().clone(),
                    request_id: req.headers().get(REQUEST_ID).cloned(),
                    received: received.clone(),
                };
                (Some(request), Some(received))
            }
            None => (None, None),
        };
        let req = req.map(|inner| Counted { inner, received });
        ResponseFuture {
            answer: self.inner.call(req),
            arrived,
            request,
        }
    }
}

/// What the line says of the request, kept from its arrival (the method
/// and URI are reference-counted, not copied).
struct Requested {
    context: Arc<Routing>,
    method: Method,
    uri: Uri,
    /// The request's `x-request-id` (the one it came with, or the one the
    /// gateway gave it), which ties the line to the request's other lines.
    request_id: Option<HeaderValue>,
    /// Request body bytes read so far, counted by its [`Counted`] body.
    received: Arc<AtomicU64>,
}

pin_project! {
    /// The inner service's answer, counted and timed at its head.
    pub(super) struct ResponseFuture<F> {
        #[pin]
        answer: F,
        arrived: Instant,
        request: Option<Requested>,
    }
}

impl<F, R> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<R>, Infallible>>,
    R: Body,
{
    type Output = Result<Response<Logged<R>>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let Ok(response) = std::task::ready!(this.answer.poll(cx));
        let outcome = outcome(&response);
        count(outcome, &response, this.arrived.elapsed());
        let line = this.request.take().map(|request| Line {
            request,
            arrived: *this.arrived,
            status: response.status().as_u16(),
            outcome,
            job: response.extensions().get::<JobId>().copied(),
            by: response.extensions().get::<AnsweredBy>().cloned(),
            sent: 0,
        });
        Poll::Ready(Ok(response.map(|inner| Logged { inner, line })))
    }
}

/// The answer's outcome, as `idemgate_requests_total{outcome}` and the
/// access log name it: 0 `problem` (the gateway refused or failed it),
/// 1 `replayed` (a recorded answer), 2 `executed` (an attempt's answer),
/// 3 `passed_through` (not opted in).
fn outcome<B>(response: &Response<B>) -> usize {
    match response.extensions().get::<Outcome>() {
        Some(Outcome::Problem) => 0,
        Some(Outcome::Replayed) => 1,
        Some(Outcome::Executed) => 2,
        None => 3,
    }
}

const REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");
/// The most of a request id the line keeps.
const REQUEST_ID_KEPT: usize = 128;

const OUTCOMES: [&str; 4] = ["problem", "replayed", "executed", "passed_through"];
const PASSED_THROUGH: usize = 3;

/// Counts a request by how it was answered (`idemgate_requests_total{outcome,
/// status}`) and times it to its answer's head
/// (`idemgate_request_duration_seconds{outcome}`); the status by class.
fn count<B>(outcome: usize, response: &Response<B>, latency: std::time::Duration) {
    const STATUSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];
    let class = usize::from(response.status().as_u16() / 100).clamp(1, 5) - 1;
    // The handle is looked up once per series, not once per request (a
    // lookup hashes the name and labels under the registry's lock).
    static COUNTERS: [[std::sync::OnceLock<metrics::Counter>; 5]; 4] =
        [const { [const { std::sync::OnceLock::new() }; 5] }; 4];
    COUNTERS[outcome][class]
        .get_or_init(|| {
            metrics::counter!("idemgate_requests_total",
                "outcome" => OUTCOMES[outcome], "status" => STATUSES[class])
        })
        .increment(1);
    static DURATIONS: [std::sync::OnceLock<metrics::Histogram>; 4] =
        [const { std::sync::OnceLock::new() }; 4];
    DURATIONS[outcome]
        .get_or_init(|| {
            metrics::histogram!("idemgate_request_duration_seconds", "outcome" => OUTCOMES[outcome])
        })
        .record(latency.as_secs_f64());
}

/// One request's line, written once its answer ends.
struct Line {
    request: Requested,
    arrived: Instant,
    status: u16,
    outcome: usize,
    job: Option<JobId>,
    by: Option<AnsweredBy>,
    /// Answer body bytes sent so far.
    sent: u64,
}

impl Line {
    /// Writes the line; `complete` is false when the answer was cut short
    /// (its client went away, or its upstream broke off mid-body).
    fn write(self, complete: bool) {
        let Requested {
            context,
            method,
            uri,
            request_id,
            received,
        } = self.request;
        // The path as routes and upstreams read it (the normal form; a path
        // refused as ambiguous as it came), never the query.
        let raw = uri.path();
        let path = idemgate_domain::path::normalize(raw).unwrap_or(Cow::Borrowed(raw));
        let route = route::find(&context.routes, &method, &path);
        // A pass-through request goes where the idempotency layer sends it:
        // its route's primary, or the first upstream (`opt_in::classify`).
        let upstream = match (&self.by, self.outcome) {
            (Some(by), _) => Some(&*by.upstream),
            (None, PASSED_THROUGH) => Some(match route {
                Some(route) => route.primary.name(),
                None => context.default_upstream.name(),
            }),
            (None, _) => None,
        };
        // Written by a formatter of its own, not `tracing`'s: the same
        // fields in the same format at a fraction of the cost
        // (docs/performance.md, item 26).
        record::info(record::ACCESS, "request answered", |line| {
            line.display("method", &method);
            if let Some(route) = route {
                line.str("route", &route.name);
            }
            line.str("path", &path)
                .u64("status", u64::from(self.status))
                .str("outcome", OUTCOMES[self.outcome]);
            if let Some(job) = &self.job {
                line.display("job", job);
            }
            if let Some(by) = &self.by {
                line.i64("attempt", i64::from(by.number))
                    .display("attempt_id", &by.attempt);
            }
            if let Some(upstream) = upstream {
                line.str("upstream", upstream);
            }
            // A client may send its own id, of any length a header may
            // have: the line keeps its first 128 characters (visible ASCII,
            // as `to_str` requires).
            if let Some(id) = request_id.as_ref().and_then(|id| id.to_str().ok()) {
                line.str("request_id", &id[..id.len().min(REQUEST_ID_KEPT)]);
            }
            // Whole microseconds: no float noise in the line.
            line.f64(
                "duration_ms",
                self.arrived.elapsed().as_micros() as f64 / 1000.0,
            )
            .u64("request_bytes", received.load(Ordering::Relaxed))
            .u64("response_bytes", self.sent)
            .bool("complete", complete);
        });
    }
}

pin_project! {
    /// A request body whose bytes are counted for the access log (when on).
    pub(super) struct Counted<B> {
        #[pin]
        inner: B,
        received: Option<Arc<AtomicU64>>,
    }
}

impl<B: Body> Body for Counted<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = std::task::ready!(this.inner.poll_frame(cx));
        if let (Some(received), Some(Ok(frame))) = (this.received, &frame) {
            if let Some(data) = frame.data_ref() {
                received.fetch_add(data.remaining() as u64, Ordering::Relaxed);
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project! {
    /// An answer body that writes the request's line (when on) once it
    /// ends, fails, or is dropped unfinished.
    pub(super) struct Logged<B>
    where
        B: Body,
    {
        #[pin]
        inner: B,
        line: Option<Line>,
    }

    impl<B> PinnedDrop for Logged<B>
    where
        B: Body,
    {
        fn drop(this: Pin<&mut Self>) {
            // Not polled to its end: complete if there was nothing left to
            // send (an empty body is never polled), else its client went
            // away.
            let this = this.project();
            if let Some(line) = this.line.take() {
                line.write(this.inner.is_end_stream());
            }
        }
    }
}

impl<B: Body> Body for Logged<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        let frame = std::task::ready!(this.inner.as_mut().poll_frame(cx));
        let Some(line) = this.line.as_mut() else {
            return Poll::Ready(frame);
        };
        let complete = match &frame {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    line.sent += data.remaining() as u64;
                }
                // Its last frame: the server may not poll again.
                this.inner.is_end_stream().then_some(true)
            }
            None => Some(true),
            Some(Err(_)) => Some(false),
        };
        if let Some(complete) = complete {
            if let Some(line) = this.line.take() {
                line.write(complete);
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
