//! The request fingerprint: what a duplicate must match to be replayed.
//!
//! SHA-256 over the method, the path and query, the configured significant
//! headers and the body. Every part is length-prefixed, so no two different
//! requests can frame to the same bytes. A route may canonicalise JSON bodies
//! (object keys sorted, so key order does not matter) and drop fields named
//! by JSON pointers (a client-side timestamp, a trace id) before hashing.

use std::fmt;

use sha2::{Digest, Sha256};

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
    /// Hash JSON bodies in canonical form (object keys sorted).
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
    /// The significant headers: lower-case name and value, in configured order.
    /// An absent header is `None`, which hashes differently from an empty one.
    pub headers: Vec<(&'a str, Option<&'a [u8]>)>,
    /// The whole body.
    pub body: &'a [u8],
}

/// Computes the fingerprint of a request under a route's body rule.
pub fn fingerprint(parts: &RequestParts<'_>, rule: &BodyRule) -> Fingerprint {
    let mut h = Sha256::new();
    frame(&mut h, parts.method.as_bytes());
    frame(&mut h, parts.path_and_query.as_bytes());
    for (name, value) in &parts.headers {
        frame(&mut h, name.as_bytes());
        match value {
            Some(v) => {
                h.update([1]);
                frame(&mut h, v);
            }
            None => h.update([0]),
        }
    }
    match canonical_body(parts.body, rule) {
        Some(canonical) => {
            h.update([1]);
            frame(&mut h, &canonical);
        }
        None => {
            h.update([0]);
            frame(&mut h, parts.body);
        }
    }
    Fingerprint(h.finalize().into())
}

fn frame(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

/// The canonical JSON form of a body, when the rule asks for it and the body
/// is JSON. A body that is not JSON is hashed as raw bytes instead.
fn canonical_body(body: &[u8], rule: &BodyRule) -> Option<Vec<u8>> {
    if !rule.canonical_json && rule.ignore.is_empty() {
        return None;
    }
    let mut value: serde_json::Value = serde_json::from_slice(body).ok()?;
    for pointer in &rule.ignore {
        remove_pointer(&mut value, pointer);
    }
    // serde_json's map is ordered by key (no `preserve_order` feature), so
    // serialising the parsed value is already canonical.
    serde_json::to_vec(&value).ok()
}

fn remove_pointer(value: &mut serde_json::Value, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else {
        return;
    };
    let last = last.replace("~1", "/").replace("~0", "~");
    match value.pointer_mut(parent) {
        Some(serde_json::Value::Object(map)) => {
            map.remove(&last);
        }
        Some(serde_json::Value::Array(items)) => {
            if let Ok(i) = last.parse::<usize>() {
                if i < items.len() {
                    items.remove(i);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(body: &[u8], rule: &BodyRule) -> Fingerprint {
        fingerprint(
            &RequestParts {
                method: "POST",
                path_and_query: "/v1/charges",
                headers: vec![("content-type", Some(b"application/json"))],
                body,
            },
            rule,
        )
    }

    #[test]
    fn every_part_counts() {
        let rule = BodyRule::default();
        let base = fp(br#"{"a":1}"#, &rule);
        assert_ne!(base, fp(br#"{"a":2}"#, &rule));
        let other_path = fingerprint(
            &RequestParts {
                method: "POST",
                path_and_query: "/v1/refunds",
                headers: vec![("content-type", Some(b"application/json"))],
                body: br#"{"a":1}"#,
            },
            &rule,
        );
        assert_ne!(base, other_path);
        let no_header = fingerprint(
            &RequestParts {
                method: "POST",
                path_and_query: "/v1/charges",
                headers: vec![("content-type", None)],
                body: br#"{"a":1}"#,
            },
            &rule,
        );
        assert_ne!(base, no_header);
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
                "[a-z ]{0,8}".prop_map(Value::from),
            ];
            leaf.prop_recursive(3, 24, 4, |inner| {
                prop_oneof![
                    proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                    proptest::collection::btree_map("[a-c~/]{1,3}", inner, 0..4)
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

        fn fp(body: &[u8], rule: &BodyRule) -> Fingerprint {
            fingerprint(
                &RequestParts {
                    method: "POST",
                    path_and_query: "/",
                    headers: vec![],
                    body,
                },
                rule,
            )
        }

        proptest! {
            #[test]
            fn any_body_and_any_pointers_fingerprint_without_panicking(
                body in proptest::collection::vec(any::<u8>(), 0..200),
                pointers in proptest::collection::vec("[/~0-9a-z]{0,6}", 0..4),
            ) {
                let rule = BodyRule { canonical_json: true, ignore: pointers };
                let _ = fp(&body, &rule);
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
