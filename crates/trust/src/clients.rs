//! Clients proven by their client key: its SHA-256 compared with every
//! configured digest in constant time (the gateway never holds the keys).

use http::HeaderMap;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::headers::{bearer, only};
use crate::settings::Clients;
use idemgate_proxy::http::ProvenClient;

/// The client whose key `headers` carry, if any.
pub(super) fn prove(clients: &Clients, headers: &HeaderMap) -> Option<ProvenClient> {
    let raw = std::str::from_utf8(only(headers, &clients.header)?).ok()?;
    let digest: [u8; 32] = Sha256::digest(bearer(raw).as_bytes()).into();
    // Every digest is compared, so the time taken names no client.
    let mut proven = None;
    for client in &clients.clients {
        if bool::from(client.key_sha256.ct_eq(&digest)) {
            proven = Some(ProvenClient(client.name.as_str().into()));
        }
    }
    proven
}
