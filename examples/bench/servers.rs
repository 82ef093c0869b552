//! The reference servers: nginx (the fixed-answer upstream every row
//! loads, and the reference proxy) and the floor example, each on a free
//! port and stopped when dropped.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

/// An nginx of the bench's own, in a folder of its own, on a free port.
pub struct Nginx {
    pub url: String,
    child: Child,
}

/// The floor example serving on a free port, killed when dropped.
pub struct Floor {
    pub url: String,
    pub pid: u32,
    _child: Child,
}

impl Floor {
    pub async fn start(binary: &str, mode: &str, upstream: &str) -> Floor {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let child = Command::new(binary)
            .args([mode, &addr.to_string(), upstream])
            .kill_on_drop(true)
            .spawn()
            .expect("start the floor example (scripts/bench.sh builds it)");
        for _ in 0..200 {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        Floor {
            url: format!("http://{addr}"),
            pid: child.id().unwrap_or(0),
            _child: child,
        }
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // A fast shutdown of the master takes its workers with it (a kill
        // would orphan them).
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
    }
}

impl Nginx {
    pub async fn upstream(dir: &Path) -> Nginx {
        Self::start(
            dir,
            "location / { default_type application/json; return 200 '{\"charge\":1,\"status\":\"succeeded\",\"amount\":1000}'; }",
            "",
        )
        .await
    }

    /// An upstream that answers every request `503`: the failover row's
    /// primary, so every key's first attempt fails and the next runs on
    /// the fixed-answer upstream.
    pub async fn busy(dir: &Path) -> Nginx {
        Self::start(
            dir,
            "location / { default_type application/json; return 503 '{\"error\":\"busy\"}'; }",
            "",
        )
        .await
    }

    pub async fn proxy(dir: &Path, upstream: &str) -> Nginx {
        Self::start(
            dir,
            "location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection \"\"; }",
            &format!(
                "upstream backend {{ server {}; keepalive 64; }}",
                upstream.trim_start_matches("http://")
            ),
        )
        .await
    }

    async fn start(dir: &Path, location: &str, http_extra: &str) -> Nginx {
        std::fs::create_dir_all(dir.join("logs")).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let conf = format!(
            "daemon off; worker_processes 1; pid {dir}/nginx.pid; error_log {dir}/logs/error.log warn;\n\
             events {{ worker_connections 20000; }}\n\
             http {{ access_log off; keepalive_requests 1000000; client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy;\n\
             {http_extra}\n\
             server {{ listen 127.0.0.1:{port}; {location} }} }}\n",
            dir = dir.display()
        );
        let path = dir.join("nginx.conf");
        std::fs::write(&path, conf).unwrap();
        let child = Command::new("nginx")
            .arg("-c")
            .arg(&path)
            .arg("-p")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nginx is not installed; run scripts/bench.sh, which installs it");
        let url = format!("http://127.0.0.1:{port}");
        for _ in 0..200 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        Nginx { url, child }
    }

    /// The master and its worker.
    pub fn pids(&self) -> Vec<u32> {
        let master = self.child.id().unwrap_or(0);
        let mut pids = vec![master];
        if let Ok(children) =
            std::fs::read_to_string(format!("/proc/{master}/task/{master}/children"))
        {
            pids.extend(
                children
                    .split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
        pids
    }
}
