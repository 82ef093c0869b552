//! A small OTLP/HTTP receiver: takes `POST /v1/traces` (protobuf) on
//! loopback and keeps every span it is sent, flattened.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;
use tokio::net::TcpListener;

/// One received span, with the fields the tests look at.
#[derive(Debug, Clone)]
pub struct Span {
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    /// `SPAN_KIND_SERVER` is 2, `SPAN_KIND_CLIENT` 3.
    pub kind: i32,
    pub attributes: HashMap<String, String>,
    /// Each attribute's OTLP type: `string`, `int`, `bool`, `double`.
    pub types: HashMap<String, &'static str>,
    /// The resource's `service.name`.
    pub service: String,
}

impl Span {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }

    /// The OTLP type `key` was sent as.
    pub fn attr_type(&self, key: &str) -> Option<&'static str> {
        self.types.get(key).copied()
    }
}

pub struct Receiver {
    pub port: u16,
    spans: Arc<Mutex<Vec<Span>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    pub async fn start() -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let kept = spans.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let kept = kept.clone();
                tokio::spawn(async move {
                    let service =
                        hyper::service::service_fn(move |req: http::Request<Incoming>| {
                            let kept = kept.clone();
                            async move {
                                let path = req.uri().path().to_owned();
                                let body = req.into_body().collect().await?.to_bytes();
                                if path != "/v1/traces" {
                                    return Ok::<_, hyper::Error>(status(StatusCode::NOT_FOUND));
                                }
                                let Ok(export) = ExportTraceServiceRequest::decode(body) else {
                                    return Ok(status(StatusCode::BAD_REQUEST));
                                };
                                kept.lock().unwrap().extend(flatten(export));
                                let ok = ExportTraceServiceResponse::default().encode_to_vec();
                                Ok(Response::builder()
                                    .header("content-type", "application/x-protobuf")
                                    .body(Full::new(Bytes::from(ok)))
                                    .unwrap())
                            }
                        });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        Receiver { port, spans, task }
    }

    /// The endpoint, as `OTEL_EXPORTER_OTLP_ENDPOINT` takes it.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits (10 s at most) until `enough` holds for what has arrived.
    pub async fn wait_for(&self, what: &str, enough: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let spans = self.spans();
            if enough(&spans) {
                return spans;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: not received within 10 s; got {spans:#?}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn status(code: StatusCode) -> Response<Full<Bytes>> {
    Response::builder()
        .status(code)
        .body(Full::new(Bytes::new()))
        .unwrap()
}

fn flatten(export: ExportTraceServiceRequest) -> Vec<Span> {
    let mut out = Vec::new();
    for resource in export.resource_spans {
        let service = resource
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| kv.value.as_ref())
            .map(|v| text(&v.value))
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for s in scope.spans {
                out.push(Span {
                    name: s.name,
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: hex(&s.parent_span_id),
                    kind: s.kind,
                    types: s
                        .attributes
                        .iter()
                        .map(|kv| {
                            (
                                kv.key.clone(),
                                kind(kv.value.as_ref().and_then(|v| v.value.as_ref())),
                            )
                        })
                        .collect(),
                    attributes: s
                        .attributes
                        .into_iter()
                        .map(|kv| (kv.key, kv.value.map(|v| text(&v.value)).unwrap_or_default()))
                        .collect(),
                    service: service.clone(),
                });
            }
        }
    }
    out
}

fn kind(value: Option<&AnyValue>) -> &'static str {
    match value {
        Some(AnyValue::StringValue(_)) => "string",
        Some(AnyValue::IntValue(_)) => "int",
        Some(AnyValue::BoolValue(_)) => "bool",
        Some(AnyValue::DoubleValue(_)) => "double",
        _ => "other",
    }
}

fn text(value: &Option<AnyValue>) -> String {
    match value {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
