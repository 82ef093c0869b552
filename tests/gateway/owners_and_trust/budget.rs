//! The memory budget (design §18), each mechanism on its own, through the
//! real binary: past the budget a new keyed request is `503 …/overloaded`
//! before any job exists; the budget comes back once requests finish; an
//! attempt whose client left still holds it until it ends; a client that
//! stops mid-body is cut off by the body-read timeout and creates nothing;
//! pass-through requests stream, are not held and are not refused.

use std::time::Duration;

use bytes::Bytes;
use http::Method;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::process::peak_rss;
use crate::support::sink::Sink;
use crate::support::upstream::json_response;
use crate::support::{eventually, send, FakeUpstream, Gate, Gateway, Reply, TestStore};

const KIB: usize = 1024;

/// A gateway with a 1 MiB budget, whose one route takes bodies of up to
/// 1 MiB (a route's bodies must fit in the budget).
fn small_budget(store: &TestStore, upstream: &FakeUpstream) -> crate::support::gateway::Builder {
    Gateway::builder(store, &upstream.url())
        .set("memory_budget", "\"1MiB\"")
        .tables("[[routes]]\npath_prefix = \"/\"\nbody_limit = \"1MiB\"")
}

/// An upstream that holds keyed requests (the gateway sends them with the
/// job's id as their key) until `gate` lets them through, and answers
/// every request with a small JSON (an echo of the body would count the
/// body again, as an answer).
async fn gated(gate: &Gate) -> FakeUpstream {
    let gate = gate.clone();
    FakeUpstream::start(move |r| {
        let gate = gate.clone();
        async move {
            if r.header("idempotency-key").is_some() {
                gate.pass().await;
            }
            json_response(
                200,
                serde_json::json!({ "hit": r.hit, "len": r.body.len() }),
            )
        }
    })
    .await
}

/// A keyed upload of `len` bytes, sent in a task of its own.
fn upload(gateway: &Gateway, key: &str, len: usize) -> tokio::task::JoinHandle<Reply> {
    let (url, key) = (
        gateway.path(&format!("/v1/uploads?key={key}")),
        key.to_owned(),
    );
    tokio::spawn(async move {
        let headers = [
            ("idempotency-key", key.as_str()),
            ("content-type", "application/octet-stream"),
        ];
        send(Method::POST, &url, &headers, vec![b'x'; len]).await
    })
}

async fn keyed(gateway: &Gateway, key: &str, len: usize) -> Reply {
    upload(gateway, key, len).await.unwrap()
}

async fn in_use(gateway: &Gateway) -> f64 {
    gateway.metric("idemgate_memory_budget_in_use_bytes").await
}

async fn jobs_for(store: &TestStore, key: &str) -> i64 {
    store
        .column(&format!("SELECT count(*) FROM jobs WHERE key = '{key}'"))
        .await[0]
        .parse()
        .unwrap()
}

#[tokio::test]
async fn past_the_budget_a_keyed_request_is_503_before_any_job_and_a_later_one_succeeds() {
    let store = TestStore::embedded();
    let gate = Gate::new();
    let upstream = gated(&gate).await;
    let gateway = small_budget(&store, &upstream).start().await;
    // 700 KiB held at the upstream: 324 KiB of the budget are left.
    let first = upload(&gateway, "first", 700 * KIB);
    upstream.arrival().await;
    assert!(in_use(&gateway).await >= (700 * KIB) as f64);

    let refused = keyed(&gateway, "second", 400 * KIB).await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.problem(), "overloaded");
    assert!(
        refused.header("retry-after").is_some(),
        "says when to come back"
    );
    assert!(
        refused.problem_detail().contains("memory budget"),
        "{}",
        refused.problem_detail()
    );
    assert_eq!(
        jobs_for(&store, "second").await,
        0,
        "no job for the refused request"
    );
    assert_eq!(upstream.hits(), 1, "nothing forwarded for it");
    assert_eq!(
        gateway
            .metric("idemgate_memory_budget_refusals_total")
            .await,
        1.0
    );

    // Without a declared length a body is taken as it comes, and refused
    // once it outgrows the room left, still before any job.
    let chunked = Sending {
        chunked: true,
        ..Sending::default()
    };
    let answer = upload_whole(&gateway, "third", 400 * KIB, chunked).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("/overloaded"), "{answer}");
    assert_eq!(jobs_for(&store, "third").await, 0);
    assert_eq!(upstream.hits(), 1);

    // Pass-through traffic is neither held nor refused by the budget.
    let passing = send(
        Method::POST,
        &gateway.path("/v1/uploads?key=none"),
        &[],
        vec![b'y'; 900 * KIB],
    )
    .await;
    assert_eq!(passing.status, 200, "{:?}", passing.body);
    assert_eq!(passing.json()["len"], 900 * KIB);

    gate.open(2);
    assert_eq!(first.await.unwrap().status, 200);
    // Given back once the answer is sent and the attempt has ended.
    eventually(
        Duration::from_secs(10),
        "the budget to be given back",
        || async { in_use(&gateway).await == 0.0 },
    )
    .await;
    let retried = keyed(&gateway, "second", 400 * KIB).await;
    assert_eq!(retried.status, 200, "{:?}", retried.body);
    assert_eq!(jobs_for(&store, "second").await, 1);
    assert_eq!(
        retried.json()["len"],
        400 * KIB,
        "the whole body went upstream"
    );
}

