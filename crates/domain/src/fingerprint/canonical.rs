//! The canonical form of a JSON body, as fingerprints hash it
//! (`docs/design.md` §11, "Canonical JSON"): whitespace dropped, object
//! members sorted by key, strings written as serde_json writes them, and
//! numbers and literals exactly as the client wrote them (`1.0`, `1` and
//! `1e0` are three intents: upstreams read them differently, and no float
//! is ever parsed here). An object that names a member twice has no
//! canonical form: parsers disagree on which one counts, so two bodies
//! that differ in what the upstream reads could share one.
//!
//! Parsed in one pass by jiter, which hands out a number's bytes as
//! written; serde_json can only do that with `arbitrary_precision`, which
//! would change every number of the crate (contracts, admin JSON) and still
//! rewrites exponents (`1E2` as `1e+2`).

use jiter::{Jiter, JiterError, Peek};

/// Nesting deeper than this is not canonicalised; the body is hashed as
/// raw bytes instead, as it was under serde_json's own limit (which
/// refuses a 128th level).
const MAX_DEPTH: usize = 127;

/// A parsed body: numbers and literals keep the bytes they were written with.
#[derive(Debug)]
pub(super) enum Node<'j> {
    /// A number, `true`, `false` or `null`, as written.
    Raw(&'j [u8]),
    /// A string, unescaped.
    Str(String),
    /// An array's items, in order.
    Array(Vec<Node<'j>>),
    /// An object's members, sorted by key, each key once.
    Object(Vec<(String, Node<'j>)>),
}

/// Why a body has no canonical form.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refused {
    /// Not JSON, or nested deeper than [`MAX_DEPTH`]: hashed as raw bytes.
    NotJson,
    /// An object names a member twice: the path to it, innermost first.
    Duplicate(Vec<String>),
}

impl From<JiterError> for Refused {
    fn from(_: JiterError) -> Self {
        Refused::NotJson
    }
}

impl Refused {
    /// The same refusal, seen from one level up (`segment` leads to it).
    fn within(self, segment: impl FnOnce() -> String) -> Self {
        match self {
            Refused::Duplicate(mut path) => {
                path.push(segment());
                Refused::Duplicate(path)
            }
            not_json => not_json,
        }
    }
}

/// Parses a whole body.
pub(super) fn parse(body: &[u8]) -> Result<Node<'_>, Refused> {
    let mut jiter = Jiter::new(body);
    let peek = jiter.peek()?;
    let node = value(&mut jiter, peek, 0)?;
    jiter.finish()?;
    Ok(node)
}

fn value<'j>(jiter: &mut Jiter<'j>, peek: Peek, depth: usize) -> Result<Node<'j>, Refused> {
    match peek {
        Peek::Object => object(jiter, depth + 1),
        Peek::Array => array(jiter, depth + 1),
        Peek::String => Ok(Node::Str(jiter.known_str()?.to_owned())),
        Peek::True | Peek::False => {
            let literal: &'static [u8] = if jiter.known_bool(peek)? {
                b"true"
            } else {
                b"false"
            };
            Ok(Node::Raw(literal))
        }
        Peek::Null => {
            jiter.known_null()?;
            Ok(Node::Raw(b"null"))
        }
        // A number (anything else is refused by jiter): its bytes as written.
        _ => {
            let start = jiter.current_index();
            jiter.known_number_bytes(peek)?;
            Ok(Node::Raw(jiter.slice_to_current(start)))
        }
    }
}

fn object<'j>(jiter: &mut Jiter<'j>, depth: usize) -> Result<Node<'j>, Refused> {
    if depth > MAX_DEPTH {
        return Err(Refused::NotJson);
    }
    let mut members = Vec::new();
    let mut key = jiter.known_object()?.map(str::to_owned);
    while let Some(name) = key {
        let peek = jiter.peek()?;
        let member = value(jiter, peek, depth).map_err(|e| e.within(|| name.clone()))?;
        members.push((name, member));
        key = jiter.next_key()?.map(str::to_owned);
    }
    if case_variants(&members) {
        // Keys that differ only in case: parsers that match members
        // without case (Go's encoding/json, ASP.NET Core's web defaults,
        // Jackson's case-insensitive option) take the later one, so the
        // order the members were sent in is part of the request: such an
        // object keeps it whole (docs/design.md §11, "Canonical JSON").
        let mut keys: Vec<&str> = members.iter().map(|m| m.0.as_str()).collect();
        keys.sort_unstable();
        if let Some(twice) = keys.windows(2).find(|w| w[0] == w[1]) {
            return Err(Refused::Duplicate(vec![twice[0].to_owned()]));
        }
        return Ok(Node::Object(members));
    }
    // Byte order of the unescaped keys, as serde_json's map sorts them, so
    // bodies fingerprinted before this parser hash the same.
    members.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    if let Some(twice) = members.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(Refused::Duplicate(vec![twice[0].0.clone()]));
    }
    Ok(Node::Object(members))
}

