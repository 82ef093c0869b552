//! The floor under the pass-through path: the gateway's own listener
//! (`server::serve`) and upstream pool (`Upstreams`) with none of the Tower
//! layers between them, on a runtime of the shape asked for. What idemgate
//! costs per passed-through request above this is its layers'; what this
//! costs above nginx is the stack's.
//!
//! `floor MODE LISTEN UPSTREAM`, MODE one of `mt2` (multi-thread, two
//! workers), `mt1` (multi-thread, one worker), `ct` (one current-thread
//! runtime) and `ct-per-core` (a current-thread runtime per core, each with
//! its own listener on one port by `SO_REUSEPORT` and its own pool).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use http::Request;
use http_body_util::BodyExt;
use hyper::body::Incoming;

use idemgate::config::{Flags, Settings};
use idemgate_proxy::http::BodyError;
use idemgate_proxy::server::{self, Limits};
use idemgate_proxy::upstream::Upstreams;
use tower::{Service, ServiceExt};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, mode, listen, upstream] = &args[..] else {
        eprintln!("usage: floor mt2|mt1|ct|ct-per-core LISTEN UPSTREAM");
        std::process::exit(2);
    };
    let listen: SocketAddr = listen.parse().expect("LISTEN is an address");
    let file = Settings::parse_file(&format!(
        "[[upstreams]]\nname = \"floor\"\nurl = \"{upstream}\"\n"
    ))
    .expect("a valid configuration");
    let settings = Settings::from_sources(file, Flags::default()).expect("valid settings");
    let threads = match mode.as_str() {
        "mt2" | "mt1" => {
            let workers = if mode == "mt2" { 2 } else { 1 };
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(workers)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(serve(&settings, listen, false));
            return;
        }
        "ct" => 1,
        "ct-per-core" => std::thread::available_parallelism().map_or(1, |n| n.get()),
        other => panic!("unknown mode {other}"),
    };
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let settings = settings.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(serve(&settings, listen, threads > 1));
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

async fn serve(settings: &Settings, listen: SocketAddr, reuse_port: bool) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_reuseaddr(true).unwrap();
    if reuse_port {
        socket.set_reuseport(true).unwrap();
    }
    socket.bind(listen).unwrap();
    let listener = socket.listen(1024).unwrap();
    let upstreams = Upstreams::new(&settings.upstreams).expect("one upstream");
    let service = tower::service_fn(move |req: Request<Incoming>| {
        let req = req.map(|b| b.map_err(BodyError::new).boxed());
        let mut upstreams = upstreams.clone();
        async move {
            let response = match upstreams.ready().await {
                Ok(u) => u.call(req).await,
                Err(e) => Err(e),
            };
            Ok::<_, Infallible>(response.unwrap_or_else(|e| {
                http::Response::builder()
                    .status(502)
                    .body(
                        http_body_util::Full::new(bytes::Bytes::from(e.to_string()))
                            .map_err(|never| match never {})
                            .boxed(),
                    )
                    .unwrap()
            }))
        }
    });
    let limits = Limits {
        max_connections: 10_000,
        header_read_timeout: Duration::from_secs(30),
        keepalive_timeout: Duration::from_secs(75),
        max_header_size: 16 * 1024,
        body_read_timeout: Duration::from_secs(30),
        body_min_rate: 0,
        http2_keepalive_interval: None,
        http2_keepalive_timeout: Duration::from_secs(20),
        http2_idle_timeout: None,
        send_timeout: Duration::from_secs(60),
    };
    let accept = server::Accept {
        counted: false,
        listener,
        elsewhere: Vec::new(),
    };
    server::serve(
        accept,
        service,
        tokio_util::sync::CancellationToken::new(),
        Duration::ZERO,
        limits,
        Default::default(),
    )
    .await;
}
