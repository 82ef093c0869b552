//! The client's `Idempotency-Key` and the owner it belongs to.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// A validated idempotency key: 1–255 visible ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why a key header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The header was present but empty.
    #[error("the idempotency key is empty")]
    Empty,
    /// An MCP tool call's `params._meta.idempotencyKey` that is not a
    /// string.
    #[error("params._meta.idempotencyKey must be a string")]
    NotAString,
    /// Longer than 255 characters.
    #[error("the idempotency key is longer than 255 characters")]
    TooLong,
    /// A character outside visible ASCII (0x21–0x7E).
    #[error("the idempotency key may only hold visible ASCII characters")]
    InvalidCharacter,
    /// A structured-field string that does not parse.
    #[error("the idempotency key is a malformed structured-field string")]
    MalformedString,
    /// A bare key with a comma: intermediaries join repeated header lines
    /// with commas, so such a key may be two keys joined (`docs/design.md`
    /// §11).
    #[error(
        "a bare key may not contain a comma (a proxy joins repeated header lines with \
         commas, so it could be two keys); send it as a structured-field string, \
         `Idempotency-Key: \"a,b\"`"
    )]
    Comma,
    /// The header was sent more than once on one request.
    #[error("the Idempotency-Key header was sent more than once; send one key, on one line")]
    Repeated,
}

impl IdempotencyKey {
    /// The longest key accepted.
    pub const MAX_LEN: usize = 255;

    /// Parses a header value in either form the contract accepts: the IETF
    /// structured-field string (`"abc"`, RFC 8941 §3.3.3) or the bare token
    /// (`abc`). Both forms of the same characters name the same key. A bare
    /// key may not hold a comma: `a,b` is what a proxy makes of two lines
    /// `a` and `b`; the quoted form `"a,b"` is one key.
    pub fn parse(raw: &[u8]) -> Result<Self, KeyError> {
        let raw = trim_ows(raw);
        let key = match raw {
            [b'"', rest @ ..] => unquote_sf_string(rest)?,
            _ if raw.contains(&b',') => return Err(KeyError::Comma),
            _ => raw.to_vec(),
        };
        Self::from_bytes(key)
    }

    /// Parses the request's `Idempotency-Key` header lines: `None` without
    /// one; two or more lines are refused, since which one the client meant
    /// cannot be told.
    pub fn from_lines<'a>(
        mut lines: impl Iterator<Item = &'a [u8]>,
    ) -> Option<Result<Self, KeyError>> {
        let first = lines.next()?;
        Some(match lines.next() {
            Some(_) => Err(KeyError::Repeated),
            None => Self::parse(first),
        })
    }

    /// Builds a key from its characters (already unquoted).
    pub fn new(key: impl Into<String>) -> Result<Self, KeyError> {
        Self::from_bytes(key.into().into_bytes())
    }

    fn from_bytes(key: Vec<u8>) -> Result<Self, KeyError> {
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > Self::MAX_LEN {
            return Err(KeyError::TooLong);
        }
        if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
            return Err(KeyError::InvalidCharacter);
        }
        // Checked just above: every byte is ASCII.
        String::from_utf8(key)
            .map(IdempotencyKey)
            .map_err(|_| KeyError::InvalidCharacter)
    }

    /// The key's characters.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// The body of an sf-string after its opening quote: `\"` and `\\` are the
/// only escapes, and the closing quote must end the value.
fn unquote_sf_string(rest: &[u8]) -> Result<Vec<u8>, KeyError> {
    let mut out = Vec::with_capacity(rest.len());
    let mut bytes = rest.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&c @ (b'"' | b'\\')) => out.push(c),
                _ => return Err(KeyError::MalformedString),
            },
            b'"' => {
                return if bytes.as_slice().is_empty() {
                    Ok(out)
                } else {
                    Err(KeyError::MalformedString)
                };
            }
            0x20..=0x7e => out.push(b),
            _ => return Err(KeyError::InvalidCharacter),
        }
    }
    Err(KeyError::MalformedString)
}

