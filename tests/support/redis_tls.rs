//! Redis over TLS, made by the test: a PKI from rcgen (a CA, a server
//! certificate for localhost and 127.0.0.1, a client certificate, and a CA
//! that signed none of them), and throwaway `redis-server`s that speak
//! only TLS (`--port 0 --tls-port N`) and know one ACL user, `alice`, with
//! the default user off: one node, a cluster of three masters
//! (`--tls-cluster yes`), and a master watched by a sentinel that also
//! speaks only TLS.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

use super::eventually;
use super::redis::free_port;
use super::redis_cluster::{cluster_port, Access, Node};

pub const USER: &str = "alice";
pub const PASSWORD: &str = "alice-pw";

/// The certificates, as PEM files in a folder of their own.
pub struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    pub fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, pem: String| std::fs::write(dir.path().join(name), pem).unwrap();
        let (ca, ca_key) = authority("idemgate test CA");
        let (other, _) = authority("a CA that signed nothing here");
        let issue = |names: &[&str], file: &str| {
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = rcgen::CertificateParams::new(
                names.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
            )
            .unwrap()
            .signed_by(&key, &ca, &ca_key)
            .unwrap();
            write(&format!("{file}.pem"), cert.pem());
            write(&format!("{file}.key"), key.serialize_pem());
        };
        issue(&["localhost", "127.0.0.1"], "server");
        issue(&["idemgate"], "client");
        write("ca.pem", ca.pem());
        write("other-ca.pem", other.pem());
        Pki { dir }
    }

    /// The folder: `ca.pem`, `other-ca.pem`, `server.pem`/`.key`,
    /// `client.pem`/`.key` (for `Builder::files_from`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// How the test reaches a node: trusting the CA, showing the client
    /// certificate (servers that ask for one get it), as alice.
    pub fn access(&self) -> Access {
        let read = |name: &str| std::fs::read(self.path(name)).unwrap();
        Access {
            tls: Some(redis::TlsCertificates {
                client_tls: Some(redis::ClientTlsConfig {
                    client_cert: read("client.pem"),
                    client_key: read("client.key"),
                }),
                root_cert: Some(read("ca.pem")),
            }),
            user: Some((USER.to_owned(), PASSWORD.to_owned())),
        }
    }

    /// The server side of TLS, for `redis-server` (the certificate is also
    /// what a node shows when it connects to another: cluster bus,
    /// replication, a sentinel watching a master).
    fn server_args(&self, port: u16, auth_clients: &str) -> Vec<String> {
        let path = |name: &str| self.path(name).display().to_string();
        [
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--tls-cert-file",
            &path("server.pem"),
            "--tls-key-file",
            &path("server.key"),
            "--tls-ca-cert-file",
            &path("ca.pem"),
            "--tls-auth-clients",
            auth_clients,
        ]
        .map(str::to_owned)
        .to_vec()
    }
}

/// A CA certificate and its key.
fn authority(name: &str) -> (rcgen::Certificate, rcgen::KeyPair) {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    (params.self_signed(&key).unwrap(), key)
}

/// alice may do anything; nobody else may do anything.
const ACL: [&str; 10] = [
    "--user",
    USER,
    "on",
    ">alice-pw",
    "~*",
    "&*",
    "+@all",
    "--user",
    "default",
    "off",
];

/// One TLS-only node. `auth_clients`: `optional` (a client certificate is
/// checked when shown) or `yes` (one is required).
pub async fn node(pki: &Pki, dir: &Path, auth_clients: &str) -> Node {
    let port = free_port().await;
    let mut args = pki.server_args(port, auth_clients);
    args.extend(ACL.map(str::to_owned));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Node::spawn_with(port, &dir.to_path_buf(), &args, pki.access()).await
}

/// The number of keys a node holds.
pub async fn keys(node: &Node) -> i64 {
    node.query(&["DBSIZE"]).await.unwrap()
}

/// How many subscribers a node has on the announcement channel.
pub async fn subscribers(node: &Node) -> i64 {
    let numsub: (String, i64) = node
        .query(&["PUBSUB", "NUMSUB", "idemgate:jobs"])
        .await
        .unwrap();
    numsub.1
}

/// Three TLS-only masters, joined into a cluster whose bus is TLS too.
pub struct TlsCluster {
    pub nodes: Vec<Node>,
    _dir: tempfile::TempDir,
}

