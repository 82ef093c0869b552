//! The request fingerprint: what a duplicate must match to be replayed.
//!
//! SHA-256 over the method, the path and query, the configured significant
//! headers and the body. Every part is length-prefixed, so no two different
//! requests can frame to the same bytes. A route may canonicalise JSON bodies
//! (object keys sorted, so key order does not matter; numbers as written)
//! and drop fields named by JSON pointers (a client-side timestamp, a trace
//! id) before hashing; a body it cannot canonicalise unambiguously (a member
//! named twice) is refused ([`canonical`]). A multipart body is hashed
//! without its boundary, in the body and in its `Content-Type`: framing a
//! client draws anew for every try (`docs/design.md` §11, "A multipart
//! boundary is framing").

use std::fmt;

use sha2::{Digest, Sha256};

mod canonical;

/// A JSON member's name as a matcher that ignores case sees it (Go's
/// `encoding/json`): what two names must not share in a message read by
/// name (`docs/design.md` §11, "Canonical JSON").
pub fn fold_name(name: &str) -> String {
    canonical::fold(name)
}

/// A JSON body that names an object member twice: parsers disagree on
/// which one counts, so it has no one meaning to fingerprint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the JSON body names the member {pointer} more than once, and JSON parsers disagree \
     on which one counts; send each member of an object once"
)]
pub struct AmbiguousJson {
    /// The JSON pointer (RFC 6901) of the member named twice.
    pub pointer: String,
}

/// A SHA-256 request fingerprint.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(self.0))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl Fingerprint {
    /// Rebuilds a stored fingerprint.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Fingerprint)
    }
}

/// How a route fingerprints its bodies.
#[derive(Debug, Clone, Default)]
pub struct BodyRule {
    /// Hash JSON bodies in canonical form (object keys sorted, numbers as
    /// written, a member named twice refused).
    pub canonical_json: bool,
    /// JSON pointers (RFC 6901) of fields left out of the hash.
    pub ignore: Vec<String>,
}

/// The parts of a request that make up its fingerprint.
pub struct RequestParts<'a> {
    /// `POST`, `PATCH`, …
    pub method: &'a str,
    /// Path and query as received.
    pub path_and_query: &'a str,
    /// The significant headers: lower-case name and every line of it, in
    /// configured order and as sent. An absent header has no line, which
    /// hashes differently from an empty one.
    pub headers: Vec<(&'a str, Vec<&'a [u8]>)>,
    /// The whole body.
    pub body: &'a [u8],
    /// The boundary of a multipart body, as its `Content-Type` names it
    /// ([`multipart_boundary`]).
    pub boundary: Option<&'a [u8]>,
}

/// The boundary a multipart body's `Content-Type` names (RFC 2046
/// §5.1.1), if any: how the body's parts are delimited, which httpx and
/// browsers draw at random for every try, so no part of what the request
/// asks. `content_types` are the request's `Content-Type` lines: of two,
/// or a boundary named twice in one, parsers disagree on which counts, and
/// none is taken.
pub fn multipart_boundary<'a>(content_types: impl IntoIterator<Item = &'a [u8]>) -> Option<String> {
    let mut lines = content_types.into_iter();
    let (Some(line), None) = (lines.next(), lines.next()) else {
        return None;
    };
    // Every keyed request comes here: a JSON one is no media type to parse.
    let multipart = line.trim_ascii_start().get(..10);
    if !multipart.is_some_and(|t| t.eq_ignore_ascii_case(b"multipart/")) {
        return None;
    }
    let media: mime::Mime = std::str::from_utf8(line).ok()?.parse().ok()?;
    let named = media.params().filter(|(name, _)| *name == mime::BOUNDARY);
    if named.count() != 1 {
        return None;
    }
    let boundary = media.get_param(mime::BOUNDARY)?.as_str();
    (!boundary.is_empty()).then(|| boundary.to_owned())
}

/// What marks a significant header's second line, and each after it.
const EXTRA_LINE: u8 = 3;

