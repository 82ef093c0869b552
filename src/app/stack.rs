//! THE stack: the request path of the proxy listener, outermost layer
//! first (`docs/design.md` §2), and how each answered request is recorded
//! on its span (counted, timed and logged by `access`).

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderName, Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tower::{Service, ServiceBuilder};
use tower_http::request_id::{PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnFailure, TraceLayer};

use super::access::{AccessLogLayer, Counted};

use crate::config::Settings;
use crate::BoxError;
use idemgate_domain::id::JobId;
use idemgate_idempotency::route::{self, Route};
use idemgate_idempotency::{IdempotencyLayer, Shared};
use idemgate_proxy::http::idle::{IdleTimeout, Pace};
use idemgate_proxy::http::linger::{Linger, Lingering};
use idemgate_proxy::http::request_id::{Logged, RequestIds};
use idemgate_proxy::http::{cookie, hop, spelling, ClientAddr, IDEMPOTENCY_KEY};
use idemgate_proxy::path::NormalizePathLayer;
use idemgate_proxy::shed::ShedLayer;
use idemgate_proxy::upstream::Upstreams;

/// A request's span at `$level` (a constant, as `tracing` needs it): its
/// method, path and id, with its status and job recorded when it is answered.
macro_rules! request_span {
    ($level:expr, $req:expr, $name:expr, $route:expr) => {
        tracing::span!(
            $level,
            "request",
            otel.kind = "server",
            // `{method} {route}`, or `{method}` on no route, as HTTP server
            // spans are named (the exporter starts the span early: its name
            // cannot wait for the idempotency layer's own match).
            otel.name = %$name,
            http.route = $route,
            http.request.method = %$req.method(),
            url.path = %$req.uri().path(),
            request_id = %Logged($req
                .headers()
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()),
            http.response.status_code = tracing::field::Empty,
            job.id = tracing::field::Empty,
        )
    };
}

/// The proxy's service: ids, spans and counts, paths normalised, load
/// shedding, the idempotency layer, and the upstreams.
pub(super) fn proxy(
    settings: &Settings,
    shared: Arc<Shared>,
    upstreams: Upstreams,
) -> impl Service<
    Request<Incoming>,
    Response = Response<
        impl http_body::Body<Data = Bytes, Error = impl Into<BoxError>> + Send + 'static,
    >,
    Error = Infallible,
    Future = impl Send + 'static,
> + Clone
       + Send
       + Sync
       + 'static {
    let pace = Pace {
        timeout: settings.limits.body_read_timeout,
        min_rate: settings.limits.body_min_rate,
    };
    // Shared, not copied, by the per-request clones of the stack.
    let routes: Arc<[Arc<Route>]> = settings.routes.iter().cloned().collect();
    let span_routes = routes.clone();
    let trusted_only = trusted_only(settings);
    ServiceBuilder::new()
        // Every request gets an id (kept if the client sent one)…
        .layer(SetRequestIdLayer::x_request_id(RequestIds))
        // …which the request span carries, so all its logs can be joined;
        // exported over OTLP when configured, continuing the client's trace…
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(move |req: &Request<Incoming>| span(req, &span_routes))
                .on_response(answered)
                // A 5xx here is usually the upstream's, already explained by the
                // attempt's own log line: a warning, not an error of the gateway.
                .on_failure(DefaultOnFailure::new().level(tracing::Level::WARN)),
        )
        // …and the response echoes.
        .layer(PropagateRequestIdLayer::x_request_id())
        // Each request timed once, from here: counted and timed to its
        // answer's head, and logged once its answer ends (`access_log`).
        .layer(AccessLogLayer::new(
            settings.access_log,
            routes.clone(),
            settings.upstreams[0].id.clone(),
        ))
        .map_request(move |req| enter(req, pace, &trusted_only))
        // One spelling of each path: routes match, and the upstream gets,
        // what the upstream will read (`400` for a path read two ways).
        .layer(NormalizePathLayer)
        // Saturated: answer 503 at once rather than queue without bound.
        .layer(ShedLayer::new(settings.max_in_flight, settings.retry_after))
        // Opted-in requests become jobs and attempts; the rest stream through.
        .layer(IdempotencyLayer::new(shared))
        // Each request goes to the upstream its attempt chose, or the first.
        .service(upstreams)
}

