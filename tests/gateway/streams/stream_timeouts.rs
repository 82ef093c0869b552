//! The two silences of an attempt through the real binary
//! (`docs/design.md` §10, §11): `first_byte_timeout` before the answer's
//! head (then unknown, and a side-effect-free route fails over while it
//! still can), `stream_idle_timeout` between chunks once the head has come
//! (then a stream is cut and the attempt unknown); each set per route or
//! per upstream, and neither standing in for the other.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::StreamBody;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use crate::support::sse::{event, Ending, Finish, Reader, SseUpstream};
use crate::support::upstream::echo_response;
use crate::support::{eventually, post, FakeUpstream, Gate, Gateway, TestStore};

const EVENT: usize = 128;

fn events(job: &str, from: usize, to: usize) -> String {
    (from..=to).map(|n| event(job, n, EVENT)).collect()
}

/// A gateway whose upstreams are named tables (`(name, url, extra keys)`)
/// and whose one side-effect-free route on `/v1` has `route_keys`; the
/// global timeout is long, so only the keys under test can fire.
async fn gateway(store: &TestStore, upstreams: &[(&str, &str, &str)], route_keys: &str) -> Gateway {
    let mut builder = Gateway::builder(store, "http://unused")
        .unset("upstreams")
        .set("upstream_timeout", "\"30s\"")
        .set("attempt_deadline", "\"60s\"");
    for (name, url, keys) in upstreams {
        builder = builder.tables(&format!(
            "[[upstreams]]\nname = {name:?}\nurl = {url:?}\n{keys}\n"
        ));
    }
    builder
        .tables(&format!(
            "[[routes]]\npath_prefix = \"/v1\"\nside_effect_free = true\n{route_keys}\n"
        ))
        .start()
        .await
}

async fn attempt(gateway: &Gateway, job: &str, i: usize) -> serde_json::Value {
    gateway.job(job).await["attempts"][i].clone()
}

/// A keyed POST to `/v1/charges` is answered `504` unknown well before the
/// 30 s the other timeouts allow, its attempt recorded unknown with `detail`.
async fn unknown_soon(gateway: &Gateway, key: &str, detail: &str) {
    let started = Instant::now();
    let unknown = post(&gateway.path("/v1/charges"), key, "{}").await;
    assert_eq!(unknown.status, 504, "{:?}", unknown.json());
    assert_eq!(unknown.problem(), "attempt-outcome-unknown");
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(15),
        "answered after {took:?}, as if by a 30 s timeout"
    );
    let first = attempt(gateway, &unknown.job().unwrap(), 0).await;
    assert_eq!(first["state"], "unknown", "{first}");
    let recorded = first["detail"].as_str().unwrap();
    assert!(recorded.contains(detail), "{recorded}");
}

/// The primary sends no head within `first_byte_timeout`: the attempt is
/// unknown, and since nothing has streamed yet the route fails over; the
/// client gets the fallback's whole stream.
async fn a_silent_head_fails_over_to_the_next_upstream(store: TestStore) {
    let silent = Gate::new();
    let primary = FakeUpstream::gated_echo(&silent, |_| true).await;
    let gate = Gate::new();
    gate.open(4);
    let fallback = SseUpstream::start(4, EVENT, &gate, Ending::Clean).await;
    let upstreams = [
        ("primary", primary.url(), ""),
        ("fallback", fallback.url(), ""),
    ];
    let upstreams: Vec<_> = upstreams
        .iter()
        .map(|(n, u, k)| (*n, u.as_str(), *k))
        .collect();
    let gateway = gateway(&store, &upstreams, "first_byte_timeout = \"300ms\"").await;

    let mut client = Reader::post(&gateway.path("/v1/chat"), "fb-1", "{}").await;
    assert_eq!(client.status, 200);
    assert_eq!(client.header("content-type"), Some("text/event-stream"));
    assert_eq!(client.finish().await, Finish::Complete);
    let job = client.header("idempotency-job").unwrap().to_owned();
    assert_eq!(String::from_utf8(client.read).unwrap(), events(&job, 1, 4));
    assert_eq!((primary.hits(), fallback.hits()), (1, 1));

    let first = attempt(&gateway, &job, 0).await;
    assert_eq!(first["upstream"], "primary", "{first}");
    // Unknown when its silence fired; superseded once the fallback won.
    assert!(
        first["state"] == "unknown" || first["state"] == "superseded",
        "{first}"
    );
    let second = attempt(&gateway, &job, 1).await;
    assert_eq!(second["upstream"], "fallback", "{second}");
    assert_eq!(second["state"], "succeeded", "{second}");
    assert_eq!(gateway.job(&job).await["state"], "completed");
    silent.open(1);
}

