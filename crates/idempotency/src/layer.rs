//! The Tower layer: a request that does not opt in goes straight to the
//! inner service, streamed and untouched; one that does is answered by the
//! [flow] (`docs/design.md` §2).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::future::Either;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service, ServiceExt};
use tracing::Instrument;

use super::execute::UpstreamService;
use super::flow;
use super::keyed::Keyed;
use super::opt_in::{self, Classified, OptedIn, Prepared, Refused};
use super::route::Protocol;
use super::shared::Shared;
use super::{mcp, poll, respond_async};
use crate::error::{ClientError, GatewayError};
use idemgate_domain::key::Owner;
use idemgate_proxy::http::idle::{BodyTimedOut, ClientBodyFailed};
use idemgate_proxy::http::without_gateway_headers;
use idemgate_proxy::http::Body;
use idemgate_proxy::shed::Admitted;
use idemgate_proxy::upstream::{Target, UpstreamError};

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
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            shared: self.shared.clone(),
            not_ready: None,
        }
    }
}

/// The service built by [`IdempotencyLayer`]. The server clones the stack
/// for every request (the Tower contract: a service is called through
/// `&mut`), so a clone of this costs reference counts, never an allocation
/// (`docs/performance.md`, item 22).
pub struct Idempotency<S> {
    /// What a passed-through request is sent to, as it is: no box. An
    /// opted-in request's attempts get a boxed clone of it.
    inner: S,
    shared: Arc<Shared>,
    /// The upstream handle's readiness error, answered to the request that
    /// follows (the pooled clients are always ready: this is for a service
    /// that is not).
    not_ready: Option<UpstreamError>,
}

impl<S: Clone> Clone for Idempotency<S> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
            not_ready: None,
        }
    }
}

impl<S> Service<Request<Body>> for Idempotency<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = UpstreamError>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture<S::Future>;

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

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        // Kept only by a session's end, whose work outlives its client.
        let admitted = match req.method() == http::Method::DELETE {
            true => req.extensions_mut().remove::<Admitted>(),
            false => None,
        };
        let prefix = &self.shared.config.respond_async_path;
        if let Some(job) = poll::polled(prefix, req.method(), req.uri().path()) {
            let shared = self.shared.clone();
            return ResponseFuture {
                answer: Answer::Guarded {
                    answer: Box::pin(poll::answer(shared, job, req)),
                },
            };
        }
        let classified = opt_in::classify(&self.shared.config.routes, &self.shared.trust, req);
        let answer = match classified {
            // An MCP session's end waits for its keyed calls at the server.
            Classified::PassThrough(req) if crate::mcp::ends_session(&req) => {
                let req = passed_on_a_route(&self.shared, req);
                let (shared, upstream) = (self.shared.clone(), self.inner.clone());
                let upstream: UpstreamService = BoxCloneSyncService::new(upstream);
                Answer::Guarded {
                    answer: Box::pin(end_session(shared, req, upstream, admitted)),
                }
            }
            // Straight to the upstream: no clone of it, no box, and none of
            // the opted-in flow's state (kilobytes) allocated for a request
            // that does not need it.
            Classified::PassThrough(req) => match self.not_ready.take() {
                None => Answer::Passing {
                    answer: self.inner.call(passed_on_a_route(&self.shared, req)),
                },
                Some(e) => Answer::Ready {
                    response: Some(GatewayError::from(e).into_response()),
                },
            },
            Classified::Refused(error) => Answer::Ready {
                response: Some(error.into_response()),
            },
            Classified::OptedIn(opted) => {
                let shared = self.shared.clone();
                // Boxed here, for the attempt tasks (which need no generics):
                // only an opted-in request pays for it.
                let attempts: UpstreamService = BoxCloneSyncService::new(self.inner.clone());
                Answer::Guarded {
                    answer: Box::pin(opted_in(shared, opted, attempts)),
                }
            }
        };
        ResponseFuture { answer }
    }
}

