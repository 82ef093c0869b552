//! Connections to one upstream, kept open between requests.
//!
//! A stack of idle HTTP/1.1 connections over hyper's connection-level
//! client: the most recently used is taken first, so the busy ones stay
//! warm and the rest age out past the upstream's `idle_timeout`; with a
//! runtime per worker thread, the most recent of those the worker's own
//! runtime drives ([`Pool::checkout`]). A
//! connection comes back when its answer's body has been read to the end.
//! hyper-util's pooled client did the same with more machinery per request
//! (a checkout future, a keyed pool map, a `Host` and URI rewrite of its
//! own); docs/performance.md, item 10, has what the change bought.
//!
//! At most [`MAX_IDLE`] idle connections are kept per upstream (design §11);
//! one returned past that is closed. Without a cap, a burst of concurrent
//! requests (up to `max_in_flight`, 10,000 by default) left as many idle
//! connections open for `idle_timeout`, each holding a file descriptor and
//! hyper's buffers here, and a connection on the upstream's side.
//!
//! A request that a reused connection could not send (the upstream had just
//! closed it) comes back from hyper unsent and is sent again on another
//! connection: nothing reached the upstream, so that is safe for any method.
//! Once hyper may have written a byte of it, a failure is `Broken`, never
//! retried here: whether to try again is the attempt's decision.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::client::conn::TrySendError;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use tower::ServiceExt;

use idemgate_domain::worker;

use super::UpstreamError;
use crate::http::{Body, BodyError};

/// Idle connections kept per upstream, at most: pingora's default for its
/// whole pool (`upstream_keepalive_pool_size`), here per upstream. Only idle
/// ones count, so the cap bounds the slack above the current concurrency:
/// steady load never meets it (the benchmark's 32 clients keep at most 32),
/// and connections past it close as a burst ends instead of idling for
/// `idle_timeout`.
pub(super) const MAX_IDLE: usize = 128;

/// The idle connections to one upstream, and how to open another.
pub(super) struct Pool {
    connector: HttpsConnector<HttpConnector>,
    /// Where connections go: the upstream's base, scheme and authority.
    base: Uri,
    /// How long a connection may idle and still be reused (the upstream's
    /// `idle_timeout`; zero: never reused).
    idle_timeout: Duration,
    /// How many idle connections are kept at most ([`MAX_IDLE`]).
    max_idle: usize,
    /// Most recently returned last.
    idle: Mutex<Vec<Idle>>,
}

struct Idle {
    conn: Conn,
    since: Instant,
}

/// A connection's sending half, and the worker whose runtime drives the
/// connection (the one that opened it: its task was spawned there).
struct Conn {
    sender: SendRequest<Body>,
    worker: usize,
}

