//! A fake streaming upstream (server-sent events) whose events are released
//! one by one through a gate, and a client that reads a streamed answer as
//! it comes.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use super::upstream::Gate;

/// How a stream ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Cleanly, after every event.
    Clean,
    /// The connection is reset after this many events.
    ResetAfter(usize),
}

/// Streams `events` events per request, each waiting for a permit of `gate`.
pub struct SseUpstream {
    pub addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    sent: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

/// The bytes of event `n` of the stream of `job`, padded to `size` bytes.
pub fn event(job: &str, n: usize, size: usize) -> String {
    let head = format!("data: {{\"job\":\"{job}\",\"n\":{n},\"pad\":\"");
    let tail = "\"}\n\n";
    let pad = size.saturating_sub(head.len() + tail.len());
    format!("{head}{}{tail}", "x".repeat(pad))
}

/// What releases each event.
#[derive(Clone)]
pub enum Pace {
    /// A permit of the gate.
    Gate(Gate),
    /// This much time.
    Every(Duration),
    /// A permit of the gate, sending a heartbeat this often meanwhile.
    Beating(Gate, Duration),
}

impl Pace {
    /// Waits for the next event: `true` when it is due, `false` when a
    /// heartbeat is.
    fn wait(self) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send>> {
        match self {
            Pace::Gate(gate) => Box::pin(async move {
                gate.pass().await;
                true
            }),
            Pace::Every(gap) => Box::pin(async move {
                tokio::time::sleep(gap).await;
                true
            }),
            Pace::Beating(gate, beat) => {
                Box::pin(async move { tokio::time::timeout(beat, gate.pass()).await.is_ok() })
            }
        }
    }
}

/// The bytes of event `n` with an `id: e<n>` line first, `size` bytes in all.
pub fn event_with_id(job: &str, n: usize, size: usize) -> String {
    let id = format!("id: e{n}\n");
    format!("{id}{}", event(job, n, size - id.len()))
}

/// The heartbeat [`SseUpstream::with_heartbeats`] sends.
pub const HEARTBEAT: &str = ": keep-alive\n\n";

/// What the events say.
#[derive(Debug, Clone, Copy)]
enum Events {
    /// [`event`]s of this size.
    Padded(usize),
    /// [`event_with_id`]s of this size.
    WithIds(usize),
    /// OpenAI chat completion chunks of these tokens, then `[DONE]`.
    OpenAi(&'static [&'static str]),
}

impl Events {
    fn make(self, job: &str, n: usize) -> String {
        match self {
            Events::Padded(size) => event(job, n, size),
            Events::WithIds(size) => event_with_id(job, n, size),
            Events::OpenAi(tokens) => openai_chunk(tokens, n),
        }
    }
}

/// An OpenAI-compatible chat completion chunk carrying `token`, or the
/// final `[DONE]` after the last token.
pub fn openai_chunk(tokens: &'static [&'static str], n: usize) -> String {
    match tokens.get(n - 1) {
        Some(token) => format!(
            "data: {}\n\n",
            serde_json::json!({
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "created": 1_700_000_000,
                "model": "fake-model",
                "choices": [{"index": 0, "delta": {"content": token}, "finish_reason": null}],
            })
        ),
        None => "data: [DONE]\n\n".to_owned(),
    }
}

impl SseUpstream {
    pub async fn start(events: usize, size: usize, gate: &Gate, ending: Ending) -> SseUpstream {
        Self::serve(
            events,
            Pace::Gate(gate.clone()),
            Events::Padded(size),
            ending,
        )
        .await
    }

    /// Like [`SseUpstream::start`], each event with an `id:` line
    /// ([`event_with_id`]).
    pub async fn with_ids(events: usize, size: usize, gate: &Gate) -> SseUpstream {
        let pace = Pace::Gate(gate.clone());
        Self::serve(events, pace, Events::WithIds(size), Ending::Clean).await
    }

    /// Like [`SseUpstream::start`], sending a [`HEARTBEAT`] every `beat`
    /// while it waits to send the next event.
    pub async fn with_heartbeats(
        events: usize,
        size: usize,
        gate: &Gate,
        beat: Duration,
    ) -> SseUpstream {
        let pace = Pace::Beating(gate.clone(), beat);
        Self::serve(events, pace, Events::Padded(size), Ending::Clean).await
    }

