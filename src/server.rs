//! Accepting connections and serving a Tower service on them, until shutdown.
//!
//! The listener defends itself before any request reaches the service: a
//! bounded number of connections (past it, new ones wait in the kernel's
//! backlog), a timeout for reading a request's headers (which also closes a
//! connection idle between requests, and one that sends half a request line
//! and stops), and a bound on the size of a request's header block (`431`).
//! Framing is hyper's: two different `Content-Length`s are `400`; a
//! `Content-Length` beside `Transfer-Encoding: chunked` is ignored for the
//! chunked framing and the connection is closed after the answer (RFC 9112
//! §6.1).

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower::{Service, ServiceExt};

use crate::http::BoxError;
use crate::upstream::ClientAddr;

/// What a listener allows its clients.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Open connections at most.
    pub max_connections: usize,
    /// How long a client may take to send a request's headers (and how long
    /// a connection may sit idle between requests).
    pub header_read_timeout: Duration,
    /// Largest request header block, in bytes.
    pub max_header_size: usize,
}

/// Serves `service` on every connection `listener` accepts (HTTP/1.1 and
/// HTTP/2) within `limits`, tagging each request with the peer's address,
/// until `shutdown` resolves; then stops accepting and lets open connections
/// finish, for `grace` at most.
pub async fn serve<S, B>(
    listener: TcpListener,
    service: S,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    limits: Limits,
) where
    S: Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        // hyper's read buffer bounds the header block (it cannot go below
        // 8 KiB); past it the answer is 431.
        .max_buf_size(limits.max_header_size.max(8192));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.max_header_size).unwrap_or(u32::MAX));
    let connections = std::sync::Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    tokio::pin!(shutdown);
    loop {
        // At the limit, new connections wait in the kernel's backlog.
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = connections.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: back off, keep serving.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let service = service.clone();
        let client = ClientAddr::new(peer);
        let tagged = tower::service_fn(move |mut req: Request<Incoming>| {
            req.extensions_mut().insert(client.clone());
            service.clone().oneshot(req)
        });
        let connection = builder
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(tagged))
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, %peer, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(grace) => tracing::warn!("connections still open after shutdown_grace; closing"),
    }
}
