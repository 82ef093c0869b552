//! One PostgreSQL database per test, created on the shared server and
//! dropped afterwards, so tests run in parallel without seeing each other.

use tokio_postgres::NoTls;

/// The server tests create their databases on.
pub fn server_url() -> String {
    std::env::var("IDEMGATE_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

pub struct TestDb {
    pub name: String,
    pub url: String,
}

impl TestDb {
    pub async fn new() -> TestDb {
        let name = format!("idemgate_test_{}", uuid::Uuid::new_v4().simple());
        let (client, conn) = tokio_postgres::connect(&server_url(), NoTls).await.expect(
            "the test PostgreSQL server is not reachable; run scripts/test.sh, which starts it",
        );
        tokio::spawn(conn);
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("create test database");
        let mut config: tokio_postgres::Config = server_url().parse().unwrap();
        config.dbname(&name);
        let url = format!(
            "postgres://{}@{}:{}/{}",
            config.get_user().unwrap_or("postgres"),
            host(&config),
            config.get_ports().first().copied().unwrap_or(5432),
            name
        );
        TestDb { name, url }
    }

    /// A plain connection, for assertions on stored rows.
    pub async fn connect(&self) -> tokio_postgres::Client {
        let (client, conn) = tokio_postgres::connect(&self.url, NoTls).await.unwrap();
        tokio::spawn(conn);
        client
    }
}

fn host(config: &tokio_postgres::Config) -> String {
    match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".into(),
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop runs inside a runtime; do the async work on a thread of its own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok((client, conn)) = tokio_postgres::connect(&server_url(), NoTls).await {
                    tokio::spawn(conn);
                    let _ = client
                        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .await;
                }
            });
        })
        .join();
    }
}
