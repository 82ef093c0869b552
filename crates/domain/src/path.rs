//! Request paths in their one normal form (`docs/design.md` §2, "Paths are
//! normalised first"), so that a route is matched on the path the upstream
//! will read, and the upstream is sent the path that was matched.
//!
//! RFC 3986 §6.2.2: percent-encodings of unreserved characters are decoded,
//! the hex of the others upper-cased, dot segments removed (§5.2.4, also
//! when they were percent-encoded), and repeated slashes merged. Bytes a
//! URI may not hold raw (non-ASCII, `"`, `{`, `|`, …) are percent-encoded,
//! as a browser would send them. Spellings that upstreams read in
//! different ways are refused instead ([`Ambiguity`]). Path case is
//! significant (RFC 3986 §6.2.2.1) and kept. Pure: no HTTP types, so the
//! settings can check route prefixes with it too.

use std::borrow::Cow;

/// A path spelling that upstreams read in different ways, so no single
/// normal form would be "the path the upstream reads". Each message says
/// what was found and what to send instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Ambiguity {
    /// `%2F`: a separator to some upstreams, part of a segment to others.
    #[error("the path contains `%2F`, an encoded `/`, which some upstreams read as a segment separator and others as part of a segment; send `/` between segments, or put the value in the query string")]
    EncodedSlash,
    /// `%5C`: a separator to some upstreams (those that read `\` as `/`).
    #[error("the path contains `%5C`, an encoded `\\`, which some upstreams read as `/`; send the value in the query string instead")]
    EncodedBackslash,
    /// `%00`: the end of the path to upstreams written in C.
    #[error("the path contains `%00`, a NUL byte, at which some upstreams end the path; send the path without it")]
    EncodedNul,
    /// A raw `\`: a separator to some upstreams.
    #[error("the path contains `\\`, which some upstreams read as `/`; send `/` between segments")]
    Backslash,
    /// `;`: the start of path parameters, cut before routing by some.
    #[error("the path contains `;`, where Java servlet containers cut path parameters off a segment before routing and other upstreams keep them; send a literal `;` as `%3B`, parameters in the query string")]
    PathParameter,
    /// A segment that ends in `.` but is no dot segment (`charges.`, also
    /// spelled `charges%2e`): Windows, IIS and frameworks that strip an
    /// empty extension read it without the dot, as another path.
    #[error("the path has a segment ending in `.` (such as `charges.`, or `charges%2e`), which some upstreams read without the dot; send the segment without it")]
    TrailingDot,
    /// A `..` with nothing left to remove.
    #[error("the path's `..` segments climb above `/`; send the path they lead to")]
    AboveRoot,
    /// A `%` not followed by two hex digits.
    #[error("the path contains a `%` not followed by two hex digits; send a literal `%` as `%25`")]
    MalformedPercent,
}

/// The normal form of `path` (a request's path, without its query):
/// borrowed when the path is normal already, which is the common case and
/// costs one scan and no allocation; rewritten otherwise; refused when
/// upstreams could read it two ways. A path that does not start with `/`
/// (`*`, an authority) is no route's and is returned as it is.
pub fn normalize(path: &str) -> Result<Cow<'_, str>, Ambiguity> {
    if !path.starts_with('/') || is_normal(path.as_bytes()) {
        return Ok(Cow::Borrowed(path));
    }
    rewrite(path).map(Cow::Owned)
}

/// Whether `path` (starting with `/`) is in normal form: one pass, no
/// allocation. Anything it is unsure of (including every refusal) is left
/// to [`rewrite`].
fn is_normal(path: &[u8]) -> bool {
    let mut i = 0;
    while let Some(&byte) = path.get(i) {
        match byte {
            b'/' if starts_dot_or_empty_segment(&path[i + 1..]) => return false,
            // A segment ending in `.`: refused by `rewrite`.
            b'.' if matches!(path.get(i + 1), None | Some(b'/')) => return false,
            b'%' => {
                if !is_kept_encoding(path.get(i + 1..i + 3)) {
                    return false;
                }
                i += 2;
            }
            _ if class(byte) == Class::Encoded => return false,
            _ => {}
        }
        i += 1;
    }
    true
}

/// Whether what follows a `/` is an empty segment or a dot segment.
fn starts_dot_or_empty_segment(rest: &[u8]) -> bool {
    matches!(
        rest,
        [b'/', ..] | [b'.'] | [b'.', b'/', ..] | [b'.', b'.'] | [b'.', b'.', b'/', ..]
    )
}

