//! Replay benchmark: how fast idemgate answers duplicates of finished jobs,
//! with and without the Redis fast path (and on the embedded store), side by
//! side in one run.
//!
//! It starts one local upstream, then for each configuration a real
//! `idemgate` process (the release binary) on a fresh PostgreSQL database,
//! primes `--keys` jobs, and fires `--requests` replays over `--concurrency`
//! connections. Rounds alternate between configurations so that drift on the
//! machine hits them alike. Loopback only; bounded in requests.
//!
//! ```sh
//! scripts/bench.sh            # builds, starts services, runs this
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::time::Instant;

mod harness;
use harness::{create_database, drop_database, Gateway, Store};

struct Args {
    binary: String,
    database: String,
    redis: String,
    keys: usize,
    requests: usize,
    concurrency: usize,
    rounds: usize,
}

fn args() -> Args {
    let mut a = Args {
        binary: "target/release/idemgate".into(),
        database: "postgres://postgres@127.0.0.1:5432/postgres".into(),
        redis: "redis://127.0.0.1:6379/15".into(),
        keys: 200,
        requests: 20_000,
        concurrency: 32,
        rounds: 2,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_default();
        match flag.as_str() {
            "--binary" => a.binary = value,
            "--database" => a.database = value,
            "--redis" => a.redis = value,
            "--keys" => a.keys = value.parse().expect("--keys N"),
            "--requests" => a.requests = value.parse().expect("--requests N"),
            "--concurrency" => a.concurrency = value.parse().expect("--concurrency N"),
            "--rounds" => a.rounds = value.parse().expect("--rounds N"),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

#[tokio::main]
async fn main() {
    let args = args();
    let upstream = start_upstream().await;
    let db = create_database(&args.database).await;
    // The bench's own Redis database starts empty: entries from an earlier
    // run name jobs of a database that no longer exists.
    flush_redis(&args.redis).await;

    let direct = format!("http://{upstream}");
    let without = Gateway::start(&args.binary, &direct, Store::Postgres(&db), None, &[]).await;
    let with = Gateway::start(
        &args.binary,
        &direct,
        Store::Postgres(&db),
        Some(&args.redis),
        &[],
    )
    .await;
    let scratch = std::env::temp_dir().join(format!("idemgate-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let embedded_file = scratch.join("bench.db");
    let embedded = Gateway::start(
        &args.binary,
        &direct,
        Store::Embedded(&embedded_file),
        None,
        &[],
    )
    .await;
    for g in [&without, &with, &embedded] {
        prime(&g.url, args.keys).await;
    }
    // Let the fast path fill: every key replayed once through it.
    run(&with.url, args.keys, args.keys, 4).await;

    let configs: [(&str, &str, bool); 4] = [
        ("upstream alone (no idemgate)", &direct, false),
        ("replay, PostgreSQL only", &without.url, true),
        ("replay, PostgreSQL + Redis", &with.url, true),
        ("replay, embedded store (SQLite)", &embedded.url, true),
    ];
    replay_table(&args, &configs).await;
    let redis_hits = with
        .metric("idemgate_fastpath_lookups_total{result=\"hit\"}")
        .await;
    println!();
    println!("fast-path hits on the Redis gateway: {redis_hits:.0}");

    // A streamed answer's first byte: what a keyed (recorded) stream adds
    // over a keyless one through the same gateway.
    let streams: [(&str, &str, bool); 4] = [
        ("upstream alone (no idemgate)", &direct, false),
        ("through idemgate, no key (pass-through)", &with.url, false),
        (
            "through idemgate, new key (PostgreSQL + Redis)",
            &with.url,
            true,
        ),
        (
            "through idemgate, new key (embedded store)",
            &embedded.url,
            true,
        ),
    ];
    stream_table(&args, &streams).await;
    drop((without, with, embedded));
    drop_database(&args.database, &db).await;
    let _ = std::fs::remove_dir_all(&scratch);
}

/// Empties the Redis database at `url`.
async fn flush_redis(url: &str) {
    let mut redis = redis::Client::open(url)
        .expect("Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("Redis is not reachable; run scripts/bench.sh, which starts it");
    redis::cmd("FLUSHDB")
        .query_async::<()>(&mut redis)
        .await
        .expect("flush the bench's Redis database");
}

/// The replay table: `args.rounds` rounds of replays through each of
/// `configs` (name, URL), alternating between them, and their means.
async fn replay_table(args: &Args, configs: &[(&str, &str, bool)]) {
    let mut results: Vec<Vec<Stats>> = vec![Vec::new(); configs.len()];
    for _ in 0..args.rounds {
        for (i, (_, url, _)) in configs.iter().enumerate() {
            results[i].push(run(url, args.keys, args.requests, args.concurrency).await);
        }
    }

    println!();
    println!(
        "replays of {} finished jobs, {} requests per round, {} connections, {} rounds (mean of rounds)",
        args.keys, args.requests, args.concurrency, args.rounds
    );
    println!();
    println!("| configuration | req/s | p50 ms | p90 ms | p99 ms | errors |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (i, (name, _, _)) in configs.iter().enumerate() {
        let n = results[i].len() as f64;
        let mean = |f: fn(&Stats) -> f64| results[i].iter().map(f).sum::<f64>() / n;
        println!(
            "| {name} | {:.0} | {:.2} | {:.2} | {:.2} | {} |",
            mean(|s| s.throughput),
            mean(|s| s.p50),
            mean(|s| s.p90),
            mean(|s| s.p99),
            results[i].iter().map(|s| s.errors).sum::<usize>(),
        );
    }
}

/// The first-byte table: `args.rounds` rounds of streams through each of
/// `streams` (name, URL, keyed), alternating between them.
async fn stream_table(args: &Args, streams: &[(&str, &str, bool)]) {
    let mut first_bytes: Vec<Vec<(Duration, Duration)>> = vec![Vec::new(); streams.len()];
    for round in 0..args.rounds {
        for (i, (_, url, keyed)) in streams.iter().enumerate() {
            first_bytes[i].extend(first_byte(url, *keyed, round, 200, 8).await);
        }
    }
    println!();
    println!(
        "a streamed answer (text/event-stream; the upstream sends its first event at once, its last 50 ms later), {} streams per row",
        first_bytes[0].len()
    );
    println!();
    println!("| path | first byte p50 ms | p90 ms | p99 ms | end p50 ms |");
    println!("|---|---:|---:|---:|---:|");
    for (i, (name, _, _)) in streams.iter().enumerate() {
        let pct = |which: fn(&(Duration, Duration)) -> Duration, p: f64| {
            let mut d: Vec<Duration> = first_bytes[i].iter().map(which).collect();
            d.sort();
            d.get(((d.len() as f64 * p) as usize).min(d.len().saturating_sub(1)))
                .map_or(0.0, |x| x.as_secs_f64() * 1000.0)
        };
        let first = |t: &(Duration, Duration)| t.0;
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.2} |",
            pct(first, 0.5),
            pct(first, 0.9),
            pct(first, 0.99),
            pct(|t| t.1, 0.5)
        );
    }
}

#[derive(Clone, Default)]
struct Stats {
    throughput: f64,
    p50: f64,
    p90: f64,
    p99: f64,
    errors: usize,
}

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build_http()
}

fn request(url: &str, key: usize) -> Request<Full<Bytes>> {
    Request::post(format!("{url}/v1/charges"))
        .header("idempotency-key", format!("bench-{key}"))
        .header("authorization", "Bearer bench-client")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"amount": 1000}"#)))
        .expect("request")
}

async fn prime(url: &str, keys: usize) {
    let c = client();
    for k in 0..keys {
        let r = c.request(request(url, k)).await.expect("prime");
        assert!(r.status().is_success(), "priming failed: {}", r.status());
        r.into_body().collect().await.expect("prime body");
    }
}

/// `requests` POSTs spread over `keys` keys by `concurrency` workers.
async fn run(url: &str, keys: usize, requests: usize, concurrency: usize) -> Stats {
    let c = client();
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (c, next, url) = (c.clone(), next.clone(), url.to_owned());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut errors = 0;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= requests {
                        return (latencies, errors);
                    }
                    let t = Instant::now();
                    match c.request(request(&url, i % keys)).await {
                        Ok(r) if r.status().is_success() => {
                            let _ = r.into_body().collect().await;
                            latencies.push(t.elapsed());
                        }
                        _ => errors += 1,
                    }
                }
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(requests);
    let mut errors = 0;
    for w in workers {
        let (l, e) = w.await.expect("worker");
        latencies.extend(l);
        errors += e;
    }
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort();
    let pct = |p: f64| {
        latencies
            .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    Stats {
        throughput: latencies.len() as f64 / elapsed,
        p50: pct(0.50),
        p90: pct(0.90),
        p99: pct(0.99),
        errors,
    }
}

/// Times the first body byte of `n` streams (new keys when `keyed`) over
/// `concurrency` workers.
async fn first_byte(
    url: &str,
    keyed: bool,
    round: usize,
    n: usize,
    concurrency: usize,
) -> Vec<(Duration, Duration)> {
    let c = client();
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (c, next, url) = (c.clone(), next.clone(), url.to_owned());
            tokio::spawn(async move {
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return out;
                    }
                    let mut req = Request::post(format!("{url}/v1/stream"))
                        .header("content-type", "application/json")
                        .header("authorization", "Bearer bench-client");
                    if keyed {
                        req = req.header("idempotency-key", format!("stream-{round}-{i}"));
                    }
                    let req = req
                        .body(Full::new(Bytes::from_static(b"{}")))
                        .expect("request");
                    let t = Instant::now();
                    let Ok(response) = c.request(req).await else {
                        continue;
                    };
                    let mut body = response.into_body();
                    let Some(Ok(_)) = body.frame().await else {
                        continue;
                    };
                    let first = t.elapsed();
                    while let Some(Ok(_)) = body.frame().await {}
                    out.push((first, t.elapsed()));
                }
            })
        })
        .collect();
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.expect("worker"));
    }
    all
}