/// On a route that fingerprints JSON in canonical form, a body of many
/// small values (`[0,0,0,…]`) parses into a tree tens of times its size:
/// that is counted against the budget while the parse runs (about 128
/// bytes a value). Past what is free, the request is `503 …/overloaded`
/// before any job, as a body that outgrew the budget is, and taken once
/// room is back; past the whole budget it could never fit, `413`. A body
/// as large with few values (one long string) costs little (docs/design.md
/// §18).
#[tokio::test]
async fn a_canonical_parse_is_counted_against_the_budget() {
    let store = TestStore::embedded();
    let gate = Gate::new();
    let upstream = gated(&gate).await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("memory_budget", "\"4MiB\"")
        .tables("[[routes]]\npath_prefix = \"/\"\nbody_limit = \"1MiB\"\ncanonical_json = true")
        .start()
        .await;
    let url = gateway.path("/v1/batch");
    let post = |key: &'static str, values: usize| {
        let url = url.clone();
        async move {
            let headers = [
                ("idempotency-key", key),
                ("content-type", "application/json"),
            ];
            send(
                Method::POST,
                &url,
                &headers,
                format!("[{}0]", "0,".repeat(values - 1)),
            )
            .await
        }
    };
    let never = post("never-fits", 40 * KIB).await;
    assert_eq!(
        (never.status, never.problem()),
        (413, "request-too-large".into()),
        "{never:?}"
    );

    // A megabyte held by a request whose upstream call waits: 24 Ki values
    // (about 3.1 MiB parsed) no longer fit the 4 MiB.
    let held = upload(&gateway, "held", 1024 * KIB);
    eventually(Duration::from_secs(10), "the upload held", || async {
        in_use(&gateway).await >= (1024 * KIB) as f64
    })
    .await;
    let refused = post("many-values", 24 * KIB).await;
    assert_eq!(
        (refused.status, refused.problem()),
        (503, "overloaded".into()),
        "{refused:?}"
    );
    assert_eq!(jobs_for(&store, "many-values").await, 0);
    let cheap = tokio::spawn({
        let url = url.clone();
        async move {
            let few = format!("{{\"text\": \"{}\"}}", "a".repeat(256 * KIB));
            let headers = [
                ("idempotency-key", "few-values"),
                ("content-type", "application/json"),
            ];
            send(Method::POST, &url, &headers, few).await
        }
    });
    gate.open(2);
    assert_eq!(held.await.unwrap().status, 200);
    assert_eq!(cheap.await.unwrap().status, 200, "few values, however long");
    gate.open(1);
    let taken = post("many-values", 24 * KIB).await;
    assert_eq!(taken.status, 200, "{taken:?}");
}