/// A request as the stack carries it: its body boxed, failing when its
/// client pauses mid-body past `body_read_timeout` (`docs/design.md` §18),
/// and its hop-by-hop headers (and those its `Connection` names) removed
/// before any layer adds a header of the gateway's own (§15). The client's
/// `Idempotency-Key` is for the gateway: naming it there does not hide it.
/// From a peer that is not a trusted proxy, the headers only a trusted
/// proxy is believed in are removed too, in every spelling an upstream
/// may read as theirs (`X_End_User`).
fn enter(
    mut req: Request<Counted<Incoming>>,
    pace: Pace,
    trusted_only: &[HeaderName],
) -> Request<idemgate_proxy::http::Body> {
    let expects_continue = req
        .headers()
        .get(http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    hop::strip_but(req.headers_mut(), Some(&IDEMPOTENCY_KEY));
    // As an HTTP/1 parser leaves them, whatever the version: one
    // credential, one owner (docs/design.md §15, "Headers").
    spelling::trim_values(req.headers_mut());
    let trusted = req
        .extensions()
        .get::<ClientAddr>()
        .is_some_and(|c| c.trusted);
    if !trusted {
        spelling::remove_every_spelling(req.headers_mut(), trusted_only);
    }
    // A console session is the gateway's alone: no owner, fingerprint or
    // upstream sees it (docs/design.md §14). An HTTP/2 client's cookies
    // split across headers are one header from here on, as the upstream
    // gets them.
    cookie::for_upstream(req.headers_mut());
    // Read to its end after its answer if answered before it was, on
    // HTTP/1.1 (docs/design.md §18, "A refusal is read").
    let linger = req.extensions_mut().remove::<Linger>();
    req.map(|b| {
        Lingering::wrap(
            IdleTimeout::paced(b, pace).boxed(),
            linger.as_ref(),
            expects_continue,
        )
    })
}

/// Headers that speak for a trusted proxy: the client addresses some
/// proxies set (`X-Real-IP`, `True-Client-IP`) and every `trusted_header`
/// owner source. The gateway believes them only from `trusted_proxies`;
/// an upstream that believes them from anyone could be told another
/// client's address or user, so from anyone else they are not forwarded
/// (`docs/design.md` §15). (`X-Forwarded-*` and `Forwarded` are replaced
/// where the request is sent, `idemgate_proxy::upstream`.)
fn trusted_only(settings: &Settings) -> Arc<[HeaderName]> {
    let mut names = vec![
        HeaderName::from_static("x-real-ip"),
        HeaderName::from_static("true-client-ip"),
    ];
    let rules = std::iter::once(&settings.owner).chain(settings.routes.iter().map(|r| &r.owner));
    for source in rules.flat_map(|rule| rule.sources.iter()) {
        for name in source.trusted_headers() {
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    names.into()
}

/// A request's span. A request without a key is only proxied, and its span
/// is context for the rare line it logs: made at `debug` unless spans are
/// exported, it costs nothing at the default `info` (docs/performance.md,
/// item 16).
fn span(req: &Request<Incoming>, routes: &[Arc<Route>]) -> tracing::Span {
    let span =
        if req.headers().contains_key(IDEMPOTENCY_KEY) || idemgate_telemetry::trace::exporting() {
            let route =
                route::find(routes, req.method(), req.uri().path()).map(|r| r.path_prefix.as_str());
            let name = match route {
                Some(route) => format!("{} {route}", req.method()),
                None => req.method().to_string(),
            };
            request_span!(tracing::Level::INFO, req, name, route)
        } else {
            request_span!(tracing::Level::DEBUG, req, req.method(), None::<&str>)
        };
    idemgate_telemetry::trace::continue_from(&span, req.headers());
    span
}

/// Records how a request was answered on its span (the access log layer
/// counts and times it).
fn answered<B>(response: &Response<B>, _latency: std::time::Duration, span: &tracing::Span) {
    // As an i64: tracing-opentelemetry sends unsigned values as text, and
    // the semantic conventions type the status code as an integer.
    span.record(
        "http.response.status_code",
        i64::from(response.status().as_u16()),
    );
    if let Some(job) = response.extensions().get::<JobId>() {
        span.record("job.id", tracing::field::display(job));
    }
}
