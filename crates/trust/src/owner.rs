//! Reading an owner source off a request's head. What a source reads is
//! its evidence: the source's label, then the value(s) it found; the owner
//! is their salted digest. A source that was not sent lets the next one be
//! tried; one that was sent but cannot name an owner (twice, empty, a
//! token that does not verify) refuses the request, whatever sources
//! follow (`docs/design.md` §15): skipping it would hand the request to a
//! wider owner, and that owner's stored answer to it.

use http::header::COOKIE;
use http::request::Parts;
use http::HeaderMap;

use super::headers::{one, One};
use super::jwt;
use crate::settings::OwnerSource;
use crate::TrustError;
use idemgate_proxy::http::{ClientAddr, ProvenClient};

/// What a source makes of a request.
pub(super) enum Read {
    /// Nothing of it was sent (or, for a trusted header, not by a trusted
    /// proxy): the next source is tried.
    Absent,
    /// Its values, pushed onto the evidence.
    Found,
}

/// What `source` finds in `head`: its label and value(s); `None` when it
/// finds nothing; an error when what it finds cannot name an owner.
pub(super) fn evidence(
    source: &OwnerSource,
    head: &Parts,
) -> Result<Option<Vec<Vec<u8>>>, TrustError> {
    let mut found = vec![source.label().into_bytes()];
    match values(source, head, &mut found)? {
        Read::Absent => Ok(None),
        Read::Found => Ok(Some(found)),
    }
}

fn values(
    source: &OwnerSource,
    head: &Parts,
    found: &mut Vec<Vec<u8>>,
) -> Result<Read, TrustError> {
    let value = match source {
        OwnerSource::Header(name) => header(source, one(&head.headers, name))?,
        OwnerSource::Cookie(name) => cookie(source, &head.headers, name)?,
        OwnerSource::Jwt(jwt) => {
            jwt::claim(jwt, &head.headers).map_err(|why| refusal(source, why))?
        }
        OwnerSource::TrustedHeader(name) => {
            let trusted = head
                .extensions
                .get::<ClientAddr>()
                .is_some_and(|c| c.trusted);
            // From anyone else the header is not believed, nor forwarded
            // (`src/app/stack.rs`): as good as not sent.
            if !trusted {
                return Ok(Read::Absent);
            }
            header(source, one(&head.headers, name))?
        }
        OwnerSource::Client => head
            .extensions
            .get::<ProvenClient>()
            .map(|client| client.0.as_bytes().to_vec()),
        OwnerSource::All(all) => return every(all, head, found),
    };
    Ok(match value {
        Some(value) => {
            found.push(value);
            Read::Found
        }
        None => Read::Absent,
    })
}

/// Every part of an `all`: absent if one part is not sent (the next source
/// is tried), refused if one part is refused, even after an absent one.
fn every(all: &[OwnerSource], head: &Parts, found: &mut Vec<Vec<u8>>) -> Result<Read, TrustError> {
    let mut absent = false;
    for part in all {
        if let Read::Absent = values(part, head, found)? {
            absent = true;
        }
    }
    Ok(if absent { Read::Absent } else { Read::Found })
}

/// A header's one value, or why it cannot be one.
fn header(source: &OwnerSource, sent: One<'_>) -> Result<Option<Vec<u8>>, TrustError> {
    if let Some(why) = sent.flaw() {
        return Err(ambiguous(source, why));
    }
    Ok(match sent {
        One::Value(value) => Some(value.to_vec()),
        _ => None,
    })
}

/// A cookie's value, from every `Cookie` header; a name sent twice with
/// two values, sent empty or sent without `=` is ambiguous.
///
/// Read as bytes, `;`-separated `name=value` pairs trimmed of spaces, the
/// value as sent (the owner is a MAC of bytes). Not as text: a browser
/// sends all its cookies on one line, and one other cookie holding UTF-8
/// (`city=Zürich`) would make the whole line unreadable, so the session
/// cookie it carries would count as not sent and the request fall to the
/// next, wider source, with that owner's stored answers (`docs/design.md`
/// §15, "Evidence is refused, never skipped").
fn cookie(
    source: &OwnerSource,
    headers: &HeaderMap,
    name: &str,
) -> Result<Option<Vec<u8>>, TrustError> {
    let mut found: Option<&[u8]> = None;
    for line in headers.get_all(COOKIE) {
        for pair in line.as_bytes().split(|&b| b == b';') {
            let (key, value) = match pair.iter().position(|&b| b == b'=') {
                Some(at) => (pair[..at].trim_ascii(), Some(pair[at + 1..].trim_ascii())),
                None => (pair.trim_ascii(), None),
            };
            if key != name.as_bytes() {
                continue;
            }
            let value = match value {
                Some([]) => return Err(ambiguous(source, "it was sent empty")),
                Some(value) => value,
                None => return Err(ambiguous(source, "it was sent without a value")),
            };
            match found {
                Some(seen) if seen != value => {
                    return Err(ambiguous(source, "it was sent twice, with two values"))
                }
                _ => found = Some(value),
            }
        }
    }
    Ok(found.map(<[u8]>::to_vec))
}

fn ambiguous(source: &OwnerSource, why: &str) -> TrustError {
    TrustError::OwnerAmbiguous {
        what: describe(source),
        why: why.to_owned(),
    }
}

fn refusal(source: &OwnerSource, why: jwt::Refusal) -> TrustError {
    match why {
        jwt::Refusal::Ambiguous(why) => ambiguous(source, why),
        jwt::Refusal::Unverified(why) => TrustError::OwnerUnproven {
            what: describe(source),
            why,
        },
    }
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