/// A named owner's request may hold its share of the budget at most (half,
/// by default): a parse that would take more than that, beside its body,
/// could never be admitted, so it is `413`, not a `503` its client would
/// retry for ever; the anonymous owner is held to the whole budget
/// (docs/design.md §18).
#[tokio::test]
async fn a_parse_past_an_owners_share_is_413() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("memory_budget", "\"4MiB\"")
        .tables(
            "[owner]\nsources = [{ header = \"authorization\" }]\nallow_anonymous = true\n\
             [[routes]]\npath_prefix = \"/\"\nbody_limit = \"1MiB\"\ncanonical_json = true",
        )
        .start()
        .await;
    let url = gateway.path("/v1/batch");
    // 20 Ki values: about 2.5 MiB parsed, past a named owner's 2 MiB.
    let body = format!("[{}0]", "0,".repeat(20 * KIB - 1));
    let named = [
        ("idempotency-key", "named"),
        ("content-type", "application/json"),
        ("authorization", "Bearer alice"),
    ];
    let refused = send(Method::POST, &url, &named, body.clone()).await;
    assert_eq!(
        (refused.status, refused.problem()),
        (413, "request-too-large".into()),
        "{refused:?}"
    );
    let anonymous = [
        ("idempotency-key", "anonymous"),
        ("content-type", "application/json"),
    ];
    let taken = send(Method::POST, &url, &anonymous, body).await;
    assert_eq!(taken.status, 200, "{taken:?}");
}

#[tokio::test]
async fn an_attempt_whose_client_left_holds_its_bytes_until_it_ends() {
    let store = TestStore::embedded();
    let gate = Gate::new();
    let upstream = gated(&gate).await;
    let gateway = small_budget(&store, &upstream).start().await;
    let leaver = upload(&gateway, "leaver", 700 * KIB);
    upstream.arrival().await;
    // The client hangs up; its attempt goes on at the upstream.
    leaver.abort();
    eventually(
        Duration::from_secs(10),
        "the request to be gone",
        || async { gateway.metric("idemgate_requests_in_flight").await == 0.0 },
    )
    .await;
    assert!(
        in_use(&gateway).await >= (700 * KIB) as f64,
        "the attempt still holds the body"
    );
    let refused = keyed(&gateway, "newcomer", 400 * KIB).await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.problem(), "overloaded");

    gate.open(2);
    eventually(Duration::from_secs(10), "the attempt to end", || async {
        in_use(&gateway).await == 0.0
    })
    .await;
    assert_eq!(keyed(&gateway, "newcomer", 400 * KIB).await.status, 200);
    // The leaver's answer was committed all the same: its retry replays it.
    let replayed = keyed(&gateway, "leaver", 700 * KIB).await;
    assert_eq!(replayed.status, 200);
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    assert_eq!(upstream.hits(), 2);
}

/// How [`upload_whole`] sends its body.
#[derive(Clone, Copy, Default)]
struct Sending {
    /// In chunks, with no declared length.
    chunked: bool,
    /// With `Expect: 100-continue`: the body is sent once `100 Continue`
    /// came, and none when the answer comes first.
    expect: bool,
    /// The body in pieces (of 1 MiB, or chunks of 16 KiB), this long apart.
    gap: Duration,
    /// With no `Idempotency-Key`.
    keyless: bool,
}

/// A keyed upload of `len` bytes, written whole before the answer is read
/// (as Python's `requests` sends a body); the answer's head and body.
async fn upload_whole(gateway: &Gateway, key: &str, len: usize, how: Sending) -> String {
    let authority = gateway.url.trim_start_matches("http://");
    let mut stream = TcpStream::connect(authority).await.unwrap();
    let expect = if how.expect {
        "expect: 100-continue\r\n"
    } else {
        ""
    };
    let key = match how.keyless {
        true => String::new(),
        false => format!("idempotency-key: {key}\r\n"),
    };
    let framing = match how.chunked {
        true => "transfer-encoding: chunked".to_owned(),
        false => format!("content-length: {len}"),
    };
    let head = format!(
        "POST /v1/uploads HTTP/1.1\r\nhost: x\r\n{key}\
         content-type: application/octet-stream\r\n{framing}\r\n{expect}\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    if how.expect {
        let continued = b"HTTP/1.1 100 Continue\r\n\r\n";
        let mut interim = vec![0u8; continued.len()];
        stream.read_exact(&mut interim).await.unwrap();
        if interim != continued {
            // Answered before the body was asked for: none is sent.
            let rest = read_answer(&mut stream).await;
            return format!("{}{rest}", String::from_utf8_lossy(&interim));
        }
    }
    let send = async {
        let piece = if how.chunked { 16 * KIB } else { 1 << 20 };
        for piece in vec![b'd'; len].chunks(piece) {
            if how.chunked {
                stream
                    .write_all(format!("{:x}\r\n", piece.len()).as_bytes())
                    .await?;
            }
            stream.write_all(piece).await?;
            if how.chunked {
                stream.write_all(b"\r\n").await?;
            }
            tokio::time::sleep(how.gap).await;
        }
        if how.chunked {
            stream.write_all(b"0\r\n\r\n").await?;
        }
        Ok::<_, std::io::Error>(())
    };
    let sent = tokio::time::timeout(Duration::from_secs(20), send).await;
    sent.expect("the body was not taken within 20 s")
        .expect("the connection was reset under the body");
    read_answer(&mut stream).await
}

