//! OpenTelemetry traces over OTLP/HTTP (protobuf), off unless an endpoint is
//! configured the way operators configure every OpenTelemetry SDK:
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`),
//! with `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*` and
//! `OTEL_EXPORTER_OTLP_HEADERS` honoured by the SDK.
//!
//! The request span (`app`) and each attempt's span (`execute`) are
//! `tracing` spans; this module turns them into OpenTelemetry spans, reads a
//! client's W3C `traceparent` and writes the current span's onto what goes
//! upstream. See docs/design.md §12.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{HeaderExtractor, HeaderInjector, HttpError};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Whether spans are exported: propagation costs nothing when they are not.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// How long an export may take before it is dropped (spans are telemetry:
/// the request path never waits on them).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The endpoint the environment names, if any.
pub fn endpoint() -> Option<String> {
    [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .into_iter()
    .filter_map(|var| std::env::var(var).ok())
    .find(|v| !v.trim().is_empty())
}

/// The exporter, once set up; [`Traces::shutdown`] sends what is buffered.
pub struct Traces {
    provider: SdkTracerProvider,
}

/// Sets up the exporter when an endpoint is configured, returning the layer
/// to add to the subscriber (spans of this crate only) and the handle that
/// flushes at exit. Needs a Tokio runtime: exports go through it.
pub fn init<S>() -> Result<Option<(impl tracing_subscriber::Layer<S>, Traces)>, String>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    if endpoint().is_none() {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_timeout(EXPORT_TIMEOUT)
        .with_http_client(Exporter::new())
        .build()
        .map_err(|e| {
            format!("traces: {e}; set OTEL_EXPORTER_OTLP_ENDPOINT to the collector's OTLP/HTTP base URL (http://otel-collector:4318), or unset it for no traces")
        })?;
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("idemgate");
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    let tracer = provider.tracer("idemgate");
    let filter =
        tracing_subscriber::filter::Targets::new().with_target("idemgate", tracing::Level::INFO);
    let layer = tracing_subscriber::Layer::with_filter(
        tracing_opentelemetry::layer().with_tracer(tracer),
        filter,
    );
    ENABLED.store(true, Ordering::Relaxed);
    Ok(Some((layer, Traces { provider })))
}

impl Traces {
    /// Exports what is buffered, waiting at most a few seconds.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown_with_timeout(Duration::from_secs(5)) {
            tracing::warn!(error = %e, "some spans were not exported at shutdown");
        }
    }
}

/// Whether spans are exported (an OTLP endpoint is configured).
pub fn exporting() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Makes `span` a child of the trace the client's `traceparent` names.
pub fn continue_from(span: &tracing::Span, headers: &HeaderMap) {
    if !exporting() || !headers.contains_key("traceparent") {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    let _ = span.set_parent(parent);
}

/// Writes the current span's `traceparent` (and `tracestate`) onto a
/// request going upstream, replacing the client's.
pub fn propagate(headers: &mut HeaderMap) {
    if !exporting() {
        return;
    }
    let context = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&context, &mut HeaderInjector(headers));
}

/// The OTLP exporter's HTTP client: the batch processor exports from a
/// thread of its own, so each request is handed to the Tokio runtime the
/// gateway runs on (captured at start) and awaited from there.
#[derive(Debug)]
struct Exporter {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    runtime: tokio::runtime::Handle,
}

impl Exporter {
    fn new() -> Self {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        let tls = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .build();
        Exporter {
            client: Client::builder(TokioExecutor::new()).build(connector),
            runtime: tokio::runtime::Handle::current(),
        }
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Exporter {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let request = request.map(Full::new);
        let call = self.client.request(request);
        let sent = self.runtime.spawn(async move {
            let response = tokio::time::timeout(EXPORT_TIMEOUT, call).await??;
            let (parts, body) = response.into_parts();
            let body = tokio::time::timeout(EXPORT_TIMEOUT, body.collect())
                .await??
                .to_bytes();
            Ok::<_, HttpError>(Response::from_parts(parts, body))
        });
        sent.await?
    }
}
