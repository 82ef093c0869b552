//! A fake upstream on an OS-assigned port: records every request, answers
//! through a script, and can hold answers behind a gate the test opens.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Semaphore};

/// A request as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// 1 for the first request the upstream received, and so on.
    pub hit: usize,
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// Holds answers until opened, one permit per answer.
#[derive(Clone)]
pub struct Gate(Arc<Semaphore>);

impl Gate {
    pub fn new() -> Self {
        Gate(Arc::new(Semaphore::new(0)))
    }
    pub async fn pass(&self) {
        self.0.acquire().await.unwrap().forget();
    }
    pub fn open(&self, n: usize) {
        self.0.add_permits(n);
    }
}

type BoxFuture = Pin<Box<dyn Future<Output = Response<Full<Bytes>>> + Send>>;
type Handler = Arc<dyn Fn(Recorded) -> BoxFuture + Send + Sync>;

pub struct FakeUpstream {
    pub addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    connections: Arc<AtomicUsize>,
    recorded: Arc<Mutex<Vec<Recorded>>>,
    arrivals: tokio::sync::Mutex<mpsc::UnboundedReceiver<Recorded>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeUpstream {
    /// Serves `handler` on a fresh port.
    pub async fn start<F, Fut>(handler: F) -> FakeUpstream
    where
        F: Fn(Recorded) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::serve(listener, handler)
    }

    /// Serves `handler` on a given listener (to come up on a known port).
    pub fn serve<F, Fut>(listener: TcpListener, handler: F) -> FakeUpstream
    where
        F: Fn(Recorded) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
    {
        let addr = listener.local_addr().unwrap();
        let handler: Handler = Arc::new(move |r| Box::pin(handler(r)));
        let hits = Arc::new(AtomicUsize::new(0));
        let connections = Arc::new(AtomicUsize::new(0));
        let recorded = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::unbounded_channel();
        let task = {
            let hits = hits.clone();
            let connections = connections.clone();
            let recorded = recorded.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        return;
                    };
                    connections.fetch_add(1, Ordering::SeqCst);
                    let handler = handler.clone();
                    let hits = hits.clone();
                    let recorded = recorded.clone();
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                            let handler = handler.clone();
                            let hits = hits.clone();
                            let recorded = recorded.clone();
                            let tx = tx.clone();
                            async move {
                                let (parts, body) = req.into_parts();
                                let body = body
                                    .collect()
                                    .await
                                    .map(|c| c.to_bytes())
                                    .unwrap_or_default();
                                let hit = hits.fetch_add(1, Ordering::SeqCst) + 1;
                                let r = Recorded {
                                    hit,
                                    method: parts.method.to_string(),
                                    path: parts
                                        .uri
                                        .path_and_query()
                                        .map(|p| p.to_string())
                                        .unwrap_or_default(),
                                    headers: parts.headers,
                                    body,
                                };
                                recorded.lock().unwrap().push(r.clone());
                                let _ = tx.send(r.clone());
                                Ok::<_, Infallible>(handler(r).await)
                            }
                        });
                        let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                            .serve_connection(TokioIo::new(stream), svc)
                            .await;
                    });
                }
            })
        };
        FakeUpstream {
            addr,
            hits,
            connections,
            recorded,
            arrivals: tokio::sync::Mutex::new(rx),
            task,
        }
    }

    /// Answers every request with 200 and a JSON body naming the hit number
    /// and the identity headers it received.
    pub async fn echo() -> FakeUpstream {
        Self::start(|r| async move { echo_response(&r) }).await
    }

    /// Answers the first request `503` (`{"error": "overloaded"}`: provably
    /// no effect, so its job reopens) and echoes every later one.
    pub async fn overloaded_once() -> FakeUpstream {
        Self::start(|r| async move {
            if r.hit == 1 {
                json_response(503, serde_json::json!({"error": "overloaded"}))
            } else {
                echo_response(&r)
            }
        })
        .await
    }

    /// Echoes every request, but answers those `held` picks only once
    /// `gate` lets them through.
    pub async fn gated_echo(
        gate: &Gate,
        held: impl Fn(&Recorded) -> bool + Send + Sync + 'static,
    ) -> FakeUpstream {
        let gate = gate.clone();
        let held = Arc::new(held);
        Self::start(move |r| {
            let (gate, held) = (gate.clone(), held.clone());
            async move {
                if held(&r) {
                    gate.pass().await;
                }
                echo_response(&r)
            }
        })
        .await
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    pub fn recorded(&self) -> Vec<Recorded> {
        self.recorded.lock().unwrap().clone()
    }

    /// Waits for the next request to arrive (10 s at most).
    pub async fn arrival(&self) -> Recorded {
        self.arrival_within(Duration::from_secs(10)).await
    }

    /// Waits for the next request to arrive, `limit` at most: for a client
    /// that is a process of its own (a Python interpreter importing an SDK
    /// takes seconds on a loaded machine).
    pub async fn arrival_within(&self, limit: Duration) -> Recorded {
        let mut rx = self.arrivals.lock().await;
        tokio::time::timeout(limit, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no request reached the upstream within {limit:?}"))
            .expect("upstream stopped")
    }
}

impl Drop for FakeUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// 200 with `{"hit": n, "job": <Idempotency-Key>, "attempt": <n>, "body": …}`.
pub fn echo_response(r: &Recorded) -> Response<Full<Bytes>> {
    json_response(
        200,
        serde_json::json!({
            "hit": r.hit,
            "job": r.header("idempotency-key"),
            "attempt": r.header("idempotency-attempt"),
            "body": String::from_utf8_lossy(&r.body),
        }),
    )
}

pub fn json_response(status: u16, value: serde_json::Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(value.to_string())))
        .unwrap()
}

/// Reads a request's head off a raw socket (an upstream that answers by
/// hand: a status hyper would not send, a connection closed mid-call);
/// `None` once the peer has gone.
pub async fn read_head(socket: &mut tokio::net::TcpStream) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    Some(head)
}
