//! Logs, metrics, and the subscriber that carries spans to OTLP.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Installs the subscriber: logs to stderr, and spans to OTLP when an
/// endpoint is configured ([`trace`](crate::trace)); the handle it returns
/// flushes the spans at exit. An unusable endpoint is an error naming it.
///
/// Logs: `RUST_LOG` filters (default `info`, migrations quiet),
/// `IDEMGATE_LOG_FORMAT=json` switches to JSON lines. Whatever `RUST_LOG`
/// says, the PostgreSQL driver never logs below `info`: at `debug` it prints
/// every statement's parameters, which hold stored responses and owners.
/// Nothing the gateway itself logs carries a body, a credential or a key.
pub fn init() -> Result<Option<crate::trace::Traces>, String> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;

    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,refinery_core=warn"));
    // Capped only when something asks for more than `info`: a quieter
    // setting stays as quiet as it was.
    if filter
        .max_level_hint()
        .is_none_or(|max| max > tracing_subscriber::filter::LevelFilter::INFO)
    {
        if let Ok(cap) = "tokio_postgres=info".parse() {
            filter = filter.add_directive(cap);
        }
    }
    let json = std::env::var("IDEMGATE_LOG_FORMAT").is_ok_and(|v| v == "json");
    let logs = if json {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed()
    };
    let (spans, traces) = match crate::trace::init()? {
        Some((layer, traces)) => (Some(layer), Some(traces)),
        None => (None, None),
    };
    let _ = tracing_subscriber::registry()
        .with(logs)
        .with(spans)
        .try_init();
    Ok(traces)
}

/// The process-wide Prometheus recorder (installed once; later gateways in
/// the same process, as in tests, share it).
pub fn metrics() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

/// Shows an error with its whole chain of causes (`a: b: c`), for log lines:
/// typed errors keep their causes as `source()`, not in their own message.
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}
