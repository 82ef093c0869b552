//! Upstreams: where attempts go, each with its own identity, timeouts,
//! credentials and trusted certificate authorities.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Uri};

use idemgate_proxy::upstream::{UpstreamId, UpstreamSettings, DEFAULT_IDLE_TIMEOUT};

use super::bounds::within_deadline;
use super::file::{HeaderSource, UpstreamFile};
use super::{bad, header_name, positive, ConfigError};

/// Every upstream, in configured order, names unique.
/// `withheld` is the header the gateway's own clients present their client
/// key in, when there are clients: never sent to any upstream. No silence
/// may outlast `attempt_deadline`.
pub(super) fn parse_all(
    files: &[UpstreamFile],
    default_timeout: Duration,
    attempt_deadline: Duration,
    base_dir: &Path,
    withheld: Option<&HeaderName>,
) -> Result<Vec<Arc<UpstreamSettings>>, ConfigError> {
    if files.is_empty() {
        return Err(bad(
            "upstreams",
            "no upstream configured; pass --upstream http://host:port, set IDEMGATE_UPSTREAM, \
             or list `upstreams = [\"http://host:port\"]` in the config file",
        ));
    }
    // A user or password is never sent (the gateway authenticates to an
    // upstream only with the headers it is given), and would be printed
    // wherever the URL is: by `idemgate check`, in start-up's summary, in
    // the errors of `base_url`. So any `@` is refused, not repeated, before
    // any URL is read: one split at a comma in its password
    // (`IDEMGATE_UPSTREAM`) leaves the password's first half in the piece
    // before, whose own error would show it.
    if let Some(i) = files.iter().position(|file| url_of(file).contains('@')) {
        return Err(bad(
            format!("upstreams[{i}]"),
            "an upstream base URL cannot carry a user or password (user:password@host); \
             send a credential with [upstreams.headers], e.g. \
             authorization = { env = \"UPSTREAM_AUTHORIZATION\" } (an @ in a path: write %40)",
        ));
    }
    let mut all: Vec<Arc<UpstreamSettings>> = Vec::with_capacity(files.len());
    for (i, file) in files.iter().enumerate() {
        let mut upstream = parse(i, file, default_timeout, attempt_deadline, base_dir)?;
        upstream.withheld = withheld.cloned();
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

/// Upstream `i`: its `timeout` defaults to `default_timeout`
/// (`upstream_timeout`), and none of its silences may outlast
/// `attempt_deadline`.
fn parse(
    i: usize,
    file: &UpstreamFile,
    default_timeout: Duration,
    attempt_deadline: Duration,
    base_dir: &Path,
) -> Result<UpstreamSettings, ConfigError> {
    let key = format!("upstreams[{i}]");
    let (url, table) = match file {
        UpstreamFile::Url(_) => (url_of(file), None),
        UpstreamFile::Table(t) => (url_of(file), Some(t)),
    };
    let base = base_url(&key, url)?;
    let default_name = if i == 0 {
        "primary".to_owned()
    } else {
        format!("fallback-{i}")
    };
    let timeout = table.and_then(|t| t.timeout).unwrap_or(default_timeout);
    // Both silences default to the upstream's one timeout, as before they
    // were split; each, that timeout too, must end by the attempt's deadline.
    let silence = |field: &str, set: Option<Duration>| {
        let key = format!("{key}.{field}");
        within_deadline(
            &key,
            positive(&key, set.unwrap_or(timeout))?,
            attempt_deadline,
        )
    };
    let mut headers = Vec::new();
    let mut credentials = Vec::new();
    for (name, source) in table.map(|t| &t.headers).into_iter().flatten() {
        let entry = format!("{key}.headers.{name}");
        let (name, value) = header(&entry, name, source)?;
        if credential(&entry, &name, source)? {
            credentials.push(name.clone());
        }
        headers.push((name, value));
    }
    let extra_roots = match table.and_then(|t| t.ca_file.as_ref()) {
        None => Vec::new(),
        Some(path) => {
            super::tls::pem_certificates(&format!("{key}.ca_file"), &base_dir.join(path))?
        }
    };
    Ok(UpstreamSettings {
        id: UpstreamId::new(
            i,
            &table.and_then(|t| t.name.clone()).unwrap_or(default_name),
        ),
        base,
        timeout: silence("timeout", Some(timeout))?,
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
        withheld: None,
        extra_roots,
    })
}

/// Whether an injected header is a credential of the operator's: each is,
/// unless marked `credential = false`, because which of a provider's headers
/// authenticates (`x-goog-api-key`, `x-subscription-token`, …) cannot be told
/// from its name (`docs/design.md` §15). One that authenticates by its very
/// name cannot be marked otherwise.
fn credential(key: &str, name: &HeaderName, source: &HeaderSource) -> Result<bool, ConfigError> {
    match source.credential {
        None | Some(true) => Ok(true),
        Some(false) if authenticates(name) => Err(bad(
            format!("{key}.credential"),
            format!(
                "{name} authenticates whoever sends it, so it is a credential of yours however \
                 it is marked: remove `credential = false`, and set require_client = true on \
                 the routes to this upstream"
            ),
        )),
        Some(false) => Ok(false),
    }
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

/// An upstream's URL, as written.
fn url_of(file: &UpstreamFile) -> &str {
    match file {
        UpstreamFile::Url(url) => url,
        UpstreamFile::Table(t) => &t.url,
    }
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

#[cfg(test)]
mod tests {
    use super::super::{Flags, Settings};

    /// The settings of `rest`, and one upstream given `headers`.
    fn with_headers(headers: &str, rest: &str) -> Result<Settings, super::ConfigError> {
        let text = format!(
            "{rest}\n[[upstreams]]\nurl = \"http://127.0.0.1:1\"\n[upstreams.headers]\n{headers}\n"
        );
        Settings::from_sources(Settings::parse_file(&text).unwrap(), Flags::default())
    }

    #[test]
    fn every_injected_header_is_a_credential_unless_marked() {
        let routed = "[[routes]]\npath_prefix = \"/v1\"\n";
        let err = with_headers("x-goog-api-key = { value = \"AIza\" }", routed).unwrap_err();
        assert_eq!(err.key, "routes[0].require_client");
        assert!(err.message.contains("x-goog-api-key"), "{}", err.message);
        assert!(
            err.message.contains("credential = false"),
            "{}",
            err.message
        );
        let marked = "x-tenant = { value = \"acme\", credential = false }";
        let s = with_headers(marked, routed).unwrap();
        assert!(s.upstreams[0].credentials.is_empty());
        assert_eq!(s.upstreams[0].headers.len(), 1);
        let err = with_headers("cookie = { value = \"s=1\", credential = false }", "").unwrap_err();
        assert_eq!(err.key, "upstreams[0].headers.cookie.credential");
    }

    #[test]
    fn the_client_key_header_is_withheld_only_with_clients() {
        let s = with_headers("x-tenant = { value = \"a\", credential = false }", "").unwrap();
        assert_eq!(s.upstreams[0].withheld, None);
        let clients = format!(
            "client_key_header = \"x-client-key\"\n[[clients]]\nname = \"web\"\n\
             key_sha256 = {{ value = \"{}\" }}\n",
            "0".repeat(64)
        );
        let s = with_headers("x-tenant = { value = \"a\", credential = false }", &clients);
        let withheld = s.unwrap().upstreams[0].withheld.clone();
        assert_eq!(withheld.as_ref().map(|h| h.as_str()), Some("x-client-key"));
    }
}
