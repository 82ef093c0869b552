//! TLS to PostgreSQL over rustls, as libpq's `sslmode` says
//! (docs/design.md §16): what is checked of the server's certificate, the
//! client certificate offered, and which refusals mean the settings are
//! wrong rather than the server away.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::config::SslMode as WireMode;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::settings::Check;
use super::settings::{PgTls, SslMode};
use crate::StoreError;

/// The TLS connector for connections made with `tls`.
pub(super) fn connector(tls: &PgTls) -> Result<MakeRustlsConnect, StoreError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier: Arc<dyn ServerCertVerifier> = match tls.check() {
        Check::Nothing => Arc::new(ShortOfHost {
            roots: None,
            provider: provider.clone(),
        }),
        Check::Chain => Arc::new(ShortOfHost {
            roots: Some(roots(&tls.roots)),
            provider: provider.clone(),
        }),
        Check::ChainAndHost => {
            WebPkiServerVerifier::builder_with_provider(roots(&tls.roots), provider.clone())
                .build()
                .map_err(|e| StoreError::Internal(Box::new(e)))?
        }
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| StoreError::Internal(Box::new(e)))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let config = match &tls.identity {
        None => builder.with_no_client_auth(),
        Some(identity) => builder
            .with_client_auth_cert(identity.chain.clone(), identity.key())
            .map_err(|e| StoreError::Internal(Box::new(e)))?,
    };
    Ok(MakeRustlsConnect::new(config))
}

/// What tokio-postgres is told: whether to ask for TLS, and whether to go
/// on without it. The verify modes are `require` plus the checks above.
pub(super) fn wire_mode(mode: SslMode) -> WireMode {
    match mode {
        SslMode::Disable => WireMode::Disable,
        SslMode::Prefer => WireMode::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => WireMode::Require,
    }
}

fn roots(certs: &[CertificateDer<'static>]) -> Arc<RootCertStore> {
    let mut store = RootCertStore::empty();
    let (_, unusable) = store.add_parsable_certificates(certs.iter().cloned());
    if unusable > 0 {
        tracing::warn!(
            unusable,
            "skipping CA certificates that cannot be parsed as trust anchors"
        );
    }
    Arc::new(store)
}

/// The refusal behind `e` when the connection failed because a
/// certificate was refused (the server's by the gateway, or the gateway's
/// by the server): a setting to fix, not a server that is away.
pub(super) fn certificate_refusal(e: &tokio_postgres::Error) -> Option<&rustls::Error> {
    let mut source = std::error::Error::source(e);
    while let Some(error) = source {
        let inner = error
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|inner| inner as &(dyn std::error::Error + 'static))
            .unwrap_or(error);
        if let Some(tls) = inner.downcast_ref::<rustls::Error>() {
            return match tls {
                rustls::Error::InvalidCertificate(_)
                | rustls::Error::AlertReceived(
                    rustls::AlertDescription::BadCertificate
                    | rustls::AlertDescription::UnknownCA
                    | rustls::AlertDescription::CertificateRequired
                    | rustls::AlertDescription::CertificateUnknown
                    | rustls::AlertDescription::UnsupportedCertificate
                    | rustls::AlertDescription::CertificateExpired
                    | rustls::AlertDescription::CertificateRevoked
                    | rustls::AlertDescription::AccessDenied,
                ) => Some(tls),
                _ => None,
            };
        }
        source = error.source();
    }
    None
}

/// What libpq checks short of `verify-full`: with `roots`, `verify-ca`
/// (the chain against the roots, not the host name: the server may be
/// reached by an address its certificate does not name); without,
/// `prefer` and `require` without a root file (the certificate is not
/// checked: encrypted, not authenticated; the start-up log says so). The
/// handshake's own signatures are checked either way, so the session is
/// with whoever holds the presented certificate's key.
#[derive(Debug)]
struct ShortOfHost {
    roots: Option<Arc<RootCertStore>>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for ShortOfHost {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if let Some(roots) = &self.roots {
            let cert = rustls::server::ParsedCertificate::try_from(end_entity)?;
            rustls::client::verify_server_cert_signed_by_trust_anchor(
                &cert,
                roots,
                intermediates,
                now,
                self.provider.signature_verification_algorithms.all,
            )?;
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