/// Whether two of `members`' keys differ only in case (or are equal), as
/// any of the matchers that ignore case would see them. Keys of lower-case
/// ASCII alone, the common case, fold to themselves, so only an object
/// with another key is folded.
fn case_variants(members: &[(String, Node<'_>)]) -> bool {
    let plain = |key: &str| !key.bytes().any(|b| b.is_ascii_uppercase() || !b.is_ascii());
    if members.len() < 2 || members.iter().all(|m| plain(&m.0)) {
        return false;
    }
    if members.iter().all(|m| m.0.is_ascii()) {
        // ASCII folds as ASCII in every matcher: compared in place, with
        // nothing folded into a string of its own (a camelCase body's
        // every object comes here).
        let mut keys: Vec<&[u8]> = members.iter().map(|m| m.0.as_bytes()).collect();
        let lower = |key: &[u8]| key.iter().map(u8::to_ascii_lowercase).collect::<Vec<u8>>();
        keys.sort_unstable_by(|a, b| {
            let (a, b) = (
                a.iter().map(u8::to_ascii_lowercase),
                b.iter().map(u8::to_ascii_lowercase),
            );
            a.cmp(b)
        });
        debug_assert!(keys.windows(2).all(|w| lower(w[0]) <= lower(w[1])));
        return keys.windows(2).any(|w| w[0].eq_ignore_ascii_case(w[1]));
    }
    let twice = |fold: fn(&str) -> String| {
        let mut folded: Vec<String> = members.iter().map(|m| fold(&m.0)).collect();
        folded.sort_unstable();
        folded.windows(2).any(|w| w[0] == w[1])
    };
    twice(fold) || twice(full_fold)
}

/// A name as Go's `encoding/json` matches it: each character lower-cased,
/// then upper-cased, by its simple mapping (`İ` meets `i`, `ſ` meets `s`,
/// `K`, the Kelvin sign, meets `k`).
pub(crate) fn fold(key: &str) -> String {
    key.chars()
        .map(|c| {
            let lower = c.to_lowercase().next().unwrap_or(c);
            let mut upper = lower.to_uppercase();
            match (upper.next(), upper.next()) {
                (Some(one), None) => one,
                _ => lower,
            }
        })
        .collect()
}

/// A name by Unicode's full case mappings, as other matchers fold it
/// (`ß` meets `ss`).
fn full_fold(key: &str) -> String {
    key.chars()
        .flat_map(char::to_lowercase)
        .flat_map(char::to_uppercase)
        .flat_map(char::to_lowercase)
        .collect()
}

fn array<'j>(jiter: &mut Jiter<'j>, depth: usize) -> Result<Node<'j>, Refused> {
    if depth > MAX_DEPTH {
        return Err(Refused::NotJson);
    }
    let mut items = Vec::new();
    let mut next = jiter.known_array()?;
    while let Some(peek) = next {
        let at = items.len();
        items.push(value(jiter, peek, depth).map_err(|e| e.within(|| at.to_string()))?);
        next = jiter.array_step()?;
    }
    Ok(Node::Array(items))
}

/// The JSON pointer (RFC 6901) of a path given innermost first.
pub(super) fn pointer(path: &[String]) -> String {
    path.iter()
        .rev()
        .map(|segment| format!("/{}", segment.replace('~', "~0").replace('/', "~1")))
        .collect()
}

/// What an array item an `ignore_fields` pointer names is hashed as: no
/// JSON value is written so, and the array keeps its length and the other
/// items their places.
const IGNORED_ITEM: &[u8] = b"?";