/// The head, then as many bytes of body as it declares.
async fn read_answer(stream: &mut TcpStream) -> String {
    let read = async {
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before a whole answer: {answer:?}");
            answer.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&answer).into_owned();
            let Some((head, body)) = text.split_once("\r\n\r\n") else {
                continue;
            };
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if body.len() >= length {
                return text;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("no answer to an upload within 10 s")
}

/// A client that sends its whole body before it reads its answer reads the
/// `413` of a body past the route's limit, declared or grown: the gateway
/// reads the rest after the answer and drops it, as nginx lingers, rather
/// than closing on unread bytes, which resets the connection under the
/// client's write and destroys the answer (`docs/design.md` §18, "A
/// refusal is read"). Before, the writes failed with a reset. 32 MiB is
/// past what the kernel's socket buffers take on their own. Also lingered
/// on: a body sent over 3 s, past `header_read_timeout` (its bytes, read
/// after the answer, are not the next request's head), and one sent after
/// `100 Continue`, whose refusal came mid-body; a client that waits for
/// `100 Continue` and is refused first is not asked for its body. Any
/// refusal made before the body is read is lingered on the same way (a
/// missing key). Nothing is created or forwarded.
#[tokio::test]
async fn a_client_that_sends_a_too_large_body_whole_reads_its_413() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("header_read_timeout", "\"1s\"")
        .tables("[[routes]]\npath_prefix = \"/\"\nbody_limit = \"64KiB\"\nrequire_key = true")
        .start()
        .await;
    let paced = Sending {
        gap: Duration::from_millis(100),
        ..Sending::default()
    };
    let chunked = Sending {
        chunked: true,
        ..Sending::default()
    };
    let expect = |chunked| Sending {
        chunked,
        expect: true,
        ..Sending::default()
    };
    let keyless = Sending {
        keyless: true,
        ..Sending::default()
    };
    let too_large = [
        upload_whole(&gateway, "declared", 32 << 20, Sending::default()).await,
        upload_whole(&gateway, "grown", 32 << 20, chunked).await,
        upload_whole(&gateway, "paced", 32 << 20, paced).await,
        upload_whole(&gateway, "continued", 32 << 20, expect(true)).await,
        // Refused before the body was asked for: no `100 Continue`, and
        // the answer comes with no byte of the body sent.
        upload_whole(&gateway, "unasked", 32 << 20, expect(false)).await,
    ];
    for answer in too_large {
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        assert!(answer.contains("application/problem+json"), "{answer}");
        assert!(answer.contains("/request-too-large"), "{answer}");
    }
    // Any refusal made before the body is read: here the key the route
    // requires, missing from a request of 32 MiB.
    let missing_key = upload_whole(&gateway, "", 32 << 20, keyless).await;
    assert!(missing_key.starts_with("HTTP/1.1 400"), "{missing_key}");
    assert!(
        missing_key.contains("/idempotency-key-missing"),
        "{missing_key}"
    );
    assert_eq!(store.job_count().await, 0, "no job");
    assert_eq!(upstream.hits(), 0, "nothing forwarded");
}

