//! Upstreams: where attempts go, each with its own identity, timeouts,
//! credentials and trusted certificate authorities.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Uri};

use super::file::{HeaderSource, UpstreamFile};
use super::{bad, header_name, positive, ConfigError};

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
    /// Whether those headers hold a credential of the operator's (a value
    /// from the environment, or a header that authenticates by its name):
    /// then only proven clients' requests are sent with them
    /// (`docs/design.md` §15).
    pub credentials: bool,
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

/// Every upstream, in configured order, names unique.
pub(super) fn parse_all(
    files: &[UpstreamFile],
    default_timeout: Duration,
    base_dir: &Path,
) -> Result<Vec<Arc<UpstreamSettings>>, ConfigError> {
    if files.is_empty() {
        return Err(bad(
            "upstreams",
            "no upstream configured; pass --upstream http://host:port, set IDEMGATE_UPSTREAM, \
             or list `upstreams = [\"http://host:port\"]` in the config file",
        ));
    }
    let mut all: Vec<Arc<UpstreamSettings>> = Vec::with_capacity(files.len());
    for (i, file) in files.iter().enumerate() {
        let upstream = parse(i, file, default_timeout, base_dir)?;
        if all.iter().any(|other| other.name() == upstream.name()) {
            return Err(bad(
                format!("upstreams[{i}].name"),
                format!(
                    "{:?} is used twice; upstream names must be unique",
                    upstream.name()
                ),
            ));
        }
        all.push(Arc::new(upstream));
    }
    Ok(all)
}

fn parse(
    i: usize,
    file: &UpstreamFile,
    default_timeout: Duration,
    base_dir: &Path,
) -> Result<UpstreamSettings, ConfigError> {
    let key = format!("upstreams[{i}]");
    let (url, table) = match file {
        UpstreamFile::Url(url) => (url.as_str(), None),
        UpstreamFile::Table(t) => (t.url.as_str(), Some(t)),
    };
    let base = base_url(&key, url)?;
    let default_name = if i == 0 {
        "primary".to_owned()
    } else {
        format!("fallback-{i}")
    };
    let timeout = table.and_then(|t| t.timeout).unwrap_or(default_timeout);
    // Both silences default to the upstream's one timeout, as before they
    // were split.
    let silence = |field: &str, set: Option<Duration>| {
        positive(&format!("{key}.{field}"), set.unwrap_or(timeout))
    };
    let mut headers = Vec::new();
    let mut credentials = false;
    for (name, source) in table.map(|t| &t.headers).into_iter().flatten() {
        let (name, value) = header(&format!("{key}.headers.{name}"), name, source)?;
        credentials |= source.env.is_some() || authenticates(&name);
        headers.push((name, value));
    }
    let extra_roots = match table.and_then(|t| t.ca_file.as_ref()) {
        None => Vec::new(),
        Some(path) => {
            super::tls::pem_certificates(&format!("{key}.ca_file"), &base_dir.join(path))?
        }
    };
    Ok(UpstreamSettings {
        id: UpstreamId {
            index: i,
            name: table
                .and_then(|t| t.name.clone())
                .unwrap_or(default_name)
                .into(),
        },
        base,
        timeout: positive(&format!("{key}.timeout"), timeout)?,
        first_byte_timeout: silence(
            "first_byte_timeout",
            table.and_then(|t| t.first_byte_timeout),
        )?,
        stream_idle_timeout: silence(
            "stream_idle_timeout",
            table.and_then(|t| t.stream_idle_timeout),
        )?,
        connect_timeout: positive(
            &format!("{key}.connect_timeout"),
            table
                .and_then(|t| t.connect_timeout)
                .unwrap_or(timeout.min(Duration::from_secs(10))),
        )?,
        idle_timeout: table
            .and_then(|t| t.idle_timeout)
            .unwrap_or(DEFAULT_IDLE_TIMEOUT),
        headers,
        credentials,
        extra_roots,
    })
}

/// Headers whose value authenticates the sender, whatever it is written as.
fn authenticates(name: &HeaderName) -> bool {
    const NAMES: [&str; 5] = [
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "api-key",
        "cookie",
    ];
    NAMES.contains(&name.as_str())
}

fn base_url(key: &str, url: &str) -> Result<Uri, ConfigError> {
    let base: Uri = url.parse().map_err(|e| {
        bad(
            key,
            format!("{url:?} is not a URL ({e}); write it like http://127.0.0.1:8000"),
        )
    })?;
    match base.scheme_str() {
        Some("http" | "https") => {}
        Some(other) => {
            return Err(bad(
                key,
                format!("scheme {other:?} is not supported; use http:// or https://"),
            ))
        }
        None => {
            return Err(bad(
                key,
                format!("{url:?} has no scheme; write it like http://{url}"),
            ))
        }
    }
    if base.authority().is_none() {
        return Err(bad(key, format!("{url:?} has no host")));
    }
    if base.query().is_some() {
        return Err(bad(key, "an upstream base URL cannot carry a query"));
    }
    Ok(base)
}

fn header(
    key: &str,
    name: &str,
    source: &HeaderSource,
) -> Result<(HeaderName, HeaderValue), ConfigError> {
    let name = header_name(key, name)?;
    let raw = match (&source.value, &source.env) {
        (Some(v), None) => v.clone(),
        (None, Some(var)) => std::env::var(var).map_err(|_| {
            bad(
                key,
                format!("environment variable {var} is not set; export it, it holds this upstream's credential"),
            )
        })?,
        _ => return Err(bad(key, "give exactly one of `value` or `env`")),
    };
    let mut value = HeaderValue::from_str(&format!("{}{raw}", source.prefix))
        .map_err(|_| bad(key, "not a valid header value"))?;
    // Often a provider's credential: never shown by `Debug`.
    value.set_sensitive(true);
    Ok((name, value))
}
