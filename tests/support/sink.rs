//! An upstream for load: it reads each request's body and drops it (a
//! fake upstream that kept them would hold gigabytes in the test), waits
//! `delay`, answers a small JSON naming the path, and counts requests per
//! path.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

pub struct Sink {
    pub addr: std::net::SocketAddr,
    seen: Arc<Mutex<HashMap<String, usize>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Sink {
    pub async fn start(delay: Duration) -> Sink {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let counts = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let counts = counts.clone();
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let counts = counts.clone();
                    async move {
                        let path = req.uri().to_string();
                        let mut body = req.into_body();
                        let mut len = 0usize;
                        while let Some(Ok(frame)) = body.frame().await {
                            len += frame.data_ref().map_or(0, Bytes::len);
                        }
                        *counts.lock().unwrap().entry(path.clone()).or_default() += 1;
                        tokio::time::sleep(delay).await;
                        let answer = serde_json::json!({ "path": path, "len": len });
                        Ok::<_, Infallible>(
                            Response::builder()
                                .header("content-type", "application/json")
                                .body(Full::new(Bytes::from(answer.to_string())))
                                .unwrap(),
                        )
                    }
                });
                tokio::spawn(async move {
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Sink { addr, seen, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many requests reached it for each path (with its query).
    pub fn seen(&self) -> HashMap<String, usize> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.task.abort();
    }
}
