//! A gateway that defends itself: idle and half-sent connections, oversized
//! headers, ambiguous framing, and overload.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::{post, FakeUpstream, Gate, Gateway, TestStore};

fn authority(gateway: &Gateway) -> String {
    gateway.url.trim_start_matches("http://").to_owned()
}

/// Everything the gateway sends back on a raw connection until it closes
/// it (10 s at most).
async fn read_until_closed(stream: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the gateway kept the connection open");
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn idle_connections_do_not_stop_a_keyed_request() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let mut idle = Vec::new();
    for i in 0..500 {
        let mut stream = TcpStream::connect(authority(&gateway)).await.unwrap();
        if i % 2 == 0 {
            // Half of them half-open: a request line never finished.
            stream.write_all(b"POST /v1/charges HT").await.unwrap();
        }
        idle.push(stream);
    }
    let started = tokio::time::Instant::now();
    let reply = post(&gateway.path("/v1/charges"), "through-the-crowd", "{}").await;
    assert_eq!(reply.status, 200);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "answered promptly, not after the idle connections: {:?}",
        started.elapsed()
    );
    drop(idle);
}

#[tokio::test]
async fn a_half_sent_request_line_is_closed_after_the_header_timeout() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("header_read_timeout", "\"1s\"")
        .start()
        .await;
    let mut stream = TcpStream::connect(authority(&gateway)).await.unwrap();
    stream.write_all(b"POST /v1/charges HT").await.unwrap();
    let started = tokio::time::Instant::now();
    read_until_closed(&mut stream).await;
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "closed after {waited:?}"
    );
    assert_eq!(upstream.hits(), 0);
}

/// Past `max_header_size` (64 KiB) a head is 431, however it arrives: one
/// of 80 KiB, read whole before hyper's read buffer reached its bound,
/// went through when only that bound held it.
#[tokio::test]
async fn an_oversized_header_block_is_431_and_never_forwarded() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    for size in [80, 128] {
        let mut stream = TcpStream::connect(authority(&gateway)).await.unwrap();
        let huge = "a".repeat(size * 1024);
        let request = format!(
            "POST /v1/charges HTTP/1.1\r\nhost: x\r\nidempotency-key: big\r\nx-huge: {huge}\r\n\
             content-length: 2\r\n\r\n{{}}"
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let answer = read_until_closed(&mut stream).await;
        assert!(
            answer.starts_with("HTTP/1.1 431"),
            "{size} KiB: {}",
            &answer[..answer.len().min(200)]
        );
    }
    assert_eq!(upstream.hits(), 0, "nothing forwarded");
    assert_eq!(store.job_count().await, 0, "nothing recorded");
    // Within it, the same head goes through.
    let fits = "a".repeat(60 * 1024);
    let reply = crate::support::send(
        http::Method::POST,
        &gateway.path("/v1/charges"),
        &[("idempotency-key", "fits"), ("x-huge", fits.as_str())],
        "{}".to_owned(),
    )
    .await;
    assert_eq!(reply.status, 200);
}

#[tokio::test]
async fn two_different_content_lengths_are_400() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let mut stream = TcpStream::connect(authority(&gateway)).await.unwrap();
    stream
        .write_all(
            b"POST /v1/charges HTTP/1.1\r\nhost: x\r\nidempotency-key: cl\r\n\
              content-length: 2\r\ncontent-length: 3\r\n\r\n{}",
        )
        .await
        .unwrap();
    let answer = read_until_closed(&mut stream).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert_eq!(upstream.hits(), 0);
}

