//! The database's errors as [`StoreError`]s, by what the caller can do;
//! at start-up, refusals that name the setting to fix (docs/design.md §16).

use tokio_postgres::error::SqlState;

use super::settings::SslMode;
use super::{replication, tls};
use crate::StoreError;

/// A database that cannot be reached, or that is read-only (a standby),
/// is `Unavailable` (503, nothing proxied); anything else the database
/// itself refused is `Internal`.
pub(super) fn map_pg(e: tokio_postgres::Error) -> StoreError {
    if let Some(db) = e.as_db_error() {
        let code = db.code().code();
        // The server is (or has become) a standby: retry on the primary.
        if code == "25006" {
            replication::saw_read_only();
            return StoreError::Unavailable(Box::new(e));
        }
        // Class 08 (connection), 57P0x (shutdown), 53 (resources), 40001/40P01
        // (serialisation, deadlock: try again), 55P03 (a lock waited for
        // past `lock_timeout`: its holder may let go) and 42P01 (no such
        // table: migrations not applied yet).
        if code.starts_with("08")
            || code.starts_with("57P")
            || code.starts_with("53")
            || code.starts_with("40")
            || db.code() == &SqlState::LOCK_NOT_AVAILABLE
            || code == "42P01"
        {
            return StoreError::Unavailable(Box::new(e));
        }
        return StoreError::Internal(Box::new(e));
    }
    StoreError::Unavailable(Box::new(e))
}

/// Whether `e` is a statement that waited for a lock past `lock_timeout`
/// (SQLSTATE 55P03): transient, and certainly not applied.
pub(crate) fn is_lock_timeout(e: &StoreError) -> bool {
    let StoreError::Unavailable(cause) = e else {
        return false;
    };
    cause
        .downcast_ref::<tokio_postgres::Error>()
        .and_then(tokio_postgres::Error::as_db_error)
        .is_some_and(|db| db.code() == &SqlState::LOCK_NOT_AVAILABLE)
}

/// The database refused the gateway for a reason only a setting can fix:
/// a certificate refused (the server's or the gateway's), a connection
/// its `pg_hba.conf` or password check does not let in. Names the setting.
#[derive(Debug, thiserror::Error)]
#[error("`{key}`: {what}")]
pub struct Refused {
    key: &'static str,
    what: String,
    #[source]
    cause: tokio_postgres::Error,
}

/// How tokio-postgres says a server answered `N` to `SSLRequest`.
const NO_TLS: &str = "server does not support TLS";

/// `e` from connecting with the settings of `key` at start-up: a
/// [`Refused`] (not transient: start-up stops and says what to fix) when
/// waiting will not help, [`map_pg`]'s answer otherwise.
pub(super) fn at_start(key: &'static str, mode: SslMode, e: tokio_postgres::Error) -> StoreError {
    let what = if let Some(refusal) = tls::certificate_refusal(&e) {
        Some(
            match refusal {
                rustls::Error::InvalidCertificate(_) => {
                    "the server's certificate did not verify: check that sslrootcert (or \
                 SSL_CERT_FILE) holds the CA that signed it and, with sslmode=verify-full, \
                 that it names the host connected to (verify-ca checks the chain only)"
                }
                _ => {
                    "the server refused the gateway's TLS client certificate: give sslcert and \
                 sslkey a certificate its ssl_ca_file trusts"
                }
            }
            .to_owned(),
        )
    } else if std::error::Error::source(&e).is_some_and(|s| s.to_string() == NO_TLS) {
        Some(format!(
            "the server does not offer TLS, which sslmode={} requires: turn ssl on at the \
             server, or connect to one that has it",
            mode.as_str()
        ))
    } else if let Some(db) = e.as_db_error() {
        // Class 28: invalid authorisation (pg_hba.conf, password, certificate).
        db.code().code().starts_with("28").then(|| {
            let hint = match mode {
                SslMode::Disable => {
                    "; with sslmode=disable: a server that accepts only TLS (hostssl) refuses \
                     this, so use sslmode=verify-full with sslrootcert"
                }
                _ => "",
            };
            format!("the server refused the connection (user, password, pg_hba.conf){hint}")
        })
    } else {
        None
    };
    match what {
        Some(what) => StoreError::Internal(Box::new(Refused {
            key,
            what,
            cause: e,
        })),
        None => map_pg(e),
    }
}
