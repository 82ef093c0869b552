//! The first contact with Redis, made in the background at start-up and
//! reported: a certificate Redis's client does not trust, a name the
//! certificate does not carry, or credentials Redis refuses are named in
//! the log, with the key to fix, instead of surfacing only as a count of
//! fast-path errors (docs/design.md §16). Nothing waits for it: Redis is a
//! fast path, and the requests go on from the store either way.

use redis::{ConnectionAddr, ErrorKind};

use super::settings::{RedisSettings, Topology};

/// Where Redis is and how it is reached, without the credentials.
pub(super) fn describe(settings: &RedisSettings) -> String {
    let addrs = |addrs: &mut dyn Iterator<Item = &ConnectionAddr>| {
        addrs.map(ToString::to_string).collect::<Vec<_>>().join(",")
    };
    let place = match &settings.topology {
        Topology::Node(info) => format!("node {}", info.addr()),
        Topology::Cluster(seeds) => format!(
            "cluster seeds {}",
            addrs(&mut seeds.iter().map(|s| s.addr()))
        ),
        Topology::Sentinel {
            sentinels, service, ..
        } => format!(
            "master `{service}` of sentinels {}",
            addrs(&mut sentinels.iter())
        ),
    };
    match &settings.tls {
        None => format!("{place}, in the clear"),
        Some(tls) => format!(
            "{place}, over TLS, certificate checked against {}{}",
            tls.roots_from,
            if tls.client.is_some() {
                ", client certificate redis_client_cert"
            } else {
                ""
            }
        ),
    }
}

/// What to look at, by what went wrong (rustls names the TLS failures:
/// `invalid peer certificate: …`, `received fatal alert: …`).
pub(super) fn hint(e: &redis::RedisError, settings: &RedisSettings) -> &'static str {
    let refused = e.kind() == ErrorKind::AuthenticationFailed
        || e.code()
            .is_some_and(|c| c == "WRONGPASS" || c == "NOAUTH" || c == "NOPERM");
    let text = e.to_string();
    let shown = settings.tls.as_ref().is_some_and(|t| t.client.is_some());
    match (&settings.tls, refused) {
        (_, true) => "Redis refused the credentials: check the user and password in redis_url (redis://user:password@host)",
        (Some(_), false) if text.contains("peer certificate") => "Redis's certificate was not accepted: it must chain to the CA named above (redis_ca_file, or SSL_CERT_FILE / SSL_CERT_DIR without it) and name the host as written in redis_url",
        (Some(_), false) if text.contains("fatal alert") && !shown => "Redis refused the TLS handshake; if it requires a client certificate (tls-auth-clients yes), set redis_client_cert and redis_client_key",
        (Some(_), false) if text.contains("fatal alert") => "Redis refused the TLS handshake: does it trust the CA of redis_client_cert?",
        (Some(_), false) => "is Redis up, and speaking TLS on that port?",
        (None, false) => "is Redis up, and does it speak TLS (then write rediss://)?",
    }
}
