//! OpenTelemetry traces over OTLP/HTTP, received by a small collector the
//! test starts: a failed-over request arrives as one request span (a child
//! of the client's trace) with a child span per attempt, each naming its
//! upstream, number, outcome, job and attempt; the upstream receives the
//! attempt's `traceparent`. Without an endpoint nothing is exported and the
//! client's own `traceparent` passes through untouched.

use crate::support::otlp::{Receiver, Span};
use crate::support::upstream::json_response;
use crate::support::{send, FakeUpstream, Gateway, TestStore};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn traceparent() -> String {
    format!("00-{TRACE_ID}-{CLIENT_SPAN}-01")
}

/// The parent span id a `traceparent` header names.
fn parent_of(header: Option<&str>) -> (String, String) {
    let header = header.expect("the upstream got no traceparent");
    let parts: Vec<&str> = header.split('-').collect();
    assert_eq!(parts.len(), 4, "malformed traceparent {header}");
    (parts[1].to_owned(), parts[2].to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_over_request_is_one_trace_with_a_child_span_per_attempt() {
    let receiver = Receiver::start().await;
    let store = TestStore::postgres().await;
    let busy =
        FakeUpstream::start(|_| async { json_response(503, serde_json::json!({"busy": true})) })
            .await;
    let fallback = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, "http://unused")
        .set(
            "upstreams",
            &format!("[{:?}, {:?}]", busy.url(), fallback.url()),
        )
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint())
        .env("OTEL_BSP_SCHEDULE_DELAY", "50")
        .env("OTEL_SERVICE_NAME", "idemgate-under-test")
        .start()
        .await;

    let reply = send(
        http::Method::POST,
        &gateway.path("/v1/charges"),
        &[
            ("idempotency-key", "traced-1"),
            ("content-type", "application/json"),
            ("traceparent", &traceparent()),
        ],
        "{}",
    )
    .await;
    assert_eq!(reply.status, 200);
    let job = reply.job().unwrap();

    let spans = receiver
        .wait_for("the request span and two attempt spans", |spans| {
            spans.iter().filter(|s| s.name == "attempt").count() >= 2
                && spans.iter().any(|s| s.kind == 2)
        })
        .await;
    let request: Vec<&Span> = spans.iter().filter(|s| s.kind == 2).collect();
    assert_eq!(request.len(), 1, "{spans:#?}");
    let request = request[0];
    // The request continues the client's trace.
    assert_eq!(request.trace_id, TRACE_ID);
    assert_eq!(request.parent_span_id, CLIENT_SPAN);
    assert_eq!(request.kind, 2, "the request span is not SERVER");
    assert_eq!(request.service, "idemgate-under-test");
    assert_eq!(request.attr("http.request.method"), Some("POST"));
    assert_eq!(request.attr("url.path"), Some("/v1/charges"));
    // Named as HTTP server spans are: the method and the route it matched
    // (the default route opts in POST and PATCH on `/`).
    assert_eq!(request.name, "POST /");
    assert_eq!(request.attr("http.route"), Some("/"));
    assert_eq!(request.attr("http.response.status_code"), Some("200"));
    assert_eq!(
        request.attr_type("http.response.status_code"),
        Some("int"),
        "an integer, as the semantic conventions type it"
    );
    assert_eq!(request.attr("job.id"), Some(job.as_str()));

    let mut attempts: Vec<&Span> = spans.iter().filter(|s| s.name == "attempt").collect();
    attempts.sort_by_key(|s| s.attr("attempt.number").map(str::to_owned));
    assert_eq!(attempts.len(), 2, "{spans:#?}");
    for (n, (attempt, upstream, outcome)) in [
        (attempts[0], "primary", "failed"),
        (attempts[1], "fallback-1", "succeeded"),
    ]
    .into_iter()
    .enumerate()
    {
        assert_eq!(attempt.trace_id, TRACE_ID);
        assert_eq!(
            attempt.parent_span_id,
            request.span_id,
            "attempt {} not a child of the request",
            n + 1
        );
        assert_eq!(attempt.kind, 3, "the attempt span is not CLIENT");
        assert_eq!(
            attempt.attr("attempt.number"),
            Some((n + 1).to_string().as_str())
        );
        assert_eq!(attempt.attr_type("attempt.number"), Some("int"));
        assert_eq!(attempt.attr("upstream"), Some(upstream));
        assert_eq!(attempt.attr("outcome"), Some(outcome));
        assert_eq!(attempt.attr("job.id"), Some(job.as_str()));
        assert!(attempt.attr("attempt.id").is_some_and(|id| id.len() == 36));
    }
    assert_ne!(
        attempts[0].attr("attempt.id"),
        attempts[1].attr("attempt.id")
    );

    // Each upstream saw its own attempt's span as the parent.
    let to_busy = parent_of(busy.recorded()[0].header("traceparent"));
    let to_fallback = parent_of(fallback.recorded()[0].header("traceparent"));
    assert_eq!(to_busy, (TRACE_ID.to_owned(), attempts[0].span_id.clone()));
    assert_eq!(
        to_fallback,
        (TRACE_ID.to_owned(), attempts[1].span_id.clone())
    );

    // The job's attempts, as the admin API tells them, are those spans.
    let stored = gateway.job(&job).await;
    let ids: Vec<&str> = stored["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        [
            attempts[0].attr("attempt.id").unwrap(),
            attempts[1].attr("attempt.id").unwrap()
        ]
    );
}

