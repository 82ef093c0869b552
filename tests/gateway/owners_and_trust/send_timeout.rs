//! A client that stops reading its answer is closed after `send_timeout`
//! (design §18, "A client that stops reading"), its connection slot freed
//! and a pass-through's upstream connection closed with it; one that reads
//! slowly but steadily is not cut.

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Empty;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::mpsc;
use tokio::time::{timeout, Instant};

use crate::support::{Gateway, TestStore};

/// The answer to `/big`: more than every buffer on the way holds (the
/// kernel's on both of the gateway's sockets, up to 32 MiB received on
/// this machine's defaults, and hyper's), so a client that reads nothing
/// stops the upstream's writes too.
const BIG: usize = 64 << 20;

fn authority(gateway: &Gateway) -> String {
    gateway.url.trim_start_matches("http://").to_owned()
}

/// An upstream that answers `/v1/big` with [`BIG`] bytes, written as the
/// gateway takes them, and anything else with `ok`. Each connection that
/// carried `/v1/big` reports when the gateway closes it.
struct Upstream {
    url: String,
    closed: mpsc::UnboundedReceiver<()>,
}

impl Upstream {
    async fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, closed) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(answer(stream, tx.clone()));
            }
        });
        Upstream { url, closed }
    }

    /// Waits (15 s at most) until the gateway has closed a `/v1/big`
    /// connection.
    async fn closed_by_the_gateway(&mut self) {
        timeout(Duration::from_secs(15), self.closed.recv())
            .await
            .expect("the gateway kept the upstream connection open")
            .unwrap();
    }
}

/// Answers requests on `stream` until it closes; reports on `closed` when
/// the gateway closes one that carried `/v1/big`.
async fn answer(mut stream: TcpStream, closed: mpsc::UnboundedSender<()>) {
    while let Some(path) = request_path(&mut stream).await {
        if path != "/v1/big" {
            let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
            if stream.write_all(ok).await.is_err() {
                return;
            }
            continue;
        }
        let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {BIG}\r\n\r\n");
        let chunk = vec![b'x'; 64 << 10];
        let mut ok = stream.write_all(head.as_bytes()).await.is_ok();
        let mut left = BIG;
        while ok && left > 0 {
            ok = stream.write_all(&chunk).await.is_ok();
            left -= chunk.len();
        }
        // Written whole or cut: either way, wait for the gateway to close.
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest).await;
        let _ = closed.send(());
        return;
    }
}

/// The path of the next request's head on `stream` (no body is sent);
/// `None` once it closes.
async fn request_path(stream: &mut TcpStream) -> Option<String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => return None,
        }
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    head.split_whitespace().nth(1).map(str::to_owned)
}

/// A connection to the gateway whose receive buffer is `bytes` (the kernel
/// doubles it), so that what it does not read stops the gateway soon.
async fn connect_with_buffer(gateway: &Gateway, bytes: u32) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(bytes).unwrap();
    socket
        .connect(authority(gateway).parse().unwrap())
        .await
        .unwrap()
}

async fn get(stream: &mut TcpStream, path: &str) {
    let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
}

#[tokio::test]
async fn a_client_that_stops_reading_is_closed_after_the_send_timeout_freeing_its_slot() {
    let store = TestStore::embedded();
    let mut upstream = Upstream::start().await;
    let gateway = Gateway::builder(&store, &upstream.url)
        .set("send_timeout", "\"1s\"")
        // One slot: the next client is served only once this one's is free.
        .set("max_connections", "1")
        .start()
        .await;
    let mut stuck = connect_with_buffer(&gateway, 4096).await;
    let asked = Instant::now();
    get(&mut stuck, "/v1/big").await;
    // Before, nothing closed it: TCP answers zero-window probes for ever.
    upstream.closed_by_the_gateway().await;
    assert!(
        asked.elapsed() >= Duration::from_secs(1),
        "not cut before the send timeout: {:?}",
        asked.elapsed()
    );
    // What the gateway had sent arrives, then the end.
    let mut got = Vec::new();
    let read = timeout(Duration::from_secs(10), stuck.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "the connection was not closed");
    assert!(got.len() < BIG, "the answer was cut short");
    // Its slot is free: the next connection is served.
    let mut next = TcpStream::connect(authority(&gateway)).await.unwrap();
    get(&mut next, "/v1/small").await;
    let mut answer = [0u8; 12];
    timeout(Duration::from_secs(10), next.read_exact(&mut answer))
        .await
        .expect("the next connection was not served")
        .unwrap();
    assert_eq!(&answer, b"HTTP/1.1 200");
}

#[tokio::test]
async fn a_client_that_reads_slowly_but_steadily_is_not_cut() {
    let store = TestStore::embedded();
    let mut upstream = Upstream::start().await;
    let gateway = Gateway::builder(&store, &upstream.url)
        .set("send_timeout", "\"1s\"")
        .start()
        .await;
    let mut slow = connect_with_buffer(&gateway, 64 << 10).await;
    get(&mut slow, "/v1/big").await;
    // 5 MiB/s, far below what the gateway sends: its writes wait between
    // reads (each frees a third of its socket's 4 MiB send buffer within
    // a fraction of the timeout), for four timeouts and more.
    let mut piece = vec![0u8; 512 << 10];
    let reading = Instant::now();
    while reading.elapsed() < Duration::from_secs(4) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        timeout(Duration::from_secs(10), slow.read_exact(&mut piece))
            .await
            .expect("the answer stopped")
            .expect("the connection was cut");
    }
    assert!(
        upstream.closed.try_recv().is_err(),
        "the upstream connection was closed under a reader"
    );
}

#[tokio::test]
async fn an_http2_client_that_keeps_its_window_shut_is_closed_after_the_send_timeout() {
    let store = TestStore::embedded();
    let mut upstream = Upstream::start().await;
    let gateway = Gateway::builder(&store, &upstream.url)
        .set("send_timeout", "\"1s\"")
        // Pinged often and answering: pings do not keep it.
        .set("http2_keepalive_interval", "\"200ms\"")
        .start()
        .await;
    let tcp = TcpStream::connect(authority(&gateway)).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    let driving = tokio::spawn(async move {
        let _ = conn.await;
    });
    let request = Request::get(gateway.path("/v1/big"))
        .body(Empty::<Bytes>::new())
        .unwrap();
    let asked = Instant::now();
    // Its body is never read, so no WINDOW_UPDATE is sent: the gateway
    // stops once the stream's window (2 MiB, hyper's) is spent.
    let answer = sender.send_request(request).await.unwrap();
    assert_eq!(answer.status(), 200);
    upstream.closed_by_the_gateway().await;
    assert!(asked.elapsed() >= Duration::from_secs(1));
    timeout(Duration::from_secs(10), driving)
        .await
        .expect("the connection was not closed")
        .unwrap();
    drop(answer);
}