/// Writes a request's head and the first `sent` of its `len` body bytes,
/// then stops; returns everything the gateway answers until it closes, and
/// how long after the stop that was.
async fn stop_mid_body(
    gateway: &Gateway,
    key: Option<&str>,
    len: usize,
    sent: usize,
) -> (String, Duration) {
    let authority = gateway.url.trim_start_matches("http://");
    let mut stream = TcpStream::connect(authority).await.unwrap();
    let key = key.map_or(String::new(), |k| format!("idempotency-key: {k}\r\n"));
    let head = format!(
        "POST /v1/uploads HTTP/1.1\r\nhost: x\r\n{key}content-type: application/octet-stream\r\ncontent-length: {len}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&vec![b'x'; sent]).await.unwrap();
    let stopped = tokio::time::Instant::now();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("the gateway kept a stalled upload open")
        .unwrap();
    (
        String::from_utf8_lossy(&answer).into_owned(),
        stopped.elapsed(),
    )
}

#[tokio::test]
async fn a_client_that_stops_mid_body_is_cut_off_and_creates_nothing() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("body_read_timeout", "\"1s\"")
        .start()
        .await;
    let (answer, after) = stop_mid_body(&gateway, Some("stalled"), 1000, 500).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request-body-timeout"), "{answer}");
    assert!(
        after >= Duration::from_millis(900) && after < Duration::from_secs(5),
        "cut off {after:?} after it stopped"
    );
    assert_eq!(store.job_count().await, 0, "no job");
    assert_eq!(upstream.hits(), 0, "nothing forwarded");
    eventually(
        Duration::from_secs(5),
        "its bytes to be given back",
        || async { in_use(&gateway).await == 0.0 },
    )
    .await;

    // Passed through, the upstream saw the body start; the client still
    // hears why it was cut off.
    let (answer, _) = stop_mid_body(&gateway, None, 1000, 500).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");

    // The clock runs between pieces of a body, not over all of it: an
    // upload that keeps coming, slower than the timeout in all, is read.
    let authority = gateway.url.trim_start_matches("http://");
    let mut steady = TcpStream::connect(authority).await.unwrap();
    steady
        .write_all(
            b"POST /v1/uploads HTTP/1.1\r\nhost: x\r\nidempotency-key: steady\r\n\
              content-type: application/octet-stream\r\ncontent-length: 3000\r\n\r\n",
        )
        .await
        .unwrap();
    for _ in 0..6 {
        steady.write_all(&[b'x'; 500]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let mut answer = vec![0u8; 12];
    tokio::time::timeout(Duration::from_secs(10), steady.read_exact(&mut answer))
        .await
        .expect("no answer to a steady upload")
        .unwrap();
    assert_eq!(
        &answer,
        b"HTTP/1.1 200",
        "{}",
        String::from_utf8_lossy(&answer)
    );
    assert_eq!(store.job_count().await, 1);
}

#[tokio::test]
async fn a_passed_through_upload_streams_rather_than_being_held() {
    let store = TestStore::embedded();
    let sink = Sink::start(Duration::ZERO).await;
    let gateway = Gateway::start(&store, &sink.url()).await;
    assert_eq!(
        send(Method::POST, &gateway.path("/warm"), &[], "{}")
            .await
            .status,
        200
    );
    let before = peak_rss(gateway.pid());
    const LEN: usize = 96 << 20;
    let reply = send(
        Method::POST,
        &gateway.path("/v1/files"),
        &[("content-type", "application/octet-stream")],
        Bytes::from(vec![b'z'; LEN]),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["len"], LEN, "all of it reached the upstream");
    let grew = peak_rss(gateway.pid()).saturating_sub(before);
    assert!(
        grew < 24 << 20,
        "a 96 MiB pass-through grew the gateway's peak memory by {} MiB",
        grew >> 20
    );
}

/// A keyed upload by cookie owner `sid` that declares `len` bytes and then
/// trickles ten bytes every 200 ms (50 B/s, every pause well within the
/// body-read timeout) until the gateway answers; that answer's head and
/// how long it took.
async fn trickle(url: &str, sid: &str, key: &str, len: usize) -> (String, Duration) {
    let authority = url.trim_start_matches("http://").to_owned();
    let mut stream = TcpStream::connect(&authority).await.unwrap();
    let head = format!(
        "POST /v1/uploads?key={key} HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\n\
         cookie: sid={sid}\r\ncontent-type: application/octet-stream\r\ncontent-length: {len}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let started = tokio::time::Instant::now();
    let (mut read, mut write) = stream.into_split();
    let sending = tokio::spawn(async move {
        for _ in 0..len / 10 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if write.write_all(&[b't'; 10]).await.is_err() {
                return;
            }
        }
    });
    let mut answer = vec![0; 512];
    let n = tokio::time::timeout(Duration::from_secs(20), read.read(&mut answer))
        .await
        .expect("a trickled upload was held for 20 s")
        .unwrap();
    sending.abort();
    (
        String::from_utf8_lossy(&answer[..n]).into_owned(),
        started.elapsed(),
    )
}

/// Uploads that declare much and send little cannot sit on the budget
/// (design §18): each is admitted with the first 64 KiB of what it
/// declares and takes the rest only once past them, so eight of them under
/// eight made-up owners (an owner an `Authorization` header names is
/// anyone's to invent) leave room for another's keyed request; and a body
/// slower than `body_min_rate` once past the body-read timeout is
/// answered `408` and its bytes given back, though it never paused for
/// long. Before, each took the whole 1 MiB it declared, two of them the
/// whole budget, and every keyed request was refused until they were cut.
async fn trickled_uploads_neither_starve_other_owners_nor_hold_their_bytes(store: TestStore) {
    let upstream = FakeUpstream::start(|r| async move {
        json_response(200, serde_json::json!({ "len": r.body.len() }))
    })
    .await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("memory_budget", "\"2MiB\"")
        .set("body_read_timeout", "\"2s\"")
        .set("body_min_rate", "\"1KiB\"")
        .tables(
            "[owner]\nsources = [{ cookie = \"sid\" }]\n\n\
             [[routes]]\npath_prefix = \"/\"\nbody_limit = \"1MiB\"",
        )
        .start()
        .await;
    let trickles: Vec<_> = (0..8)
        .map(|n| {
            let url = gateway.url.clone();
            tokio::spawn(async move {
                trickle(&url, &format!("mallory-{n}"), &format!("m{n}"), 1 << 20).await
            })
        })
        .collect();
    eventually(
        Duration::from_secs(5),
        "the trickles are admitted",
        || async { in_use(&gateway).await >= (8 * 64 * KIB) as f64 },
    )
    .await;
    let held = in_use(&gateway).await;
    assert!(held < (1 << 20) as f64, "8 MiB declared, {held} held");

    let alice = send(
        Method::POST,
        &gateway.path("/v1/uploads?key=alice"),
        &[("idempotency-key", "a1"), ("cookie", "sid=alice")],
        vec![b'a'; 600 * KIB],
    )
    .await;
    assert_eq!(
        alice.status, 200,
        "another owner is served: {:?}",
        alice.body
    );

    for trickle in trickles {
        let (cut, after) = trickle.await.unwrap();
        assert!(cut.starts_with("HTTP/1.1 408"), "{cut}");
        assert!(cut.contains("/request-body-timeout"), "{cut}");
        assert!(
            after < Duration::from_secs(8),
            "cut once behind 1 KiB/s past the 2 s grace, not when the 1 MiB would end: {after:?}"
        );
    }
    eventually(
        Duration::from_secs(5),
        "its bytes are given back",
        || async { in_use(&gateway).await == 0.0 },
    )
    .await;
    for n in 0..8 {
        assert_eq!(
            jobs_for(&store, &format!("m{n}")).await,
            0,
            "no job for a cut upload"
        );
    }
}

/// A length its owner's share could never hold is refused at once, before
/// its body: taken ahead only 64 KiB at a time, it would otherwise wait
/// for its first 64 KiB to be told what its head already said.
#[tokio::test]
async fn a_length_past_the_owners_share_is_refused_at_once() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("memory_budget", "\"2MiB\"")
        .tables(
            "[owner]\nsources = [{ cookie = \"sid\" }]\n\n\
             [[routes]]\npath_prefix = \"/\"\nbody_limit = \"2MiB\"",
        )
        .start()
        .await;
    let (answer, after) = trickle(&gateway.url, "mallory", "big", 1536 * KIB).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("/overloaded"), "{answer}");
    assert!(after < Duration::from_secs(2), "answered after {after:?}");
    assert_eq!(upstream.hits(), 0);
}

crate::on_each_deployment!(
    [embedded, postgres]
    trickled_uploads_neither_starve_other_owners_nor_hold_their_bytes
);
