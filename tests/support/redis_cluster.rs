//! Throwaway Redis deployments on free loopback ports: a six-node Redis
//! Cluster (three masters, one replica each) joined with `redis-cli --cluster
//! create`, and a master with a replica watched by Sentinel. Each node runs
//! from a temporary directory and is killed with the value.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

use super::eventually;
use super::redis::free_port;

/// One `redis-server` of a throwaway deployment.
pub struct Node {
    pub port: u16,
    child: Option<Child>,
    access: Access,
}

/// How the test itself talks to a node: in the clear, or (`redis_tls.rs`)
/// over TLS with the test's certificates, as an ACL user.
#[derive(Clone, Default)]
pub struct Access {
    pub tls: Option<redis::TlsCertificates>,
    pub user: Option<(String, String)>,
}

impl Access {
    fn client(&self, addr: &str) -> redis::RedisResult<redis::Client> {
        let auth = match &self.user {
            Some((user, password)) => format!("{user}:{password}@"),
            None => String::new(),
        };
        match &self.tls {
            None => redis::Client::open(format!("redis://{auth}{addr}")),
            Some(certs) => {
                redis::Client::build_with_tls(format!("rediss://{auth}{addr}"), certs.clone())
            }
        }
    }
}

impl Node {
    async fn spawn(port: u16, dir: &PathBuf, extra: &[&str]) -> Node {
        Self::spawn_with(port, dir, extra, Access::default()).await
    }

    /// A node started with `extra` arguments (which may turn the plain
    /// port off for TLS: later arguments win), reached as `access` says.
    pub async fn spawn_with(port: u16, dir: &PathBuf, extra: &[&str], access: Access) -> Node {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            // Replicas sync at once (the default waits 5 s for company).
            .args(["--repl-diskless-sync-delay", "0"])
            .arg("--dir")
            .arg(dir)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("redis-server is not installed; scripts/test.sh installs it");
        let node = Node {
            port,
            child: Some(child),
            access,
        };
        eventually(
            Duration::from_secs(10),
            "a throwaway redis-server to answer",
            || async { node.query::<String>(&["PING"]).await.is_ok() },
        )
        .await;
        node
    }

