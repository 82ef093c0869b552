//! TLS to Redis: what the server's certificate is checked against
//! (`redis_ca_file`, or the system roots, which honour `SSL_CERT_FILE` and
//! `SSL_CERT_DIR`) and the gateway's own certificate (`redis_client_cert`,
//! `redis_client_key`), read and checked once at start-up
//! (`docs/design.md` §16).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::RootCertStore;

use super::Topology;
use crate::config::{bad, ConfigError, FileConfig, Flags};

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

/// The TLS settings for `topology`: `None` for a plain connection (where
/// any of the three keys is a mistake), the roots and client certificate
/// otherwise.
pub(in crate::config) fn read(
    file: &FileConfig,
    flags: &Flags,
    topology: Option<&Topology>,
) -> Result<Option<RedisTls>, ConfigError> {
    // A flag's path is the shell's; a file's is relative to the file.
    let path = |flag: &Option<PathBuf>, in_file: &Option<PathBuf>| {
        flag.clone()
            .or_else(|| in_file.as_ref().map(|p| file.base_dir.join(p)))
    };
    let ca = path(&flags.redis_ca_file, &file.redis_ca_file);
    let cert = path(&flags.redis_client_cert, &file.redis_client_cert);
    let key = path(&flags.redis_client_key, &file.redis_client_key);
    if !topology.is_some_and(Topology::is_tls) {
        let given = [
            ("redis_ca_file", &ca),
            ("redis_client_cert", &cert),
            ("redis_client_key", &key),
        ];
        if let Some((name, _)) = given.iter().find(|(_, p)| p.is_some()) {
            let why = match topology {
                None => "no redis_url is set",
                Some(_) => "redis_url does not use TLS",
            };
            return Err(bad(
                *name,
                format!("{why}: write a rediss:// (rediss+cluster://, rediss+sentinel://) URL in redis_url, or remove this key"),
            ));
        }
        return Ok(None);
    }
    let (roots, roots_from) = match &ca {
        Some(path) => (
            ca_file(path)?,
            format!("redis_ca_file ({})", path.display()),
        ),
        None => system_roots()?,
    };
    let client = match (cert, key) {
        (None, None) => None,
        (Some(_), None) => {
            return Err(bad(
                "redis_client_key",
                "redis_client_cert is set without its key: name the PEM private key in redis_client_key",
            ))
        }
        (None, Some(_)) => {
            return Err(bad(
                "redis_client_cert",
                "redis_client_key is set without its certificate: name the PEM certificate in redis_client_cert",
            ))
        }
        (Some(cert), Some(key)) => Some(client_cert(&roots, &cert, &key)?),
    };
    Ok(Some(RedisTls {
        roots,
        roots_from,
        client,
    }))
}

/// `redis_ca_file`: every certificate in it must be usable as a trust
/// anchor (the redis crate refuses the whole file otherwise).
fn ca_file(path: &Path) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let key = "redis_ca_file";
    let certs = pem_certificates(key, path)?;
    let mut store = RootCertStore::empty();
    for cert in &certs {
        store.add(cert.clone()).map_err(|e| {
            bad(
                key,
                format!("{} holds a certificate that cannot be a trust anchor: {e}", path.display()),
            )
        })?;
    }
    Ok(certs)
}

fn pem_certificates(
    key: &str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            bad(
                key,
                format!("cannot read PEM certificates from {}: {e}", path.display()),
            )
        })?;
    if certs.is_empty() {
        return Err(bad(
            key,
            format!("{} holds no PEM certificate", path.display()),
        ));
    }
    Ok(certs)
}

/// The system's roots, as OpenSSL-based clients find them: the files named
/// by `SSL_CERT_FILE` / `SSL_CERT_DIR` when either is set (a private CA
/// mounted into the container), the platform's store otherwise. Read once
/// here, so that the redis crate never reads them per connection.
fn system_roots() -> Result<(Vec<CertificateDer<'static>>, String), ConfigError> {
    let named: Vec<String> = ["SSL_CERT_FILE", "SSL_CERT_DIR"]
        .iter()
        .filter_map(|var| {
            let value = std::env::var_os(var)?;
            Some(format!("{var}={}", Path::new(&value).display()))
        })
        .collect();
    let found = rustls_native_certs::load_native_certs();
    let errors: Vec<String> = found.errors.iter().map(ToString::to_string).collect();
    // A location the operator named must be readable; the platform's store
    // is taken for what it holds.
    if !named.is_empty() && !errors.is_empty() {
        return Err(bad(
            "redis_ca_file",
            format!(
                "without redis_ca_file, Redis's certificate is checked against {} and reading it failed: {}; fix the variable or name the CA in redis_ca_file",
                named.join(", "),
                errors.join("; ")
            ),
        ));
    }
    // Only what the crate will take: one unusable anchor would fail it all.
    let mut store = RootCertStore::empty();
    let roots: Vec<_> = found
        .certs
        .into_iter()
        .filter(|cert| store.add(cert.clone()).is_ok())
        .collect();
    if roots.is_empty() {
        return Err(bad(
            "redis_ca_file",
            "rediss:// needs a CA to check Redis's certificate against and the system has none: name the CA's PEM file in redis_ca_file (or set SSL_CERT_FILE)",
        ));
    }
    let from = if named.is_empty() {
        "the system roots".to_owned()
    } else {
        named.join(", ")
    };
    Ok((roots, from))
}

/// `redis_client_cert` and `redis_client_key`: both PEM, the key the
/// certificate's (checked as rustls will when a server asks for them).
fn client_cert(
    roots: &[CertificateDer<'static>],
    cert: &Path,
    key: &Path,
) -> Result<ClientCert, ConfigError> {
    let chain = pem_certificates("redis_client_cert", cert)?;
    let private = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        bad(
            "redis_client_key",
            format!("cannot read a PEM private key from {}: {e}", key.display()),
        )
    })?;
    let mut store = RootCertStore::empty();
    store.add_parsable_certificates(roots.iter().cloned());
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("redis_client_key", e.to_string()))?
        .with_root_certificates(store)
        .with_client_auth_cert(chain, private)
        .map_err(|e| {
            bad(
                "redis_client_key",
                format!(
                    "{} is not the key of the certificate in redis_client_cert ({}): {e}",
                    key.display(),
                    cert.display()
                ),
            )
        })?;
    let read = |name: &str, path: &Path| {
        std::fs::read(path).map_err(|e| bad(name, format!("cannot read {}: {e}", path.display())))
    };
    Ok(ClientCert {
        chain_pem: read("redis_client_cert", cert)?,
        key_pem: read("redis_client_key", key)?,
    })
}