impl Pool {
    pub(super) fn new(
        connector: HttpsConnector<HttpConnector>,
        base: Uri,
        idle_timeout: Duration,
        max_idle: usize,
    ) -> Arc<Self> {
        Arc::new(Pool {
            connector,
            base,
            idle_timeout,
            max_idle,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Sends `req` (its URI in origin form, its `Host` set) on an idle
    /// connection, or on a new one when none is ready.
    pub(super) fn send(self: &Arc<Self>, req: Request<Body>) -> Sending {
        Sending {
            pool: self.clone(),
            state: State::Unsent(req),
        }
    }

    /// Sends `req` on a connection of its own, opened first. Nothing is
    /// retried here: a new connection that did not send the request failed
    /// before it could, so the failure is `Refused` (safe to retry), and
    /// one that may have written a byte of it is `Broken`.
    async fn send_fresh(
        self: Arc<Self>,
        req: Request<Body>,
    ) -> Result<Response<Body>, UpstreamError> {
        let mut conn = self.connect().await?;
        match conn.sender.try_send_request(req).await {
            Ok(response) => self.answered(conn, response),
            Err(mut e) => Err(match e.take_message() {
                Some(_) => UpstreamError::Refused(Box::new(e.into_error())),
                None => sent_and_failed(e.into_error()),
            }),
        }
    }

    /// An answer whose head arrived on `sender`'s connection: its body
    /// returns the connection to the pool once read to the end. One framed
    /// two ways is refused, its connection closed ([`framed_two_ways`]).
    fn answered(
        self: &Arc<Self>,
        conn: Conn,
        response: Response<Incoming>,
    ) -> Result<Response<Body>, UpstreamError> {
        // A `204` or `304` has no body to misread, whatever its head says.
        let bodiless = matches!(response.status().as_u16(), 204 | 304);
        if let Some(why) = framed_two_ways(response.headers()).filter(|_| !bodiless) {
            return Err(UpstreamError::Broken(why.into()));
        }
        let (parts, body) = response.into_parts();
        let body = if body.is_end_stream() {
            self.put_back(conn);
            body.map_err(BodyError::new).boxed()
        } else {
            Returning {
                body,
                conn: Some(conn),
                pool: Arc::downgrade(self),
            }
            .map_err(BodyError::new)
            .boxed()
        };
        Ok(Response::from_parts(parts, body))
    }

    /// The most recently used idle connection that is still ready, closing
    /// the ones that are not (the upstream closed them) or have idled too
    /// long. One the calling worker's runtime drives comes first: with a
    /// runtime per worker thread, a request on another's connection wakes
    /// that thread to write it and to read the answer (`docs/design.md`
    /// §12, "Threads"). With one runtime every connection is worker 0's.
    fn checkout(&self) -> Option<Conn> {
        let here = worker::current();
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let last = idle.len().checked_sub(1)?;
            let at = idle.iter().rposition(|i| i.conn.worker == here);
            let Idle { conn, since } = idle.remove(at.unwrap_or(last));
            if conn.sender.is_ready() && since.elapsed() < self.idle_timeout {
                return Some(conn);
            }
        }
    }

    /// Returns a connection whose answer has been read to the end, for the
    /// next request, once hyper is ready to send one on it: at once, as a
    /// rule (the connection's task saw the answer's end before the body's
    /// reader did); otherwise when it is (say, while the request's own body
    /// is still being sent after an early answer), in a task of its own so
    /// that no request ever waits on another's connection.
    fn put_back(self: &Arc<Self>, mut conn: Conn) {
        if conn.sender.is_ready() {
            self.keep(conn);
        } else if !conn.sender.is_closed() {
            let pool = Arc::downgrade(self);
            tokio::spawn(async move {
                if conn.sender.ready().await.is_ok() {
                    if let Some(pool) = pool.upgrade() {
                        pool.keep(conn);
                    }
                }
            });
        }
    }

    /// Keeps a connection ready for another request, unless the pool holds
    /// as many as it may: then it is closed (dropping its last handle ends
    /// hyper's connection task, which closes the socket).
    fn keep(&self, conn: Conn) {
        if self.idle_timeout.is_zero() {
            return;
        }
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        // The oldest sit at the bottom; close those nobody used for a while.
        let stale = idle
            .iter()
            .take_while(|i| now.duration_since(i.since) >= self.idle_timeout)
            .count();
        idle.drain(..stale);
        if idle.len() < self.max_idle {
            idle.push(Idle { conn, since: now });
        }
    }

    /// A new connection; failing to make one (refused, timed out, a failed
    /// TLS handshake) happens before anything is sent.
    async fn connect(&self) -> Result<Conn, UpstreamError> {
        let io = self
            .connector
            .clone()
            .oneshot(self.base.clone())
            .await
            .map_err(UpstreamError::Refused)?;
        let (sender, connection) = http1::Builder::new()
            .max_header_size(MAX_ANSWER_HEAD)
            .handshake(io)
            .await
            .map_err(|e| UpstreamError::Refused(Box::new(e)))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
        });
        Ok(Conn {
            sender,
            worker: worker::current(),
        })
    }
}

/// The most bytes of an answer's head (status line and headers) an
/// upstream may send; a longer one is an error, as nginx's "upstream sent
/// too big header" (`docs/design.md` §18, "An answer's head"). Without it
/// hyper takes heads as long as its read buffer, 400 KiB and more, and a
/// head is stored and replayed with its answer.
pub const MAX_ANSWER_HEAD: usize = 64 << 10;

