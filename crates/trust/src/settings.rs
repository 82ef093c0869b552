//! The trust settings: where an owner comes from, and the clients that may
//! prove themselves. The configuration reads the file into these.

use std::sync::Arc;

use http::HeaderName;
use jsonwebtoken::{DecodingKey, Validation};

/// Where the owner of a key comes from, and whether a keyed request may go
/// without one.
#[derive(Debug, Clone)]
pub struct OwnerRule {
    /// Tried in order; the first that yields a value is the owner.
    pub sources: Vec<OwnerSource>,
    /// Keyed requests with no owner share the owner `anonymous` instead of
    /// being refused.
    pub allow_anonymous: bool,
}

/// One place an owner may be read from. Its label (`header:x-user`, …)
/// is part of the owner's digest, so two sources never share an owner.
#[derive(Debug, Clone)]
pub enum OwnerSource {
    /// A request header, as sent (`authorization` by default).
    Header(HeaderName),
    /// A cookie, by name.
    Cookie(String),
    /// A claim of a JWT whose signature verifies.
    Jwt(Arc<JwtSource>),
    /// A header believed only from a trusted proxy.
    TrustedHeader(HeaderName),
    /// The name of the client that proved itself with a client key.
    Client,
    /// Every one of these together (tenant header + user claim); all must be
    /// present.
    All(Vec<OwnerSource>),
}

/// A JWT owner source: where the token is, how it is verified, which claim
/// names the owner.
#[derive(Clone)]
pub struct JwtSource {
    /// The claim whose value is the owner (`sub`).
    pub claim: String,
    /// The header carrying the token (a `Bearer ` prefix is stripped).
    pub from: HeaderName,
    /// The keys a signature may verify with, by `kid` where the keys name one.
    pub keys: Vec<(Option<String>, DecodingKey)>,
    /// Algorithms, expiry, not-before (within `leeway`), audience and
    /// issuer (required where configured).
    pub validation: Validation,
    /// The issuers of the other sources of its list that read the same
    /// claim from the same header (`docs/design.md` §15, "Several
    /// issuers"): a token one of them made is theirs to verify, not
    /// refused here.
    pub beside: Vec<String>,
    /// Whether its issuer is part of its owners: for every such source
    /// but the first, whose owners stay as they were before it had
    /// siblings.
    pub owned_by_issuer: bool,
}

impl JwtSource {
    /// Its `issuer`, where configured (the one its tokens must name).
    pub fn issuer(&self) -> Option<&String> {
        self.validation.iss.as_ref()?.iter().next()
    }
}

impl std::fmt::Debug for JwtSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtSource")
            .field("claim", &self.claim)
            .field("from", &self.from)
            .field("keys", &self.keys.len())
            .finish_non_exhaustive()
    }
}

impl OwnerSource {
    /// The headers this source believes only from a trusted proxy: removed
    /// from the requests of anyone else (`docs/design.md` §15).
    pub fn trusted_headers(&self) -> Vec<HeaderName> {
        match self {
            OwnerSource::TrustedHeader(name) => vec![name.clone()],
            OwnerSource::All(all) => all.iter().flat_map(OwnerSource::trusted_headers).collect(),
            _ => Vec::new(),
        }
    }

    /// What the source is, as part of an owner's digest and in answers that
    /// say which source was expected.
    pub fn label(&self) -> String {
        match self {
            OwnerSource::Header(name) => format!("header:{name}"),
            OwnerSource::Cookie(name) => format!("cookie:{name}"),
            // As it always was, but for a later source beside others on
            // its header and claim: its issuer tells their owners apart.
            OwnerSource::Jwt(jwt) => match (jwt.issuer(), jwt.owned_by_issuer) {
                (Some(issuer), true) => format!("jwt:{}:{}:{issuer}", jwt.from, jwt.claim),
                _ => format!("jwt:{}:{}", jwt.from, jwt.claim),
            },
            OwnerSource::TrustedHeader(name) => format!("trusted_header:{name}"),
            OwnerSource::Client => "client".to_owned(),
            OwnerSource::All(all) => {
                let parts: Vec<String> = all.iter().map(OwnerSource::label).collect();
                format!("all({})", parts.join("+"))
            }
        }
    }
}

/// A client of the gateway, proven by a key only its operator handed out.
#[derive(Clone)]
pub struct ClientSettings {
    /// Its name: logged, and the owner for the `client` source.
    pub name: String,
    /// SHA-256 of its key; the key itself is never configured.
    pub key_sha256: [u8; 32],
}

impl std::fmt::Debug for ClientSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientSettings")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The gateway's clients and where they present their key.
#[derive(Debug, Clone)]
pub struct Clients {
    /// The header carrying a client key (a `Bearer ` prefix is stripped).
    pub header: HeaderName,
    /// Every client.
    pub clients: Vec<ClientSettings>,
}
