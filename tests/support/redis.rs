//! A throwaway Redis server on a free port, for tests that stop, restart or
//! flush it (never the shared one on 6379).

use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

pub struct ThrowawayRedis {
    pub port: u16,
    child: Option<Child>,
}

impl ThrowawayRedis {
    pub async fn start() -> ThrowawayRedis {
        Self::start_on(free_port().await).await
    }

    pub async fn start_on(port: u16) -> ThrowawayRedis {
        let mut redis = ThrowawayRedis { port, child: None };
        redis.restart().await;
        redis
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the server on its port and waits until it answers.
    pub async fn restart(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("redis-server is not installed; scripts/test.sh installs it");
        self.child = Some(child);
        for _ in 0..200 {
            if self.ping().await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("redis-server did not come up on port {}", self.port);
    }

    /// Kills the server at once (SIGKILL).
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    async fn connection(&self) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
        redis::Client::open(self.url())?
            .get_multiplexed_async_connection()
            .await
    }

    async fn ping(&self) -> bool {
        match self.connection().await {
            Ok(mut c) => redis::cmd("PING")
                .query_async::<String>(&mut c)
                .await
                .is_ok(),
            Err(_) => false,
        }
    }

    pub async fn get(&self, key: &str) -> Option<Vec<u8>> {
        let mut c = self.connection().await.unwrap();
        redis::cmd("GET")
            .arg(key)
            .query_async(&mut c)
            .await
            .unwrap()
    }

    pub async fn set(&self, key: &str, value: &[u8]) {
        let mut c = self.connection().await.unwrap();
        redis::cmd("SET")
            .arg(key)
            .arg(value)
            .query_async::<()>(&mut c)
            .await
            .unwrap();
    }

    pub async fn flush(&self) {
        let mut c = self.connection().await.unwrap();
        redis::cmd("FLUSHALL")
            .query_async::<()>(&mut c)
            .await
            .unwrap();
    }
}

/// A port nothing listens on, for a server the test starts (or leaves
/// down) later. Picked below the kernel's ephemeral range (32768 and up), so
/// that neither an OS-assigned listener nor the local end of an outgoing
/// connection can take it in the meantime; and never handed out twice in
/// one test process, so two servers not yet started (a pod's two ports,
/// two tests' servers) cannot be given the same one (seen once in CI: a
/// pod's admin port was its own HTTP port).
pub async fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let candidate = 20_000 + (uuid::Uuid::new_v4().as_u128() % 12_000) as u16;
        if tokio::net::TcpListener::bind(("127.0.0.1", candidate))
            .await
            .is_err()
        {
            continue;
        }
        let mut given = GIVEN.lock().unwrap();
        if !given.contains(&candidate) {
            given.push(candidate);
            return candidate;
        }
    }
}
