//! Accepting connections and serving a Tower service on them, until shutdown.
//!
//! The listener defends itself before any request reaches the service: a
//! bounded number of connections (past it, new ones wait in the kernel's
//! backlog), a timeout for reading a request's headers (which closes one
//! that sends half a request line and stops), a longer one for an HTTP/1.1
//! connection idle between requests ([`keepalive`]), and a bound on the
//! size of a request's header block (`431`).
//! HTTP/1.1, and HTTP/2 with prior knowledge (told apart by the first bytes,
//! [`opening`]); an HTTP/2 connection is pinged to find dead peers and
//! closed once it has had no open stream for `http2_idle_timeout`
//! ([`connection`], `docs/design.md` §18).
//! Framing is hyper's: two different `Content-Length`s are `400`; a
//! `Content-Length` beside `Transfer-Encoding: chunked` is ignored for the
//! chunked framing and the connection is closed after the answer (RFC 9112
//! §6.1).

mod activity;
mod balance;
mod connection;
mod keepalive;
mod opening;
mod sending;
mod settings;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tower::{Service, ServiceExt};

use self::activity::{Head, Streams};
use self::connection::{drive, Counted, Idle};
use self::keepalive::Watched;
use self::opening::sniff;
use self::sending::{Handed, Sending};

use crate::http::linger::Linger;
use crate::http::BoxError;
use crate::http::ClientAddr;
pub use settings::{Limits, TrustedProxies};

/// Serves `service` on every connection `listener` accepts (HTTP/1.1 and
/// HTTP/2) within `limits`, tagging each request with the peer's address,
/// until `shutdown` is cancelled; then stops accepting and lets open
/// connections finish, for `grace` at most. A peer among `trusted` is a
/// proxy whose forwarding headers are believed.
///
/// `accept.elsewhere` are other runtimes, each with its own handle on the
/// same listening socket: each accepts too, and serves what it accepted on
/// its own thread (`worker_runtime = "per_thread"`, `docs/design.md` §12,
/// "Threads"). All of them share `limits.max_connections` and the drain.
pub async fn serve<S, B>(
    accept: Accept,
    service: S,
    shutdown: CancellationToken,
    grace: Duration,
    limits: Limits,
    trusted: TrustedProxies,
) where
    S: Served<B>,
    B: Answer,
{
    // Cancelled to drain; every connection holds a sender of `open`, whose
    // receiver hears `None` once the last has ended.
    let drain = CancellationToken::new();
    let (open, mut all_closed) = mpsc::channel::<()>(1);
    let accepting = Accepting {
        // Shared by the connections: each holds a reference count, not a
        // copy of hyper's two builders (docs/performance.md, "Per held
        // duplicate").
        protocols: Arc::new(Protocols::new(&limits, trusted)),
        room: Arc::new(Semaphore::new(limits.max_connections)),
        balance: balance::Balance::new(1 + accept.elsewhere.len()),
        drain: drain.clone(),
        open,
        service,
    };
    let counted = accept.counted;
    let others: Vec<_> = (1..)
        .zip(accept.elsewhere)
        .map(|(worker, (runtime, listener))| {
            let (accepting, shutdown) = (accepting.clone(), shutdown.clone());
            runtime.spawn(async move {
                accepting
                    .until(listener, worker, accepted(counted, worker), shutdown)
                    .await
            })
        })
        .collect();
    accepting
        .until(accept.listener, 0, accepted(counted, 0), shutdown)
        .await;
    for other in others {
        let _ = other.await;
    }
    drain.cancel();
    tokio::select! {
        _ = all_closed.recv() => {}
        () = tokio::time::sleep(grace) => tracing::warn!("connections still open after shutdown_grace; closing"),
    }
}

/// What a listener serves: a Tower service of hyper's requests, cloned
/// for each connection and run on whichever worker accepted it.
pub trait Served<B>:
    Service<Request<Incoming>, Response = Response<B>, Error = Infallible, Future: Send + 'static>
    + Clone
    + Send
    + Sync
    + 'static
{
}

