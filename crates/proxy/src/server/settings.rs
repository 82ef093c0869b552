//! What the proxy listener allows its clients, and whom it believes about
//! the client's address. The configuration reads the file into these.

use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;

/// What a listener allows its clients.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Open connections at most.
    pub max_connections: usize,
    /// How long a client may take to send a request's headers, from their
    /// first byte (or from the connection's opening).
    pub header_read_timeout: Duration,
    /// How long an HTTP/1.1 connection may sit idle between requests; above
    /// the idle timeouts of the balancers and client pools in front, so
    /// that they close first (docs/design.md §18).
    pub keepalive_timeout: Duration,
    /// Largest request header block, in bytes.
    pub max_header_size: usize,
    /// How long a client may pause in the middle of a request body (between
    /// two pieces of it, not for the whole body).
    pub body_read_timeout: Duration,
    /// Bytes a second a request body must average once past the first
    /// `body_read_timeout` (0: any rate), so that a trickled upload cannot
    /// hold what it declared for long (`docs/design.md` §18).
    pub body_min_rate: u64,
    /// How often an HTTP/2 connection is pinged; `None`: never.
    pub http2_keepalive_interval: Option<Duration>,
    /// How long a ping may go unanswered before the connection is closed.
    pub http2_keepalive_timeout: Duration,
    /// How long an HTTP/2 connection may have no open stream before it is
    /// closed; `None`: never.
    pub http2_idle_timeout: Option<Duration>,
    /// How long what a connection has to send may wait on a client that
    /// reads none of it (no write progress; not the whole answer's time)
    /// before the connection is closed (`docs/design.md` §18).
    pub send_timeout: Duration,
}

/// Proxies in front of the gateway: their forwarding headers (and owner
/// sources marked `trusted_header`) are believed; anyone else's are not.
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies(Vec<IpNet>);

impl From<Vec<IpNet>> for TrustedProxies {
    fn from(nets: Vec<IpNet>) -> Self {
        TrustedProxies(nets)
    }
}

impl TrustedProxies {
    /// Whether a connection from `ip` comes from a trusted proxy.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        self.0.iter().any(|net| net.contains(&ip))
    }
}