/// Computes the fingerprint of a request under a route's body rule; a body
/// the rule canonicalises is refused when it is ambiguous JSON.
pub fn fingerprint(
    parts: &RequestParts<'_>,
    rule: &BodyRule,
) -> Result<Fingerprint, AmbiguousJson> {
    let mut h = Sha256::new();
    frame(&mut h, parts.method.as_bytes());
    frame(&mut h, parts.path_and_query.as_bytes());
    for (name, lines) in &parts.headers {
        frame(&mut h, name.as_bytes());
        let Some((first, more)) = lines.split_first() else {
            h.update([0]);
            continue;
        };
        h.update([1]);
        match parts.boundary.filter(|_| *name == "content-type") {
            Some(boundary) => framed_without_boundary(&mut h, first, boundary),
            None => frame(&mut h, first),
        }
        // Every further line counts too: a retry that adds a line (a second
        // `Content-Type`, which an upstream may read instead of the first)
        // is another request. Marked apart from what may follow a header
        // (the next name's length, whose first byte is 0, or the body's
        // 0, 1 or 2), so a header of one line hashes as it always did.
        // (It was 2 once, a multipart body's mark too: an empty second
        // line then hashed as an unopened multipart body of one piece.)
        for line in more {
            h.update([EXTRA_LINE]);
            frame(&mut h, line);
        }
    }
    if let Some(boundary) = parts.boundary {
        h.update([2]);
        framed_parts(&mut h, parts.body, boundary);
        return Ok(Fingerprint(h.finalize().into()));
    }
    match canonical_body(parts.body, rule)? {
        Some(canonical) => {
            h.update([1]);
            frame(&mut h, &canonical);
        }
        None => {
            h.update([0]);
            frame(&mut h, parts.body);
        }
    }
    Ok(Fingerprint(h.finalize().into()))
}

