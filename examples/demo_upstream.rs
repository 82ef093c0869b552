//! A stand-in for a slow, side-effecting API, for the README's quick start.
//!
//! Every POST "charges" once: it takes a while (2 s, or `DEMO_DELAY_MS`),
//! then answers with the charge number and the identity headers idemgate
//! forwarded. `GET /calls` tells how many charges were made.
//!
//! ```sh
//! cargo run --release --example demo_upstream   # listens on 127.0.0.1:8000
//! ```

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let addr = std::env::var("DEMO_LISTEN").unwrap_or_else(|_| "127.0.0.1:8000".into());
    let delay = Duration::from_millis(
        std::env::var("DEMO_DELAY_MS")
            .ok()
            .and_then(|d| d.parse().ok())
            .unwrap_or(2000),
    );
    let listener = TcpListener::bind(&addr).await?;
    println!("demo upstream on http://{addr}: every POST is one charge ({delay:?} each)");
    let charges = Arc::new(AtomicU64::new(0));
    loop {
        let (stream, _) = listener.accept().await?;
        let charges = charges.clone();
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |req| answer(req, charges.clone(), delay));
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn answer(
    req: Request<Incoming>,
    charges: Arc<AtomicU64>,
    delay: Duration,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let body = if req.method() == Method::POST {
        let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
        println!(
            "charge #{n} (idempotency-key: {:?})",
            header("idempotency-key")
        );
        tokio::time::sleep(delay).await;
        serde_json::json!({
            "charge": n,
            "idempotency_key": header("idempotency-key"),
            "attempt": header("idempotency-attempt"),
        })
    } else {
        serde_json::json!({"charges": charges.load(Ordering::SeqCst)})
    };
    Ok(Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string() + "\n")))
        .expect("static response"))
}