#[tokio::test]
async fn content_length_beside_chunked_is_framed_by_chunks_and_the_connection_closed() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let mut stream = TcpStream::connect(authority(&gateway)).await.unwrap();
    // The length says 100; the chunks say `{"a":1}`. A second request is
    // smuggled after them.
    stream
        .write_all(
            b"POST /v1/charges HTTP/1.1\r\nhost: x\r\nidempotency-key: te\r\n\
              content-type: application/json\r\ncontent-length: 100\r\n\
              transfer-encoding: chunked\r\n\r\n7\r\n{\"a\":1}\r\n0\r\n\r\n\
              POST /v1/smuggled HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n",
        )
        .await
        .unwrap();
    let answer = read_until_closed(&mut stream).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(
        answer.matches("HTTP/1.1").count(),
        1,
        "one answer, then closed: {answer}"
    );
    let seen = upstream.recorded();
    assert_eq!(
        seen.len(),
        1,
        "the smuggled request never reached the upstream"
    );
    assert_eq!(seen[0].body, r#"{"a":1}"#, "framed by the chunks");
}

#[tokio::test]
async fn a_saturated_gateway_sheds_at_once_before_taking_a_job() {
    let store = TestStore::embedded();
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("max_in_flight", "2")
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    let busy: Vec<_> = ["busy-1", "busy-2"]
        .into_iter()
        .map(|key| {
            let url = url.clone();
            tokio::spawn(async move { post(&url, key, "{}").await })
        })
        .collect();
    // Both held at the upstream: the gateway is at its limit. Each arrival
    // is waited for at most 10 s, and fails saying none came.
    upstream.arrival().await;
    upstream.arrival().await;
    let started = tokio::time::Instant::now();
    let shed = post(&url, "one-too-many", "{}").await;
    assert_eq!(shed.status, 503);
    assert_eq!(shed.problem(), "overloaded");
    assert!(shed.header("retry-after").is_some());
    assert!(started.elapsed() < Duration::from_secs(1), "at once");
    assert_eq!(
        store.job_count().await,
        2,
        "no job taken for the shed request"
    );
    // Two for the held requests, one for the retry below.
    gate.open(3);
    for b in busy {
        assert_eq!(b.await.unwrap().status, 200);
    }
    // Capacity is back: the same key now goes through.
    assert_eq!(post(&url, "one-too-many", "{}").await.status, 200);
    assert_eq!(upstream.hits(), 3);
}

/// One keep-alive GET on `stream`, answered 200 (the whole answer read by
/// its length).
async fn get_on(stream: &mut TcpStream) -> Result<(), String> {
    stream
        .write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            Ok(_) => return Err("closed".into()),
            Err(e) => return Err(e.to_string()),
        }
    }
    let head = String::from_utf8_lossy(&head).to_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .map_or(0, |n| n.trim().parse().unwrap());
    let mut body = vec![0u8; length];
    stream
        .read_exact(&mut body)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

#[tokio::test]
async fn a_connection_idle_past_the_header_timeout_is_kept_until_the_keepalive_timeout() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("header_read_timeout", "\"1s\"")
        .set("keepalive_timeout", "\"4s\"")
        .start()
        .await;
    let mut stream = TcpStream::connect(authority(&gateway)).await.unwrap();
    get_on(&mut stream).await.unwrap();
    // Idle three times the header timeout: a balancer reusing it now must
    // not meet a reset (before, this connection was closed at 1 s).
    tokio::time::sleep(Duration::from_secs(3)).await;
    get_on(&mut stream)
        .await
        .expect("the idle connection was still open");
    let idle_from = tokio::time::Instant::now();
    read_until_closed(&mut stream).await;
    let idle = idle_from.elapsed();
    assert!(
        idle >= Duration::from_millis(3900) && idle < Duration::from_secs(8),
        "closed after {idle:?} idle, not at the keepalive timeout"
    );
    assert_eq!(upstream.hits(), 2);
}

#[tokio::test]
async fn a_slow_head_after_an_idle_pause_is_timed_from_its_first_byte() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("header_read_timeout", "\"1s\"")
        .set("keepalive_timeout", "\"30s\"")
        .start()
        .await;
    let mut stream = TcpStream::connect(authority(&gateway)).await.unwrap();
    get_on(&mut stream).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stream.write_all(b"POST /v1/charges HT").await.unwrap();
    let started = tokio::time::Instant::now();
    read_until_closed(&mut stream).await;
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "a head stalled mid-line is closed by the header timeout, not kept for the keepalive one: {waited:?}"
    );
    assert_eq!(upstream.hits(), 1);
}
