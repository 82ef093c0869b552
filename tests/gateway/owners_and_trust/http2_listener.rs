//! The listener's HTTP/2 defences (design §18): connections with no open
//! stream are closed after `http2_idle_timeout`, never while a stream is
//! open; peers that stop answering pings are closed; a connection that
//! sends part of the preface and stops is closed at the header timeout,
//! waiting on the socket rather than polling it.

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::h2::{RawH2, GOAWAY, PING, PREFACE};
use crate::support::process::cpu_time;
use crate::support::{FakeUpstream, Gate, Gateway, TestStore};

fn authority(gateway: &Gateway) -> String {
    gateway.url.trim_start_matches("http://").to_owned()
}

/// An HTTP/2 client connection (hyper's, which answers pings) and the task
/// driving it, which ends when the connection closes.
async fn h2_client(
    gateway: &Gateway,
) -> (
    hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    tokio::task::JoinHandle<()>,
) {
    let tcp = TcpStream::connect(authority(gateway)).await.unwrap();
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    let driving = tokio::spawn(async move {
        let _ = conn.await;
    });
    (sender, driving)
}

#[tokio::test]
async fn a_connection_with_no_open_stream_is_closed_after_the_idle_timeout() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("http2_idle_timeout", "\"1s\"")
        // What a peer told to go away gets to answer the ping that follows
        // (this one never answers).
        .set("http2_keepalive_timeout", "\"1s\"")
        .start()
        .await;
    let mut conn = RawH2::open(&authority(&gateway)).await;
    let opened = tokio::time::Instant::now();
    let frames = conn.until_closed(Duration::from_secs(10)).await;
    let after = opened.elapsed();
    assert!(
        frames.iter().any(|f| f.kind == GOAWAY),
        "told to go away first: {frames:?}"
    );
    assert!(
        after >= Duration::from_millis(1900) && after < Duration::from_secs(6),
        "closed after {after:?}"
    );
}

#[tokio::test]
async fn a_connection_is_not_idle_while_a_stream_is_open() {
    let store = TestStore::embedded();
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("http2_idle_timeout", "\"1s\"")
        .start()
        .await;
    let (mut sender, driving) = h2_client(&gateway).await;
    let request = Request::post(gateway.path("/v1/charges"))
        .header("idempotency-key", "long")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let answer = tokio::spawn(async move {
        let response = sender.send_request(request).await.unwrap();
        let status = response.status();
        response.into_body().collect().await.unwrap();
        (status, sender)
    });
    upstream.arrival().await;
    // Three idle timeouts with the stream open: the connection stays.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!driving.is_finished(), "closed with a stream open");
    gate.open(1);
    let (status, _sender) = tokio::time::timeout(Duration::from_secs(10), answer)
        .await
        .expect("answered")
        .unwrap();
    assert_eq!(status, 200);
    // Then, idle, it is closed, although the client keeps it.
    tokio::time::timeout(Duration::from_secs(5), driving)
        .await
        .expect("closed once idle")
        .unwrap();
}

#[tokio::test]
async fn a_peer_that_stops_answering_pings_is_closed_and_one_that_answers_is_kept() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("http2_keepalive_interval", "\"300ms\"")
        .set("http2_keepalive_timeout", "\"300ms\"")
        .set("http2_idle_timeout", "\"0s\"")
        .start()
        .await;
    // hyper's client answers pings: its connection stays, idle or not.
    let (mut sender, driving) = h2_client(&gateway).await;
    // A raw connection never answers them.
    let mut silent = RawH2::open(&authority(&gateway)).await;
    let frames = silent.until_closed(Duration::from_secs(10)).await;
    assert!(
        frames.iter().any(|f| f.kind == PING && f.flags & 0x1 == 0),
        "pinged first: {frames:?}"
    );
    assert!(!driving.is_finished(), "the peer answering pings is kept");
    let request = Request::get(gateway.path("/still-here"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), 200);
}

