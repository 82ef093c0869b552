//! A fake MCP server (Streamable HTTP, JSON-RPC 2.0): it answers
//! `initialize` and `tools/list`, and runs `tools/call` by counting each
//! tool's runs, answering with the request's own `id`, as JSON or as an
//! event stream (a progress notification, then the response). Calls can be
//! held at a gate, and a tool named `flaky` answers a JSON-RPC error.
//!
//! Its transport answers as the official SDK's server does: every answer
//! carries the request's `Mcp-Session-Id`; a POST in session `gone` (one
//! the server no longer knows, as after a restart) is answered `404` with
//! a JSON-RPC error whose `id` is `null`, one in session `refused` a bare
//! `400`; a call held at the gate is answered `-32800` "Request cancelled"
//! once its `notifications/cancelled` comes, and, when a `DELETE` ends its
//! session, `500` with an `id: null` error (JSON) or a stream that ends
//! without its response. A call cut so counts a run: the tool may have
//! acted.

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
use tokio::sync::oneshot;

use super::upstream::Gate;

/// How the server answers a tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answering {
    /// `application/json`.
    Json,
    /// `text/event-stream`: a progress notification, then the response.
    Stream,
}

/// Why a call held at the gate was cut short.
#[derive(Debug, Clone, Copy)]
enum Cut {
    /// Its `notifications/cancelled` came.
    Cancelled,
    /// Its session was deleted.
    Terminated,
}

/// The calls held at the gate, by session and `id` (as JSON text).
type Pending = Arc<Mutex<HashMap<(String, String), oneshot::Sender<Cut>>>>;

pub struct FakeMcp {
    addr: std::net::SocketAddr,
    runs: Arc<Mutex<HashMap<String, usize>>>,
    posts: Arc<Mutex<Vec<Value>>>,
    pending: Pending,
    deletes: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

/// What one request asks, as the server reads it.
struct Asked<'a> {
    method: http::Method,
    session: String,
    message: &'a Value,
}

