//! Logs, metrics, and the subscriber that carries spans to OTLP.

#![warn(unreachable_pub, missing_docs)]

pub mod catalogue;
pub mod ends;
pub mod logs;
pub mod trace;

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Installs the subscriber: logs to stderr, and spans to OTLP when an
/// endpoint is configured ([`trace`]); the handles it returns flush the
/// spans and the log's lines ([`logs`]) at exit, and must be kept until
/// then. An unusable endpoint is an error naming it.
///
/// Logs: `RUST_LOG` filters (default `info`, migrations quiet),
/// `IDEMGATE_LOG_FORMAT=json` switches to JSON lines. Whatever `RUST_LOG`
/// says, the PostgreSQL driver never logs below `info`: at `debug` it prints
/// every statement's parameters, which hold stored responses and owners.
/// Nothing the gateway itself logs carries a body, a credential or a key.
pub fn init() -> Result<(Option<crate::trace::Traces>, logs::Logs), String> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;

    let filter = log_filter();
    // The access line is written by a formatter of its own, not as an
    // event: whether the filter lets its target through is asked here once,
    // of a subscriber holding the same filter alone.
    let access = tracing::subscriber::with_default(
        tracing_subscriber::registry().with(log_filter()),
        || tracing::enabled!(target: logs::record::ACCESS, tracing::Level::INFO),
    );
    let (spans, traces) = match crate::trace::init()? {
        Some((layer, traces)) => (Some(layer), Some(traces)),
        None => (None, None),
    };
    // Lines go to stderr from a thread of their own, in batches: written
    // where they are logged, the access log's line per request cost more
    // than the rest of the line (docs/design.md §12, "Access log").
    let json = std::env::var("IDEMGATE_LOG_FORMAT").is_ok_and(|v| v == "json");
    let format = if json {
        logs::record::Format::Json
    } else {
        logs::record::Format::Text
    };
    let (writer, flusher) = logs::start(format, access)
        .map_err(|e| format!("cannot start the log's writer thread: {e}"))?;
    let logs = if json {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(writer)
            .with_filter(filter)
            .boxed()
    } else {
        // Colours only for a person at a terminal: a log file or collector
        // would get escape codes, and every request span's fields would be
        // styled for nobody (docs/performance.md, item 14).
        tracing_subscriber::fmt::layer()
            .with_writer(writer)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_filter(filter)
            .boxed()
    };
    let _ = tracing_subscriber::registry()
        .with(logs)
        .with(spans)
        .try_init();
    Ok((traces, flusher))
}

/// The log's filter: `RUST_LOG`, or `info` with migrations quiet; the
/// PostgreSQL driver capped at `info` ([`init`]).
fn log_filter() -> tracing_subscriber::EnvFilter {
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
    filter
}

/// The process-wide Prometheus recorder (installed once; later gateways in
/// the same process, as in tests, share it).
pub fn metrics() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            // Latencies as histograms (not summaries), so replicas aggregate.
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
                    // Up to two minutes: upstream answers (a model's) take long.
                    &[
                        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                        5.0, 10.0, 30.0, 60.0, 120.0,
                    ],
                )
                .expect("buckets are given")
                .build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_ok() {
                catalogue::describe();
                zero();
            }
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

/// Every series a dashboard or an alert reads, at zero from the start:
/// rates over a counter that appears only at its first event miss that
/// event, and a panel over a missing series shows "no data" instead of 0.
fn zero() {
    for name in [
        "idemgate_jobs_created_total",
        "idemgate_jobs_purged_total",
        "idemgate_commits_superseded_total",
        "idemgate_failovers_total",
        "idemgate_hedges_total",
        "idemgate_record_retries_total",
        "idemgate_requests_shed_total",
        "idemgate_streams_cut_total",
        "idemgate_stream_joiners_total",
        "idemgate_fastpath_errors_total",
        "idemgate_fastpath_writes_total",
        "idemgate_requests_held_total",
        "idemgate_attempts_rejected_total",
        "idemgate_database_read_only_total",
        "idemgate_streamed_bytes_total",
        "idemgate_memory_budget_refusals_total",
    ] {
        metrics::counter!(name).absolute(0);
    }
    for name in [
        "idemgate_held_requests",
        "idemgate_requests_in_flight",
        "idemgate_streams_in_flight",
        "idemgate_jobs_unknown",
    ] {
        metrics::gauge!(name).set(0.0);
    }
    zero_labelled();
}

/// The series with bounded labels, each label set at zero.
fn zero_labelled() {
    for source in ["memory", "redis", "store"] {
        metrics::counter!("idemgate_replays_total", "source" => source).absolute(0);
    }
    for source in ["postgres", "redis"] {
        metrics::counter!("idemgate_wakeups_total", "source" => source).absolute(0);
    }
    for found in ["running", "answered", "unsettled", "not_found", "unproven"] {
        metrics::counter!("idemgate_polls_total", "found" => found).absolute(0);
    }
    for question in ["mark", "ask"] {
        metrics::counter!("idemgate_mcp_store_timeouts_total", "question" => question).absolute(0);
    }
    for result in ["resumed", "refused"] {
        metrics::counter!("idemgate_stream_resumes_total", "result" => result).absolute(0);
    }
    for result in ["hit", "miss", "invalid", "error", "skipped"] {
        metrics::counter!("idemgate_fastpath_lookups_total", "result" => result).absolute(0);
    }
    // The reasons of `fastpath::Rejection` (docs/design.md §17); telemetry
    // sits below the layer that defines them, so they are named here.
    for reason in [
        "malformed",
        "version",
        "unknown_key",
        "forged",
        "plaintext",
        "truncated",
    ] {
        metrics::counter!("idemgate_replay_entries_rejected_total", "reason" => reason).absolute(0);
    }
    for outcome in ["replayed", "executed", "problem", "passed_through"] {
        for status in ["2xx", "4xx", "5xx"] {
            metrics::counter!("idemgate_requests_total", "outcome" => outcome, "status" => status)
                .absolute(0);
        }
        let _ = metrics::histogram!("idemgate_request_duration_seconds", "outcome" => outcome);
    }
    for operation in [
        "begin",
        "commit",
        "change",
        "job",
        "job_detail",
        "find_job",
        "unknown_jobs",
        "renew_leases",
        "expire_lapsed",
        "purge_expired",
        "ping",
        "watch",
        "mark_call",
        "unmark_call",
        "call_at_server",
    ] {
        for kind in ["unavailable", "internal"] {
            metrics::counter!("idemgate_store_errors_total", "operation" => operation, "kind" => kind)
                .absolute(0);
        }
        let _ = metrics::histogram!("idemgate_store_seconds", "operation" => operation);
    }
}