impl<S, B> Served<B> for S
where
    S: Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
}

/// The body of what a listener's service answers.
pub trait Answer: http_body::Body<Data: Send, Error: Into<BoxError>> + Send + 'static {}

impl<B> Answer for B
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
}

/// A listening socket, and the other runtimes that accept on it.
pub struct Accept {
    /// Whether its connections count in
    /// `idemgate_connections_accepted_total` (the proxy's do).
    pub counted: bool,
    /// Accepted on by the runtime that serves it (worker 0).
    pub listener: TcpListener,
    /// Workers 1, 2, … (`worker_runtime = "per_thread"`): each runtime
    /// with its own handle on the same socket, registered with that
    /// runtime's reactor.
    pub elsewhere: Vec<(Handle, TcpListener)>,
}

/// `idemgate_connections_accepted_total` of one worker, if counted.
fn accepted(counted: bool, worker: usize) -> Option<metrics::Counter> {
    counted.then(
        || metrics::counter!("idemgate_connections_accepted_total", "worker" => worker.to_string()),
    )
}

/// What every accepting runtime of one listener shares.
#[derive(Clone)]
struct Accepting<S> {
    protocols: Arc<Protocols>,
    /// `max_connections`, counted across the runtimes.
    room: Arc<Semaphore>,
    /// The connections each runtime holds, spread evenly.
    balance: Arc<balance::Balance>,
    drain: CancellationToken,
    /// Held by each connection, and by each accepting loop until it stops.
    open: mpsc::Sender<()>,
    service: S,
}

impl<S> Accepting<S> {
    /// The next connection `worker` takes: in its turn, unless it ran out
    /// of patience (`balance.rs`).
    async fn next(
        &self,
        listener: &TcpListener,
        worker: usize,
    ) -> (TcpStream, SocketAddr, OwnedSemaphorePermit) {
        loop {
            if !self.balance.turn(worker).await {
                return accept(listener, &self.room).await;
            }
            tokio::select! {
                next = accept(listener, &self.room) => return next,
                () = self.balance.overtaken(worker) => {}
            }
        }
    }

    /// Accepts on `listener` until `shutdown`, serving each connection in a
    /// task of the current runtime.
    async fn until<B>(
        self,
        listener: TcpListener,
        worker: usize,
        accepted: Option<metrics::Counter>,
        shutdown: CancellationToken,
    ) where
        S: Served<B>,
        B: Answer,
    {
        loop {
            let (stream, peer, permit) = tokio::select! {
                () = shutdown.cancelled() => break,
                next = self.next(&listener, worker) => next,
            };
            let held = self.balance.hold(worker);
            if let Some(accepted) = &accepted {
                accepted.increment(1);
            }
            // The connection's future is made here, outside the task's:
            // what it is made from is moved into it, not kept beside it
            // for as long as the connection lasts.
            let connection =
                self.protocols
                    .serve(stream, peer, self.service.clone(), self.drain.clone());
            let open = self.open.clone();
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(error = %e, %peer, "connection ended with an error");
                }
                drop((permit, held, open));
            });
        }
    }
}