impl FakeMcp {
    /// A server answering as `answering`; tool calls wait at `gate` when
    /// one is given.
    pub async fn start(answering: Answering, gate: Option<Gate>) -> FakeMcp {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let posts: Arc<Mutex<Vec<Value>>> = Arc::default();
        let pending: Pending = Arc::default();
        let deletes: Arc<Mutex<Vec<String>>> = Arc::default();
        let task = {
            let (runs, posts, pending) = (runs.clone(), posts.clone(), pending.clone());
            let deletes = deletes.clone();
            tokio::spawn(async move {
                while let Ok((stream, _)) = listener.accept().await {
                    let (runs, posts, gate) = (runs.clone(), posts.clone(), gate.clone());
                    let (pending, deletes) = (pending.clone(), deletes.clone());
                    tokio::spawn(async move {
                        let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                            let (runs, posts, gate) = (runs.clone(), posts.clone(), gate.clone());
                            let (pending, deletes) = (pending.clone(), deletes.clone());
                            async move {
                                let (parts, body) = req.into_parts();
                                let session = parts
                                    .headers
                                    .get("mcp-session-id")
                                    .and_then(|v| v.to_str().ok())
                                    .unwrap_or_default()
                                    .to_owned();
                                let body = body.collect().await.unwrap().to_bytes();
                                let message: Value =
                                    serde_json::from_slice(&body).unwrap_or(Value::Null);
                                if parts.method == http::Method::POST {
                                    posts.lock().unwrap().push(message.clone());
                                }
                                if parts.method == http::Method::DELETE {
                                    deletes.lock().unwrap().push(session.clone());
                                }
                                let asked = Asked {
                                    method: parts.method,
                                    session: session.clone(),
                                    message: &message,
                                };
                                let mut answer =
                                    answer(&asked, &runs, gate.as_ref(), &pending, answering).await;
                                if !session.is_empty() {
                                    answer
                                        .headers_mut()
                                        .insert("mcp-session-id", session.parse().unwrap());
                                }
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
            pending,
            deletes,
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

    /// The sessions it was sent a `DELETE` of, in order.
    pub fn deletes(&self) -> Vec<String> {
        self.deletes.lock().unwrap().clone()
    }

    /// How many calls are held at the gate.
    pub fn pending(&self) -> usize {
        self.pending.lock().unwrap().len()
    }
}

/// A JSON-RPC message as an answer, with `status`.
fn json_answer(status: u16, message: &Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(message.to_string())))
        .unwrap()
}

async fn answer(
    asked: &Asked<'_>,
    runs: &Mutex<HashMap<String, usize>>,
    gate: Option<&Gate>,
    pending: &Pending,
    answering: Answering,
) -> Response<Full<Bytes>> {
    let (message, session) = (asked.message, asked.session.as_str());
    if asked.method == http::Method::DELETE {
        // The session ends: every call of it held at the gate is cut.
        let mut pending = pending.lock().unwrap();
        let ended: Vec<_> = pending
            .keys()
            .filter(|(s, _)| s == session)
            .cloned()
            .collect();
        for at in ended {
            let _ = pending.remove(&at).unwrap().send(Cut::Terminated);
        }
        return Response::new(Full::default());
    }
    match session {
        "gone" => {
            let error = json!({"jsonrpc": "2.0", "id": null,
                               "error": {"code": -32600, "message": "Session not found"}});
            return json_answer(404, &error);
        }
        "refused" => {
            return Response::builder()
                .status(400)
                .body(Full::default())
                .unwrap()
        }
        _ => {}
    }
    let id = message.get("id").cloned().unwrap_or(Value::Null);
    let method = message.get("method").and_then(Value::as_str).unwrap_or("");
    if method == "notifications/cancelled" {
        let request = message
            .pointer("/params/requestId")
            .cloned()
            .unwrap_or(Value::Null);
        let held = pending
            .lock()
            .unwrap()
            .remove(&(session.to_owned(), request.to_string()));
        if let Some(held) = held {
            let _ = held.send(Cut::Cancelled);
        }
    }
    let response = match method {
        "initialize" => json!({"jsonrpc": "2.0", "id": id, "result": {
            "protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
            "serverInfo": {"name": "fake", "version": "1"}}}),
        "tools/list" => json!({"jsonrpc": "2.0", "id": id, "result": {"tools": []}}),
        "tools/call" => {
            let tool = message
                .pointer("/params/name")
                .and_then(Value::as_str)
                .unwrap_or("");
            let run = || {
                let mut runs = runs.lock().unwrap();
                let n = runs.entry(tool.to_owned()).or_default();
                *n += 1;
                *n
            };
            if let Some(gate) = gate {
                let at = (session.to_owned(), id.to_string());
                let (tx, cut) = oneshot::channel();
                pending.lock().unwrap().insert(at.clone(), tx);
                tokio::select! {
                    () = gate.pass() => {
                        pending.lock().unwrap().remove(&at);
                    }
                    Ok(how) = cut => {
                        run();
                        return cut_short(how, &id, answering);
                    }
                }
            }
            let run = run();
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

/// The answer of a call cut short `how`, as the official SDK's server
/// gives it.
fn cut_short(how: Cut, id: &Value, answering: Answering) -> Response<Full<Bytes>> {
    let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress",
                          "params": {"progressToken": 1, "progress": 1}});
    let stream = |body: String| {
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(Full::new(Bytes::from(body)))
            .unwrap()
    };
    match (how, answering) {
        (Cut::Cancelled, Answering::Json) => {
            let error = json!({"jsonrpc": "2.0", "id": id,
                               "error": {"code": -32800, "message": "Request cancelled"}});
            json_answer(200, &error)
        }
        (Cut::Cancelled, Answering::Stream) => {
            let error = json!({"jsonrpc": "2.0", "id": id,
                               "error": {"code": -32800, "message": "Request cancelled"}});
            stream(format!(
                "event: message\ndata: {progress}\n\nevent: message\ndata: {error}\n\n"
            ))
        }
        (Cut::Terminated, Answering::Json) => {
            let error = json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32603,
                               "message": "Session terminated before the request completed"}});
            json_answer(500, &error)
        }
        // The stream ends, cleanly, before the response.
        (Cut::Terminated, Answering::Stream) => {
            stream(format!("event: message\ndata: {progress}\n\n"))
        }
    }
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