    /// Streams `tokens` as OpenAI chat completion chunks, one every `gap`,
    /// then `[DONE]`.
    pub async fn openai(tokens: &'static [&'static str], gap: Duration) -> SseUpstream {
        Self::serve(
            tokens.len() + 1,
            Pace::Every(gap),
            Events::OpenAi(tokens),
            Ending::Clean,
        )
        .await
    }

    async fn serve(events: usize, pace: Pace, make: Events, ending: Ending) -> SseUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let sent = Arc::new(AtomicUsize::new(0));
        let task = {
            let (hits, sent) = (hits.clone(), sent.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        return;
                    };
                    let (hits, sent, pace) = (hits.clone(), sent.clone(), pace.clone());
                    tokio::spawn(async move {
                        let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                            let (hits, sent, pace) = (hits.clone(), sent.clone(), pace.clone());
                            async move {
                                hits.fetch_add(1, Ordering::SeqCst);
                                let job = req
                                    .headers()
                                    .get("idempotency-key")
                                    .and_then(|v| v.to_str().ok())
                                    .unwrap_or("")
                                    .to_owned();
                                let frames = futures_util::stream::unfold(0usize, move |n| {
                                    let (pace, sent, job) =
                                        (pace.clone(), sent.clone(), job.clone());
                                    async move {
                                        if let Ending::ResetAfter(k) = ending {
                                            if n == k {
                                                return Some((
                                                    Err(std::io::Error::other("reset")),
                                                    n + 1,
                                                ));
                                            }
                                        }
                                        if n >= events {
                                            return None;
                                        }
                                        if !pace.wait().await {
                                            let beat = Bytes::from_static(HEARTBEAT.as_bytes());
                                            return Some((Ok(Frame::data(beat)), n));
                                        }
                                        sent.fetch_add(1, Ordering::SeqCst);
                                        let bytes = Bytes::from(make.make(&job, n + 1));
                                        Some((Ok(Frame::data(bytes)), n + 1))
                                    }
                                });
                                let response = Response::builder()
                                    .header("content-type", "text/event-stream")
                                    .header("cache-control", "no-cache")
                                    .body(StreamBody::new(frames))
                                    .unwrap();
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
        SseUpstream {
            addr,
            hits,
            sent,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A gateway in front of it on `store`, mirroring streams on `redis`:
    /// one of several replicas (5 s upstream timeout).
    pub async fn replica(
        &self,
        store: &super::TestStore,
        redis: &super::ThrowawayRedis,
    ) -> super::Gateway {
        super::Gateway::builder(store, &self.url())
            .set("upstream_timeout", "\"5s\"")
            .set("redis_url", &format!("{:?}", redis.url()))
            .start()
            .await
    }

    /// How many requests it got.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    /// How many events it has sent, over all requests.
    pub fn sent(&self) -> usize {
        self.sent.load(Ordering::SeqCst)
    }
}

impl Drop for SseUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A streamed answer being read by a client.
pub struct Reader {
    pub status: u16,
    pub headers: http::HeaderMap,
    body: Incoming,
    pub read: Vec<u8>,
}

/// How a reader's body ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Finish {
    /// The message ended properly.
    Complete,
    /// The connection failed before the message was complete.
    Aborted,
}

impl Reader {
    /// Sends a keyed POST and returns once the answer's head arrived.
    pub async fn post(url: &str, key: &str, body: &str) -> Reader {
        Self::post_with(url, key, body, &[]).await
    }

    /// Sends a keyed POST with `headers` besides and returns once the
    /// answer's head arrived.
    pub async fn post_with(url: &str, key: &str, body: &str, headers: &[(&str, &str)]) -> Reader {
        let mut req = Request::post(url)
            .header("idempotency-key", key)
            .header("content-type", "application/json");
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        Self::send(req.body(Full::new(Bytes::from(body.to_owned()))).unwrap()).await
    }

    /// Sends a GET with `headers` and returns once the answer's head arrived.
    pub async fn get_with(url: &str, headers: &[(&str, &str)]) -> Reader {
        let mut req = Request::get(url);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        Self::send(req.body(Full::new(Bytes::new())).unwrap()).await
    }

    async fn send(req: Request<Full<Bytes>>) -> Reader {
        let response = tokio::time::timeout(Duration::from_secs(20), super::client().request(req))
            .await
            .expect("no answer head within 20 s")
            .expect("request failed");
        let (parts, body) = response.into_parts();
        Reader {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body,
            read: Vec::new(),
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Reads until `bytes` bytes in all were read (10 s at most).
    pub async fn read_until(&mut self, bytes: usize) {
        let read = async {
            while self.read.len() < bytes {
                match self.body.frame().await {
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            self.read.extend_from_slice(&data);
                        }
                    }
                    Some(Err(e)) => {
                        panic!("the stream failed after {} bytes: {e}", self.read.len())
                    }
                    None => panic!(
                        "the stream ended after {} of {bytes} bytes",
                        self.read.len()
                    ),
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .unwrap_or_else(|_| panic!("only {} of {bytes} bytes within 10 s", self.read.len()));
    }

    /// Reads to the end (20 s at most): complete, or aborted.
    pub async fn finish(&mut self) -> Finish {
        self.finish_within(Duration::from_secs(20)).await
    }

    /// Reads to the end (`limit` at most): complete, or aborted.
    pub async fn finish_within(&mut self, limit: Duration) -> Finish {
        let read = async {
            loop {
                match self.body.frame().await {
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            self.read.extend_from_slice(&data);
                        }
                    }
                    Some(Err(_)) => return Finish::Aborted,
                    None => return Finish::Complete,
                }
            }
        };
        tokio::time::timeout(limit, read)
            .await
            .unwrap_or_else(|_| panic!("the stream neither ended nor failed within {limit:?}"))
    }
}