#[tokio::test]
async fn a_request_without_a_traceparent_starts_its_own_trace_and_passes_requests_through_traced() {
    let receiver = Receiver::start().await;
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint())
        .env("OTEL_BSP_SCHEDULE_DELAY", "50")
        .start()
        .await;
    // Not opted in: passed through, still traced and propagated.
    let reply = send(http::Method::GET, &gateway.path("/v1/models"), &[], "").await;
    assert_eq!(reply.status, 200);
    let spans = receiver
        .wait_for("the pass-through request span", |s| {
            s.iter().any(|s| s.kind == 2)
        })
        .await;
    let request = spans.iter().find(|s| s.kind == 2).unwrap();
    assert_eq!(request.name, "GET", "no route: the method alone");
    assert_eq!(request.attr("http.route"), None);
    assert!(
        request.parent_span_id.is_empty(),
        "a root span was expected"
    );
    assert_eq!(request.service, "idemgate", "the default service name");
    let (trace, parent) = parent_of(upstream.recorded()[0].header("traceparent"));
    assert_eq!(
        (trace.as_str(), parent.as_str()),
        (request.trace_id.as_str(), request.span_id.as_str())
    );
}

#[tokio::test]
async fn without_an_endpoint_nothing_is_exported_and_the_clients_traceparent_passes_untouched() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        .start()
        .await;
    let sent = traceparent();
    let reply = send(
        http::Method::POST,
        &gateway.path("/v1/charges"),
        &[("idempotency-key", "untraced-1"), ("traceparent", &sent)],
        "{}",
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        upstream.recorded()[0].header("traceparent"),
        Some(sent.as_str())
    );
}

/// A gateway exporting its spans to `receiver` as `service`, every
/// `schedule_ms`.
async fn exporting_as(
    service: &str,
    schedule_ms: &str,
    store: &TestStore,
    upstream: &FakeUpstream,
    receiver: &Receiver,
) -> Gateway {
    Gateway::builder(store, &upstream.url())
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint())
        .env("OTEL_BSP_SCHEDULE_DELAY", schedule_ms)
        .env("OTEL_SERVICE_NAME", service)
        .start()
        .await
}

#[tokio::test]
async fn spans_buffered_at_shutdown_are_exported_before_the_process_exits() {
    let receiver = Receiver::start().await;
    let upstream = FakeUpstream::echo().await;
    let (stores, to) = ([TestStore::embedded(), TestStore::embedded()], &receiver);
    // Far longer than the test: only the flush at exit can send its spans.
    let mut held = exporting_as("held", "600000", &stores[0], &upstream, to).await;
    // Exports every 50 ms: the measure of "would have arrived by now".
    let control = exporting_as("control", "50", &stores[1], &upstream, to).await;
    for (gateway, key) in [(&held, "flushed-1"), (&control, "scheduled-1")] {
        let path = gateway.path("/v1/charges");
        let reply = send(http::Method::POST, &path, &[("idempotency-key", key)], "{}").await;
        assert_eq!(reply.status, 200);
    }
    // The control's spans end after the held gateway's and arrive on their
    // schedule; the held gateway's, exported at once or on any schedule as
    // short, would have arrived first.
    let spans = receiver
        .wait_for("the control's request span", |spans| {
            spans.iter().any(|s| s.service == "control" && s.kind == 2)
        })
        .await;
    let early: Vec<&Span> = spans.iter().filter(|s| s.service == "held").collect();
    assert!(early.is_empty(), "exported before the flush: {early:#?}");
    assert!(held.terminate().await.success());
    let spans: Vec<Span> = receiver
        .spans()
        .into_iter()
        .filter(|s| s.service == "held")
        .collect();
    assert!(spans.iter().any(|s| s.kind == 2), "{spans:#?}");
    assert!(spans
        .iter()
        .any(|s| s.name == "attempt" && s.attr("outcome") == Some("succeeded")));
}

#[tokio::test]
async fn an_unusable_endpoint_stops_start_up_naming_the_variable() {
    let store = TestStore::embedded();
    let said = Gateway::builder(&store, "http://127.0.0.1:9")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "::not a url")
        .start_and_fail()
        .await;
    assert!(said.contains("OTEL_EXPORTER_OTLP_ENDPOINT"), "{said}");
    assert!(said.contains("::not a url"), "{said}");
}
