//! Who is asking (`docs/design.md` §15): clients proven by their client key
//! before a credential of the operator's is spent for them, and the owner
//! of a key established from what the request proves — a header, a cookie,
//! a verified JWT claim, a header from a trusted proxy, the proven client —
//! and kept only as a digest salted with the deployment's secret.
//!
//! Pure decisions over a request's head; no I/O.

#![warn(unreachable_pub, missing_docs)]

mod clients;
mod headers;
mod jwt;
mod owner;
mod settings;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use http::HeaderMap;

use idemgate_domain::key::{Owner, OwnerSalt};
use idemgate_proxy::http::ProvenClient;

pub use settings::{ClientSettings, Clients, JwtSource, OwnerRule, OwnerSource};

/// Why who is asking could not be established (answered `401`, or `400`
/// for owner evidence sent in a form that names no one).
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    /// A keyed request whose owner could not be established, on a route
    /// that does not allow anonymous owners.
    #[error("this route needs to know who owns the key: send {expected}")]
    OwnerMissing {
        /// The sources the route reads, in words.
        expected: String,
    },
    /// A source's credential was sent but proves no owner: a token that
    /// does not verify, or names no owner (`docs/design.md` §15).
    #[error("the token sent for {what} proves no owner: {why}; send a valid one")]
    OwnerUnproven {
        /// The source, in words.
        what: String,
        /// What is wrong with what was sent.
        why: String,
    },
    /// A source's value was sent in a form that names no one for certain
    /// (twice, or empty): refused, never skipped for a wider owner's
    /// source that follows (`docs/design.md` §15).
    #[error("this key's owner cannot be read from {what}: {why}; send it once, with a value")]
    OwnerAmbiguous {
        /// The source, in words.
        what: String,
        /// What is wrong with what was sent.
        why: String,
    },
    /// The route serves only clients that prove themselves with a client
    /// key, and none was presented (or it matched no client).
    #[error("this route serves only the gateway's clients: send your client key in the {header} header (as `Bearer <key>`)")]
    ClientUnproven {
        /// Where the key goes.
        header: String,
    },
}

/// What the gateway trusts, built once at start-up.
pub struct Trust {
    salt: OwnerSalt,
    clients: Arc<Clients>,
    /// `[owner]`: how an operator's raw owner value is read in the admin API.
    default_owner: Arc<OwnerRule>,
}

impl Trust {
    /// Trust salted with `salt`, knowing `clients`.
    pub fn new(salt: OwnerSalt, clients: Arc<Clients>, default_owner: Arc<OwnerRule>) -> Self {
        Trust {
            salt,
            clients,
            default_owner,
        }
    }

    /// Trust that knows no client and reads owners from `Authorization`, as
    /// the defaults say (for tests and tools).
    pub fn with_salt(salt: OwnerSalt) -> Self {
        let clients = Clients {
            header: http::header::AUTHORIZATION,
            clients: Vec::new(),
        };
        let owner = OwnerRule {
            sources: vec![OwnerSource::Header(http::header::AUTHORIZATION)],
            allow_anonymous: false,
        };
        Trust::new(salt, Arc::new(clients), Arc::new(owner))
    }

    /// The client whose key `headers` carry, or why there is none.
    pub fn prove_client(&self, headers: &HeaderMap) -> Result<ProvenClient, TrustError> {
        clients::prove(&self.clients, headers).ok_or_else(|| TrustError::ClientUnproven {
            header: self.clients.header.to_string(),
        })
    }

    /// The owner of a keyed request on a route with `rule`: the first source
    /// that yields a value, or `anonymous` where the rule allows it. A
    /// source sent in a form that names no owner refuses the request,
    /// whatever follows it (`docs/design.md` §15).
    pub fn owner(
        &self,
        rule: &OwnerRule,
        head: &http::request::Parts,
    ) -> Result<Owner, TrustError> {
        for source in &rule.sources {
            if let Some(evidence) = owner::evidence(source, head)? {
                let parts: Vec<&[u8]> = evidence.iter().map(Vec::as_slice).collect();
                return Ok(Owner::of(&self.salt, &parts));
            }
        }
        if rule.allow_anonymous {
            return Ok(Owner::anonymous());
        }
        Err(TrustError::OwnerMissing {
            expected: owner::expected(&rule.sources),
        })
    }

    /// An owner as an operator writes it in the admin API: its stored form
    /// (`anonymous`, `hmac:<hex>`), or the raw value the first of `[owner]`'s
    /// sources reads (a header's value, a cookie's, a client's name).
    pub fn owner_from_admin(&self, text: &str) -> Option<Owner> {
        if let Some(owner) = Owner::parse_stored(text) {
            return Some(owner);
        }
        let source = self.default_owner.sources.first()?;
        match source {
            OwnerSource::Header(_)
            | OwnerSource::Cookie(_)
            | OwnerSource::TrustedHeader(_)
            | OwnerSource::Client => {
                let label = source.label();
                Some(Owner::of(&self.salt, &[label.as_bytes(), text.as_bytes()]))
            }
            OwnerSource::Jwt(_) | OwnerSource::All(_) => None,
        }
    }
}
