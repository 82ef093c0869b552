//! The first contact with Redis, made in the background at start-up and
//! reported: a certificate Redis's client does not trust, a name the
//! certificate does not carry, or credentials Redis refuses are named in
//! the log, with the key to fix, instead of surfacing only as a count of
//! fast-path errors (docs/design.md §16). Nothing waits for it: Redis is a
//! fast path, and the requests go on from the store either way.

use std::sync::Arc;

use redis::{ConnectionAddr, ErrorKind};

use crate::config::{RedisSettings, Topology};

impl super::FastPath {
    /// Connects once and logs how that went.
    pub async fn first_contact(self: Arc<Self>) {
        let reached = async {
            let mut conn = self.redis.dedicated().await?;
            redis::cmd("PING").query_async::<String>(&mut conn).await
        }
        .await;
        let what = describe(&self.settings);
        match reached {
            Ok(_) => tracing::info!(redis = %what, "Redis reached"),
            Err(e) => tracing::warn!(
                error = %e,
                "redis_url: Redis not reached ({what}): {}; requests go on from the store",
                hint(&e, &self.settings)
            ),
        }
    }
}

/// Where Redis is and how it is reached, without the credentials.
fn describe(settings: &RedisSettings) -> String {
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

/// What to look at, by what went wrong.
fn hint(e: &redis::RedisError, settings: &RedisSettings) -> &'static str {
    let refused = e.kind() == ErrorKind::AuthenticationFailed
        || e.code().is_some_and(|c| c == "WRONGPASS" || c == "NOAUTH" || c == "NOPERM");
    match (&settings.tls, refused) {
        (_, true) => "Redis refused the credentials: check the user and password in redis_url (redis://user:password@host)",
        (Some(_), false) => "is it up, and does its certificate chain to the CA named above and name the host as written in redis_url? A server that asks for a client certificate needs redis_client_cert and redis_client_key",
        (None, false) => "is it up, and does it speak TLS (then write rediss://)?",
    }
}
