//! Requests of the benchmark's own, outside the measured rounds: priming
//! keys, and emptying its Redis database.

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

pub async fn prime(url: &str, keys: usize) {
    for k in 0..keys {
        let status = send(url, Some(&format!("replay-{k}"))).await;
        assert_eq!(status, 200, "priming {url}");
    }
}

pub async fn send(url: &str, key: Option<&str>) -> u16 {
    let c = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut req = Request::post(format!("{url}/v1/charges"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer bench-client");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    let req = req
        .body(Full::new(Bytes::from_static(b"{\"amount\": 1000}")))
        .unwrap();
    match c.request(req).await {
        Ok(r) => {
            let status = r.status().as_u16();
            let _ = r.into_body().collect().await;
            status
        }
        Err(_) => 0,
    }
}

pub async fn flush_redis(url: &str) {
    let mut redis = redis::Client::open(url)
        .expect("Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("Redis is not reachable; run scripts/bench.sh, which starts it");
    redis::cmd("FLUSHDB")
        .query_async::<()>(&mut redis)
        .await
        .expect("flush");
}
