//! The store a test's gateways run on: a fresh PostgreSQL database, or a
//! fresh embedded (SQLite) file. Tests that make sense on both are written
//! once, taking a `TestStore`, and instantiated for each by
//! `on_each_deployment!([embedded, postgres] …)`.

use super::TestDb;

pub enum TestStore {
    Postgres(TestDb),
    Embedded(tempfile::TempDir),
    /// A database the test owns itself (a throwaway server, an unreachable
    /// address): only its URL is known here.
    External(String),
}

impl TestStore {
    pub async fn postgres() -> TestStore {
        TestStore::Postgres(TestDb::new().await)
    }

    pub fn external(url: impl Into<String>) -> TestStore {
        TestStore::External(url.into())
    }

    pub fn embedded() -> TestStore {
        TestStore::Embedded(tempfile::tempdir().unwrap())
    }

    /// The config key and TOML value that point a gateway at this store.
    pub fn setting(&self) -> (&'static str, String) {
        match self {
            TestStore::Postgres(db) => ("database_url", format!("{:?}", db.url)),
            TestStore::Embedded(dir) => ("embedded_path", format!("{:?}", self.embedded_file(dir))),
            TestStore::External(url) => ("database_url", format!("{url:?}")),
        }
    }

    fn embedded_file(&self, dir: &tempfile::TempDir) -> String {
        dir.path().join("idemgate.db").display().to_string()
    }

    /// Runs a query returning one column of text (or a count as text),
    /// straight against the stored rows.
    pub async fn column(&self, sql: &str) -> Vec<String> {
        match self {
            TestStore::Postgres(db) => db
                .connect()
                .await
                .query(sql, &[])
                .await
                .unwrap()
                .iter()
                .map(|r| {
                    r.try_get::<_, String>(0)
                        .unwrap_or_else(|_| r.get::<_, i64>(0).to_string())
                })
                .collect(),
            TestStore::Embedded(dir) => {
                let path = self.embedded_file(dir);
                let sql = sql.to_owned();
                tokio::task::spawn_blocking(move || {
                    let conn = rusqlite::Connection::open(path).unwrap();
                    let mut stmt = conn.prepare(&sql).unwrap();
                    stmt.query_map([], |r| {
                        Ok(match r.get_ref(0)? {
                            rusqlite::types::ValueRef::Integer(i) => i.to_string(),
                            other => other.as_str().unwrap_or_default().to_owned(),
                        })
                    })
                    .unwrap()
                    .map(Result::unwrap)
                    .collect()
                })
                .await
                .unwrap()
            }
            TestStore::External(_) => {
                panic!("an external store's rows are the test's own business")
            }
        }
    }

    /// Runs a statement straight against the stored rows.
    pub async fn execute(&self, sql: &str) {
        match self {
            TestStore::Postgres(db) => {
                db.connect().await.batch_execute(sql).await.unwrap();
            }
            TestStore::Embedded(dir) => {
                let (path, sql) = (self.embedded_file(dir), sql.to_owned());
                tokio::task::spawn_blocking(move || {
                    rusqlite::Connection::open(path)
                        .unwrap()
                        .execute_batch(&sql)
                        .unwrap()
                })
                .await
                .unwrap();
            }
            TestStore::External(_) => {
                panic!("an external store's rows are the test's own business")
            }
        }
    }

    pub async fn job_count(&self) -> i64 {
        self.column("SELECT count(*) FROM jobs").await[0]
            .parse()
            .unwrap()
    }
}
