use proptest::prelude::*;

use super::*;

fn normal(path: &str) -> String {
    normalize(path)
        .unwrap_or_else(|e| panic!("{path:?} refused: {e}"))
        .into_owned()
}

#[test]
fn a_normal_path_is_borrowed_as_it_is() {
    for path in [
        "/",
        "/v1/charges",
        "/v1/charges/",
        "/v1/charges/ch_123/refunds",
        "/v1/chat/completions",
        "/V1/Charges",
        "/a/.b/..c/.d",
        "/caf%C3%A9",
        "/a%2Bb/%3B/%25",
        "/v1/projects/p:run",
        "/a!$&'()*+,=:@~-_.z",
        "*",
        "",
    ] {
        assert!(
            matches!(normalize(path), Ok(Cow::Borrowed(p)) if p == path),
            "{path:?} -> {:?}",
            normalize(path)
        );
    }
}

#[test]
fn the_spellings_of_one_path_are_one_path() {
    for (spelling, expected) in [
        ("//v1/charges", "/v1/charges"),
        ("/v1//charges", "/v1/charges"),
        ("/v1///charges//", "/v1/charges/"),
        ("/v1/./charges", "/v1/charges"),
        ("/v1/x/../charges", "/v1/charges"),
        ("/v1/x/y/../../charges", "/v1/charges"),
        ("/v1/%63harges", "/v1/charges"),
        ("/%76%31/%43harges", "/v1/Charges"),
        ("/v1/charges/.", "/v1/charges/"),
        ("/v1/charges/..", "/v1/"),
        ("/v1/charges/x/..", "/v1/charges/"),
        ("/v1/%2e/charges", "/v1/charges"),
        ("/v1/%2E%2E/v1/charges", "/v1/charges"),
        ("/v1/x/.%2e/charges", "/v1/charges"),
        ("/v1/x/%2e./charges", "/v1/charges"),
        ("/a/..", "/"),
        ("/./", "/"),
        ("//", "/"),
        ("/%7euser/%41%5a%30%2d%5f", "/~user/AZ0-_"),
    ] {
        assert_eq!(normal(spelling), expected, "{spelling:?}");
    }
}

#[test]
fn only_the_hex_of_remaining_encodings_changes_case() {
    assert_eq!(normal("/caf%c3%a9/a%2bb"), "/caf%C3%A9/a%2Bb");
    assert_eq!(normal("/x%3b%25y"), "/x%3B%25y");
    assert_eq!(normal("/Mixed/CASE"), "/Mixed/CASE");
}

#[test]
fn bytes_a_uri_may_not_hold_raw_are_encoded() {
    assert_eq!(normal("/café"), "/caf%C3%A9");
    assert_eq!(normal("/{\"a\"}|^[]"), "/%7B%22a%22%7D%7C%5E%5B%5D");
}

#[test]
fn ambiguous_spellings_are_refused() {
    for (path, why) in [
        ("/v1/charges%2Fx", Ambiguity::EncodedSlash),
        ("/v1%2fcharges", Ambiguity::EncodedSlash),
        ("/v1/charges%5C", Ambiguity::EncodedBackslash),
        ("/v1/charges%5cx", Ambiguity::EncodedBackslash),
        ("/v1/charges%00", Ambiguity::EncodedNul),
        ("/v1\\charges", Ambiguity::Backslash),
        ("/v1/charges;jsessionid=1", Ambiguity::PathParameter),
        ("/v1/..;/charges", Ambiguity::PathParameter),
        ("/..", Ambiguity::AboveRoot),
        ("/../v1/charges", Ambiguity::AboveRoot),
        ("/v1/../../v1/charges", Ambiguity::AboveRoot),
        ("/%2e%2e/v1", Ambiguity::AboveRoot),
        ("/v1/charges.", Ambiguity::TrailingDot),
        ("/v1/charges%2e", Ambiguity::TrailingDot),
        ("/v1/charges%2E/x", Ambiguity::TrailingDot),
        ("/v1/charges./", Ambiguity::TrailingDot),
        ("/a/...", Ambiguity::TrailingDot),
        ("/v1/%zzcharges", Ambiguity::MalformedPercent),
        ("/v1/charges%4", Ambiguity::MalformedPercent),
        ("/v1/charges%", Ambiguity::MalformedPercent),
        ("/v1/%%63harges", Ambiguity::MalformedPercent),
    ] {
        assert_eq!(normalize(path), Err(why), "{path:?}");
    }
}

/// Every refusal says what to send instead.
#[test]
fn every_refusal_names_what_to_send() {
    for why in [
        Ambiguity::EncodedSlash,
        Ambiguity::EncodedBackslash,
        Ambiguity::EncodedNul,
        Ambiguity::Backslash,
        Ambiguity::PathParameter,
        Ambiguity::TrailingDot,
        Ambiguity::AboveRoot,
        Ambiguity::MalformedPercent,
    ] {
        let text = why.to_string();
        assert!(text.contains("; send "), "{text}");
    }
}