fn frame(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

/// Hashes a multipart `body` as the pieces between its delimiters: a
/// line break, `--` and the `boundary` (RFC 2046 §5.1.1: no part may hold
/// one, and a parser ends a part at the first), or `--` and the boundary
/// where the body starts, each a whole delimiter line ([`delimits`]). The
/// boundary spelled anywhere else (mid-line, or with more on its line) is
/// a part's content, as a parser reads it, and hashed as such.
fn framed_parts(h: &mut Sha256, body: &[u8], boundary: &[u8]) {
    let opening = [b"--", boundary].concat();
    let (opened, rest) = match body
        .strip_prefix(opening.as_slice())
        .filter(|r| delimits(r))
    {
        Some(rest) => (1, rest),
        None => (0, body),
    };
    h.update([opened]);
    let cut = [b"\r\n--", boundary].concat();
    let delimiters: Vec<usize> = memchr::memmem::find_iter(rest, &cut)
        .filter(|&at| delimits(&rest[at + cut.len()..]))
        .collect();
    h.update(((delimiters.len() + 1) as u64).to_be_bytes());
    let mut from = 0;
    for at in delimiters {
        frame(h, &rest[from..at]);
        from = at + cut.len();
    }
    frame(h, &rest[from..]);
}

/// Whether what follows `--` and a boundary ends its line as a delimiter
/// does (RFC 2046 §5.1.1): `--` for the last, then any spaces or tabs,
/// then a line break or the body's end. `--AAAAX` is a part's content,
/// as a parser reads it, not `--AAAA` and `X`.
fn delimits(after: &[u8]) -> bool {
    let after = after.strip_prefix(b"--").unwrap_or(after);
    let padding = after
        .iter()
        .take_while(|&&b| b == b' ' || b == b'\t')
        .count();
    let rest = &after[padding..];
    rest.is_empty() || rest.starts_with(b"\r\n")
}

/// Hashes a `Content-Type` line without its `boundary` parameter's value:
/// the two pieces around it, as [`framed_without`] hashes a line that
/// spells the boundary once. Only the parameter's value is cut, not every
/// spelling of its text: a boundary named `form-data` would otherwise cut
/// the subtype too, and `multipart/form-data` and `multipart/mixed` hash
/// alike.
fn framed_without_boundary(h: &mut Sha256, line: &[u8], boundary: &[u8]) {
    let named = memchr::memmem::find_iter(line, boundary).find(|&at| {
        let before = &line[..at];
        let before = before.strip_suffix(b"\"").unwrap_or(before);
        let Some(start) = before.len().checked_sub(b"boundary=".len()) else {
            return false;
        };
        let after_separator = start == 0 || matches!(before[start - 1], b';' | b' ' | b'\t');
        before[start..].eq_ignore_ascii_case(b"boundary=") && after_separator
    });
    let Some(at) = named else {
        return framed_without(h, line, boundary);
    };
    h.update(2u64.to_be_bytes());
    frame(h, &line[..at]);
    frame(h, &line[at + boundary.len()..]);
}

/// Hashes `bytes` as the pieces between the occurrences of `cut`: their
/// number, then each framed. The same pieces however `cut` was spelled,
/// and no two different sequences of pieces alike.
fn framed_without(h: &mut Sha256, bytes: &[u8], cut: &[u8]) {
    let pieces = memchr::memmem::find_iter(bytes, cut).count() + 1;
    h.update((pieces as u64).to_be_bytes());
    let mut rest = bytes;
    while let Some(at) = memchr::memmem::find(rest, cut) {
        frame(h, &rest[..at]);
        rest = &rest[at + cut.len()..];
    }
    frame(h, rest);
}

/// At most the bytes canonicalising `body` under `rule` holds while it
/// runs (its parse tree and its canonical form), 0 when the rule does not
/// canonicalise or the body is no JSON object or array (hashed raw: a
/// bare JSON scalar is small). Each value in the tree takes a node of its own, a few
/// dozen bytes, so a body of many small values (`[0,0,0,…]`) takes tens of
/// times its size: counted against the memory budget before the parse
/// (`docs/design.md` §18). Every value but the first follows a `,`, `:`,
/// `[` or `{`; counting those bytes (inside strings too) can only count
/// more values than there are.
pub fn canonical_footprint(body: &[u8], rule: &BodyRule) -> usize {
    let json = matches!(body.trim_ascii_start().first(), Some(b'{' | b'['));
    if !rule.canonical_json && rule.ignore.is_empty() || !json {
        return 0;
    }
    /// A node (32 bytes), its place in a vector grown by doubling (up to
    /// twice that), and the two vectors of a reallocation live at once.
    const PER_VALUE: usize = 128;
    let values = 1 + body
        .iter()
        .filter(|&&b| matches!(b, b',' | b':' | b'[' | b'{'))
        .count();
    values
        .saturating_mul(PER_VALUE)
        .saturating_add(2 * body.len())
}

/// The canonical JSON form of a body, when the rule asks for it and the body
/// is JSON. A body that is not JSON is hashed as raw bytes instead: raw bytes
/// never make two different bodies one intent.
fn canonical_body(body: &[u8], rule: &BodyRule) -> Result<Option<Vec<u8>>, AmbiguousJson> {
    if !rule.canonical_json && rule.ignore.is_empty() {
        return Ok(None);
    }
    let mut node = match canonical::parse(body) {
        Ok(node) => node,
        Err(canonical::Refused::NotJson) => return Ok(None),
        Err(canonical::Refused::Duplicate(path)) => {
            let pointer = canonical::pointer(&path);
            return Err(AmbiguousJson { pointer });
        }
    };
    for pointer in &rule.ignore {
        canonical::remove(&mut node, pointer);
    }
    let mut out = Vec::with_capacity(body.len());
    canonical::write(&node, &mut out);
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(body: &[u8], rule: &BodyRule) -> Fingerprint {
        try_fp(body, rule).unwrap()
    }

    fn try_fp(body: &[u8], rule: &BodyRule) -> Result<Fingerprint, AmbiguousJson> {
        fingerprint(
            &RequestParts {
                method: "POST",
                path_and_query: "/v1/charges",
                headers: vec![("content-type", vec![b"application/json"])],
                body,
                boundary: None,
            },
            rule,
        )
    }

    const CANONICAL: BodyRule = BodyRule {
        canonical_json: true,
        ignore: vec![],
    };

    #[test]
    fn every_part_counts() {
        let rule = BodyRule::default();
        let base = fp(br#"{"a":1}"#, &rule);
        assert_ne!(base, fp(br#"{"a":2}"#, &rule));
        let other_path = fingerprint(
            &RequestParts {
                method: "POST",
                path_and_query: "/v1/refunds",
                headers: vec![("content-type", vec![b"application/json"])],
                body: br#"{"a":1}"#,
                boundary: None,
            },
            &rule,
        )
        .unwrap();
        assert_ne!(base, other_path);
        let no_header = fingerprint(
            &RequestParts {
                method: "POST",
                path_and_query: "/v1/charges",
                headers: vec![("content-type", vec![])],
                body: br#"{"a":1}"#,
                boundary: None,
            },
            &rule,
        )
        .unwrap();
        assert_ne!(base, no_header);
        let repeated = fingerprint(
            &RequestParts {
                method: "POST",
                path_and_query: "/v1/charges",
                headers: vec![(
                    "content-type",
                    vec![b"application/json", b"application/x-www-form-urlencoded"],
                )],
                body: br#"{"a":1}"#,
                boundary: None,
            },
            &rule,
        )
        .unwrap();
        assert_ne!(base, repeated, "a line added to a significant header");
    }

    /// A multipart request as httpx sends it, under `boundary`: the same
    /// parts, delimited by it, and a `Content-Type` naming it (quoted or
    /// not, as `quoted` says).
    fn multipart(boundary: &str, quoted: bool, file: &str) -> Fingerprint {
        multipart_as("multipart/form-data", boundary, quoted, file)
    }

    /// The same as `media`.
    fn multipart_as(media: &str, boundary: &str, quoted: bool, file: &str) -> Fingerprint {
        let body = format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n\
             fine-tune\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; \
             filename=\"a.jsonl\"\r\n\r\n{file}\r\n--{boundary}--\r\n"
        );
        let header = match quoted {
            true => format!("{media}; boundary=\"{boundary}\""),
            false => format!("{media}; boundary={boundary}"),
        };
        let named = multipart_boundary([header.as_bytes()]);
        assert_eq!(named.as_deref(), Some(boundary));
        fingerprint(
            &RequestParts {
                method: "POST",
                path_and_query: "/v1/files",
                headers: vec![("content-type", vec![header.as_bytes()])],
                body: body.as_bytes(),
                boundary: named.as_deref().map(str::as_bytes),
            },
            &BodyRule::default(),
        )
        .unwrap()
    }

    #[test]
    fn a_multipart_boundary_is_framing_not_content() {
        let first = multipart("5ded705948d6888c3d6efb422f4f64e5", false, "{}");
        let retry = multipart("0b6a1c1e2f3d4c5b6a798897a6b5c4d3", false, "{}");
        assert_eq!(first, retry, "another boundary, the same request");
        let quoted = multipart("x-y", true, "{}");
        assert_eq!(
            quoted,
            multipart("y-z", true, "{}"),
            "quoted, as some send it"
        );
        assert_ne!(
            first,
            multipart("5ded705948d6888c3d6efb422f4f64e5", false, "{ }")
        );
        // The boundary spelled inside a part is content, as its own
        // delimiter would not be.
        assert_ne!(
            multipart("b1", false, "--b2"),
            multipart("b2", false, "--b1"),
        );
        // Nor mid-line, where a parser reads it as content.
        assert_ne!(
            multipart("B1", false, "x--B1"),
            multipart("B2", false, "x--B2")
        );
        // Nor at a line's start with more on its line: no delimiter.
        // Before, `--AAAA` was cut there, and the two were one request.
        assert_ne!(
            multipart("AAAA", false, "pay alice\r\n--AAAAX"),
            multipart("BBBB", false, "pay alice\r\n--BBBBX")
        );
        for delimiter in [&b"\r\n"[..], b"--\r\n", b"  \t\r\n", b"--", b""] {
            assert!(delimits(delimiter), "{delimiter:?}");
        }
        for content in [&b"X\r\n"[..], b"--X", b" x\r\n", b"\n"] {
            assert!(!delimits(content), "{content:?}");
        }
        assert_eq!(
            multipart_boundary([&b"multipart/form-data; boundary=a; boundary=b"[..]]),
            None,
            "named twice: parsers disagree on which counts"
        );
        let one = |line: &'static [u8]| multipart_boundary([line]);
        assert_eq!(one(b"application/json"), None);
        assert_eq!(one(b"multipart/form-data"), None);
        assert_eq!(one(b"text/plain; boundary=x"), None);
        assert_eq!(
            one(b"Multipart/Form-Data; boundary=x").as_deref(),
            Some("x")
        );
        let two: [&[u8]; 2] = [b"multipart/form-data; boundary=x", b"text/plain"];
        assert_eq!(multipart_boundary(two), None, "two lines: none counts");
    }

    /// A boundary spelled like another part of the `Content-Type` line
    /// cuts only the parameter's value: a change of subtype (or of another
    /// parameter) hidden under it is still another request. Before, the
    /// line was cut at every spelling of the boundary.
    #[test]
    fn a_boundary_spelled_like_the_subtype_hides_nothing() {
        assert_ne!(
            multipart_as("multipart/form-data", "form-data", false, "{}"),
            multipart_as("multipart/mixed", "mixed", false, "{}"),
        );
        assert_ne!(
            multipart_as("multipart/form-data; charset=utf-8", "utf-8", true, "{}"),
            multipart_as("multipart/form-data; charset=latin1", "latin1", true, "{}"),
        );
        assert_eq!(
            multipart_as("multipart/mixed", "mixed", false, "{}"),
            multipart_as("multipart/mixed", "other", false, "{}"),
            "the boundary itself is still framing"
        );
    }

    /// A significant header's second line is marked apart from a
    /// multipart body: an empty second line beside a JSON body once hashed
    /// as a multipart body that never opened, of the same bytes.
    #[test]
    fn a_second_line_is_no_multipart_body() {
        let parts = |lines: Vec<&'static [u8]>, boundary: Option<&'static [u8]>| RequestParts {
            method: "POST",
            path_and_query: "/v1/charges",
            headers: vec![("x-api-version", lines)],
            body: br#"{"a":1}"#,
            boundary,
        };
        let multipart = fingerprint(&parts(vec![b"v1"], Some(b"XYZ")), &CANONICAL).unwrap();
        let json = fingerprint(&parts(vec![b"v1", b""], None), &CANONICAL).unwrap();
        assert_ne!(multipart, json);
    }

    /// Jobs keep their fingerprint across releases: a retry after an
    /// upgrade must still match its job. This one is pinned.
    #[test]
    fn a_fingerprint_is_the_same_in_every_release() {
        let pinned = fp(br#"{"a":1}"#, &BodyRule::default());
        assert_eq!(
            pinned.to_string(),
            "089929006b85cfc24ea0055fb71cec1dc466d2f00e396ba76637f87fb81eabbc"
        );
    }

    #[test]
    fn raw_bodies_are_order_sensitive_canonical_ones_are_not() {
        let raw = BodyRule::default();
        assert_ne!(fp(br#"{"a":1,"b":2}"#, &raw), fp(br#"{"b":2,"a":1}"#, &raw));
        let canonical = BodyRule {
            canonical_json: true,
            ignore: vec![],
        };
        assert_eq!(
            fp(br#"{"a":1,"b":2}"#, &canonical),
            fp(br#"{ "b": 2, "a": 1 }"#, &canonical)
        );
    }

    #[test]
    fn numbers_are_the_text_the_client_wrote() {
        let canonical = |body: &str| fp(body.as_bytes(), &CANONICAL);
        // Past f64 precision, and the spellings an upstream reads apart.
        for (a, b) in [
            ("1.00000000000000001", "1"),
            ("1e2", "100"),
            ("1.0", "1"),
            ("1E2", "1e2"),
            ("-0", "0"),
            ("12345678901234567890123", "12345678901234567890124"),
        ] {
            let (a, b) = (format!(r#"{{"n":{a}}}"#), format!(r#"{{"n":{b}}}"#));
            assert_ne!(canonical(&a), canonical(&b), "{a} and {b}");
        }
        assert_eq!(
            canonical(r#"{"n":1.50,"m":[1e-7]}"#),
            canonical(r#"{ "m" : [ 1e-7 ] , "n" : 1.50 }"#)
        );
    }

    #[test]
    fn a_member_named_twice_is_refused_wherever_bodies_are_canonicalised() {
        let twice = br#"{"amount":1,"to":"x","amount":1000}"#;
        let ambiguous = AmbiguousJson {
            pointer: "/amount".into(),
        };
        let refused = Err(ambiguous.clone());
        assert_eq!(try_fp(twice, &CANONICAL), refused);
        let ignoring = BodyRule {
            canonical_json: false,
            ignore: vec!["/meta".into()],
        };
        assert_eq!(try_fp(twice, &ignoring), refused);
        // Raw bytes are hashed as sent: two bodies are never merged.
        assert!(try_fp(twice, &BodyRule::default()).is_ok());
        let detail = ambiguous.to_string();
        assert!(detail.contains("/amount") && detail.contains("send each member"));
    }

    #[test]
    fn a_body_that_is_not_json_is_hashed_as_sent() {
        assert_ne!(fp(b"{not json", &CANONICAL), fp(b"{not  json", &CANONICAL));
        assert_eq!(
            fp(b"{not json", &CANONICAL),
            fp(b"{not json", &BodyRule::default())
        );
    }

    #[test]
    fn ignored_pointers_do_not_count() {
        let rule = BodyRule {
            canonical_json: true,
            ignore: vec!["/meta/sent_at".into()],
        };
        assert_eq!(
            fp(br#"{"a":1,"meta":{"sent_at":1}}"#, &rule),
            fp(br#"{"a":1,"meta":{"sent_at":2}}"#, &rule)
        );
        assert_ne!(
            fp(br#"{"a":1,"meta":{"sent_at":1}}"#, &rule),
            fp(br#"{"a":2,"meta":{"sent_at":1}}"#, &rule)
        );
    }

    mod props {
        use super::super::*;
        use proptest::prelude::*;
        use serde_json::Value;

        fn json() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::from),
                any::<i64>().prop_map(Value::from),
                any::<f64>()
                    .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
                    .prop_map(Value::from),
                "[a-z \"\\\\é\\x01]{0,8}".prop_map(Value::from),
            ];
            leaf.prop_recursive(3, 24, 4, |inner| {
                prop_oneof![
                    proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                    proptest::collection::btree_map("[a-c~/\"é]{1,3}", inner, 0..4)
                        .prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        /// The same JSON written with every object's keys in reverse order
        /// and spaces after separators.
        fn reversed(v: &Value) -> String {
            match v {
                Value::Object(map) => {
                    let fields: Vec<String> = map
                        .iter()
                        .rev()
                        .map(|(k, v)| format!("{}: {}", Value::from(k.as_str()), reversed(v)))
                        .collect();
                    format!("{{ {} }}", fields.join(", "))
                }
                Value::Array(items) => {
                    format!(
                        "[{}]",
                        items.iter().map(reversed).collect::<Vec<_>>().join(", ")
                    )
                }
                leaf => leaf.to_string(),
            }
        }

        fn escape(key: &str) -> String {
            key.replace('~', "~0").replace('/', "~1")
        }

        /// The pointers of every object in `v`.
        fn objects(v: &Value, here: &str, out: &mut Vec<String>) {
            match v {
                Value::Object(map) => {
                    out.push(here.to_owned());
                    for (k, v) in map {
                        objects(v, &format!("{here}/{}", escape(k)), out);
                    }
                }
                Value::Array(items) => {
                    for (i, v) in items.iter().enumerate() {
                        objects(v, &format!("{here}/{i}"), out);
                    }
                }
                _ => {}
            }
        }

        /// `v` written out with the object at `target` naming a member
        /// twice (its first, or `dup`); `twice` gets that member's pointer.
        fn with_duplicate(v: &Value, here: &str, target: &str, twice: &mut String) -> String {
            match v {
                Value::Object(map) => {
                    let mut fields: Vec<String> = map
                        .iter()
                        .map(|(k, v)| {
                            let inner =
                                with_duplicate(v, &format!("{here}/{}", escape(k)), target, twice);
                            format!("{}:{inner}", Value::from(k.as_str()))
                        })
                        .collect();
                    if here == target {
                        let (k, v) = map
                            .iter()
                            .next()
                            .map_or(("dup".to_owned(), "1".to_owned()), |(k, v)| {
                                (k.clone(), v.to_string())
                            });
                        fields.push(format!("{}:{v}", Value::from(k.as_str())));
                        if map.is_empty() {
                            fields.push(format!("{}:{v}", Value::from(k.as_str())));
                        }
                        *twice = format!("{here}/{}", escape(&k));
                    }
                    format!("{{{}}}", fields.join(","))
                }
                Value::Array(items) => {
                    let items: Vec<String> = items
                        .iter()
                        .enumerate()
                        .map(|(i, v)| with_duplicate(v, &format!("{here}/{i}"), target, twice))
                        .collect();
                    format!("[{}]", items.join(","))
                }
                leaf => leaf.to_string(),
            }
        }

        fn try_fp(body: &[u8], rule: &BodyRule) -> Result<Fingerprint, AmbiguousJson> {
            fingerprint(
                &RequestParts {
                    method: "POST",
                    path_and_query: "/",
                    headers: vec![],
                    body,
                    boundary: None,
                },
                rule,
            )
        }

        fn fp(body: &[u8], rule: &BodyRule) -> Fingerprint {
            try_fp(body, rule).unwrap()
        }

        /// A JSON number as a client may write it.
        const NUMBER: &str = "-?(0|[1-9][0-9]{0,25})(\\.[0-9]{1,25})?([eE][+-]?[0-9]{1,3})?";

        proptest! {
            #[test]
            fn any_body_and_any_pointers_fingerprint_without_panicking(
                body in proptest::collection::vec(any::<u8>(), 0..200),
                pointers in proptest::collection::vec("[/~0-9a-z]{0,6}", 0..4),
            ) {
                let rule = BodyRule { canonical_json: true, ignore: pointers };
                let _ = try_fp(&body, &rule);
            }

            #[test]
            fn canonical_json_hashes_what_earlier_versions_hashed(value in json()) {
                // Before, a canonical body was serde_json's writing of its
                // parsed value: keys sorted, numbers as serde_json writes
                // them. A body written that way, in any key order, still
                // canonicalises to exactly those bytes, so keys retried
                // across an upgrade keep their fingerprints.
                let rule = BodyRule { canonical_json: true, ignore: vec![] };
                let before = serde_json::to_vec(&value).unwrap();
                let now = canonical_body(reversed(&value).as_bytes(), &rule).unwrap().unwrap();
                prop_assert_eq!(String::from_utf8(now).unwrap(), String::from_utf8(before).unwrap());
            }

            #[test]
            fn a_member_named_twice_anywhere_is_refused(
                value in json(),
                pick in any::<proptest::sample::Index>(),
            ) {
                let value = serde_json::json!({"v": value});
                let mut all = Vec::new();
                objects(&value, "", &mut all);
                let target = pick.get(&all);
                let mut twice = String::new();
                let body = with_duplicate(&value, "", target, &mut twice);
                let rule = BodyRule { canonical_json: true, ignore: vec![] };
                prop_assert_eq!(try_fp(body.as_bytes(), &rule), Err(AmbiguousJson { pointer: twice }));
            }

            #[test]
            fn two_numbers_written_differently_are_two_intents(a in NUMBER, b in NUMBER) {
                let rule = BodyRule { canonical_json: true, ignore: vec![] };
                let body = |n: &str| format!(r#"{{"n":{n},"m":[{n}]}}"#);
                let spaced = format!(r#"{{ "m" : [ {a} ] , "n" : {a} }}"#);
                prop_assert_eq!(fp(body(&a).as_bytes(), &rule), fp(spaced.as_bytes(), &rule));
                if a != b {
                    prop_assert_ne!(fp(body(&a).as_bytes(), &rule), fp(body(&b).as_bytes(), &rule));
                }
            }

            #[test]
            fn canonical_json_ignores_key_order_and_spacing(value in json()) {
                let rule = BodyRule { canonical_json: true, ignore: vec![] };
                let sorted = serde_json::to_vec(&value).unwrap();
                let reversed = reversed(&value);
                prop_assert_eq!(fp(&sorted, &rule), fp(reversed.as_bytes(), &rule));
                let raw = BodyRule::default();
                if sorted != reversed.as_bytes() {
                    prop_assert_ne!(fp(&sorted, &raw), fp(reversed.as_bytes(), &raw));
                }
            }

            #[test]
            fn an_ignored_field_never_counts(value in json(), noise in any::<i64>()) {
                let rule = BodyRule { canonical_json: true, ignore: vec!["/ignored".into()] };
                let with = serde_json::json!({"v": value.clone(), "ignored": noise});
                let without = serde_json::json!({"v": value});
                prop_assert_eq!(
                    fp(&serde_json::to_vec(&with).unwrap(), &rule),
                    fp(&serde_json::to_vec(&without).unwrap(), &rule)
                );
            }
        }
    }
}
