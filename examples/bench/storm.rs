//! The duplicate storm: thousands of clients holding one key at once, and
//! how fast the gateway releases them when the key's answer comes.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::args::Args;
use crate::harness::{Gateway, Store};
use crate::usage::{cpu_us, rss_kib, uptime};

/// The storm table's head.
const HEAD: &str = "| duplicate storm | holders | all held after ms | upstream calls | release p50 ms | p99 ms | last ms | RSS per holder KiB | CPU ms during release: gateway / load generator |\n|---|--:|--:|--:|--:|--:|--:|--:|--:|\n";

/// The duplicate storm: `args.storm` clients hold one key while its only
/// attempt waits at a gated upstream; then it answers. Reports upstream
/// calls, how long after the answer the holders were released, and the
/// gateway's memory per held request.
pub async fn storm(args: &Args, scratch: &Path, db: &str) -> String {
    let gate = Arc::new(Notify::new());
    let (upstream, calls) = gated_upstream(gate.clone()).await;
    let mut out = String::from(HEAD);
    let stores = [
        (
            "PostgreSQL + Redis",
            Store::Postgres(db),
            Some(args.redis.as_str()),
        ),
        (
            "embedded store",
            Store::Embedded(&scratch.join("storm.db")),
            None,
        ),
    ];
    // Room for every holder: the defaults (10,000 requests in flight)
    // would shed the last one, and the storm would wait for it in vain.
    let limits = scratch.join("storm.toml");
    let room = args.storm + 100;
    std::fs::write(
        &limits,
        format!("max_in_flight = {room}\nmax_connections = {room}\n"),
    )
    .unwrap();
    let limits = limits.display().to_string();
    for (name, store, redis) in stores {
        calls.store(0, Ordering::SeqCst);
        let flags = ["--hold-timeout", "120s", "--config", &limits];
        let gateway = Gateway::start(&args.binary, &upstream, store, redis, &flags).await;
        out.push_str(&one_storm(name, &gateway, &gate, &calls, args.storm).await);
    }
    out
}

/// The storm on one gateway (`name`): its row of the table.
async fn one_storm(
    name: &str,
    gateway: &Gateway,
    gate: &Notify,
    calls: &AtomicUsize,
    storm: usize,
) -> String {
    let idle = rss_kib(gateway.pid);
    let key = format!("storm-{}-{}", name.len(), std::process::id());
    let first = tokio::spawn(timed(gateway.url.clone(), key.clone()));
    while calls.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let holding = Instant::now();
    let holders = hold(gateway, &key, storm).await;
    let all_held = holding.elapsed().as_secs_f64() * 1000.0;
    let held_rss = rss_kib(gateway.pid);
    let answered = Instant::now();
    let (gateway_cpu, client_cpu) = (cpu_us(&[gateway.pid]), cpu_us(&[std::process::id()]));
    gate.notify_one();
    let _ = first.await;
    let mut releases: Vec<f64> = Vec::new();
    let mut open = Vec::with_capacity(storm);
    for h in holders {
        if let Ok(Some((done, connection))) = h.await {
            releases.push(done.saturating_duration_since(answered).as_secs_f64() * 1000.0);
            open.push(connection);
        }
    }
    // For a profile of the release alone (`perf record -k CLOCK_MONOTONIC`,
    // then `perf script --time`): the window on the system's clock.
    eprintln!(
        "{name}: release window {:.2},{:.2} (seconds since boot)",
        uptime() - answered.elapsed().as_secs_f64(),
        uptime()
    );
    // Where the release's time goes: the gateway's CPU and this load
    // generator's, which share the machine's cores.
    let gateway_cpu = (cpu_us(&[gateway.pid]) - gateway_cpu) / 1000.0;
    let client_cpu = (cpu_us(&[std::process::id()]) - client_cpu) / 1000.0;
    drop(open);
    releases.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| {
        releases
            .get(((releases.len() as f64 * p) as usize).min(releases.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    };
    format!(
        "| {name} | {} answered of {} | {all_held:.0} | {} | {:.0} | {:.0} | {:.0} | {:.1} | {gateway_cpu:.0} / {client_cpu:.0} |\n",
        releases.len(),
        storm,
        calls.load(Ordering::SeqCst),
        pct(0.5),
        pct(0.99),
        releases.last().copied().unwrap_or(0.0),
        (held_rss.saturating_sub(idle)) as f64 / storm as f64,
    )
}

/// `storm` holders of `key`, started in batches of 500, once the gateway
/// holds them all (or two minutes have passed).
async fn hold(
    gateway: &Gateway,
    key: &str,
    storm: usize,
) -> Vec<JoinHandle<Option<(Instant, tokio::net::TcpStream)>>> {
    let mut holders = Vec::with_capacity(storm);
    for i in 0..storm {
        holders.push(tokio::spawn(timed(gateway.url.clone(), key.to_owned())));
        if i % 500 == 499 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while gateway.metric("idemgate_held_requests").await < storm as f64 && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    holders
}

/// One keyed request; when it was answered (200), or `None`, and the
/// connection, still open. Written and read on a bare socket and kept
/// alive, as wrk does: the storm's load generator shares the cores with the
/// gateway, so the less it spends per holder the more the release measures
/// the gateway's answering (not the teardown of 10,000 connections, which
/// a client closing each at once would add to the window).
async fn timed(url: String, key: String) -> Option<(Instant, tokio::net::TcpStream)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = url.strip_prefix("http://")?;
    let body = "{\"amount\": 1000}";
    let request = format!(
        "POST /v1/charges HTTP/1.1\r\nhost: {addr}\r\nidempotency-key: {key}\r\n\
         authorization: Bearer bench-client\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut buf = Vec::with_capacity(1024);
        loop {
            if stream.read_buf(&mut buf).await.ok()? == 0 {
                return None;
            }
            let Some(head) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                continue;
            };
            let text = std::str::from_utf8(&buf[..head]).ok()?;
            let length: usize = text
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().ok())?
                })
                .unwrap_or(0);
            if buf.len() >= head + 4 + length {
                let ok = text.starts_with("HTTP/1.1 200");
                return ok.then(|| (Instant::now(), stream));
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(180), exchange)
        .await
        .ok()?
}

/// An upstream whose answers wait for `gate`; counts its calls.
async fn gated_upstream(gate: Arc<Notify>) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (gate, calls) = (gate.clone(), counted.clone());
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |_req: Request<hyper::body::Incoming>| {
                        let (gate, calls) = (gate.clone(), calls.clone());
                        async move {
                            calls.fetch_add(1, Ordering::SeqCst);
                            gate.notified().await;
                            Ok::<_, std::convert::Infallible>(Response::new(Full::new(
                                Bytes::from_static(b"{\"charged\":true}"),
                            )))
                        }
                    });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (format!("http://{addr}"), calls)
}