/// Why an answer's head frames its body two ways, if it does: a
/// `Transfer-Encoding` beside a `Content-Length` (RFC 9112 §6.3: an error,
/// as nginx takes it), or one with a coding other than `chunked` alone
/// (`identity`, `gzip, chunked`), whose body hyper reads otherwise than
/// the length or the type says: the bytes could be a cut or a still
/// encoded answer, recorded and replayed as whole (`docs/design.md` §10).
fn framed_two_ways(headers: &http::HeaderMap) -> Option<String> {
    let codings = headers.get_all(http::header::TRANSFER_ENCODING);
    let mut lines = codings.iter();
    // Nearly every answer: no `Transfer-Encoding`, or `chunked` alone,
    // told without allocating.
    let first = lines.next()?;
    let chunked_alone = lines.next().is_none()
        && first
            .as_bytes()
            .trim_ascii()
            .eq_ignore_ascii_case(b"chunked");
    let length = headers.contains_key(http::header::CONTENT_LENGTH);
    (!chunked_alone || length).then(|| {
        let said: Vec<_> = codings.iter().map(|c| String::from_utf8_lossy(c.as_bytes())).collect();
        format!(
            "the upstream framed its answer two ways (Transfer-Encoding: {}{}): its body cannot be told whole",
            said.join(", "),
            if length { ", beside a Content-Length" } else { "" }
        )
    })
}

/// What a request that may have reached the upstream failed with: an
/// answer whose head outgrew [`MAX_ANSWER_HEAD`] is one too large to
/// record, not a broken connection (its outcome is unknown either way).
fn sent_and_failed(e: hyper::Error) -> UpstreamError {
    if e.is_parse_too_large() {
        return UpstreamError::ResponseTooLarge {
            limit: MAX_ANSWER_HEAD,
        };
    }
    UpstreamError::Broken(Box::new(e))
}

/// hyper's future for an answer's head, which hyper does not name.
type Answer =
    Pin<Box<dyn Future<Output = Result<Response<Incoming>, TrySendError<Request<Body>>>> + Send>>;

/// A request on its way upstream: the future [`Pool::send`] returns.
///
/// Named rather than an `async fn` boxed whole: on a warm pool a request's
/// only allocation here is hyper's own future for the answer (hyper does not
/// name it, so it is boxed); opening a connection, rare once the pool is
/// warm, is an `async fn` boxed whole.
pub(super) struct Sending {
    pool: Arc<Pool>,
    state: State,
}

enum State {
    /// Not yet handed to a connection.
    Unsent(Request<Body>),
    /// On a connection that was idle.
    Reused { conn: Conn, answer: Answer },
    /// On a connection of its own, opened first.
    Fresh(Pin<Box<dyn Future<Output = Result<Response<Body>, UpstreamError>> + Send>>),
    /// Answered, or failed.
    Done,
}

impl Future for Sending {
    type Output = Result<Response<Body>, UpstreamError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            this.state = match std::mem::replace(&mut this.state, State::Done) {
                State::Unsent(req) => match this.pool.checkout() {
                    Some(mut conn) => State::Reused {
                        answer: Box::pin(conn.sender.try_send_request(req)),
                        conn,
                    },
                    None => State::Fresh(Box::pin(this.pool.clone().send_fresh(req))),
                },
                State::Reused { conn, mut answer } => match answer.as_mut().poll(cx) {
                    Poll::Pending => {
                        this.state = State::Reused { conn, answer };
                        return Poll::Pending;
                    }
                    Poll::Ready(Ok(response)) => {
                        return Poll::Ready(this.pool.answered(conn, response))
                    }
                    Poll::Ready(Err(mut e)) => match e.take_message() {
                        // The upstream closed the idle connection as we took
                        // it: nothing was written, so another connection may
                        // carry the request.
                        Some(unsent) => State::Unsent(unsent),
                        None => return Poll::Ready(Err(sent_and_failed(e.into_error()))),
                    },
                },
                State::Fresh(mut sending) => match sending.as_mut().poll(cx) {
                    Poll::Pending => {
                        this.state = State::Fresh(sending);
                        return Poll::Pending;
                    }
                    Poll::Ready(answered) => return Poll::Ready(answered),
                },
                State::Done => panic!("a request's future polled after it completed"),
            };
        }
    }
}