/// A request passed through on one of the gateway's routes (it names the
/// route's upstream: `Target`) carries no job id or attempt number of its
/// client's. There those headers are the gateway's, in every spelling: an
/// upstream that deduplicates by them (`reconcile = "resend"`, an API
/// idempotent by itself) would otherwise replay another owner's job to a
/// caller who names its id (`docs/design.md` §15, "Headers"). A path no
/// route names is the upstream's own, and keeps them.
fn passed_on_a_route(shared: &Shared, mut req: Request<Body>) -> Request<Body> {
    if req.extensions().get::<Target>().is_some() {
        let ours = shared.runner.forwarded_headers();
        idemgate_proxy::http::spelling::remove_every_spelling(req.headers_mut(), &ours);
    }
    req
}

/// An MCP session's `DELETE`, sent on once no keyed call of the session is
/// at its server from here or any replica (at most the attempt deadline), in a
/// task of its own: a client that does not wait for it still ends its
/// session (`docs/design.md` §19, "An agent's cancel"). The task keeps the
/// request counted against `max_in_flight` (`admitted`) until it ends, so
/// clients that leave their `DELETE`s held cannot pile up tasks unbounded;
/// the upstream's answer is waited for at most the attempt deadline, as
/// the hold is, so that one that never answers keeps no count forever.
async fn end_session(
    shared: Arc<Shared>,
    req: Request<Body>,
    upstream: UpstreamService,
    admitted: Option<Admitted>,
) -> Response<Body> {
    let calls = shared.runner.calls.clone();
    let (store, instance) = (shared.runner.store.clone(), shared.runner.instance);
    let limit = shared.config.attempt.deadline;
    let ended = tokio::spawn(
        async move {
            calls.quiet(&store, instance, &req, limit).await;
            // Bounded as the hold is: the request stays counted until then.
            let answer = match tokio::time::timeout(limit, upstream.oneshot(req)).await {
                Ok(answer) => answer,
                Err(_) => Err(UpstreamError::TimedOut(limit)),
            };
            drop(admitted);
            answer
        }
        .in_current_span(),
    );
    match ended.await {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => passing_failed(e).into_response(),
        Err(e) => GatewayError::Internal(Box::new(e)).into_response(),
    }
}

/// What a passed-through request that failed is answered: `408` when its
/// own client paused mid-body past the body-read timeout, `400` when its
/// client's body could not be read (a malformed chunk; the upstream saw the
/// request cut short either way), the upstream's failure otherwise: each
/// by who caused it (`docs/design.md` §2).
fn passing_failed(e: UpstreamError) -> GatewayError {
    if let Some(timed_out) = BodyTimedOut::within(&e) {
        return ClientError::BodyTimedOut(timed_out).into();
    }
    match ClientBodyFailed::within(&e) {
        Some(why) => ClientError::BodyUnreadable(why.into()).into(),
        None => e.into(),
    }
}

pin_project! {
    /// The answer to one request: streamed from the upstream, decided by the
    /// opted-in flow, or known at once.
    pub struct ResponseFuture<F> {
        #[pin]
        answer: Answer<F>,
    }
}

pin_project! {
    #[project = AnswerProj]
    enum Answer<F> {
        // Not opted in: the upstream's answer, errors mapped to problems.
        Passing { #[pin] answer: F },
        // Opted in: the flow's answer.
        Guarded { answer: Pin<Box<dyn Future<Output = Response<Body>> + Send>> },
        // Refused before anything was sent.
        Ready { response: Option<Response<Body>> },
    }
}

impl<F> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<Body>, UpstreamError>>,
{
    type Output = Result<Response<Body>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let response = match self.project().answer.project() {
            AnswerProj::Passing { answer } => match std::task::ready!(answer.poll(cx)) {
                Ok(response) => response,
                Err(e) => passing_failed(e).into_response(),
            },
            AnswerProj::Guarded { answer } => std::task::ready!(answer.as_mut().poll(cx)),
            AnswerProj::Ready { response } => response
                .take()
                .expect("a ResponseFuture is not polled after it completed"),
        };
        Poll::Ready(Ok(response))
    }
}

/// How long a request that prefers `respond-async` waits before `202`
/// (its `wait`, at most the hold timeout); `None` when it does not prefer
/// it, its route does not answer that way, or it resumes a stream (which
/// only ever continues an answer).
fn async_wait(shared: &Shared, request: &Keyed) -> Option<std::time::Duration> {
    if !request.intent.route.respond_async || request.resume.is_some() {
        return None;
    }
    // An anonymous job's poll would prove nothing but its id, which the
    // upstream and the access log see: its requests wait for their answer
    // (docs/design.md §10, "Answered later").
    if request.intent.owner == Owner::anonymous() {
        return None;
    }
    respond_async::preference(&request.parts.headers, shared.config.hold.timeout)
}

