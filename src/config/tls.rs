//! Certificates for the TLS connections the gateway itself makes to the
//! services it keeps state in (PostgreSQL, Redis): the CA certificates a
//! server's chain is checked against, from a PEM file or from the system,
//! and a client certificate with its key (docs/design.md §16).
//!
//! Everything is read at start-up, so a missing, unreadable or mismatched
//! file stops the gateway with a [`ConfigError`] naming the key that named
//! it, never later on a connection. Three calls make up the API:
//! [`pem_certificates`], [`system_roots`] and [`client_identity`].

use std::path::Path;

use idemgate_store::postgres::ClientIdentity;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::{bad, ConfigError};

/// Every certificate in the PEM file at `path` (at least one), which the
/// configuration named as `key`.
pub fn pem_certificates(
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
            format!(
                "{} holds no certificate; name a PEM file holding the CA certificate(s)",
                path.display()
            ),
        ));
    }
    Ok(certs)
}

/// The system's CA certificates, found the way OpenSSL-based clients find
/// them: the PEM file `SSL_CERT_FILE` and the folders `SSL_CERT_DIR` when
/// either is set (so a private CA mounted into the container and named
/// there is trusted), the platform's store otherwise (on Debian,
/// `/etc/ssl/certs`). An empty result is an error naming `key`, the
/// setting that asked for them. Certificates that cannot be read are
/// skipped with a warning, as OpenSSL skips them.
pub fn system_roots(key: &str) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let found = rustls_native_certs::load_native_certs();
    for error in &found.errors {
        tracing::warn!(%error, "skipping a system CA certificate that cannot be read");
    }
    if found.certs.is_empty() {
        let from = ["SSL_CERT_FILE", "SSL_CERT_DIR"]
            .iter()
            .filter_map(|var| {
                std::env::var_os(var).map(|v| format!("{var}={}", v.to_string_lossy()))
            })
            .collect::<Vec<_>>();
        let place = if from.is_empty() {
            "the system's store (install ca-certificates)".to_owned()
        } else {
            from.join(" and ")
        };
        return Err(bad(
            key,
            format!(
                "no CA certificate found in {place}; name the CA file with sslrootcert=/path/ca.pem, \
                 or point SSL_CERT_FILE at it"
            ),
        ));
    }
    Ok(found.certs)
}

/// Reads the chain from `cert` (named by the key `cert_key`) and the
/// unencrypted PKCS#8, PKCS#1 or SEC1 private key from `key` (named by
/// `key_key`), and checks that the key is the leaf's.
pub fn client_identity(
    cert_key: &str,
    cert: &Path,
    key_key: &str,
    key: &Path,
) -> Result<ClientIdentity, ConfigError> {
    let chain = pem_certificates(cert_key, cert)?;
    let private = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        bad(
            key_key,
            format!(
                "cannot read a private key from {}: {e}; give an unencrypted PEM key \
                 (PKCS#8, PKCS#1 or SEC1)",
                key.display()
            ),
        )
    })?;
    let provider = rustls::crypto::ring::default_provider();
    let signing = provider
        .key_provider
        .load_private_key(private.clone_key())
        .map_err(|e| {
            bad(
                key_key,
                format!("{} is not a usable key: {e}", key.display()),
            )
        })?;
    match rustls::sign::CertifiedKey::new(chain.clone(), signing).keys_match() {
        // A key whose public half the provider cannot tell: the server judges.
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {}
        Err(e) => {
            return Err(bad(
                key_key,
                format!(
                    "{} is not the key of the certificate in {} ({e}); give the pair \
                     issued together",
                    key.display(),
                    cert.display()
                ),
            ))
        }
    }
    Ok(ClientIdentity::new(chain, private))
}
