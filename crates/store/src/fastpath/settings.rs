//! The fast path's own settings: where Redis is, as `redis_url` names it
//! (one node, a Redis Cluster, or a master watched by Sentinel:
//! `docs/design.md` §13), in the clear or over TLS (`docs/design.md` §16).
//! The configuration reads the file into these; the URL's grammar is the
//! redis crate's, so it is read here.

use std::time::Duration;

use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};
use rustls::pki_types::CertificateDer;

/// The Redis fast path's settings.
#[derive(Debug, Clone)]
pub struct RedisSettings {
    /// Where Redis is: one node, a cluster or a Sentinel-managed master.
    pub topology: Topology,
    /// Longest a Redis call may take before the request goes on without it.
    pub timeout: Duration,
    /// Largest response body kept inline; larger ones are kept by reference.
    pub inline_max: usize,
    /// What every Redis key and channel of this deployment starts with, so
    /// that deployments sharing one Redis never meet (`docs/design.md` §13).
    pub key_prefix: String,
    /// What a TLS Redis's certificate is checked against, and the client's
    /// own; `Some` exactly when `redis_url` is a `rediss…` URL.
    pub tls: Option<RedisTls>,
}

/// Where Redis is, as `redis_url` names it.
#[derive(Debug, Clone)]
pub enum Topology {
    /// One node: `redis://[user:password@]host:6379/0` (or `rediss://`,
    /// `redis+unix://`).
    Node(ConnectionInfo),
    /// A Redis Cluster, found from seed nodes:
    /// `redis+cluster://[user:password@]host:port,host:port,…` (or
    /// `rediss+cluster://`: every node over TLS).
    Cluster(Vec<ConnectionInfo>),
    /// A master watched by Sentinel:
    /// `redis+sentinel://[user:password@]host:26379,host:26379,…/service[/db]`;
    /// the credentials and database are the Redis nodes', not the sentinels'.
    /// `rediss+sentinel://` speaks TLS to the sentinels and to the nodes alike.
    Sentinel {
        /// The sentinels.
        sentinels: Vec<ConnectionAddr>,
        /// The name the sentinels know the master by.
        service: String,
        /// How to talk to the master once found.
        node: redis::RedisConnectionInfo,
        /// Whether the sentinels and the nodes are reached over TLS.
        tls: bool,
    },
}

/// TLS to Redis, for a `rediss…` `redis_url`.
#[derive(Clone)]
pub struct RedisTls {
    /// The trust anchors the server's certificate must chain to.
    pub roots: Vec<CertificateDer<'static>>,
    /// Where they came from, for the logs (`redis_ca_file (…)`, `the
    /// system roots`, `SSL_CERT_FILE (…)`).
    pub roots_from: String,
    /// The gateway's own certificate, for servers that ask for one.
    pub client: Option<ClientCert>,
}