/// Whether the two digits after a `%` make an encoding a normal path
/// keeps: upper-case hex, of a byte that is neither unreserved nor refused.
fn is_kept_encoding(digits: Option<&[u8]>) -> bool {
    let Some(&[hi @ (b'0'..=b'9' | b'A'..=b'F'), lo @ (b'0'..=b'9' | b'A'..=b'F')]) = digits else {
        return false;
    };
    let byte = hex(hi) << 4 | hex(lo);
    class(byte) != Class::Unreserved && !matches!(byte, 0x00 | b'/' | b'\\')
}

/// The normal form of a path that [`is_normal`] did not pass: each segment
/// made canonical, then dot segments removed and empty ones merged as they
/// come (RFC 3986 §5.2.4 on an output buffer). A `/` never comes out of a
/// decoding (`%2F` is refused), so the raw path's segments are the decoded
/// path's.
fn rewrite(path: &str) -> Result<String, Ambiguity> {
    let mut out = String::with_capacity(path.len() + 8);
    // Whether the path ends with a `/`: after an empty or a dot segment
    // (`/a/` and `/a/.` are `/a/`, `/a/b/..` is `/a/`).
    let mut trailing = false;
    for segment in path[1..].split('/') {
        let start = out.len();
        out.push('/');
        canonical_segment(segment, &mut out)?;
        trailing = true;
        match &out[start + 1..] {
            "" | "." => out.truncate(start),
            ".." => {
                out.truncate(start);
                let parent = out.rfind('/').ok_or(Ambiguity::AboveRoot)?;
                out.truncate(parent);
            }
            dotted if dotted.ends_with('.') => return Err(Ambiguity::TrailingDot),
            _ => trailing = false,
        }
    }
    if trailing || out.is_empty() {
        out.push('/');
    }
    Ok(out)
}

/// Appends `segment` to `out` in canonical form: unreserved characters
/// decoded, other encodings with upper-case hex, bytes a URI may not hold
/// raw encoded, ambiguous ones refused.
fn canonical_segment(segment: &str, out: &mut String) -> Result<(), Ambiguity> {
    let bytes = segment.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        match byte {
            b'%' => {
                let decoded = match (bytes.get(i + 1), bytes.get(i + 2)) {
                    (Some(&hi), Some(&lo)) if hi.is_ascii_hexdigit() && lo.is_ascii_hexdigit() => {
                        hex(hi) << 4 | hex(lo)
                    }
                    _ => return Err(Ambiguity::MalformedPercent),
                };
                match decoded {
                    0x00 => return Err(Ambiguity::EncodedNul),
                    b'/' => return Err(Ambiguity::EncodedSlash),
                    b'\\' => return Err(Ambiguity::EncodedBackslash),
                    b if class(b) == Class::Unreserved => out.push(char::from(b)),
                    b => encode(b, out),
                }
                i += 2;
            }
            b'\\' => return Err(Ambiguity::Backslash),
            b';' => return Err(Ambiguity::PathParameter),
            b if matches!(class(b), Class::Unreserved | Class::Kept) => out.push(char::from(b)),
            b => encode(b, out),
        }
        i += 1;
    }
    Ok(())
}

/// How a byte is written in a normal path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// ALPHA / DIGIT / `-` `.` `_` `~`: always raw, never encoded.
    Unreserved,
    /// The rest of RFC 3986's `pchar` but `;`, and `/`: raw, and an
    /// encoding of one is kept (it may mean something else to the upstream).
    Kept,
    /// Anything else: percent-encoded (or refused by the rules above).
    Encoded,
}

/// A byte's class, looked up in a table: the scan of a normal path does
/// this once per byte.
fn class(byte: u8) -> Class {
    CLASSES[usize::from(byte)]
}

const CLASSES: [Class; 256] = {
    let mut table = [Class::Encoded; 256];
    let mut byte = 0;
    while byte < 256 {
        table[byte] = match byte as u8 {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                Class::Unreserved
            }
            b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b',' | b'=' | b':' | b'@'
            | b'/' => Class::Kept,
            _ => Class::Encoded,
        };
        byte += 1;
    }
    table
};

/// The value of one hex digit (the caller checked it is one).
fn hex(digit: u8) -> u8 {
    match digit {
        b'0'..=b'9' => digit - b'0',
        b'a'..=b'f' => digit - b'a' + 10,
        _ => digit - b'A' + 10,
    }
}

/// Appends `%XX`, upper-case (RFC 3986 §6.2.2.1).
fn encode(byte: u8, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(char::from(HEX[usize::from(byte >> 4)]));
    out.push(char::from(HEX[usize::from(byte & 0xF)]));
}

#[cfg(test)]
mod tests;
