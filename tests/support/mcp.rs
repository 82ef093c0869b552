//! A fake MCP server (Streamable HTTP, JSON-RPC 2.0): it answers
//! `initialize` and `tools/list`, and runs `tools/call` by counting each
//! tool's runs, answering with the request's own `id`, as JSON or as an
//! event stream (a progress notification, then the response). Calls can be
//! held at a gate, and a tool named `flaky` answers a JSON-RPC error.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use super::upstream::Gate;

/// How the server answers a tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answering {
    /// `application/json`.
    Json,
    /// `text/event-stream`: a progress notification, then the response.
    Stream,
}

pub struct FakeMcp {
    addr: std::net::SocketAddr,
    runs: Arc<Mutex<HashMap<String, usize>>>,
    posts: Arc<Mutex<Vec<Value>>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeMcp {
    /// A server answering as `answering`; tool calls wait at `gate` when
    /// one is given.
    pub async fn start(answering: Answering, gate: Option<Gate>) -> FakeMcp {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let posts: Arc<Mutex<Vec<Value>>> = Arc::default();
        let task = {
            let (runs, posts) = (runs.clone(), posts.clone());
            tokio::spawn(async move {
                while let Ok((stream, _)) = listener.accept().await {
                    let (runs, posts, gate) = (runs.clone(), posts.clone(), gate.clone());
                    tokio::spawn(async move {
                        let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                            let (runs, posts, gate) = (runs.clone(), posts.clone(), gate.clone());
                            async move {
                                let body = req.into_body().collect().await.unwrap().to_bytes();
                                let message: Value =
                                    serde_json::from_slice(&body).unwrap_or(Value::Null);
                                posts.lock().unwrap().push(message.clone());
                                let answer =
                                    answer(&message, &runs, gate.as_ref(), answering).await;
                                Ok::<_, Infallible>(answer)
                            }
                        });
                        let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                            .serve_connection(TokioIo::new(stream), svc)
                            .await;
                    });
                }
            })
        };
        FakeMcp {
            addr,
            runs,
            posts,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many times `tool` ran.
    pub fn runs(&self, tool: &str) -> usize {
        self.runs.lock().unwrap().get(tool).copied().unwrap_or(0)
    }

    /// Every message it was posted, in order.
    pub fn posts(&self) -> Vec<Value> {
        self.posts.lock().unwrap().clone()
    }
}

async fn answer(
    message: &Value,
    runs: &Mutex<HashMap<String, usize>>,
    gate: Option<&Gate>,
    answering: Answering,
) -> Response<Full<Bytes>> {
    let id = message.get("id").cloned().unwrap_or(Value::Null);
    let method = message.get("method").and_then(Value::as_str).unwrap_or("");
    let response = match method {
        "initialize" => json!({"jsonrpc": "2.0", "id": id, "result": {
            "protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
            "serverInfo": {"name": "fake", "version": "1"}}}),
        "tools/list" => json!({"jsonrpc": "2.0", "id": id, "result": {"tools": []}}),
        "tools/call" => {
            if let Some(gate) = gate {
                gate.pass().await;
            }
            let tool = message
                .pointer("/params/name")
                .and_then(Value::as_str)
                .unwrap_or("");
            let run = {
                let mut runs = runs.lock().unwrap();
                let n = runs.entry(tool.to_owned()).or_default();
                *n += 1;
                *n
            };
            if tool == "flaky" {
                json!({"jsonrpc": "2.0", "id": id,
                       "error": {"code": -32603, "message": "the tool's backend is down"}})
            } else {
                let args = message
                    .pointer("/params/arguments")
                    .cloned()
                    .unwrap_or(json!({}));
                json!({"jsonrpc": "2.0", "id": id, "result": {
                    "content": [{"type": "text", "text": format!("{tool} run {run} with {args}")}],
                    "isError": false}})
            }
        }
        // Notifications and responses: accepted, no body.
        _ => {
            return Response::builder()
                .status(202)
                .body(Full::default())
                .unwrap()
        }
    };
    if answering == Answering::Stream && method == "tools/call" {
        let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress",
                              "params": {"progressToken": 1, "progress": 1}});
        let body =
            format!("event: message\ndata: {progress}\n\nevent: message\ndata: {response}\n\n");
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
    }
    Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(response.to_string())))
        .unwrap()
}

impl Drop for FakeMcp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A `tools/call` message: `id`, `tool`, `arguments`, and its key in
/// `params._meta.idempotencyKey` when given.
pub fn tool_call(id: Value, tool: &str, arguments: Value, key: Option<&str>) -> Value {
    let mut params = json!({"name": tool, "arguments": arguments, "_meta": {"progressToken": id}});
    if let Some(key) = key {
        params["_meta"]["idempotencyKey"] = json!(key);
    }
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params})
}
