//! The PostgreSQL store's own settings: the connection string, its TLS as
//! libpq spells it (`docs/design.md` §16), and the pool. The configuration
//! reads the file into these.

use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// Never TLS.
    Disable,
    /// TLS when the server offers it, plaintext otherwise (the default).
    Prefer,
    /// TLS or no connection.
    Require,
    /// TLS, the server's chain checked against the roots.
    VerifyCa,
    /// TLS, the chain checked and the host name matched against it.
    VerifyFull,
}

impl SslMode {
    /// Every mode, in libpq's order.
    pub const ALL: [SslMode; 5] = [
        SslMode::Disable,
        SslMode::Prefer,
        SslMode::Require,
        SslMode::VerifyCa,
        SslMode::VerifyFull,
    ];

    /// As libpq spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// What a connection checks of the server's certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Nothing: encrypted, but anyone on the path can pose as the server.
    Nothing,
    /// The chain, against the roots; not the host name (`verify-ca`).
    Chain,
    /// The chain and the host name (`verify-full`).
    ChainAndHost,
}

/// How one connection string uses TLS.
#[derive(Debug, Clone)]
pub struct PgTls {
    /// The mode, as given or libpq's default.
    pub mode: SslMode,
    /// The CA certificates the server's chain is checked against; empty
    /// when nothing is checked.
    pub roots: Vec<CertificateDer<'static>>,
    /// Where [`roots`](Self::roots) came from, for the start-up log.
    pub roots_from: String,
    /// The client certificate (`sslcert` + `sslkey`), when given.
    pub identity: Option<ClientIdentity>,
}

impl PgTls {
    /// What is checked of the server: libpq's rule, where a root file
    /// given to `prefer` or `require` makes them check the chain.
    pub fn check(&self) -> Check {
        match self.mode {
            SslMode::VerifyFull => Check::ChainAndHost,
            SslMode::VerifyCa => Check::Chain,
            _ if !self.roots.is_empty() => Check::Chain,
            _ => Check::Nothing,
        }
    }

    /// One line for the start-up log: the mode and what it proves.
    pub fn describe(&self) -> String {
        let client = match &self.identity {
            Some(_) => ", with a client certificate",
            None => "",
        };
        let what = match (self.mode, self.check()) {
            (SslMode::Disable, _) => "no TLS: the connection is plaintext".to_owned(),
            (mode, Check::Nothing) => format!(
                "sslmode={}: {}encrypted, the server's certificate NOT verified (anyone on \
                 the path can pose as the server; use verify-full with the CA's file)",
                mode.as_str(),
                if mode == SslMode::Prefer {
                    "if the server offers TLS, "
                } else {
                    ""
                }
            ),
            (mode, Check::Chain) => format!(
                "sslmode={}: TLS, the chain checked against {} (not the host name)",
                mode.as_str(),
                self.roots_from
            ),
            (mode, Check::ChainAndHost) => format!(
                "sslmode={}: TLS, the chain checked against {} and the host name matched",
                mode.as_str(),
                self.roots_from
            ),
        };
        format!("{what}{client}")
    }
}

/// A PostgreSQL connection string, its TLS taken out.
#[derive(Debug, Clone)]
pub struct PgUrl {
    /// The setting it came from (`database_url`, `database_direct_url`):
    /// what an error about it names.
    pub key: &'static str,
    /// The string without `sslmode`, `sslrootcert`, `sslcert`, `sslkey`,
    /// for tokio-postgres.
    pub url: String,
    /// Its TLS.
    pub tls: PgTls,
}

/// Connection settings for the PostgreSQL store.
#[derive(Debug, Clone)]
pub struct PgSettings {
    /// `database_url`: a libpq-style URL or key=value string, its TLS read.
    pub url: PgUrl,
    /// Where sessions that must stay one session go (LISTEN, the migration
    /// lock), when `url` is a transaction pooler; `url` when unset.
    pub direct_url: Option<PgUrl>,
    /// Most connections in the pool.
    pub pool_size: usize,
    /// How long to wait for a connection (new or pooled) before answering 503.
    pub connect_timeout: Duration,
    /// How long a statement waits for a lock another transaction holds
    /// before it gives its connection back and fails as transient
    /// (`database_lock_timeout`; docs/design.md §13, "A lock waited for").
    pub lock_timeout: Duration,
}

/// A client certificate chain (the leaf first) and its private key, for
/// servers that ask the gateway to prove who it is.
#[derive(Clone)]
pub struct ClientIdentity {
    /// The leaf, then any intermediates.
    pub chain: Vec<CertificateDer<'static>>,
    key: Arc<PrivateKeyDer<'static>>,
}

impl ClientIdentity {
    /// A chain (the leaf first) and the private key it was issued with,
    /// already checked to match.
    pub fn new(chain: Vec<CertificateDer<'static>>, key: PrivateKeyDer<'static>) -> Self {
        ClientIdentity {
            chain,
            key: Arc::new(key),
        }
    }

    /// The private key, for a TLS client configuration.
    pub fn key(&self) -> PrivateKeyDer<'static> {
        self.key.clone_key()
    }
}

impl std::fmt::Debug for ClientIdentity {
    /// The key never shows.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientIdentity")
            .field("certificates", &self.chain.len())
            .finish_non_exhaustive()
    }
}
