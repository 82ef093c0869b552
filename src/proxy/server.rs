//! Accepting connections and serving a Tower service on them, until shutdown.
//!
//! The listener defends itself before any request reaches the service: a
//! bounded number of connections (past it, new ones wait in the kernel's
//! backlog), a timeout for reading a request's headers (which also closes a
//! connection idle between requests, and one that sends half a request line
//! and stops), and a bound on the size of a request's header block (`431`).
//! HTTP/1.1, and HTTP/2 with prior knowledge (told apart by the first bytes,
//! peeked at without consuming them).
//! Framing is hyper's: two different `Content-Length`s are `400`; a
//! `Content-Length` beside `Transfer-Encoding: chunked` is ignored for the
//! chunked framing and the connection is closed after the answer (RFC 9112
//! §6.1).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower::{Service, ServiceExt};

use crate::config::{Limits, TrustedProxies};
use crate::proxy::http::BoxError;
use crate::proxy::http::ClientAddr;

/// Serves `service` on every connection `listener` accepts (HTTP/1.1 and
/// HTTP/2) within `limits`, tagging each request with the peer's address,
/// until `shutdown` resolves; then stops accepting and lets open connections
/// finish, for `grace` at most. A peer among `trusted` is a proxy whose
/// forwarding headers are believed.
pub async fn serve<S, B>(
    listener: TcpListener,
    service: S,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    limits: Limits,
    trusted: TrustedProxies,
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
    let protocols = Protocols::new(&limits, trusted);
    let room = Arc::new(Semaphore::new(limits.max_connections));
    tokio::pin!(shutdown);
    loop {
        let (stream, peer, permit) = tokio::select! {
            () = &mut shutdown => break,
            next = accept(&listener, &room) => next,
        };
        let service = service.clone();
        let protocols = protocols.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            if let Err(e) = protocols.serve(stream, peer, service, watcher).await {
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
    trusted: Arc<TrustedProxies>,
}

impl Protocols {
    fn new(limits: &Limits, trusted: TrustedProxies) -> Self {
        let mut h1 = http1::Builder::new();
        h1.timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            // hyper's read buffer bounds the header block (it cannot go below
            // 8 KiB); past it the answer is 431.
            .max_buf_size(limits.max_header_size.max(8192));
        let mut h2 = http2::Builder::new(TokioExecutor::new());
        h2.timer(TokioTimer::new())
            .max_header_list_size(u32::try_from(limits.max_header_size).unwrap_or(u32::MAX));
        Protocols {
            h1,
            h2,
            opening_timeout: limits.header_read_timeout,
            trusted: Arc::new(trusted),
        }
    }

    /// Serves one connection from `peer` in the protocol its first bytes
    /// show, each request tagged with the peer's address, until it closes
    /// or the drain `watcher` watches for ends it.
    async fn serve<S, B>(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        service: S,
        watcher: Watcher,
    ) -> hyper::Result<()>
    where
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
        let client = ClientAddr::new(peer, self.trusted.contains(peer.ip()));
        let tagged = tower::service_fn(move |mut req: Request<Incoming>| {
            req.extensions_mut().insert(client.clone());
            service.clone().oneshot(req)
        });
        let service = TowerToHyperService::new(tagged);
        match tokio::time::timeout(self.opening_timeout, opens_with_http2(&stream)).await {
            Ok(Ok(false)) => {
                let io = TokioIo::new(stream);
                watcher.watch(self.h1.serve_connection(io, service)).await
            }
            Ok(Ok(true)) => {
                let io = TokioIo::new(stream);
                watcher.watch(self.h2.serve_connection(io, service)).await
            }
            // Nothing (or half a preface) within the header timeout.
            Ok(Err(_)) | Err(_) => Ok(()),
        }
    }
}

/// HTTP/2's connection preface (RFC 9113 §3.4), which a client that knows
/// the gateway speaks HTTP/2 sends first.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Whether a connection opens with HTTP/2's preface, looked at without
/// consuming a byte.
///
/// hyper-util's automatic version detection reads the first bytes itself
/// and hands them to the HTTP/1 reader as a separate first read, which
/// makes hyper grow its connection's 8 KiB read buffer to 16 KiB for every
/// HTTP/1 connection; peeking leaves the whole request to one read
/// (docs/performance.md, item 11).
async fn opens_with_http2(stream: &TcpStream) -> io::Result<bool> {
    let mut first = [0u8; PREFACE.len()];
    loop {
        let n = stream.peek(&mut first).await?;
        if n == 0 || first[..n] != PREFACE[..n] {
            // HTTP/1 (or a closed connection, which hyper then sees).
            return Ok(false);
        }
        if n == PREFACE.len() {
            return Ok(true);
        }
        // Part of the preface has arrived: the rest is a moment behind
        // (peeking again at once would see the same bytes).
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (client, server)
    }

    #[tokio::test]
    async fn an_http1_request_is_told_from_its_first_bytes_and_left_unread() {
        let (mut client, server) = pair().await;
        client
            .write_all(b"POST /v1/charges HTTP/1.1\r\n")
            .await
            .unwrap();
        assert!(!opens_with_http2(&server).await.unwrap());
        let mut all = [0u8; 64];
        let n = server.peek(&mut all).await.unwrap();
        assert!(
            all[..n].starts_with(b"POST /v1/charges"),
            "nothing consumed"
        );
    }

    #[tokio::test]
    async fn a_preface_arriving_in_pieces_is_http2() {
        let (mut client, server) = pair().await;
        client.write_all(&PREFACE[..9]).await.unwrap();
        let sniff = tokio::spawn(async move { opens_with_http2(&server).await.unwrap() });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!sniff.is_finished(), "half a preface decides nothing");
        client.write_all(&PREFACE[9..]).await.unwrap();
        assert!(sniff.await.unwrap());
    }

    #[tokio::test]
    async fn a_connection_closed_before_a_byte_is_not_http2() {
        let (client, server) = pair().await;
        drop(client);
        assert!(!opens_with_http2(&server).await.unwrap());
    }
}