/// Leaves out the member a JSON pointer names, if there is one, or blanks
/// the item it names ([`IGNORED_ITEM`]), with serde_json's `pointer_mut`
/// rules for the way there. An item is not taken out: `[5]` would then be
/// `[]`, and each later pointer into the array would name the item after
/// the one it was written for.
pub(super) fn remove(root: &mut Node<'_>, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else {
        return;
    };
    let last = unescape(last);
    match find(root, parent) {
        Some(Node::Object(members)) => members.retain(|(name, _)| *name != last),
        Some(Node::Array(items)) => {
            if let Some(item) = index(&last).and_then(|i| items.get_mut(i)) {
                *item = Node::Raw(IGNORED_ITEM);
            }
        }
        _ => {}
    }
}

fn find<'n, 'j>(node: &'n mut Node<'j>, pointer: &str) -> Option<&'n mut Node<'j>> {
    if pointer.is_empty() {
        return Some(node);
    }
    let mut tokens = pointer.strip_prefix('/')?.split('/').map(unescape);
    tokens.try_fold(node, |target, token| match target {
        Node::Object(members) => members
            .iter_mut()
            .find(|(name, _)| *name == token)
            .map(|(_, member)| member),
        Node::Array(items) => index(&token).and_then(|i| items.get_mut(i)),
        _ => None,
    })
}

fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

/// An array index as serde_json's pointers read it: no sign, no leading zero.
fn index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
        return None;
    }
    token.parse().ok()
}

/// Writes the canonical bytes of `node`.
pub(super) fn write(node: &Node<'_>, out: &mut Vec<u8>) {
    match node {
        Node::Raw(bytes) => out.extend_from_slice(bytes),
        Node::Str(s) => write_str(s, out),
        Node::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(item, out);
            }
            out.push(b']');
        }
        Node::Object(members) => {
            out.push(b'{');
            for (i, (name, member)) in members.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_str(name, out);
                out.push(b':');
                write(member, out);
            }
            out.push(b'}');
        }
    }
}

