//! The database's errors as [`StoreError`]s, by what the caller can do;
//! at start-up, refusals that name the setting to fix (docs/design.md §16).

use tokio_postgres::error::SqlState;

use super::settings::SslMode;
use super::{replication, tls};
use crate::StoreError;

/// A database that cannot be reached, or that is read-only (a standby),
/// or that gave up on a statement it may take when asked again, is
/// `Unavailable` (503, nothing proxied; an outcome's write is retried,
/// docs/design.md §5); anything else the database itself refused is
/// `Internal`.
pub(super) fn map_pg(e: tokio_postgres::Error) -> StoreError {
    if let Some(db) = e.as_db_error() {
        let code = db.code().code();
        // The server is (or has become) a standby: retry on the primary.
        if code == "25006" {
            replication::saw_read_only();
            return StoreError::Unavailable(Box::new(e));
        }
        if transient(code) {
            return StoreError::Unavailable(Box::new(e));
        }
        return StoreError::Internal(Box::new(e));
    }
    StoreError::Unavailable(Box::new(e))
}

/// Whether the database's refusal with SQLSTATE `code` may pass when the
/// statement is asked again: class 08 (connection), 57P0x (shutdown),
/// 57014 (a statement cancelled: by `statement_timeout`, or by
/// `pg_cancel_backend`; its transaction rolled back), 58 (the server's own
/// I/O failed), 53 (resources), 40001/40P01 (serialisation, deadlock: try
/// again), 55P03 (a lock waited for past `lock_timeout`: its holder may
/// let go) and 42P01 (no such table: migrations not applied yet).
/// A cancelled statement rolled back its transaction; and every write
/// asked again is decided again under its job's lock (or by its
/// compare-and-swap), so a second try never writes twice, even after a
/// first whose reply was lost (docs/design.md §13, "A lock waited for").
fn transient(code: &str) -> bool {
    code.starts_with("08")
        || code.starts_with("57P")
        || code == SqlState::QUERY_CANCELED.code()
        || code.starts_with("58")
        || code.starts_with("53")
        || code.starts_with("40")
        || code == SqlState::LOCK_NOT_AVAILABLE.code()
        || code == "42P01"
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

#[cfg(test)]
mod tests {
    use super::transient;

    /// A statement the database gave up on, and may take when asked again,
    /// is transient, so an outcome's write is retried rather than dropped;
    /// a statement it refused for what it is stays permanent.
    #[test]
    fn a_cancelled_statement_is_transient_and_a_refused_one_is_not() {
        for code in [
            "08006", "57P01", "57014", "58000", "58030", "53300", "40001", "40P01", "55P03",
            "42P01",
        ] {
            assert!(transient(code), "{code}");
        }
        for code in [
            "23505", "22P02", "42601", "42501", "XX000", "55000", "57000",
        ] {
            assert!(!transient(code), "{code}");
        }
    }
}