/// The next connection, once there are fewer than `max_connections` open
/// (until then new ones wait in the kernel's backlog), with the permit that
/// counts it as open.
async fn accept(
    listener: &TcpListener,
    room: &Arc<Semaphore>,
) -> (TcpStream, SocketAddr, OwnedSemaphorePermit) {
    let permit = room
        .clone()
        .acquire_owned()
        .await
        .expect("the connection semaphore is never closed");
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                return (stream, peer, permit);
            }
            Err(e) => {
                // Out of file descriptors and the like: back off, keep serving.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// hyper's HTTP/1 and HTTP/2 servers, configured by the listener's limits.
#[derive(Clone)]
struct Protocols {
    h1: http1::Builder,
    h2: http2::Builder<TokioExecutor>,
    /// How long a new connection may take to show which protocol it speaks
    /// (the header read timeout).
    opening_timeout: Duration,
    /// How long an HTTP/2 connection may have no open stream.
    http2_idle: Option<Duration>,
    /// How long an HTTP/1.1 connection may sit between requests.
    keepalive: Duration,
    /// How long a peer may take to answer a ping.
    http2_ping_timeout: Duration,
    /// How long what a connection has to send may wait on its client.
    send: Duration,
    trusted: Arc<TrustedProxies>,
}

impl Protocols {
    fn new(limits: &Limits, trusted: TrustedProxies) -> Self {
        let mut h1 = http1::Builder::new();
        // hyper's header timer also runs between requests; ours are two
        // (keepalive.rs).
        h1.timer(TokioTimer::new())
            .header_read_timeout(None)
            // Past it the answer is 431. The read buffer's bound alone let a
            // head that came whole in one read through at up to twice it.
            .max_header_size(limits.max_header_size)
            // hyper's read buffer (it cannot go below 8 KiB).
            .max_buf_size(limits.max_header_size.max(8192));
        let mut h2 = http2::Builder::new(TokioExecutor::new());
        h2.timer(TokioTimer::new())
            .max_header_list_size(u32::try_from(limits.max_header_size).unwrap_or(u32::MAX))
            // Pings find peers that vanished without closing (a dead NAT
            // entry, a killed pod): unanswered, the connection is closed.
            .keep_alive_interval(limits.http2_keepalive_interval)
            .keep_alive_timeout(limits.http2_keepalive_timeout);
        Protocols {
            h1,
            h2,
            opening_timeout: limits.header_read_timeout,
            http2_idle: limits.http2_idle_timeout,
            keepalive: limits.keepalive_timeout,
            http2_ping_timeout: limits.http2_keepalive_timeout,
            send: limits.send_timeout,
            trusted: Arc::new(trusted),
        }
    }

    /// Serves one connection from `peer` in the protocol its first bytes
    /// show, each request tagged with the peer's address, until it closes
    /// or `drain` ends it.
    ///
    /// Its future lives as long as the connection, a held duplicate's
    /// included, so it is kept small (docs/performance.md, "Per held
    /// duplicate"): made by a plain function, so the service is moved
    /// into the tagging closure before the future exists instead of being
    /// kept as an argument beside it; and hyper's connection boxed, as an
    /// `async` function keeps a value it was given beside the one it moves
    /// it to.
    fn serve<S, B>(
        self: &Arc<Self>,
        stream: TcpStream,
        peer: SocketAddr,
        service: S,
        drain: CancellationToken,
    ) -> impl Future<Output = hyper::Result<()>> + Send + 'static
    where
        S: Served<B>,
        B: Answer,
    {
        let client = ClientAddr::new(peer, self.trusted.contains(peer.ip()));
        let tagged = tower::service_fn(move |mut req: Request<Incoming>| {
            req.extensions_mut().insert(client.clone());
            service.clone().oneshot(req)
        });
        let this = self.clone();
        async move {
            // Nothing (or half a preface) within the header timeout: closed.
            let Ok(Ok(opened)) = tokio::time::timeout(this.opening_timeout, sniff(stream)).await
            else {
                return Ok(());
            };
            let requests = Streams::new();
            let io = Sending::new(opened.io, requests.clone());
            if !opened.http2 {
                let head = Head::started_now(requests.clone());
                let io = Watched::new(io, head.clone(), requests.clone());
                let idle = Idle::after(
                    requests.clone(),
                    Some(this.keepalive),
                    Duration::ZERO,
                    this.send,
                )
                .with_head(head.clone(), this.opening_timeout);
                let conn = Box::pin(this.h1.serve_connection(
                    TokioIo::new(io),
                    TowerToHyperService::new(counting(requests, Some(head), tagged)),
                ));
                return drive(conn, &drain, idle, |c| c.graceful_shutdown()).await;
            }
            let idle = Idle::after(
                requests.clone(),
                this.http2_idle,
                this.http2_ping_timeout,
                this.send,
            );
            let conn = Box::pin(this.h2.serve_connection(
                TokioIo::new(io),
                TowerToHyperService::new(counting(requests, None, tagged)),
            ));
            drive(conn, &drain, idle, |c| c.graceful_shutdown()).await
        }
    }
}

/// `inner`, each request counted open among `requests` until its answer
/// is sent; on HTTP/1.1 its `head` noted complete when it is served, and
/// the request counted open until its body is read too ([`Linger`]); on
/// HTTP/2 (no `head`) its answer's chunks counted unsent until taken on
/// ([`Handed`]).
fn counting<S, B>(
    requests: Streams,
    head: Option<Head>,
    inner: S,
) -> impl Service<
    Request<Incoming>,
    Response = Response<Counted<B>>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<Counted<B>>, Infallible>> + Send,
> + Clone
where
    S: Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    tower::service_fn(move |mut req: Request<Incoming>| {
        let open = requests.open();
        if let Some(head) = &head {
            head.complete();
            // Open, too, while its body may be read after its answer.
            req.extensions_mut().insert(Linger::new(requests.open()));
        }
        let window = head.is_none().then(|| requests.clone());
        let answer = inner.clone().oneshot(req);
        async move {
            let response = answer.await?;
            Ok::<_, Infallible>(
                response.map(|inner| Counted::new(Handed::new(inner, window), open)),
            )
        }
    })
}