/// The head comes at once, then the stream stalls after 2 of 6 events: cut
/// after `stream_idle_timeout` (not the long first-byte or global timeout),
/// the client's body aborted, the attempt unknown, the retry refused.
async fn a_stream_that_stalls_midway_is_cut_and_unknown(store: TestStore) {
    let gate = Gate::new();
    gate.open(2);
    let upstream = SseUpstream::start(6, EVENT, &gate, Ending::Clean).await;
    let url = upstream.url();
    let keys = "first_byte_timeout = \"30s\"\nstream_idle_timeout = \"1s\"";
    let gateway = gateway(&store, &[("only", url.as_str(), "")], keys).await;
    let url = gateway.path("/v1/chat");

    let mut client = Reader::post(&url, "idle-1", "{}").await;
    assert_eq!(client.status, 200);
    client.read_until(2 * EVENT).await;
    let job = client.header("idempotency-job").unwrap().to_owned();
    // Well within the 30 s the other timeouts allow.
    assert_eq!(
        client.finish_within(Duration::from_secs(15)).await,
        Finish::Aborted,
        "no clean end for a stream cut midway"
    );
    assert_eq!(client.read, events(&job, 1, 2).into_bytes());
    eventually(
        Duration::from_secs(10),
        "the attempt to be unknown",
        || async { attempt(&gateway, &job, 0).await["state"] == "unknown" },
    )
    .await;
    let detail = attempt(&gateway, &job, 0).await["detail"].clone();
    let detail = detail.as_str().unwrap();
    assert!(
        detail.contains("went silent for 1s (stream_idle_timeout)"),
        "{detail}"
    );
    let retry = post(&url, "idle-1", "{}").await;
    assert_eq!(retry.status, 409);
    assert_eq!(retry.problem(), "attempt-outcome-unknown");
    assert_eq!(upstream.hits(), 1);
    gate.open(4);
}

/// Answers every request on a fresh port with `answer(request)`: a head,
/// then a body streamed as its frames come. The port's URL.
async fn serve<F, Fut, S>(answer: F) -> String
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response<StreamBody<S>>> + Send + 'static,
    S: futures_util::Stream<Item = Result<Frame<Bytes>, Infallible>> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let answer = answer.clone();
            let svc = hyper::service::service_fn(move |req| {
                let answer = answer.clone();
                async move { Ok::<_, Infallible>(answer(req).await) }
            });
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    url
}

/// Streams `events` events spaced by `gap` after a head that takes `head`.
async fn slow_head_stream(head: Duration, events: usize, gap: Duration) -> String {
    serve(move |req: Request<Incoming>| async move {
        let job = req.headers()["idempotency-key"]
            .to_str()
            .unwrap()
            .to_owned();
        tokio::time::sleep(head).await;
        let frames = futures_util::stream::unfold(1usize, move |n| {
            let job = job.clone();
            async move {
                if n > events {
                    return None;
                }
                if n > 1 {
                    tokio::time::sleep(gap).await;
                }
                let data = Bytes::from(event(&job, n, EVENT));
                Some((Ok::<_, Infallible>(Frame::data(data)), n + 1))
            }
        });
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(StreamBody::new(frames))
            .unwrap()
    })
    .await
}