/// A client certificate chain and its key, as PEM (the form the redis crate
/// takes), already checked to parse and to match.
#[derive(Clone)]
pub struct ClientCert {
    /// `redis_client_cert`: the certificate, then any intermediates.
    pub chain_pem: Vec<u8>,
    /// `redis_client_key`: the private key.
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTls")
            .field("roots", &self.roots.len())
            .field("roots_from", &self.roots_from)
            .field("client", &self.client.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl RedisTls {
    /// The trust anchors as PEM, the form the redis crate takes them in.
    pub fn roots_pem(&self) -> Vec<u8> {
        use base64::Engine;
        let mut pem = Vec::with_capacity(self.roots.len() * 2048);
        for cert in &self.roots {
            pem.extend_from_slice(b"-----BEGIN CERTIFICATE-----\n");
            let text = base64::engine::general_purpose::STANDARD.encode(cert.as_ref());
            for line in text.as_bytes().chunks(64) {
                pem.extend_from_slice(line);
                pem.push(b'\n');
            }
            pem.extend_from_slice(b"-----END CERTIFICATE-----\n");
        }
        pem
    }
}

/// Why `redis_url` does not name a Redis.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TopologyError(String);

impl Topology {
    /// Reads `redis_url`.
    pub fn parse(url: &str) -> Result<Self, TopologyError> {
        let bad = |why: String| TopologyError(why);
        if url.contains('#') {
            // `#insecure` is the redis crate's way of skipping the check of
            // the server's certificate: never wanted (docs/design.md §16).
            return Err(bad(
                "idemgate always checks Redis's certificate: remove the `#…` fragment and name the CA in redis_ca_file".into(),
            ));
        }
        if let Some((scheme, rest)) = url
            .strip_prefix("redis+cluster://")
            .map(|r| ("redis", r))
            .or_else(|| url.strip_prefix("rediss+cluster://").map(|r| ("rediss", r)))
        {
            let (auth, hosts, path) = split(rest);
            if !path.is_empty() {
                return Err(bad(format!(
                    "a cluster has no database to choose (`/{path}`); remove it"
                )));
            }
            let seeds = hosts
                .iter()
                .map(|host| {
                    format!("{scheme}://{auth}{host}")
                        .into_connection_info()
                        .map_err(|e| bad(format!("seed `{host}`: {e}")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            return Ok(Topology::Cluster(seeds));
        }
        if let Some((scheme, rest)) = url
            .strip_prefix("redis+sentinel://")
            .map(|r| ("redis", r))
            .or_else(|| {
                url.strip_prefix("rediss+sentinel://")
                    .map(|r| ("rediss", r))
            })
        {
            let (auth, hosts, path) = split(rest);
            let mut path = path.split('/');
            let service = path.next().unwrap_or_default().to_owned();
            if service.is_empty() {
                return Err(bad(
                    "name the master's service after the sentinels: redis+sentinel://host:26379/mymaster".into(),
                ));
            }
            let db = path.next().filter(|d| !d.is_empty()).unwrap_or("0");
            let node = format!("redis://{auth}localhost/{db}")
                .into_connection_info()
                .map_err(|e| bad(format!("credentials or database: {e}")))?
                .redis_settings()
                .clone();
            let sentinels = hosts
                .iter()
                .map(|host| {
                    format!("{scheme}://{host}")
                        .into_connection_info()
                        .map(|info| info.addr().clone())
                        .map_err(|e| bad(format!("sentinel `{host}`: {e}")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            return Ok(Topology::Sentinel {
                sentinels,
                service,
                node,
                tls: scheme == "rediss",
            });
        }
        url.into_connection_info().map(Topology::Node).map_err(|e| {
            bad(format!(
                "{e}; use redis://host:6379/0, redis+cluster://host:7000,host:7001 or redis+sentinel://host:26379/mymaster (rediss… for TLS)"
            ))
        })
    }

    /// Whether Redis is reached over TLS (`rediss://`, `rediss+cluster://`,
    /// `rediss+sentinel://`).
    pub fn is_tls(&self) -> bool {
        let tls = |addr: &ConnectionAddr| matches!(addr, ConnectionAddr::TcpTls { .. });
        match self {
            Topology::Node(info) => tls(info.addr()),
            Topology::Cluster(seeds) => seeds.iter().any(|s| tls(s.addr())),
            Topology::Sentinel { tls, .. } => *tls,
        }
    }
}

/// `[auth@]host,host[/path]` → (`auth@` or empty, hosts, path).
fn split(rest: &str) -> (&str, Vec<&str>, &str) {
    let (auth, rest) = match rest.rfind('@') {
        Some(at) => rest.split_at(at + 1),
        None => ("", rest),
    };
    let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
    let hosts = hosts.split(',').filter(|h| !h.is_empty()).collect();
    (auth, hosts, path.trim_end_matches('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_a_node_a_cluster_or_a_sentinel_master() {
        assert!(matches!(
            Topology::parse("redis://127.0.0.1:6379/2").unwrap(),
            Topology::Node(info) if info.redis_settings().db() == 2
        ));
        let Topology::Cluster(seeds) =
            Topology::parse("redis+cluster://u:p@10.0.0.1:7000,10.0.0.2:7001").unwrap()
        else {
            panic!("not a cluster")
        };
        assert_eq!(seeds.len(), 2);
        assert_eq!(
            seeds[1].addr(),
            &ConnectionAddr::Tcp("10.0.0.2".into(), 7001)
        );
        assert_eq!(seeds[0].redis_settings().password(), Some("p"));
        let Topology::Sentinel {
            sentinels,
            service,
            node,
            ..
        } = Topology::parse("redis+sentinel://:secret@s1:26379,s2:26380/mymaster/3").unwrap()
        else {
            panic!("not sentinel")
        };
        assert_eq!(sentinels[1], ConnectionAddr::Tcp("s2".into(), 26380));
        assert_eq!(service, "mymaster");
        assert_eq!((node.db(), node.password()), (3, Some("secret")));
    }

    fn tls(addr: &ConnectionAddr) -> bool {
        matches!(
            addr,
            ConnectionAddr::TcpTls {
                insecure: false,
                ..
            }
        )
    }

    #[test]
    fn acl_users_are_kept_for_one_node() {
        for (url, over_tls) in [
            ("redis://alice:p%40ss@10.0.0.1:6379/2", false),
            ("rediss://alice:p%40ss@redis.example:6380/2", true),
        ] {
            let topology = Topology::parse(url).unwrap();
            let Topology::Node(info) = &topology else {
                panic!("{url}: not one node")
            };
            let redis = info.redis_settings();
            assert_eq!(
                (redis.username(), redis.password(), redis.db()),
                (Some("alice"), Some("p@ss"), 2),
                "{url}"
            );
            assert_eq!(tls(info.addr()), over_tls, "{url}");
            assert_eq!(topology.is_tls(), over_tls, "{url}");
        }
    }

    #[test]
    fn acl_users_are_kept_for_every_cluster_seed() {
        for (url, over_tls) in [
            ("redis+cluster://alice:pw@a:7000,b:7001", false),
            ("rediss+cluster://alice:pw@a:7000,b:7001", true),
        ] {
            let topology = Topology::parse(url).unwrap();
            let Topology::Cluster(seeds) = &topology else {
                panic!("{url}: not a cluster")
            };
            assert_eq!(seeds.len(), 2);
            for seed in seeds {
                let redis = seed.redis_settings();
                assert_eq!(
                    (redis.username(), redis.password()),
                    (Some("alice"), Some("pw"))
                );
                assert_eq!(tls(seed.addr()), over_tls, "{url}");
            }
            assert_eq!(topology.is_tls(), over_tls, "{url}");
        }
    }

    #[test]
    fn acl_users_are_the_sentinel_masters_and_tls_reaches_both() {
        for (url, over_tls) in [
            (
                "redis+sentinel://alice:pw@s1:26379,s2:26380/mymaster/1",
                false,
            ),
            (
                "rediss+sentinel://alice:pw@s1:26379,s2:26380/mymaster/1",
                true,
            ),
        ] {
            let topology = Topology::parse(url).unwrap();
            let Topology::Sentinel {
                sentinels,
                service,
                node,
                tls: tls_on,
            } = &topology
            else {
                panic!("{url}: not sentinel")
            };
            assert_eq!(service, "mymaster");
            assert_eq!(
                (node.username(), node.password(), node.db()),
                (Some("alice"), Some("pw"), 1),
                "{url}"
            );
            assert_eq!(*tls_on, over_tls);
            assert!(sentinels.iter().all(|s| tls(s) == over_tls), "{url}");
            assert_eq!(sentinels[1].to_string(), "s2:26380");
            assert_eq!(topology.is_tls(), over_tls, "{url}");
        }
    }

    #[test]
    fn bad_urls_say_what_to_write() {
        for (url, says) in [
            ("http://x", "redis+cluster://"),
            ("redis+sentinel://s1:26379", "name the master's service"),
            ("redis+cluster://a:7000/1", "no database"),
            ("redis+cluster://a:notaport", "seed `a:notaport`"),
            (
                "rediss://h:6380/#insecure",
                "always checks Redis's certificate",
            ),
            ("rediss+cluster://a:7000,b:7001#insecure", "redis_ca_file"),
        ] {
            let why = Topology::parse(url).unwrap_err().to_string();
            assert!(why.contains(says), "{url}: {why}");
        }
    }
}