    /// A node the caller started itself (a sentinel).
    pub fn running(port: u16, child: Child, access: Access) -> Node {
        Node {
            port,
            child: Some(child),
            access,
        }
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Kills the node at once (SIGKILL), as a crashed machine would vanish.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    pub fn alive(&self) -> bool {
        self.child.is_some()
    }

    /// One command on this node alone.
    pub async fn query<T: redis::FromRedisValue>(&self, args: &[&str]) -> redis::RedisResult<T> {
        let client = self.access.client(&self.addr())?;
        let mut conn = tokio::time::timeout(
            Duration::from_secs(2),
            client.get_multiplexed_async_connection(),
        )
        .await
        .map_err(|_| redis::RedisError::from((redis::ErrorKind::Io, "timed out")))??;
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        cmd.query_async(&mut conn).await
    }
}

/// A port whose neighbour 10,000 above is free too (a cluster node's bus).
pub async fn cluster_port() -> u16 {
    loop {
        let port = free_port().await;
        if port < 22_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// Three masters and three replicas, joined.
pub struct ThrowawayCluster {
    pub nodes: Vec<Node>,
    _dir: tempfile::TempDir,
}

impl ThrowawayCluster {
    /// Six ports a cluster can be started on later.
    pub async fn ports() -> Vec<u16> {
        let mut ports = Vec::new();
        while ports.len() < 6 {
            let port = cluster_port().await;
            if !ports.contains(&port) {
                ports.push(port);
            }
        }
        ports
    }

    /// `redis+cluster://` naming these ports as seeds.
    pub fn url_of(ports: &[u16]) -> String {
        let seeds: Vec<_> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        format!("redis+cluster://{}", seeds.join(","))
    }

    pub async fn start() -> ThrowawayCluster {
        Self::start_on(Self::ports().await).await
    }

    pub async fn start_on(ports: Vec<u16>) -> ThrowawayCluster {
        let dir = tempfile::tempdir().unwrap();
        let mut nodes = Vec::new();
        for port in ports {
            let own = dir.path().join(port.to_string());
            std::fs::create_dir_all(&own).unwrap();
            nodes.push(
                Node::spawn(
                    port,
                    &own,
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        // Failover within about two seconds of a master's death.
                        "--cluster-node-timeout",
                        "1000",
                    ],
                )
                .await,
            );
        }
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(nodes.iter().map(Node::addr))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .await
            .expect("redis-cli is not installed; scripts/test.sh installs redis-server");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = ThrowawayCluster { nodes, _dir: dir };
        cluster.wait_ok().await;
        cluster
    }

    /// `redis+cluster://` with every node as a seed.
    pub fn url(&self) -> String {
        let seeds: Vec<_> = self.nodes.iter().map(Node::addr).collect();
        format!("redis+cluster://{}", seeds.join(","))
    }

    /// Until every living node says the cluster is whole and every slot
    /// is served by a living master, and every replica is in sync (a
    /// replica that never synced is not eligible to take over).
    pub async fn wait_ok(&self) {
        eventually(Duration::from_secs(30), "the cluster to be ok", || async {
            for node in self.nodes.iter().filter(|n| n.alive()) {
                let info: String = match node.query(&["CLUSTER", "INFO"]).await {
                    Ok(info) => info,
                    Err(_) => return false,
                };
                if !info.contains("cluster_state:ok") {
                    return false;
                }
            }
            true
        })
        .await;
        eventually(Duration::from_secs(30), "the replicas to sync", || async {
            for node in self.nodes.iter().filter(|n| n.alive()) {
                let info: String = match node.query(&["INFO", "replication"]).await {
                    Ok(info) => info,
                    Err(_) => return false,
                };
                if info.contains("role:slave") && !info.contains("master_link_status:up") {
                    return false;
                }
            }
            true
        })
        .await;
    }

    fn any(&self) -> &Node {
        self.nodes
            .iter()
            .find(|n| n.alive())
            .expect("a living node")
    }

    /// The slot of a key, as the cluster computes it.
    pub async fn slot(&self, key: &str) -> i64 {
        self.any()
            .query(&["CLUSTER", "KEYSLOT", key])
            .await
            .unwrap()
    }

    /// The index of the master serving `slot` now.
    pub async fn master_of(&self, slot: i64) -> usize {
        let nodes: String = self.any().query(&["CLUSTER", "NODES"]).await.unwrap();
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            if !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            let port: u16 = fields[1]
                .split(['@', ':'])
                .nth(1)
                .and_then(|p| p.parse().ok())
                .unwrap();
            let serves = fields[8..].iter().any(|range| {
                let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                match (lo.parse::<i64>(), hi.parse::<i64>()) {
                    (Ok(lo), Ok(hi)) => (lo..=hi).contains(&slot),
                    _ => false,
                }
            });
            if serves {
                return self.nodes.iter().position(|n| n.port == port).unwrap();
            }
        }
        panic!("no master serves slot {slot}:\n{nodes}");
    }

    /// `GET` through the cluster, following redirections.
    pub async fn get(&self, key: &str) -> Option<Vec<u8>> {
        let seeds: Vec<_> = self
            .nodes
            .iter()
            .filter(|n| n.alive())
            .map(|n| format!("redis://{}", n.addr()))
            .collect();
        let client = redis::cluster::ClusterClient::new(seeds).unwrap();
        let mut conn = client.get_async_connection().await.ok()?;
        redis::cmd("GET")
            .arg(key)
            .query_async(&mut conn)
            .await
            .ok()?
    }
}

/// A master, its replica and one sentinel watching them as `mymaster`.
pub struct ThrowawaySentinel {
    pub master: Node,
    pub replica: Node,
    pub sentinel: Node,
    _dir: tempfile::TempDir,
}

impl ThrowawaySentinel {
    pub async fn start() -> ThrowawaySentinel {
        let dir = tempfile::tempdir().unwrap();
        let master = Node::spawn(free_port().await, &dir.path().to_path_buf(), &[]).await;
        let replica_dir = dir.path().join("replica");
        std::fs::create_dir_all(&replica_dir).unwrap();
        let master_port = master.port.to_string();
        let replica = Node::spawn(
            free_port().await,
            &replica_dir,
            &["--replicaof", "127.0.0.1", &master_port],
        )
        .await;
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "sentinel monitor mymaster 127.0.0.1 {master_port} 1\n\
                 sentinel down-after-milliseconds mymaster 1000\n\
                 sentinel failover-timeout mymaster 5000\n"
            ),
        )
        .unwrap();
        let port = free_port().await;
        let child = Command::new("redis-server")
            .arg(&conf)
            .args([
                "--sentinel",
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("redis-server is not installed");
        let sentinel = Node::running(port, child, Access::default());
        eventually(Duration::from_secs(15), "the replica to sync", || async {
            replica
                .query::<String>(&["INFO", "replication"])
                .await
                .is_ok_and(|i| i.contains("master_link_status:up"))
        })
        .await;
        eventually(
            Duration::from_secs(15),
            "the sentinel to see the replica",
            || async {
                sentinel
                    .query::<Vec<redis::Value>>(&["SENTINEL", "REPLICAS", "mymaster"])
                    .await
                    .is_ok_and(|r| !r.is_empty())
            },
        )
        .await;
        ThrowawaySentinel {
            master,
            replica,
            sentinel,
            _dir: dir,
        }
    }

    pub fn url(&self) -> String {
        format!("redis+sentinel://{}/mymaster", self.sentinel.addr())
    }

    /// The port of the master Sentinel names now.
    pub async fn master_port(&self) -> u16 {
        let addr: Vec<String> = self
            .sentinel
            .query(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster"])
            .await
            .unwrap();
        addr[1].parse().unwrap()
    }
}