/// A head slower than `stream_idle_timeout` but within
/// `first_byte_timeout`, then events closer together than the idle
/// allowance: the idle clock does not run before the head, so it completes.
async fn the_idle_allowance_does_not_time_the_head(store: TestStore) {
    let url = slow_head_stream(Duration::from_secs(1), 6, Duration::from_millis(100)).await;
    let keys = "first_byte_timeout = \"5s\"\nstream_idle_timeout = \"300ms\"";
    let gateway = gateway(&store, &[("slow", url.as_str(), "")], keys).await;

    let mut client = Reader::post(&gateway.path("/v1/chat"), "sep-1", "{}").await;
    assert_eq!(client.status, 200);
    assert_eq!(client.finish().await, Finish::Complete);
    let job = client.header("idempotency-job").unwrap().to_owned();
    assert_eq!(String::from_utf8(client.read).unwrap(), events(&job, 1, 6));
    let first = attempt(&gateway, &job, 0).await;
    assert_eq!(first["state"], "succeeded", "{first}");
}

/// An `[[upstreams]]` table's `first_byte_timeout` holds on a route that
/// sets none (answered long before the upstream's 30 s `timeout`), and a
/// route's own key overrides it for the same upstream.
async fn an_upstreams_first_byte_timeout_holds_unless_the_route_sets_one(store: TestStore) {
    let silent = Gate::new();
    // `/v1/…` never answers; `/patient/…` answers after a second.
    let upstream = FakeUpstream::start({
        let silent = silent.clone();
        move |r| {
            let silent = silent.clone();
            async move {
                if r.path.starts_with("/v1") {
                    silent.pass().await;
                } else {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                echo_response(&r)
            }
        }
    })
    .await;
    let url = upstream.url();
    let keys = "timeout = \"30s\"\nfirst_byte_timeout = \"300ms\"";
    let gateway = Gateway::builder(&store, "http://unused")
        .unset("upstreams")
        .set("attempt_deadline", "\"60s\"")
        .tables(&format!(
            "[[upstreams]]\nname = \"u\"\nurl = {url:?}\n{keys}\n"
        ))
        .tables("[[routes]]\npath_prefix = \"/v1\"\n")
        .tables("[[routes]]\npath_prefix = \"/patient\"\nfirst_byte_timeout = \"5s\"\n")
        .start()
        .await;

    unknown_soon(
        &gateway,
        "ufb-1",
        "no answer head within 300ms (first_byte_timeout)",
    )
    .await;

    let patient = post(&gateway.path("/patient/charges"), "ufb-2", "{}").await;
    assert_eq!(patient.status, 200, "{:?}", patient.json());
    silent.open(1);
}

/// Answers a JSON head and the first half of its body at once, then the
/// rest only when `gate` opens.
async fn half_a_body(gate: &Gate) -> String {
    let gate = gate.clone();
    serve(move |_req| {
        let gate = gate.clone();
        async move {
            let halves = futures_util::stream::unfold(0, move |n| {
                let gate = gate.clone();
                async move {
                    let half = match n {
                        0 => "{\"half\": ",
                        1 => {
                            gate.pass().await;
                            "\"and the rest\"}"
                        }
                        _ => return None,
                    };
                    let frame = Frame::data(Bytes::from_static(half.as_bytes()));
                    Some((Ok::<_, Infallible>(frame), n + 1))
                }
            });
            Response::builder()
                .header("content-type", "application/json")
                .body(StreamBody::new(halves))
                .unwrap()
        }
    })
    .await
}

/// A buffered (not streamed) answer whose body goes silent after its head
/// is timed by `stream_idle_timeout` too: unknown, its detail naming it,
/// long before the first-byte and global timeouts.
async fn a_buffered_body_gone_silent_is_unknown_by_the_idle_allowance(store: TestStore) {
    let gate = Gate::new();
    let url = half_a_body(&gate).await;
    let keys = "first_byte_timeout = \"30s\"\nstream_idle_timeout = \"1s\"";
    let gateway = gateway(&store, &[("half", url.as_str(), "")], keys).await;
    let detail = "the answer's body went silent for 1s (stream_idle_timeout)";
    unknown_soon(&gateway, "half-1", detail).await;
    gate.open(1);
}

crate::on_each_deployment!(
    [embedded, postgres]
    a_silent_head_fails_over_to_the_next_upstream,
    a_stream_that_stalls_midway_is_cut_and_unknown,
    the_idle_allowance_does_not_time_the_head,
    an_upstreams_first_byte_timeout_holds_unless_the_route_sets_one,
    a_buffered_body_gone_silent_is_unknown_by_the_idle_allowance,
);