/// Timing of the common case and of a rewrite, printed in ns per path:
/// `cargo test --release --lib domain::path -- --ignored --nocapture`.
#[test]
#[ignore = "a timing, not a check"]
fn cost_per_path() {
    fn time(path: &str) -> f64 {
        const N: u32 = 2_000_000;
        let started = std::time::Instant::now();
        for _ in 0..N {
            std::hint::black_box(normalize(std::hint::black_box(path)).ok());
        }
        started.elapsed().as_nanos() as f64 / f64::from(N)
    }
    for path in [
        "/",
        "/v1/charges",
        "/v1/chat/completions",
        "/v1/customers/cus_9s6XKzkNRiz8i3/payment_methods",
        "//v1/charges",
        "/v1/x/../charges",
        "/v1/%63harges",
    ] {
        println!("{path:<52} {:>6.1} ns", time(path));
    }
}

/// Paths made of the pieces that matter: separators, dot segments plain
/// and encoded, encodings of every kind in both cases, malformed ones, the
/// refused bytes, raw bytes that must be encoded, and plain text.
fn spelling() -> impl Strategy<Value = String> {
    let piece = prop::sample::select(vec![
        "/", "//", ".", "..", "%2e", "%2E", "%2f", "%5C", "%00", "%41", "%7e", "%c3%a9", "%3b",
        "%25", "%zz", "%4", ";", "\\", "é", "{", "a", "B", "~", ":", "@", "+",
    ]);
    prop::collection::vec(piece, 0..12).prop_map(|pieces| format!("/{}", pieces.concat()))
}

/// `path` fully percent-decoded into segments, with dot segments removed
/// and empty ones merged: what the path means to an upstream that decodes
/// before it routes (the reference the normal form must keep).
fn meaning(path: &str) -> Option<Vec<Vec<u8>>> {
    let mut segments: Vec<Vec<u8>> = Vec::new();
    for raw in path[1..].split('/') {
        let mut seg = Vec::new();
        let b = raw.as_bytes();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' {
                seg.push(u8::from_str_radix(raw.get(i + 1..i + 3)?, 16).ok()?);
                i += 3;
            } else {
                seg.push(b[i]);
                i += 1;
            }
        }
        match seg.as_slice() {
            b"" | b"." => {}
            b".." => {
                segments.pop()?;
            }
            _ => segments.push(seg),
        }
    }
    Some(segments)
}

proptest! {
    #[test]
    fn normalising_twice_changes_nothing(path in spelling()) {
        if let Ok(once) = normalize(&path) {
            let twice = normalize(&once);
            prop_assert!(matches!(&twice, Ok(Cow::Borrowed(p)) if **p == *once), "{:?} -> {:?} -> {:?}", path, once, twice);
        }
    }

    /// The one-scan check and the rewrite agree: whatever the scan passes,
    /// the rewrite leaves as it is.
    #[test]
    fn the_scan_passes_only_what_the_rewrite_keeps(path in spelling()) {
        if is_normal(path.as_bytes()) {
            prop_assert_eq!(rewrite(&path), Ok(path.clone()));
        }
    }

    #[test]
    fn a_normal_form_has_no_dot_segment_no_empty_segment_no_needless_encoding(path in spelling()) {
        let Ok(out) = normalize(&path) else { return Ok(()) };
        let segments: Vec<&str> = out[1..].split('/').collect();
        for (i, seg) in segments.iter().enumerate() {
            prop_assert!(*seg != "." && *seg != "..", "{:?}", out);
            prop_assert!(!seg.is_empty() || i == segments.len() - 1, "{:?}", out);
        }
        for (i, _) in out.match_indices('%') {
            let hex = &out[i + 1..i + 3];
            prop_assert_eq!(hex, hex.to_ascii_uppercase());
            let byte = u8::from_str_radix(hex, 16).unwrap();
            prop_assert_eq!(class(byte), Class::Encoded, "{:?}", out);
        }
        prop_assert!(out.bytes().all(|b| b == b'%' || class(b) != Class::Encoded), "{:?}", out);
    }

    /// The normal form means what the request meant, to an upstream that
    /// decodes and resolves dot segments; a refused path is one that has no
    /// single meaning (or none at all).
    #[test]
    fn the_normal_form_means_what_the_path_meant(path in spelling()) {
        match normalize(&path) {
            Ok(out) => prop_assert_eq!(meaning(&out), meaning(&path)),
            Err(Ambiguity::AboveRoot) => prop_assert_eq!(meaning(&path), None),
            Err(_) => {}
        }
    }
}
