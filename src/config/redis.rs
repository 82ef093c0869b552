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

use crate::config::tls::pem_certificates;
use crate::config::{bad, ConfigError, FileConfig, Flags};
use idemgate_store::fastpath::{ClientCert, RedisTls, Topology};

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
                format!(
                    "{} holds a certificate that cannot be a trust anchor: {e}",
                    path.display()
                ),
            )
        })?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    /// A CA, a client certificate it signed and that certificate's key,
    /// plus a key of nobody's, written as PEM files into a folder.
    fn pki() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca.self_signed(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let client = rcgen::CertificateParams::new(vec!["idemgate".to_owned()])
            .unwrap()
            .signed_by(&key, &ca, &ca_key)
            .unwrap();
        let other = rcgen::KeyPair::generate().unwrap();
        for (name, pem) in [
            ("ca.pem", ca.pem()),
            ("client.pem", client.pem()),
            ("client.key", key.serialize_pem()),
            ("other.key", other.serialize_pem()),
            ("empty.pem", "no certificate here\n".to_owned()),
        ] {
            std::fs::write(dir.path().join(name), pem).unwrap();
        }
        dir
    }

    fn load(dir: &Path, toml: &str, flags: Flags) -> Result<Option<RedisTls>, ConfigError> {
        let file = Settings::parse_file(toml).unwrap().relative_to(dir);
        let flags = Flags {
            upstreams: vec!["http://127.0.0.1:1".into()],
            ..flags
        };
        Settings::from_sources(file, flags).map(|s| s.redis.and_then(|r| r.tls))
    }

    #[test]
    fn the_ca_and_client_certificate_are_read_relative_to_the_file() {
        let dir = pki();
        let tls = load(
            dir.path(),
            "redis_url = \"rediss://alice:pw@127.0.0.1:6380\"\n\
             redis_ca_file = \"ca.pem\"\n\
             redis_client_cert = \"client.pem\"\n\
             redis_client_key = \"client.key\"\n",
            Flags::default(),
        )
        .unwrap()
        .expect("rediss:// is TLS");
        assert!(
            tls.roots_from.contains("redis_ca_file"),
            "{}",
            tls.roots_from
        );
        let ca = pem_certificates("ca", &dir.path().join("ca.pem")).unwrap();
        assert_eq!(tls.roots, ca);
        // What the redis crate is handed parses back to the same anchors.
        let again: Vec<_> = CertificateDer::pem_slice_iter(&tls.roots_pem())
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(again, ca);
        let client = tls.client.expect("a client certificate");
        assert_eq!(
            client.key_pem,
            std::fs::read(dir.path().join("client.key")).unwrap()
        );
    }

    #[test]
    fn a_flag_names_its_file_from_where_the_gateway_runs() {
        let dir = pki();
        let flags = Flags {
            redis_ca_file: Some(dir.path().join("ca.pem")),
            ..Flags::default()
        };
        let tls = load(
            Path::new("/nowhere"),
            "redis_url = \"rediss+cluster://a:7000,b:7001\"\nredis_ca_file = \"missing.pem\"\n",
            flags,
        )
        .unwrap()
        .unwrap();
        assert_eq!(tls.roots.len(), 1);
        assert!(tls.client.is_none());
    }

    #[test]
    fn without_a_ca_file_the_system_roots_are_used() {
        let dir = pki();
        // The test machine has a CA bundle (ca-certificates): it is read.
        let tls = load(
            dir.path(),
            "redis_url = \"rediss+sentinel://s:26379/mymaster\"\n",
            Flags::default(),
        )
        .unwrap()
        .unwrap();
        assert!(!tls.roots.is_empty());
        assert!(tls.roots_from.contains("system") || tls.roots_from.contains("SSL_CERT"));
    }

    /// The Redis lines the example file leaves commented out
    /// (`config/idemgate.example.toml`) load once uncommented: every
    /// `redis_url`, and the TLS block with its files beside the config.
    #[test]
    fn the_example_files_redis_lines_load() {
        let text = include_str!("../../config/idemgate.example.toml");
        let lines: Vec<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# redis_"))
            .filter(|l| l.contains(" = "))
            .map(|l| format!("redis_{l}"))
            .collect();
        let dir = pki();
        for (from, to) in [
            ("ca.pem", "redis-ca.pem"),
            ("client.pem", "redis-client.pem"),
            ("client.key", "redis-client.key"),
        ] {
            std::fs::copy(dir.path().join(from), dir.path().join(to)).unwrap();
        }
        let urls: Vec<_> = lines
            .iter()
            .filter(|l| l.starts_with("redis_url"))
            .collect();
        assert!(urls.len() >= 4, "{lines:?}");
        for url in &urls {
            load(dir.path(), url, Flags::default()).unwrap_or_else(|e| panic!("{url}: {e}"));
        }
        let tls_block: Vec<_> = lines
            .iter()
            .filter(|l| !l.starts_with("redis_url") || l.contains("rediss://"))
            .map(String::as_str)
            .collect();
        assert_eq!(tls_block.len(), 4, "{tls_block:?}");
        let tls = load(dir.path(), &tls_block.join("\n"), Flags::default())
            .unwrap()
            .expect("the example is TLS");
        assert!(tls.roots_from.contains("redis-ca.pem"));
        assert!(tls.client.is_some());
    }

    #[test]
    fn mistakes_name_their_key_and_the_fix() {
        let dir = pki();
        let tls = "redis_url = \"rediss://127.0.0.1:6380\"\n";
        for (toml, key, says) in [
            (
                "redis_url = \"redis://127.0.0.1:6379\"\nredis_ca_file = \"ca.pem\"\n".to_owned(),
                "redis_ca_file",
                "write a rediss://",
            ),
            (
                "redis_client_cert = \"client.pem\"\n".to_owned(),
                "redis_client_cert",
                "no redis_url is set",
            ),
            (
                format!("{tls}redis_ca_file = \"missing.pem\"\n"),
                "redis_ca_file",
                "missing.pem",
            ),
            (
                format!("{tls}redis_ca_file = \"empty.pem\"\n"),
                "redis_ca_file",
                "holds no certificate",
            ),
            (
                format!("{tls}redis_ca_file = \"ca.pem\"\nredis_client_cert = \"client.pem\"\n"),
                "redis_client_key",
                "without its key",
            ),
            (
                format!("{tls}redis_ca_file = \"ca.pem\"\nredis_client_key = \"client.key\"\n"),
                "redis_client_cert",
                "without its certificate",
            ),
            (
                format!(
                    "{tls}redis_ca_file = \"ca.pem\"\nredis_client_cert = \"client.pem\"\nredis_client_key = \"other.key\"\n"
                ),
                "redis_client_key",
                "is not the key of the certificate",
            ),
            (
                format!(
                    "{tls}redis_ca_file = \"ca.pem\"\nredis_client_cert = \"client.pem\"\nredis_client_key = \"ca.pem\"\n"
                ),
                "redis_client_key",
                "cannot read a PEM private key",
            ),
        ] {
            let err = load(dir.path(), &toml, Flags::default()).unwrap_err();
            assert_eq!(err.key, key, "{toml}: {err}");
            assert!(err.message.contains(says), "{toml}: {err}");
        }
    }
}