/// A string escaped as serde_json escapes it.
fn write_str(s: &str, out: &mut Vec<u8>) {
    // Writing into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canonical(body: &str) -> Result<String, Refused> {
        let node = parse(body.as_bytes())?;
        let mut out = Vec::new();
        write(&node, &mut out);
        Ok(String::from_utf8(out).unwrap())
    }

    fn duplicate_at(body: &str) -> String {
        match canonical(body) {
            Err(Refused::Duplicate(path)) => pointer(&path),
            other => panic!("{body}: expected a duplicate, got {other:?}"),
        }
    }

    #[test]
    fn members_are_sorted_and_whitespace_dropped() {
        assert_eq!(
            canonical(r#" { "b" : [ 1 , {"d":null,"c":true} ], "a": "x" } "#).unwrap(),
            r#"{"a":"x","b":[1,{"c":true,"d":null}]}"#
        );
    }

    #[test]
    fn numbers_keep_their_text_and_strings_their_meaning() {
        for n in [
            "1",
            "1.0",
            "1e0",
            "1E0",
            "1e+0",
            "-0",
            "100",
            "1e2",
            "1.00000000000000001",
        ] {
            assert_eq!(canonical(&format!("[{n}]")).unwrap(), format!("[{n}]"));
        }
        assert_eq!(canonical(r#""\u00e9\/""#).unwrap(), "\"é/\"");
        assert_eq!(canonical(r#""a\u0000""#).unwrap(), r#""a\u0000""#);
    }

    #[test]
    fn a_member_named_twice_is_refused_with_its_pointer() {
        assert_eq!(duplicate_at(r#"{"a":1,"a":2}"#), "/a");
        assert_eq!(duplicate_at(r#"{"a":1,"a":1}"#), "/a");
        assert_eq!(duplicate_at(r#"{"a":1,"\u0061":2}"#), "/a");
        assert_eq!(
            duplicate_at(r#"{"x":{"y":[0,{"id":1,"id":2}]}}"#),
            "/x/y/1/id"
        );
        assert_eq!(duplicate_at(r#"{"x/y":{"~":1,"~":2}}"#), "/x~1y/~0");
    }

    /// An object whose keys differ only in case keeps its members in the
    /// order they were sent in (a case-insensitive upstream takes the
    /// later): two orders are two requests. An object without such keys
    /// sorts as before.
    #[test]
    fn keys_that_differ_only_in_case_keep_their_order() {
        let pairs = [
            (
                r#"{"amount":1,"Amount":1000}"#,
                r#"{"Amount":1000,"amount":1}"#,
            ),
            (
                r#"{"price":1,"pr\u0130ce":1000}"#,
                r#"{"pr\u0130ce":1000,"price":1}"#,
            ),
            (r#"{"\u017fum":1,"sum":2}"#, r#"{"sum":2,"\u017fum":1}"#),
            (
                r#"{"ma\u00dfe":1,"masse":2}"#,
                r#"{"masse":2,"ma\u00dfe":1}"#,
            ),
            (r#"{"b":1,"A":2,"a":3}"#, r#"{"A":2,"b":1,"a":3}"#),
        ];
        for (first, second) in pairs {
            let (one, two) = (canonical(first).unwrap(), canonical(second).unwrap());
            assert_ne!(one, two, "{first} and {second}");
        }
        assert_eq!(
            canonical(r#"{"b":1,"B":2,"a":0}"#).unwrap(),
            r#"{"b":1,"B":2,"a":0}"#,
            "as sent"
        );
        assert_eq!(
            canonical(r#"{"maxTokens":1,"Model":"m"}"#).unwrap(),
            r#"{"Model":"m","maxTokens":1}"#,
            "no two keys fold together: byte order, as before"
        );
        assert_eq!(duplicate_at(r#"{"A":1,"a":2,"A":3}"#), "/A");
    }

    #[test]
    fn what_is_not_json_is_said_so() {
        for body in [
            "",
            "{",
            "[1,]",
            "01",
            "1.",
            "NaN",
            "{\"a\":1} x",
            "'a'",
            "\"\\ud800\"",
        ] {
            assert_eq!(canonical(body), Err(Refused::NotJson), "{body:?}");
        }
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(canonical(&deep).is_ok());
        let deeper = format!("[{deep}]");
        assert_eq!(canonical(&deeper), Err(Refused::NotJson));
    }

    #[test]
    fn pointers_leave_out_what_they_name() {
        let mut node = parse(br#"{"a":{"b":1,"c":2},"l":[1,2,3],"~/":0}"#).unwrap();
        for p in ["/a/b", "/l/1", "/~0~1", "/missing/x", "/l/01/x", "nonsense"] {
            remove(&mut node, p);
        }
        let mut out = Vec::new();
        write(&node, &mut out);
        assert_eq!(out, br#"{"a":{"c":2},"l":[1,?,3]}"#);
    }

    /// An item a pointer names is blanked, not taken out: `[5]` is not
    /// `[]`, and pointers to items 0 and 1 blank those two, whatever their
    /// order (before, the second named the item after it once the first
    /// was gone, and two chats that differed in their last message were
    /// one request). An index written `01` or `+1` names nothing.
    #[test]
    fn an_ignored_item_keeps_its_place() {
        let blanked = |body: &[u8], pointers: &[&str]| {
            let mut node = parse(body).unwrap();
            for p in pointers {
                remove(&mut node, p);
            }
            let mut out = Vec::new();
            write(&node, &mut out);
            String::from_utf8(out).unwrap()
        };
        assert_ne!(blanked(b"[5]", &["/0"]), blanked(b"[]", &["/0"]));
        let chat = |n: u32| format!(r#"{{"m":["sys t={n}","terse","refund order {n}"]}}"#);
        let both = ["/m/0", "/m/1"];
        assert_eq!(
            blanked(chat(1).as_bytes(), &both),
            r#"{"m":[?,?,"refund order 1"]}"#
        );
        assert_ne!(
            blanked(chat(1).as_bytes(), &both),
            blanked(chat(2).as_bytes(), &both)
        );
        let reversed = ["/m/1", "/m/0"];
        assert_eq!(
            blanked(chat(1).as_bytes(), &both),
            blanked(chat(1).as_bytes(), &reversed)
        );
        assert_eq!(blanked(b"[1,2]", &["/+1", "/01"]), "[1,2]");
    }
}