#[tokio::test]
async fn half_a_preface_is_closed_at_the_header_timeout_without_spinning() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("header_read_timeout", "\"2s\"")
        .start()
        .await;
    const CONNECTIONS: usize = 200;
    let mut halves = Vec::with_capacity(CONNECTIONS);
    for _ in 0..CONNECTIONS {
        let mut stream = TcpStream::connect(authority(&gateway)).await.unwrap();
        stream.write_all(&PREFACE[..9]).await.unwrap();
        halves.push(stream);
    }
    let (started, cpu_before) = (tokio::time::Instant::now(), cpu_time(gateway.pid()));
    for stream in &mut halves {
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut rest))
            .await
            .expect("half a preface kept open past the header timeout");
        // Closed or reset, never answered.
        assert!(closed.is_err() || rest.is_empty(), "answered {rest:?}");
    }
    let waited = started.elapsed();
    let cpu = cpu_time(gateway.pid()) - cpu_before;
    assert!(
        waited >= Duration::from_millis(1500) && waited < Duration::from_secs(6),
        "closed after {waited:?}"
    );
    // Polling each socket every millisecond took 720 ms of CPU over the
    // wait (debug build); waiting on readiness takes next to none.
    eprintln!("{CONNECTIONS} half prefaces: {cpu:?} of gateway CPU over {waited:?}");
    assert!(
        cpu < Duration::from_millis(300),
        "{CONNECTIONS} half prefaces cost the gateway {cpu:?} of CPU over {waited:?}"
    );
}

/// An HTTP/2 client names the host in `:authority`, with no `Host` header:
/// the upstream is still told the host the client asked for, in
/// `X-Forwarded-Host`, as an HTTP/1.1 client's `Host` is.
#[tokio::test]
async fn an_http2_clients_authority_is_forwarded_as_its_host() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url()).start().await;
    let (mut sender, _driving) = h2_client(&gateway).await;
    let request = Request::get("http://api.example.com/v1/things")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let answer = sender.send_request(request).await.unwrap();
    assert_eq!(answer.status(), 200);
    let seen = upstream.recorded();
    assert_eq!(
        seen[0].header("host"),
        Some(upstream.url().trim_start_matches("http://"))
    );
    assert_eq!(seen[0].header("x-forwarded-host"), Some("api.example.com"));
}

/// An HTTP/2 client may split its cookies across several `cookie` fields
/// (RFC 9113 §8.2.3): the upstream gets them as one `Cookie` line, `; `
/// between them, as that section asks (an HTTP/1.1 server may keep only
/// one of several lines), the console's cookie left out.
#[tokio::test]
async fn an_http2_clients_split_cookies_reach_the_upstream_as_one_line() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url()).start().await;
    let (mut sender, _driving) = h2_client(&gateway).await;
    let request = Request::get("http://api.example.com/v1/things")
        .header("cookie", "a=1")
        .header("cookie", "idemgate_console=s")
        .header("cookie", "sid=alice; b=2")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let answer = sender.send_request(request).await.unwrap();
    assert_eq!(answer.status(), 200);
    let seen = upstream.recorded();
    let lines: Vec<_> = seen[0].headers.get_all("cookie").iter().collect();
    assert_eq!(lines, ["a=1; sid=alice; b=2"]);
}

/// A credential sent with whitespace around it over HTTP/2 (which hands a
/// value over as sent, where HTTP/1 trims it) is the same owner: the
/// retry over either protocol replays the one call. Before, each padding
/// named another owner, and each retry ran again.
#[tokio::test]
async fn an_http2_owner_with_whitespace_around_it_is_the_same_owner() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url()).start().await;
    let (mut sender, _driving) = h2_client(&gateway).await;
    for owner in [
        "Bearer alice",
        "Bearer alice ",
        " Bearer alice",
        "Bearer alice\t",
    ] {
        let request = Request::post("http://api.example.com/v1/charges")
            .header("authorization", owner)
            .header("idempotency-key", "ws-1")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let answer = sender.send_request(request).await.unwrap();
        assert_eq!(answer.status(), 200, "{owner:?}");
    }
    let h1 = crate::support::send(
        http::Method::POST,
        &gateway.path("/v1/charges"),
        &[
            ("authorization", "Bearer alice"),
            ("idempotency-key", "ws-1"),
            ("content-type", "application/json"),
        ],
        "{}",
    )
    .await;
    assert_eq!(h1.status, 200);
    assert_eq!(upstream.hits(), 1, "one owner, one call");
}
