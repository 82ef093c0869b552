//! `https://` upstreams: verified against the web PKI plus a configured CA;
//! a failed handshake is a safe failure (nothing was sent).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::Response;
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;

use crate::support::{post, Gateway, TestStore};

struct TlsUpstream {
    addr: SocketAddr,
    ca_pem: String,
    hits: Arc<AtomicUsize>,
}

/// An HTTPS upstream with a self-signed certificate for 127.0.0.1.
async fn tls_upstream() -> TlsUpstream {
    let certified = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(certified.key_pair.serialize_der()));
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![certified.cert.der().clone()], key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let counter = counter.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(stream).await else {
                    return;
                };
                let svc = hyper::service::service_fn(move |_req| {
                    let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                    async move {
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(format!(
                            "{{\"over\":\"tls\",\"hit\":{n}}}"
                        )))))
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    TlsUpstream {
        addr,
        ca_pem: certified.cert.pem(),
        hits,
    }
}

#[tokio::test]
async fn https_upstreams_are_verified_against_the_configured_ca() {
    let store = TestStore::embedded();
    let upstream = tls_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ca.pem"), &upstream.ca_pem).unwrap();
    let table = format!(
        "[[upstreams]]\nurl = \"https://{}\"\nca_file = \"ca.pem\"\n",
        upstream.addr
    );
    let gateway = Gateway::builder(&store, "http://unused")
        .unset("upstreams")
        .files_from(dir.path())
        .tables(&table)
        .start()
        .await;
    let first = post(&gateway.path("/v1/x"), "tls-1", "{}").await;
    assert_eq!(first.status, 200);
    assert_eq!(first.json()["over"], "tls");
    let replay = post(&gateway.path("/v1/x"), "tls-1", "{}").await;
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_untrusted_certificate_is_a_safe_failure() {
    let store = TestStore::embedded();
    let upstream = tls_upstream().await;
    let gateway = Gateway::builder(&store, &format!("https://{}", upstream.addr))
        .start()
        .await;
    let reply = post(&gateway.path("/v1/x"), "tls-untrusted", "{}").await;
    assert_eq!(reply.status, 502);
    assert_eq!(reply.problem(), "upstream-unreachable");
    let job = gateway.job(&reply.job().unwrap()).await;
    assert_eq!(
        job["state"], "open",
        "the handshake failed before anything was sent"
    );
    assert_eq!(job["attempts"][0]["state"], "failed");
    assert_eq!(upstream.hits.load(Ordering::SeqCst), 0);

    let err = Gateway::builder(&store, "http://unused")
        .unset("upstreams")
        .tables("[[upstreams]]\nurl = \"https://127.0.0.1:1\"\nca_file = \"missing.pem\"\n")
        .start_and_fail()
        .await;
    assert!(err.contains("upstreams[0].ca_file"), "{err}");
}
