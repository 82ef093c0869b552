//! Reading an owner source off a request's head. What a source reads is
//! its evidence: the source's label, then the value(s) it found; the owner
//! is their salted digest.

use http::header::COOKIE;
use http::request::Parts;
use http::HeaderMap;

use super::headers::only;
use super::jwt;
use crate::settings::OwnerSource;
use idemgate_proxy::http::{ClientAddr, ProvenClient};

/// What `source` finds in `head`: its label and value(s), or `None` when it
/// finds nothing it can stand behind (absent, empty, ambiguous, unverified,
/// or not from a trusted proxy).
pub(super) fn evidence(source: &OwnerSource, head: &Parts) -> Option<Vec<Vec<u8>>> {
    let mut found = vec![source.label().into_bytes()];
    values(source, head, &mut found)?;
    Some(found)
}

fn values(source: &OwnerSource, head: &Parts, found: &mut Vec<Vec<u8>>) -> Option<()> {
    let value = match source {
        OwnerSource::Header(name) => only(&head.headers, name)?.to_vec(),
        OwnerSource::Cookie(name) => cookie(&head.headers, name)?.into_bytes(),
        OwnerSource::Jwt(source) => jwt::claim(source, &head.headers)?.into_bytes(),
        OwnerSource::TrustedHeader(name) => {
            let peer = head.extensions.get::<ClientAddr>()?;
            if !peer.trusted {
                return None;
            }
            only(&head.headers, name)?.to_vec()
        }
        OwnerSource::Client => head.extensions.get::<ProvenClient>()?.0.as_bytes().to_vec(),
        OwnerSource::All(all) => {
            for source in all {
                values(source, head, found)?;
            }
            return Some(());
        }
    };
    found.push(value);
    Some(())
}

/// A cookie's value, from every `Cookie` header; a name sent twice with
/// two values is ambiguous.
fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    let mut found: Option<String> = None;
    for line in headers.get_all(COOKIE) {
        let Ok(line) = line.to_str() else { continue };
        for parsed in cookie::Cookie::split_parse(line).flatten() {
            if parsed.name() != name || parsed.value().is_empty() {
                continue;
            }
            match &found {
                Some(seen) if seen != parsed.value() => return None,
                _ => found = Some(parsed.value().to_owned()),
            }
        }
    }
    found
}

/// The sources a route reads, in words for a 401's detail.
pub(super) fn expected(sources: &[OwnerSource]) -> String {
    let words: Vec<String> = sources.iter().map(describe).collect();
    words.join(", or ")
}

fn describe(source: &OwnerSource) -> String {
    match source {
        OwnerSource::Header(name) => format!("the {name} header"),
        OwnerSource::Cookie(name) => format!("the {name} cookie"),
        OwnerSource::Jwt(jwt) => format!(
            "a valid signed JWT (with a `{}` claim) in the {} header",
            jwt.claim, jwt.from
        ),
        OwnerSource::TrustedHeader(name) => {
            format!("the {name} header, through a trusted proxy")
        }
        OwnerSource::Client => "your client key".to_owned(),
        OwnerSource::All(all) => {
            let parts: Vec<String> = all.iter().map(describe).collect();
            parts.join(" and ")
        }
    }
}
