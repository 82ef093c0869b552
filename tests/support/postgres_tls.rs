//! A throwaway PostgreSQL that accepts TCP connections only over TLS
//! (`hostssl`; `hostnossl … reject`), with a certificate for localhost and
//! 127.0.0.1 from a CA the test makes. It is shared by the tests that run
//! at the same time (it costs seconds to start) and stopped when the last
//! of them ends; each test has a database of its own.

use std::path::PathBuf;
use std::sync::{Arc, Weak};

use super::pki::TestCa;
use super::postgres::{ServerTls, ThrowawayPostgres};
use super::{Gateway, TestStore};

/// The whole of the server's pg_hba.conf.
const HBA: &str = "\
# The test administers the server over its Unix socket only.
local all postgres trust
# certuser proves itself with a client certificate, or is refused.
hostssl all certuser 127.0.0.1/32 cert
hostssl all all 127.0.0.1/32 trust
hostnossl all all 0.0.0.0/0 reject
";

pub struct Server {
    pub pg: ThrowawayPostgres,
    /// Beside every gateway's config: ca.pem (the server's CA),
    /// other-ca.pem (a CA that signed nothing here), client.pem and
    /// client.key (certuser's).
    pub files: tempfile::TempDir,
    /// A folder holding ca.pem alone, for SSL_CERT_DIR.
    pub certs: tempfile::TempDir,
}

impl Server {
    async fn start() -> Server {
        let ca = TestCa::new("idemgate test CA");
        let leaf = ca.issue("postgres", &["localhost", "127.0.0.1"]);
        let client = ca.issue("certuser", &[]);
        let pg = ThrowawayPostgres::start_tls(
            &ServerTls {
                cert_pem: leaf.cert_pem,
                key_pem: leaf.key_pem,
                client_ca_pem: ca.pem(),
            },
            HBA,
        )
        .await;
        pg.socket_client()
            .await
            .batch_execute("CREATE ROLE certuser LOGIN")
            .await
            .unwrap();
        let files = tempfile::tempdir().unwrap();
        let dir = files.path();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.join("other-ca.pem"), TestCa::new("another CA").pem()).unwrap();
        std::fs::write(dir.join("client.pem"), client.cert_pem).unwrap();
        std::fs::write(dir.join("client.key"), client.key_pem).unwrap();
        let certs = tempfile::tempdir().unwrap();
        std::fs::write(certs.path().join("ca.pem"), ca.pem()).unwrap();
        Server { pg, files, certs }
    }

    /// A new database owned by `owner`; its name.
    pub async fn database(&self, owner: &str) -> String {
        let name = format!("tls_{}", uuid::Uuid::new_v4().simple());
        self.pg
            .socket_client()
            .await
            .batch_execute(&format!("CREATE DATABASE {name} OWNER {owner}"))
            .await
            .unwrap();
        name
    }

    /// `database_url` for `db` as `postgres` over TCP, with `query`.
    pub fn url(&self, db: &str, query: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{db}?{query}",
            self.pg.port
        )
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.files.path().join(name)
    }

    /// A gateway on `url`, with the certificate files beside its config.
    pub fn gateway(&self, url: &str, upstream: &str) -> super::gateway::Builder {
        Gateway::builder(&TestStore::external(url), upstream).files_from(self.files.path())
    }

    /// The sessions open on `db`, and how many of them are encrypted.
    pub async fn sessions(&self, db: &str) -> (i64, i64) {
        let row = self
            .pg
            .socket_client()
            .await
            .query_one(
                "SELECT count(*), count(*) FILTER (WHERE s.ssl) \
                 FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) WHERE a.datname = $1",
                &[&db],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    }
}

/// The server, started by the first test that asks while none runs.
pub async fn server() -> Arc<Server> {
    static SHARED: tokio::sync::Mutex<Weak<Server>> = tokio::sync::Mutex::const_new(Weak::new());
    let mut shared = SHARED.lock().await;
    if let Some(server) = shared.upgrade() {
        return server;
    }
    let server = Arc::new(Server::start().await);
    *shared = Arc::downgrade(&server);
    server
}