#[cfg(test)]
#[allow(unreachable_code, unused_variables, clippy::diverging_sub_expression)]
mod held_size {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use super::*;

    /// The size of what `make` returns; `make` is never called.
    fn size_of_output<F>(_: &impl Fn() -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// A service of a known size (the stack's clone is a few hundred bytes).
    #[derive(Clone)]
    #[allow(dead_code)] // Only its size is used.
    struct Sized1000([u8; 1000]);

    impl Service<Request<Incoming>> for Sized1000 {
        type Response = Response<http_body_util::Empty<bytes::Bytes>>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Self::Response, Infallible>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: Request<Incoming>) -> Self::Future {
            unreachable!("only its type is used")
        }
    }

    /// A connection's future lasts as long as it does, a held duplicate's
    /// included: it keeps the service twice at most (the tagging closure's
    /// and the one in hyper's connection, which is boxed), not once per
    /// move (five times, and hyper's connection three, when it was an
    /// `async fn` taking them; docs/performance.md, "Per held duplicate").
    #[test]
    fn a_connection_keeps_its_service_twice_at_most() {
        let serve = size_of_output(&|| {
            let protocols: &'static Arc<Protocols> = unreachable!();
            protocols.serve(
                unreachable!(),
                unreachable!(),
                Sized1000([0; 1000]),
                unreachable!(),
            )
        });
        assert!(serve < 3 * 1000, "the connection's future is {serve} bytes");
    }

    /// hyper's connection is boxed, so driving it keeps a pointer. (A
    /// connection of 2,000 bytes: driving one is its clocks' timers, about
    /// 1,000 bytes since the send clock.)
    #[test]
    fn driving_a_connection_keeps_a_pointer_to_it() {
        #[allow(dead_code)] // Only its size is used.
        struct Conn([u8; 2000]);
        impl Future for Conn {
            type Output = hyper::Result<()>;
            fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Self::Output> {
                Poll::Pending
            }
        }
        let drive = size_of_output(&|| {
            let drain: &'static CancellationToken = unreachable!();
            connection::drive(
                Box::pin(Conn([0; 2000])),
                drain,
                unreachable!(),
                |_: Pin<&mut Conn>| {},
            )
        });
        assert!(drive < 2000, "driving a connection is {drive} bytes");
    }
}