impl TlsCluster {
    pub async fn start(pki: &Pki) -> TlsCluster {
        let dir = tempfile::tempdir().unwrap();
        let mut nodes = Vec::new();
        while nodes.len() < 3 {
            let port = cluster_port().await;
            if nodes.iter().any(|n: &Node| n.port == port) {
                continue;
            }
            let own = dir.path().join(port.to_string());
            std::fs::create_dir_all(&own).unwrap();
            let mut args = pki.server_args(port, "optional");
            args.extend(ACL.map(str::to_owned));
            args.extend(
                [
                    "--tls-cluster",
                    "yes",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                ]
                .map(str::to_owned),
            );
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            nodes.push(Node::spawn_with(port, &own, &args, pki.access()).await);
        }
        let out = Command::new("redis-cli")
            .args(["--tls", "--cacert"])
            .arg(pki.path("ca.pem"))
            .arg("--cert")
            .arg(pki.path("client.pem"))
            .arg("--key")
            .arg(pki.path("client.key"))
            .args(["--user", USER, "--pass", PASSWORD, "--no-auth-warning"])
            .args(["--cluster", "create"])
            .args(nodes.iter().map(Node::addr))
            .args(["--cluster-yes"])
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(20), out)
            .await
            .expect("redis-cli --cluster create did not finish within 20 s")
            .expect("redis-cli is not installed; scripts/test.sh installs redis-server");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = TlsCluster { nodes, _dir: dir };
        eventually(
            Duration::from_secs(20),
            "the TLS cluster to be ok",
            || async {
                for node in &cluster.nodes {
                    let info: String = match node.query(&["CLUSTER", "INFO"]).await {
                        Ok(info) => info,
                        Err(_) => return false,
                    };
                    if !info.contains("cluster_state:ok") {
                        return false;
                    }
                }
                true
            },
        )
        .await;
        cluster
    }

    /// `rediss+cluster://alice:…@` every node.
    pub fn url(&self) -> String {
        let seeds: Vec<_> = self.nodes.iter().map(Node::addr).collect();
        format!("rediss+cluster://{USER}:{PASSWORD}@{}", seeds.join(","))
    }
}

/// A TLS-only master and a TLS-only sentinel watching it as `mymaster`,
/// reaching it over TLS as alice.
pub struct TlsSentinel {
    pub master: Node,
    pub sentinel: Node,
    _dir: tempfile::TempDir,
}

impl TlsSentinel {
    pub async fn start(pki: &Pki) -> TlsSentinel {
        let dir = tempfile::tempdir().unwrap();
        let master = node(pki, dir.path(), "optional").await;
        let port = free_port().await;
        let path = |name: &str| pki.path(name).display().to_string();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port 0\ntls-port {port}\nbind 127.0.0.1\n\
                 tls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\n\
                 tls-auth-clients optional\ntls-replication yes\n\
                 sentinel monitor mymaster 127.0.0.1 {} 1\n\
                 sentinel auth-user mymaster {USER}\nsentinel auth-pass mymaster {PASSWORD}\n\
                 sentinel down-after-milliseconds mymaster 1000\n",
                path("server.pem"),
                path("server.key"),
                path("ca.pem"),
                master.port
            ),
        )
        .unwrap();
        let child = Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("redis-server is not installed");
        // The sentinel has no ACL of its own: the test reaches it over TLS
        // as the default user.
        let access = Access {
            user: None,
            ..pki.access()
        };
        let sentinel = Node::running(port, child, access);
        eventually(
            Duration::from_secs(15),
            "the sentinel to reach the master over TLS",
            || async {
                sentinel
                    .query::<std::collections::HashMap<String, String>>(&[
                        "SENTINEL", "MASTER", "mymaster",
                    ])
                    .await
                    .is_ok_and(|m| {
                        m.get("flags").is_some_and(|f| f == "master")
                            && m.get("role-reported").is_some_and(|r| r == "master")
                    })
            },
        )
        .await;
        TlsSentinel {
            master,
            sentinel,
            _dir: dir,
        }
    }

    /// `rediss+sentinel://alice:…@sentinel/mymaster`.
    pub fn url(&self) -> String {
        format!(
            "rediss+sentinel://{USER}:{PASSWORD}@{}/mymaster",
            self.sentinel.addr()
        )
    }
}
