//! A streaming upstream that answers each request with the next of a list
//! of scripted event streams (the last one again once the list runs out):
//! what AI backends send when they fail after their `200` head.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::StreamBody;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use super::upstream::Gate;

/// Answers request `n` with script `n` (the last one once they run out),
/// each event a frame of its own; with a gate, every event after the first
/// waits for one of its permits.
pub struct ScriptedSse {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl ScriptedSse {
    pub async fn start(scripts: Vec<Vec<String>>, gate: Option<Gate>) -> ScriptedSse {
        Self::serve(scripts, gate, false).await
    }

    /// Like [`ScriptedSse::start`], the answer's head held too: the gate's
    /// first permit releases the head with the first event.
    pub async fn head_held(scripts: Vec<Vec<String>>, gate: Gate) -> ScriptedSse {
        Self::serve(scripts, Some(gate), true).await
    }

    async fn serve(scripts: Vec<Vec<String>>, gate: Option<Gate>, held: bool) -> ScriptedSse {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let scripts = Arc::new(scripts);
        let task = {
            let hits = hits.clone();
            tokio::spawn(async move {
                while let Ok((stream, _)) = listener.accept().await {
                    let (hits, scripts, gate) = (hits.clone(), scripts.clone(), gate.clone());
                    tokio::spawn(async move {
                        let svc = hyper::service::service_fn(move |_: Request<Incoming>| {
                            let hit = hits.fetch_add(1, Ordering::SeqCst);
                            let events = scripts[hit.min(scripts.len() - 1)].clone();
                            let frames = stream_of(events, gate.clone());
                            let response = Response::builder()
                                .header("content-type", "text/event-stream")
                                .body(StreamBody::new(frames))
                                .unwrap();
                            let head = gate.clone().filter(|_| held);
                            async move {
                                if let Some(gate) = head {
                                    gate.pass().await;
                                }
                                Ok::<_, Infallible>(response)
                            }
                        });
                        let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                            .serve_connection(TokioIo::new(stream), svc)
                            .await;
                    });
                }
            })
        };
        ScriptedSse { addr, hits, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many requests it got.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

fn stream_of(
    events: Vec<String>,
    gate: Option<Gate>,
) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, Infallible>> {
    futures_util::stream::unfold((events.into_iter(), 0usize), move |(mut rest, n)| {
        let gate = gate.clone();
        async move {
            let event = rest.next()?;
            if let (Some(gate), true) = (&gate, n > 0) {
                gate.pass().await;
            }
            Some((Ok(Frame::data(Bytes::from(event))), (rest, n + 1)))
        }
    })
}

impl Drop for ScriptedSse {
    fn drop(&mut self) {
        self.task.abort();
    }
}