/// A minimal upstream that answers every request at once; `/v1/stream`
/// answers an event stream whose first event comes at once and whose last
/// comes 50 ms later.
async fn start_upstream() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let counter = Arc::new(AtomicUsize::new(0));
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let counter = counter.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let n = counter.fetch_add(1, Ordering::Relaxed);
                    async move {
                        if req.uri().path() == "/v1/stream" {
                            let events = futures_util::stream::unfold(0, |i| async move {
                                match i {
                                    0 => Some((
                                        Ok::<_, std::convert::Infallible>(http_body::Frame::data(
                                            Bytes::from_static(b"data: {\"token\":\"first\"}\n\n"),
                                        )),
                                        1,
                                    )),
                                    1 => {
                                        tokio::time::sleep(Duration::from_millis(50)).await;
                                        Some((
                                            Ok(http_body::Frame::data(Bytes::from_static(
                                                b"data: [DONE]\n\n",
                                            ))),
                                            2,
                                        ))
                                    }
                                    _ => None,
                                }
                            });
                            return Ok::<_, std::convert::Infallible>(
                                Response::builder()
                                    .header("content-type", "text/event-stream")
                                    .body(http_body_util::BodyExt::boxed(
                                        http_body_util::StreamBody::new(events),
                                    ))
                                    .expect("response"),
                            );
                        }
                        Ok(Response::builder()
                            .header("content-type", "application/json")
                            .body(http_body_util::BodyExt::boxed(Full::new(Bytes::from(
                                format!(
                                    "{{\"charge\":{n},\"status\":\"succeeded\",\"amount\":1000}}"
                                ),
                            ))))
                            .expect("response"))
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}