/// Who a key belongs to (`docs/design.md` §15): `anonymous`, or
/// `hmac:<hex>`, an HMAC-SHA256 under the deployment's [`OwnerSalt`] of the
/// evidence that proved the owner (which source, and what it read).
///
/// The evidence (often a bearer token or a session cookie) is never stored;
/// only its salted digest is, so a weak credential cannot be recovered from
/// the database or Redis by trying guesses without the salt.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Owner(String);

/// The per-deployment secret owner digests are salted with.
#[derive(Clone)]
pub struct OwnerSalt(Hmac<Sha256>);

impl OwnerSalt {
    /// A salt of these bytes (at least 16 of them, checked by the settings).
    pub fn new(secret: &[u8]) -> Self {
        OwnerSalt(Hmac::new_from_slice(secret).expect("HMAC takes a key of any length"))
    }
}

impl fmt::Debug for OwnerSalt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OwnerSalt(<redacted>)")
    }
}

impl Owner {
    /// The owner of keyed requests without one, where a route allows it.
    pub const ANONYMOUS: &'static str = "anonymous";

    /// The one owner every anonymous request shares.
    pub fn anonymous() -> Self {
        Owner(Self::ANONYMOUS.to_owned())
    }

    /// The owner proven by `evidence`: each part (which source, what it
    /// read) length-prefixed, so no two lists of parts digest alike.
    pub fn of(salt: &OwnerSalt, evidence: &[&[u8]]) -> Self {
        let mut mac = salt.0.clone();
        for part in evidence {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part);
        }
        Owner(format!("hmac:{}", hex::encode(mac.finalize().into_bytes())))
    }

    /// Accepts the stored form (`anonymous`, `hmac:<64 hex>`) as given by an
    /// operator; anything else is not an owner.
    pub fn parse_stored(value: &str) -> Option<Self> {
        if value == Self::ANONYMOUS {
            return Some(Self::anonymous());
        }
        let hex = value.strip_prefix("hmac:")?;
        (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| Owner(format!("hmac:{}", hex.to_ascii_lowercase())))
    }

    /// Rebuilds an owner read back from storage.
    pub fn from_stored(value: String) -> Self {
        Owner(value)
    }

    /// The stored form.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_and_sf_string_name_the_same_key() {
        let bare = IdempotencyKey::parse(b"order-42").unwrap();
        let quoted = IdempotencyKey::parse(br#""order-42""#).unwrap();
        assert_eq!(bare, quoted);
        assert_eq!(
            IdempotencyKey::parse(br#""a\"b\\c""#).unwrap().as_str(),
            r#"a"b\c"#
        );
    }

    #[test]
    fn refuses_bad_keys() {
        assert_eq!(IdempotencyKey::parse(b""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(b"\"\""), Err(KeyError::Empty));
        assert_eq!(
            IdempotencyKey::parse(b"a b"),
            Err(KeyError::InvalidCharacter)
        );
        assert_eq!(
            IdempotencyKey::parse("é".as_bytes()),
            Err(KeyError::InvalidCharacter)
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"abc"),
            Err(KeyError::MalformedString)
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"a\"b"),
            Err(KeyError::MalformedString)
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"a\\nb\""),
            Err(KeyError::MalformedString)
        );
        assert!(IdempotencyKey::parse(&[b'k'; 255]).is_ok());
        assert_eq!(IdempotencyKey::parse(&[b'k'; 256]), Err(KeyError::TooLong));
    }

    #[test]
    fn a_comma_is_refused_bare_and_kept_quoted() {
        assert_eq!(IdempotencyKey::parse(b"a,b"), Err(KeyError::Comma));
        assert_eq!(IdempotencyKey::parse(b" a, b "), Err(KeyError::Comma));
        assert_eq!(IdempotencyKey::parse(b","), Err(KeyError::Comma));
        assert_eq!(IdempotencyKey::parse(br#""a,b""#).unwrap().as_str(), "a,b");
        // `new` takes the key's characters, as stored: a comma is one of them.
        assert_eq!(IdempotencyKey::new("a,b").unwrap().as_str(), "a,b");
        let detail = KeyError::Comma.to_string();
        assert!(detail.contains(r#""a,b""#), "names what to send: {detail}");
    }

    #[test]
    fn one_line_is_a_key_two_lines_are_refused() {
        let one: [&[u8]; 1] = [b"order-42"];
        assert_eq!(
            IdempotencyKey::from_lines(one.into_iter()),
            Some(Ok(IdempotencyKey::new("order-42").unwrap()))
        );
        let two: [&[u8]; 2] = [b"a", b"a"];
        assert_eq!(
            IdempotencyKey::from_lines(two.into_iter()),
            Some(Err(KeyError::Repeated))
        );
        assert_eq!(IdempotencyKey::from_lines(std::iter::empty()), None);
    }

    #[test]
    fn owner_is_a_salted_digest_never_raw() {
        let salt = OwnerSalt::new(b"a deployment's secret, 32 bytes!");
        let owner = Owner::of(&salt, &[b"header:authorization", b"Bearer secret"]);
        assert!(owner.as_str().starts_with("hmac:"));
        assert!(!owner.as_str().contains("secret"));
        assert_eq!(Owner::parse_stored(owner.as_str()), Some(owner.clone()));
        assert_eq!(Owner::parse_stored("Bearer secret"), None);
        assert_eq!(Owner::anonymous().as_str(), "anonymous");
        // Another deployment's salt, another source, or the same bytes split
        // otherwise: another owner.
        let other_salt = OwnerSalt::new(b"another deployment's secret.....");
        assert_ne!(
            Owner::of(&other_salt, &[b"header:authorization", b"Bearer secret"]),
            owner
        );
        assert_ne!(Owner::of(&salt, &[b"cookie:sid", b"Bearer secret"]), owner);
        assert_ne!(
            Owner::of(&salt, &[b"header:authorizationBearer", b" secret"]),
            owner
        );
    }

    mod props {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn any_header_value_parses_or_is_a_typed_refusal(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
                if let Ok(key) = IdempotencyKey::parse(&raw) {
                    let s = key.as_str();
                    prop_assert!(!s.is_empty() && s.len() <= IdempotencyKey::MAX_LEN);
                    prop_assert!(s.bytes().all(|b| (0x21..=0x7e).contains(&b)));
                }
            }

            #[test]
            fn the_quoted_form_names_the_same_key(key in "[!-~]{1,200}") {
                let bare = IdempotencyKey::new(key.clone()).unwrap();
                let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
                prop_assert_eq!(IdempotencyKey::parse(quoted.as_bytes()), Ok(bare.clone()));
                if !key.starts_with('"') && !key.contains(',') {
                    prop_assert_eq!(IdempotencyKey::parse(key.as_bytes()), Ok(bare));
                }
            }

            #[test]
            fn a_bare_key_with_a_comma_is_always_refused(a in "[!-~]{0,100}", b in "[!-~]{0,100}") {
                let joined = format!("{a},{b}");
                if !joined.starts_with('"') {
                    prop_assert_eq!(IdempotencyKey::parse(joined.as_bytes()), Err(KeyError::Comma));
                }
            }

            #[test]
            fn owners_are_a_digest_and_read_back_from_storage(raw in proptest::collection::vec(any::<u8>(), 0..200), text in ".{0,100}") {
                let owner = Owner::of(&OwnerSalt::new(b"props"), &[b"header:x", &raw]);
                let s = owner.as_str();
                prop_assert!(s.len() == 69 && s.starts_with("hmac:") && s[5..].bytes().all(|b| b.is_ascii_hexdigit()));
                prop_assert_eq!(Owner::parse_stored(s), Some(owner.clone()));
                // Any other text is an owner only in the stored forms.
                if let Some(parsed) = Owner::parse_stored(&text) {
                    prop_assert!(parsed.as_str() == Owner::ANONYMOUS || parsed.as_str().starts_with("hmac:"));
                }
            }
        }
    }
}