/// An opted-in request's answer: prepared (its body read), then run through
/// the flow, at once or answered later as it prefers; or, an MCP route's
/// message that is not a keyed tool call after all, passed through.
///
/// A held duplicate waits in this future for as long as it is held, so it
/// is kept to the flow's own size (docs/performance.md, "Per held
/// duplicate"): the request is prepared in a boxed future that takes it
/// along (an `async` function would keep its argument, the request's head,
/// beside the flow), and every other step is boxed too.
fn opted_in(
    shared: Arc<Shared>,
    opted: OptedIn,
    upstream: UpstreamService,
) -> impl Future<Output = Response<Body>> + Send {
    let prepared: Pin<Box<dyn Future<Output = Result<Prepared, Refused>> + Send>> =
        Box::pin(prepare(shared.clone(), opted));
    async move {
        let answer = answer(shared, prepared.await, upstream);
        answer.await
    }
}

/// Reads an opted-in request (an MCP route reads its body before it knows
/// whether it is keyed).
async fn prepare(shared: Arc<Shared>, opted: OptedIn) -> Result<Prepared, Refused> {
    match &opted.route.protocol {
        Protocol::Mcp(mcp) => {
            let mcp = mcp.clone();
            mcp::prepare(&shared, &mcp, opted).await
        }
        _ => opt_in::prepare(&shared, opted).await,
    }
}

/// An answer made by a boxed future.
type BoxedAnswer = Pin<Box<dyn Future<Output = Response<Body>> + Send>>;

/// How a prepared request is answered: by the flow, inline (a held
/// duplicate waits in it); any other way boxed, so the future a duplicate
/// waits in is no larger than the flow's.
fn answer(
    shared: Arc<Shared>,
    prepared: Result<Prepared, Refused>,
    upstream: UpstreamService,
) -> Either<BoxedAnswer, impl Future<Output = Response<Body>> + Send> {
    let request = match prepared {
        Ok(Prepared::Keyed(request)) => request,
        Ok(Prepared::Passing(req)) => {
            let req = passed_on_a_route(&shared, req);
            return Either::Left(Box::pin(async move {
                match upstream.oneshot(req).await {
                    Ok(response) => response,
                    Err(e) => passing_failed(e).into_response(),
                }
            }));
        }
        Ok(Prepared::Answered(response)) => {
            return Either::Left(Box::pin(std::future::ready(response)))
        }
        Err(refused) => return Either::Left(Box::pin(std::future::ready(refused.into_response()))),
    };
    // An upstream's own answer headers of the gateway's reach no keyed
    // client, stored or not (docs/design.md §15, "Headers"); a message
    // passed through above keeps them.
    let upstream: UpstreamService =
        BoxCloneSyncService::new(upstream.map_response(without_gateway_headers));
    match async_wait(&shared, &request) {
        Some(wait) => Either::Left(Box::pin(respond_async::answer(
            shared, request, upstream, wait,
        ))),
        None => Either::Right(flow::run(shared, request, upstream)),
    }
}

#[cfg(test)]
#[allow(unreachable_code, unused_variables, clippy::diverging_sub_expression)]
mod held_size {
    use super::*;
    use crate::testing::size_of_output;

    /// A held duplicate waits in the opted-in future for as long as it is
    /// held: it is the flow's own, not the size of the steps before it
    /// (2,824 bytes in a test build when it kept its argument and each
    /// step inline; docs/performance.md, "Per held duplicate").
    #[test]
    fn a_held_duplicate_waits_in_a_future_the_size_of_the_flows() {
        let opted_in = size_of_output(&|| opted_in(unreachable!(), unreachable!(), unreachable!()));
        let flow = size_of_output(&|| flow::run(unreachable!(), unreachable!(), unreachable!()));
        let prepare = size_of_output(&|| {
            let shared: &'static Shared = unreachable!();
            opt_in::prepare(shared, unreachable!())
        });
        assert!(
            opted_in <= flow + 128,
            "opted_in {opted_in} bytes, the flow {flow}"
        );
        assert!(opted_in < flow + prepare, "the preparation is boxed");
    }
}
