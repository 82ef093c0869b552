//! An upstream's own settings: who it is, where it is, how long it may be
//! silent, the headers and certificate authorities it is given. The
//! configuration reads the file into these.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Uri};

/// An upstream's identity: its place among the configured upstreams (which
/// picks its connection pool) and its name (what attempts, logs and probe
/// verdicts call it). Only configuration makes one, so it always names an
/// upstream that exists.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UpstreamId {
    index: usize,
    name: Arc<str>,
}

impl UpstreamId {
    /// The upstream at `index` of the configured order, called `name`:
    /// made by the configuration only, which keeps names unique.
    pub fn new(index: usize, name: &str) -> Self {
        UpstreamId {
            index,
            name: name.into(),
        }
    }

    /// Its place in the configured order (0 is the default upstream).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl std::fmt::Display for UpstreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

/// How long an upstream connection may idle and still be reused, by
/// default: below the 5 s after which Node.js, uvicorn (vLLM's server) and
/// many other HTTP servers close an idle connection. A request sent on a
/// connection the upstream is closing at that moment may be lost with its
/// outcome unknown; one sent on a connection the gateway has retired
/// cannot be (docs/design.md §11).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// One upstream.
#[derive(Debug, Clone)]
pub struct UpstreamSettings {
    /// Who it is.
    pub id: UpstreamId,
    /// Its base URL: scheme, authority and an optional path prefix.
    pub base: Uri,
    /// Silence after which a lookup or resend of an attempt on it gives
    /// up, and the default of the two below.
    pub timeout: Duration,
    /// Silence allowed before an answer's head (`first_byte_timeout`):
    /// past it the attempt is unknown, and a side-effect-free route may
    /// still try another upstream, as it can only before a head is taken
    /// (`docs/design.md` §11).
    pub first_byte_timeout: Duration,
    /// Silence allowed between body chunks once the head has come
    /// (`stream_idle_timeout`): past it the attempt is unknown, and a
    /// stream is cut (`docs/design.md` §10).
    pub stream_idle_timeout: Duration,
    /// How long connecting may take (a safe failure: nothing was sent).
    pub connect_timeout: Duration,
    /// How long a connection may sit unused and still carry the next
    /// request; `0` opens a new connection for every request.
    pub idle_timeout: Duration,
    /// Headers set on every request to it (values may be secrets).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// Those of its headers that hold a credential of the operator's (every
    /// one not marked `credential = false`): only proven clients' requests
    /// are sent with these; the others go with every request
    /// (`docs/design.md` §15).
    pub credentials: Vec<HeaderName>,
    /// The header the gateway's own clients present their client key in,
    /// when there are clients: the gateway's alone, removed from every
    /// request before it is sent, routed or not (`docs/design.md` §15).
    pub withheld: Option<HeaderName>,
    /// Certificate authorities trusted for `https://` besides the public
    /// web PKI roots (a private CA, a self-signed provider).
    pub extra_roots: Vec<rustls::pki_types::CertificateDer<'static>>,
}

impl UpstreamSettings {
    /// Its name.
    pub fn name(&self) -> &str {
        self.id.name()
    }
}