/// An answer's body that returns its connection to the pool once read to
/// the end. Dropped before that, the connection closes with it (HTTP/1.1
/// cannot abandon an answer halfway and reuse the connection).
struct Returning {
    body: Incoming,
    conn: Option<Conn>,
    pool: Weak<Pool>,
}

impl http_body::Body for Returning {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let frame = ready!(Pin::new(&mut self.body).poll_frame(cx));
        match &frame {
            Some(Ok(_)) if !self.body.is_end_stream() => {}
            Some(Err(_)) => self.conn = None,
            _ => {
                if let (Some(conn), Some(pool)) = (self.conn.take(), self.pool.upgrade()) {
                    pool.put_back(conn);
                }
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::Full;
    use hyper_util::rt::TokioIo;
    use tokio::net::TcpListener;

    use super::*;

    /// An upstream on a fresh port that answers every request with its
    /// number, counting requests and connections, opened and closed.
    struct Counted {
        base: Uri,
        requests: Arc<AtomicUsize>,
        connections: Arc<AtomicUsize>,
        closed: Arc<AtomicUsize>,
    }

    async fn upstream() -> Counted {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base: Uri = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let requests = Arc::new(AtomicUsize::new(0));
        let connections = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let (r, c, d) = (requests.clone(), connections.clone(), closed.clone());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                c.fetch_add(1, Ordering::SeqCst);
                let (r, d) = (r.clone(), d.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |_req| {
                        let n = r.fetch_add(1, Ordering::SeqCst) + 1;
                        async move {
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(
                                n.to_string(),
                            ))))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                    d.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        Counted {
            base,
            requests,
            connections,
            closed,
        }
    }

    /// An upstream on a fresh port that hands every connection to `serve`
    /// as a bare socket, counting connections.
    async fn raw_upstream<F, Fut>(serve: F) -> (Uri, Arc<AtomicUsize>)
    where
        F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base: Uri = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let seen = accepted.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                seen.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(stream));
            }
        });
        (base, accepted)
    }

    fn pool(base: &Uri) -> Arc<Pool> {
        pool_idling(base, Duration::from_secs(60))
    }

    fn pool_idling(base: &Uri, idle_timeout: Duration) -> Arc<Pool> {
        pool_with(base, idle_timeout, MAX_IDLE)
    }

    fn pool_with(base: &Uri, idle_timeout: Duration, max_idle: usize) -> Arc<Pool> {
        let mut tcp = HttpConnector::new();
        tcp.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(super::super::tls_config(&[]))
            .https_or_http()
            .enable_http1()
            .wrap_connector(tcp);
        Pool::new(connector, base.clone(), idle_timeout, max_idle)
    }

    fn request(base: &Uri) -> Request<Body> {
        Request::builder()
            .uri("/")
            .header(http::header::HOST, base.authority().unwrap().as_str())
            .body(crate::http::full(""))
            .unwrap()
    }

    async fn text(response: Response<Body>) -> String {
        let body = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(body.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn one_connection_carries_requests_one_after_another() {
        let upstream = upstream().await;
        let pool = pool(&upstream.base);
        for n in 1..=20 {
            let response = pool.clone().send(request(&upstream.base)).await.unwrap();
            assert_eq!(text(response).await, n.to_string());
        }
        assert_eq!(upstream.connections.load(Ordering::SeqCst), 1);
    }

    /// With a runtime per worker thread, a worker takes an idle connection
    /// its own runtime drives before a more recently used one of
    /// another's, and the most recent when it has none of its own.
    #[tokio::test]
    async fn a_worker_takes_a_connection_of_its_own_first() {
        /// Worker 0 again when the test ends, however it ends.
        struct Reset;
        impl Drop for Reset {
            fn drop(&mut self) {
                worker::enter(0);
            }
        }
        let _reset = Reset;
        let upstream = upstream().await;
        let pool = pool(&upstream.base);
        worker::enter(1);
        let first = pool.clone().send(request(&upstream.base)).await.unwrap();
        worker::enter(0);
        let second = pool.clone().send(request(&upstream.base)).await.unwrap();
        text(second).await;
        text(first).await;
        assert_eq!(upstream.connections.load(Ordering::SeqCst), 2);
        let idle = |pool: &Pool| -> Vec<usize> {
            let idle = pool.idle.lock().unwrap();
            idle.iter().map(|i| i.conn.worker).collect()
        };
        while idle(&pool).len() < 2 {
            tokio::task::yield_now().await;
        }
        assert_eq!(idle(&pool), [0, 1], "worker 1's connection came back last");

        let own = pool.checkout().unwrap();
        assert_eq!(own.worker, 0, "worker 0 passed over the most recent");
        pool.keep(own);
        worker::enter(1);
        let own = pool.checkout().unwrap();
        assert_eq!(own.worker, 1, "worker 1 passed over the most recent");
        pool.keep(own);
        worker::enter(2);
        let any = pool.checkout().unwrap();
        assert_eq!(
            any.worker, 1,
            "a worker with none of its own takes the most recent"
        );
        assert_eq!(idle(&pool), [0]);
    }

    /// Five connections in use at once, then all returned to a pool that
    /// keeps three: three are kept, two closed; the next five requests take
    /// the three and open two more.
    #[tokio::test]
    async fn idle_connections_past_the_cap_are_closed_not_kept() {
        let upstream = upstream().await;
        let pool = pool_with(&upstream.base, Duration::from_secs(60), 3);
        let burst = |pool: Arc<Pool>| {
            let base = upstream.base.clone();
            async move {
                // Every answer's head before any body is read: each request
                // holds its connection, so none is shared.
                let mut answers = Vec::new();
                for _ in 0..5 {
                    answers.push(pool.send(request(&base)).await.unwrap());
                }
                for answer in answers {
                    text(answer).await;
                }
            }
        };
        burst(pool.clone()).await;
        assert_eq!(upstream.connections.load(Ordering::SeqCst), 5);
        assert_eq!(pool.idle.lock().unwrap().len(), 3, "the cap is kept");
        closing(&upstream.closed, 2).await;
        burst(pool.clone()).await;
        assert_eq!(upstream.requests.load(Ordering::SeqCst), 10);
        assert_eq!(
            upstream.connections.load(Ordering::SeqCst),
            7,
            "the three kept were reused"
        );
        assert_eq!(pool.idle.lock().unwrap().len(), 3);
        closing(&upstream.closed, 4).await;
    }

    /// Waits until the upstream has seen `n` connections closed.
    async fn closing(closed: &AtomicUsize, n: usize) {
        let seen = async {
            while closed.load(Ordering::SeqCst) < n {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), seen)
            .await
            .unwrap_or_else(|_| panic!("{n} connections closed"));
    }

    /// A connection idle past the upstream's `idle_timeout` is retired, not
    /// reused: the upstream may be closing it at that very moment.
    #[tokio::test]
    async fn a_connection_idle_past_its_timeout_is_not_reused() {
        let upstream = upstream().await;
        let pool = pool_idling(&upstream.base, Duration::from_millis(100));
        for _ in 0..3 {
            let response = pool.clone().send(request(&upstream.base)).await.unwrap();
            text(response).await;
        }
        assert_eq!(upstream.connections.load(Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_millis(150)).await;
        let response = pool.clone().send(request(&upstream.base)).await.unwrap();
        assert_eq!(text(response).await, "4");
        assert_eq!(upstream.connections.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn an_idle_timeout_of_zero_opens_a_connection_per_request() {
        let upstream = upstream().await;
        let pool = pool_idling(&upstream.base, Duration::ZERO);
        for _ in 0..3 {
            let response = pool.clone().send(request(&upstream.base)).await.unwrap();
            text(response).await;
        }
        assert_eq!(upstream.connections.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_connection_whose_answer_was_not_read_is_not_reused() {
        let upstream = upstream().await;
        let pool = pool(&upstream.base);
        let unread = pool.clone().send(request(&upstream.base)).await.unwrap();
        // Its answer is still pending on the first connection: a second.
        let read = pool.clone().send(request(&upstream.base)).await.unwrap();
        assert_eq!(text(read).await, "2");
        drop(unread);
        let again = pool.clone().send(request(&upstream.base)).await.unwrap();
        assert_eq!(text(again).await, "3");
        assert_eq!(
            upstream.connections.load(Ordering::SeqCst),
            2,
            "the connection whose answer was read to the end is reused"
        );
    }

    /// The upstream closes an idle connection just as the pool hands it
    /// out: the connection looked ready, took the request, and closed
    /// before writing a byte of it. The request goes out on a new
    /// connection, once.
    #[tokio::test]
    async fn a_request_a_closing_connection_did_not_send_goes_out_on_another() {
        let upstream = upstream().await;
        let pool = pool(&upstream.base);
        let io = tokio::net::TcpStream::connect(upstream.base.authority().unwrap().as_str())
            .await
            .unwrap();
        let (mut sender, connection) = http1::handshake(TokioIo::new(io)).await.unwrap();
        let task = tokio::spawn(connection);
        sender.ready().await.unwrap();
        pool.keep(Conn { sender, worker: 0 });
        // On this single-threaded runtime the connection's task is dropped
        // only when `send` first waits: after it has taken the connection
        // and handed it the request.
        task.abort();
        let response = pool.clone().send(request(&upstream.base)).await.unwrap();
        assert_eq!(text(response).await, "1");
        assert_eq!(upstream.requests.load(Ordering::SeqCst), 1);
        assert_eq!(upstream.connections.load(Ordering::SeqCst), 2);
    }

    /// A request body that sends one chunk and then never ends.
    struct Stalled(Option<Bytes>);

    impl http_body::Body for Stalled {
        type Data = Bytes;
        type Error = BodyError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
            match self.0.take() {
                Some(chunk) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
                None => Poll::Pending,
            }
        }
    }

    /// The upstream answers while the request's body is still being sent
    /// (and never ends): that connection is not ready for another request
    /// until it is, so the next request goes out on another connection
    /// instead of waiting for it.
    #[tokio::test]
    async fn a_connection_still_sending_a_request_body_is_not_waited_for() {
        let (base, accepted) = raw_upstream(|mut stream| async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut buf = [0u8; 4096];
            let mut head = Vec::new();
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
            if stream.write_all(answer).await.is_err() {
                return;
            }
            // Keep reading whatever follows; answer nothing more.
            while let Ok(n) = stream.read(&mut buf).await {
                if n == 0 {
                    return;
                }
            }
        })
        .await;
        let pool = pool(&base);
        let stalled = Request::builder()
            .method("POST")
            .uri("/")
            .header(http::header::HOST, base.authority().unwrap().as_str())
            .body(Stalled(Some(Bytes::from_static(b"part"))).boxed())
            .unwrap();
        let early = pool.clone().send(stalled).await.unwrap();
        assert_eq!(text(early).await, "ok");
        let next = tokio::time::timeout(Duration::from_secs(10), pool.send(request(&base)))
            .await
            .expect("the next request waited for a connection still sending a body")
            .unwrap();
        assert_eq!(text(next).await, "ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_request_a_new_connection_did_not_send_is_refused_not_retried() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base: Uri = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        drop(listener);
        let pool = pool(&base);
        let error = pool.send(request(&base)).await.unwrap_err();
        assert!(matches!(error, UpstreamError::Refused(_)), "{error:?}");
    }

    #[tokio::test]
    async fn a_connection_closed_after_the_request_was_written_is_broken_not_retried() {
        // Read the request, then hang up without an answer.
        let (base, accepted) = raw_upstream(|mut stream| async move {
            let mut buf = [0u8; 1024];
            let _ = tokio::io::AsyncReadExt::read(&mut stream, &mut buf).await;
        })
        .await;
        let pool = pool(&base);
        let error = pool.send(request(&base)).await.unwrap_err();
        assert!(matches!(error, UpstreamError::Broken(_)), "{error:?}");
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "never sent again");
    }
}
