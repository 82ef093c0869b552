//! The settings as a whole: sources, precedence, validation, the shipped examples.

use super::*;
use idemgate_idempotency::route::{OnUnknown, Reconcile};
use idemgate_trust::OwnerSource;

fn flags_with_upstream() -> Flags {
    Flags {
        upstreams: vec!["http://127.0.0.1:8000".into()],
        ..Flags::default()
    }
}

#[test]
fn flags_override_the_file() {
    let file = Settings::parse_file(
        "upstream_timeout = \"5s\"\nhold_timeout = \"7s\"\nupstreams = [\"http://a:1\"]",
    )
    .unwrap();
    let flags = Flags {
        upstream_timeout: Some(Duration::from_secs(2)),
        ..flags_with_upstream()
    };
    let s = Settings::from_sources(file, flags).unwrap();
    assert_eq!(s.upstream_timeout, Duration::from_secs(2));
    assert_eq!(s.hold_timeout, Duration::from_secs(7));
    assert_eq!(s.upstreams[0].base, "http://127.0.0.1:8000");
}

#[test]
fn an_upstream_url_carrying_a_password_is_refused_without_repeating_it() {
    // With a scheme, without one, and one that is no URL at all: each
    // refused for its password, before an error that repeats the URL.
    // And one split at a comma in its password, as `IDEMGATE_UPSTREAM` is:
    // the piece before has no `@`, and would be reported unparsable.
    for urls in [
        &["http://svc:hunter2@127.0.0.1:8000"][..],
        &["svc:hunter2@127.0.0.1:8000"],
        &["http://svc:hun ter2\"@127.0.0.1:8000"],
        &["http://svc:hunter2", "x@127.0.0.1:8000"],
    ] {
        let flags = Flags {
            upstreams: urls.iter().map(|u| u.to_string()).collect(),
            ..Flags::default()
        };
        let err = Settings::from_sources(FileConfig::default(), flags).unwrap_err();
        assert!(err.key.starts_with("upstreams"), "{}", err.key);
        let said = err.to_string();
        assert!(said.contains("[upstreams.headers]"), "{said}");
        assert!(
            !said.contains("hunter2") && !said.contains("ter2"),
            "{said}"
        );
    }
}

#[test]
fn unknown_keys_are_named() {
    let err = Settings::parse_file("upstream_timout = \"5s\"").unwrap_err();
    assert_eq!(err.key, "upstream_timout");
}

#[test]
fn unparsable_values_are_named() {
    let err =
        Settings::parse_file("listen = \"127.0.0.1:1\"\nhold_timeout = \"soon\"\n").unwrap_err();
    assert_eq!(err.key, "hold_timeout");
}

#[test]
fn bad_values_name_their_key() {
    let err = Settings::from_sources(
        Settings::parse_file("mismatch_status = 400").unwrap(),
        flags_with_upstream(),
    )
    .unwrap_err();
    assert_eq!(err.key, "mismatch_status");
    let err = Settings::from_sources(
        Settings::parse_file("[[routes]]\nmethods = [\"GET\"]").unwrap(),
        flags_with_upstream(),
    )
    .unwrap_err();
    assert_eq!(err.key, "routes[0].methods");
    let err = Settings::from_sources(FileConfig::default(), Flags::default()).unwrap_err();
    assert_eq!(err.key, "upstreams");
    let err = Settings::from_sources(
        FileConfig::default(),
        Flags {
            upstreams: vec!["ftp://x".into()],
            ..Flags::default()
        },
    )
    .unwrap_err();
    assert_eq!(err.key, "upstreams[0]");
    let err = Settings::from_sources(
        Settings::parse_file("redis_url = \"redis+sentinel://s:26379\"").unwrap(),
        flags_with_upstream(),
    )
    .unwrap_err();
    assert_eq!(err.key, "redis_url");
    assert!(err.to_string().contains("mymaster"), "{err}");
    for bad in ["\"\"", "\"a{b}:\"", "\"two words\""] {
        let err = Settings::from_sources(
            Settings::parse_file(&format!(
                "redis_url = \"redis://127.0.0.1:6379\"\nredis_key_prefix = {bad}"
            ))
            .unwrap(),
            flags_with_upstream(),
        )
        .unwrap_err();
        assert_eq!(err.key, "redis_key_prefix", "{bad}");
        assert!(err.to_string().contains("without braces"), "{err}");
    }
    let err = Settings::from_sources(
        Settings::parse_file("database_url = \"postgres://u@a:5432,b:5432/db\"").unwrap(),
        flags_with_upstream(),
    )
    .unwrap_err();
    assert_eq!(err.key, "database_url");
    assert!(
        err.to_string().contains("target_session_attrs=read-write"),
        "{err}"
    );
    let primary =
        "database_url = \"postgres://u@a:5432,b:5432/db?target_session_attrs=read-write\"";
    let err = Settings::from_sources(
        Settings::parse_file(primary).unwrap(),
        flags_with_upstream(),
    )
    .unwrap_err();
    assert_eq!(
        err.key, "owner.salt",
        "replicas on PostgreSQL need one salt"
    );
    Settings::from_sources(
        Settings::parse_file(primary).unwrap(),
        Flags {
            owner_salt: Some("c2FsdCBvZiB0ZXN0cywgbm90IGEgc2VjcmV0".into()),
            ..flags_with_upstream()
        },
    )
    .expect("a multi-host URL that asks for the primary");
}

#[test]
fn the_chat_example_is_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/chat");
    let mut file =
        Settings::parse_file(&std::fs::read_to_string(dir.join("idemgate.toml")).unwrap()).unwrap();
    file.base_dir = dir;
    // Credentials come from the environment; stand in fixed values here.
    for client in &mut file.clients {
        client.key_sha256.env = None;
        client.key_sha256.value = Some(hex::encode([7u8; 32]));
    }
    for u in file.upstreams.iter_mut().flatten() {
        if let UpstreamFile::Table(t) = u {
            for source in t.headers.values_mut() {
                source.value = Some("test".into());
                source.env = None;
            }
        }
    }
    let s = Settings::from_sources(file, Flags::default()).unwrap();
    let chat = &s.routes[0];
    assert_eq!(
        chat.upstreams().map(|u| u.id.index()).collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert!(chat.side_effect_free && chat.hedge_after.is_some());
    let contract = chat.contract.as_ref().unwrap();
    // The golden probe, and one per real case of `cases/`.
    let names: Vec<&str> = contract.probes.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["capital-of-france", "real/capital-one-word"]);
    assert_eq!(contract.probes[1].expect.len(), 2);
    let probe = &contract.probes[0];
    assert_eq!((probe.runs, probe.same, probe.expect.len()), (3, true, 2));
    assert!(probe.prompt_tokens.is_some() && !contract.proves_only_the_shape());
    assert!(chat.require_client && s.clients.clients.len() == 1);
}

/// The three owner configurations of docs/design.md §15 load as
/// written (their secrets stood in for), and say what they promise.
#[test]
fn the_owner_examples_are_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/owners");
    let load = |name: &str| {
        let text = std::fs::read_to_string(dir.join(name)).unwrap();
        let mut file = Settings::parse_file(&text).unwrap();
        for client in &mut file.clients {
            client.key_sha256 = trust::SecretFile {
                value: Some(hex::encode([7u8; 32])),
                ..Default::default()
            };
        }
        for u in file.upstreams.iter_mut().flatten() {
            if let UpstreamFile::Table(t) = u {
                for source in t.headers.values_mut() {
                    (source.value, source.env) = (Some("sk-test".into()), None);
                }
            }
        }
        Settings::from_sources(file.relative_to(&dir), Flags::default()).unwrap()
    };
    let bearer = load("bearer-api.toml");
    assert!(!bearer.routes[0].owner.allow_anonymous);
    assert!(
        matches!(bearer.routes[0].owner.sources[..], [OwnerSource::Header(ref h)] if h == "authorization")
    );
    let cookie = load("cookie-app.toml");
    assert!(
        matches!(cookie.routes[0].owner.sources[..], [OwnerSource::Cookie(ref c)] if c == "session_id")
    );
    let ai = load("ai-gateway.toml");
    let chat = &ai.routes[0];
    assert!(chat.require_client && !chat.primary.credentials.is_empty());
    assert!(ai.trusted_proxies.contains("10.1.2.3".parse().unwrap()));
    assert!(!ai.trusted_proxies.contains("192.0.2.1".parse().unwrap()));
    assert!(matches!(
        chat.owner.sources[..],
        [OwnerSource::All(_), OwnerSource::Client]
    ));
}

#[test]
fn the_example_file_is_valid() {
    let text = include_str!("../../config/idemgate.example.toml");
    let s = Settings::from_sources(Settings::parse_file(text).unwrap(), Flags::default()).unwrap();
    assert_eq!(s.routes.len(), 2);
    assert_eq!(s.routes[0].name, "chat", "most specific first");
}

#[test]
fn default_route_opts_in_post_and_patch_everywhere() {
    let s = Settings::from_sources(FileConfig::default(), flags_with_upstream()).unwrap();
    assert!(s.route_for(&Method::POST, "/anything").is_some());
    assert!(s.route_for(&Method::PATCH, "/").is_some());
    assert!(s.route_for(&Method::PUT, "/anything").is_none());
    assert!(s.route_for(&Method::GET, "/anything").is_none());
}

#[test]
fn most_specific_route_wins() {
    let file = Settings::parse_file(
        "[[routes]]\nname = \"all\"\npath_prefix = \"/\"\n\
         [[routes]]\nname = \"chat\"\npath_prefix = \"/v1/chat\"\nrequire_key = true\n",
    )
    .unwrap();
    let s = Settings::from_sources(file, flags_with_upstream()).unwrap();
    assert_eq!(
        s.route_for(&Method::POST, "/v1/chat/completions")
            .unwrap()
            .name,
        "chat"
    );
    assert_eq!(s.route_for(&Method::POST, "/v1/other").unwrap().name, "all");
}

#[test]
fn routes_match_whole_path_segments() {
    let file = Settings::parse_file(
        "[[routes]]\nname = \"chat\"\npath_prefix = \"/v1/chat\"\n\
         [[routes]]\nname = \"slash\"\npath_prefix = \"/v2/jobs/\"\n",
    )
    .unwrap();
    let s = Settings::from_sources(file, flags_with_upstream()).unwrap();
    let name = |path| s.route_for(&Method::POST, path).map(|r| r.name.as_str());
    assert_eq!(name("/v1/chat"), Some("chat"));
    assert_eq!(name("/v1/chat/completions"), Some("chat"));
    assert_eq!(
        name("/v1/chatty"),
        None,
        "a prefix matches whole segments only"
    );
    assert_eq!(name("/v1/chat-old/x"), None);
    assert_eq!(
        name("/v2/jobs"),
        Some("slash"),
        "a trailing slash is not required"
    );
    assert_eq!(name("/v2/jobs/7"), Some("slash"));
    assert_eq!(name("/v2/jobsx"), None);
}

#[test]
fn routes_match_paths_in_any_ascii_case() {
    let file =
        Settings::parse_file("[[routes]]\nname = \"charges\"\npath_prefix = \"/v1/charges\"\n")
            .unwrap();
    let s = Settings::from_sources(file, flags_with_upstream()).unwrap();
    let name = |path| s.route_for(&Method::POST, path).map(|r| r.name.as_str());
    assert_eq!(name("/V1/Charges"), Some("charges"));
    assert_eq!(name("/v1/CHARGES/ch_1"), Some("charges"));
    assert_eq!(name("/v1/chargesX"), None);
    assert_eq!(name("/v1/charg"), None);
}

/// Request paths are normalised before routing (`docs/design.md` §2),
/// so a prefix spelled any other way would never match: refused at
/// start-up, naming the normal spelling or the ambiguity.
#[test]
fn a_path_prefix_not_in_normal_form_is_refused() {
    for (prefix, says) in [
        ("/v1//charges", "write \"/v1/charges\""),
        ("/v1/./charges", "write \"/v1/charges\""),
        ("/v1/%63harges", "write \"/v1/charges\""),
        ("/caf%c3%a9", "write \"/caf%C3%A9\""),
        ("/v1/charges;x", "`;`"),
        ("/v1%2Fcharges", "`%2F`"),
        ("/..", "climb above"),
    ] {
        let text = format!("[[routes]]\npath_prefix = {prefix:?}\n");
        let file = Settings::parse_file(&text).unwrap();
        let e = Settings::from_sources(file, flags_with_upstream()).unwrap_err();
        assert_eq!(e.key, "routes[0].path_prefix", "{prefix}");
        assert!(e.to_string().contains(says), "{prefix}: {e}");
    }
}

/// `[routes.reconcile]` (`docs/design.md` §5): a lookup path must be a
/// path, and say where the job goes; a route without it looks nothing up.
#[test]
fn a_reconcile_path_must_start_with_a_slash_and_hold_the_job() {
    for (path, says) in [
        ("v1/charges/lookup/{job}", "must start with `/`"),
        ("/v1/charges/lookup", "put {job} where"),
        ("/v1/charges/{job} x", "not a valid request path"),
    ] {
        let text = format!(
            "[[routes]]\npath_prefix = \"/v1/charges\"\n[routes.reconcile]\npath = {path:?}\n"
        );
        let file = Settings::parse_file(&text).unwrap();
        let e = Settings::from_sources(file, flags_with_upstream()).unwrap_err();
        assert_eq!(e.key, "routes[0].reconcile.path", "{path}");
        assert!(e.to_string().contains(says), "{path}: {e}");
    }
    let text = "[[routes]]\npath_prefix = \"/v1/charges\"\n[routes.reconcile]\n";
    let e = Settings::from_sources(Settings::parse_file(text).unwrap(), flags_with_upstream())
        .unwrap_err();
    assert_eq!(e.key, "routes[0].reconcile.path");
    let text = "[[routes]]\npath_prefix = \"/v1/charges\"\n\
                [routes.reconcile]\npath = \"/v1/charges/lookup/{job}\"\n\
                [[routes]]\npath_prefix = \"/v1/refunds\"\n";
    let s =
        Settings::from_sources(Settings::parse_file(text).unwrap(), flags_with_upstream()).unwrap();
    let charges = s
        .routes
        .iter()
        .find(|r| r.path_prefix == "/v1/charges")
        .unwrap();
    let reconcile = charges.reconcile.as_ref().unwrap();
    assert_eq!(
        reconcile.lookup_path("j-1").as_deref(),
        Some("/v1/charges/lookup/j-1")
    );
    let refunds = s
        .routes
        .iter()
        .find(|r| r.path_prefix == "/v1/refunds")
        .unwrap();
    assert!(refunds.reconcile.is_none(), "no lookups unless asked for");
}

/// `reconcile = "resend"` is the other spelling (`docs/design.md` §5);
/// anything else is named with both ways.
#[test]
fn reconcile_is_resend_or_a_lookup_table() {
    let route = |line: &str| format!("[[routes]]\npath_prefix = \"/v1/charges\"\n{line}\n");
    let s = Settings::from_sources(
        Settings::parse_file(&route("reconcile = \"resend\"")).unwrap(),
        flags_with_upstream(),
    )
    .unwrap();
    assert_eq!(s.routes[0].reconcile, Some(Reconcile::Resend));
    for (line, says) in [
        ("reconcile = \"lookup\"", "reconcile = \"resend\""),
        ("reconcile = true", "[routes.reconcile]"),
        ("[routes.reconcile]\npathh = \"/x/{job}\"", "mean `path`?"),
    ] {
        let file = Settings::parse_file(&route(line)).unwrap();
        let e = Settings::from_sources(file, flags_with_upstream()).unwrap_err();
        assert_eq!(e.key, "routes[0].reconcile", "{line}");
        assert!(e.to_string().contains(says), "{line}: {e}");
    }
}

/// `on_unknown = "new_attempt"` (`docs/design.md` §5) only where a second
/// call can have no second effect.
#[test]
fn moving_on_from_an_unknown_outcome_needs_a_side_effect_free_route() {
    let route = |lines: &str| format!("[[routes]]\npath_prefix = \"/v1/chat\"\n{lines}\n");
    let parse = |lines: &str| {
        Settings::from_sources(
            Settings::parse_file(&route(lines)).unwrap(),
            flags_with_upstream(),
        )
    };
    let s = parse("").unwrap();
    assert_eq!(
        s.routes[0].on_unknown,
        OnUnknown::Block,
        "blocking by default"
    );
    let s = parse("side_effect_free = true\non_unknown = \"new_attempt\"").unwrap();
    assert_eq!(s.routes[0].on_unknown, OnUnknown::NewAttempt);
    for (lines, says) in [
        ("on_unknown = \"new_attempt\"", "side_effect_free = true"),
        (
            "side_effect_free = true\non_unknown = \"retry\"",
            "neither \"block\"",
        ),
    ] {
        let e = parse(lines).unwrap_err();
        assert_eq!(e.key, "routes[0].on_unknown", "{lines}");
        assert!(e.to_string().contains(says), "{lines}: {e}");
    }
}

#[test]
fn a_probeless_contract_on_a_route_with_fallbacks_is_refused() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/chat");
    let text = "upstreams = [\"http://a:1\", \"http://b:1\"]\n\
                [contracts.bare]\nschema = \"response.schema.json\"\n\
                [[routes]]\npath_prefix = \"/v1\"\ncontract = \"bare\"\n";
    let mut file = Settings::parse_file(text).unwrap();
    file.base_dir = dir.clone();
    let err = Settings::from_sources(file, Flags::default()).unwrap_err();
    assert_eq!(err.key, "routes[0].contract");
    assert!(err.message.contains("no probes"), "{}", err.message);
    // With a single upstream there is nothing to fail over to: allowed.
    let mut file = Settings::parse_file(&text.replace(", \"http://b:1\"", "")).unwrap();
    file.base_dir = dir;
    assert!(Settings::from_sources(file, Flags::default()).is_ok());
}

/// The two silences of an attempt (`docs/design.md` §11): each defaults to
/// the upstream's `timeout`, which defaults to `upstream_timeout`.
#[test]
fn stream_timeouts_default_to_the_upstreams_timeout() {
    let text = "upstream_timeout = \"7s\"\n\
                [[upstreams]]\nname = \"a\"\nurl = \"http://a:1\"\n\
                [[upstreams]]\nname = \"b\"\nurl = \"http://b:1\"\ntimeout = \"3s\"\n";
    let s = Settings::from_sources(Settings::parse_file(text).unwrap(), Flags::default()).unwrap();
    let [a, b] = [&s.upstreams[0], &s.upstreams[1]];
    assert_eq!(a.first_byte_timeout, Duration::from_secs(7));
    assert_eq!(a.stream_idle_timeout, Duration::from_secs(7));
    assert_eq!(b.first_byte_timeout, Duration::from_secs(3));
    assert_eq!(b.stream_idle_timeout, Duration::from_secs(3));
    let route = &s.routes[0];
    assert_eq!(
        (route.first_byte_timeout, route.stream_idle_timeout),
        (None, None)
    );
    let silences = route.silences(b);
    assert_eq!(silences.first_byte, Duration::from_secs(3));
    assert_eq!(silences.stream_idle, Duration::from_secs(3));
}

/// A route's key over its upstream's, the upstream's over its `timeout`.
#[test]
fn stream_timeouts_take_the_route_then_the_upstream_then_the_timeout() {
    let text = "upstream_timeout = \"30s\"\n\
                [[upstreams]]\nname = \"a\"\nurl = \"http://a:1\"\n\
                first_byte_timeout = \"2s\"\nstream_idle_timeout = \"20s\"\n\
                [[upstreams]]\nname = \"b\"\nurl = \"http://b:1\"\n\
                [[routes]]\npath_prefix = \"/v1/chat\"\nfirst_byte_timeout = \"500ms\"\n\
                [[routes]]\npath_prefix = \"/v1/embeddings\"\nstream_idle_timeout = \"1m\"\n";
    let s = Settings::from_sources(Settings::parse_file(text).unwrap(), Flags::default()).unwrap();
    let route = |prefix: &str| s.routes.iter().find(|r| r.path_prefix == prefix).unwrap();
    let [a, b] = [&s.upstreams[0], &s.upstreams[1]];
    let (chat, embeddings) = (route("/v1/chat"), route("/v1/embeddings"));
    let secs = Duration::from_secs;
    // The route's own first byte; the upstream's (or its timeout's) idle.
    assert_eq!(chat.silences(a).first_byte, Duration::from_millis(500));
    assert_eq!(chat.silences(a).stream_idle, secs(20));
    assert_eq!(chat.silences(b).first_byte, Duration::from_millis(500));
    assert_eq!(chat.silences(b).stream_idle, secs(30));
    // The upstream's (or its timeout's) first byte; the route's own idle.
    assert_eq!(embeddings.silences(a).first_byte, secs(2));
    assert_eq!(embeddings.silences(b).first_byte, secs(30));
    assert_eq!(embeddings.silences(a).stream_idle, secs(60));
    assert_eq!(embeddings.silences(b).stream_idle, secs(60));
}

/// How long a database statement waits for a lock: two seconds unless
/// set, never zero (PostgreSQL would read it as "for ever") and at most a
/// day (PostgreSQL's own bound is 24 days, and past it no session starts).
#[test]
fn the_database_lock_timeout_is_read_and_zero_is_refused_naming_it() {
    let url = "database_url = \"postgres://u@h/db\"\n";
    let lock_timeout = |text: &str| {
        let file = Settings::parse_file(&format!("{url}{text}")).unwrap();
        match store::store_settings(&file, &Flags::default()) {
            Ok(idemgate_store::StoreSettings::Postgres(pg)) => Ok(pg.lock_timeout),
            Ok(other) => panic!("not PostgreSQL: {other:?}"),
            Err(e) => Err(e),
        }
    };
    assert_eq!(lock_timeout("").unwrap(), Duration::from_secs(2));
    assert_eq!(
        lock_timeout("database_lock_timeout = \"250ms\"\n").unwrap(),
        Duration::from_millis(250)
    );
    let e = lock_timeout("database_lock_timeout = \"0s\"\n").unwrap_err();
    assert_eq!(e.key, "database_lock_timeout");
    assert!(e.to_string().contains("greater than zero"), "{e}");
    let e = lock_timeout("database_lock_timeout = \"30d\"\n").unwrap_err();
    assert_eq!(e.key, "database_lock_timeout");
    assert!(e.to_string().contains("at most 24h"), "{e}");
}

#[test]
fn a_zero_stream_timeout_is_refused_naming_its_key() {
    let upstream = "[[upstreams]]\nurl = \"http://a:1\"\n";
    let routes = "[[routes]]\npath_prefix = \"/a\"\n[[routes]]\npath_prefix = \"/b\"\n";
    for (text, key) in [
        (
            format!("{upstream}first_byte_timeout = \"0s\"\n"),
            "upstreams[0].first_byte_timeout",
        ),
        (
            format!("{upstream}stream_idle_timeout = \"0ms\"\n"),
            "upstreams[0].stream_idle_timeout",
        ),
        (
            format!("{upstream}{routes}first_byte_timeout = \"0s\"\n"),
            "routes[1].first_byte_timeout",
        ),
        (
            format!("{upstream}{routes}stream_idle_timeout = \"0s\"\n"),
            "routes[1].stream_idle_timeout",
        ),
    ] {
        let file = Settings::parse_file(&text).unwrap();
        let err = Settings::from_sources(file, Flags::default()).unwrap_err();
        assert_eq!(err.key, key, "{text}");
        assert!(err.message.contains("greater than zero"), "{}", err.message);
    }
}

mod props {
    use super::super::*;
    use proptest::prelude::*;

    /// Values of every TOML shape, many of them wrong for their key.
    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<i64>().prop_map(|n| n.to_string()),
            "[a-z0-9:/. ]{0,12}".prop_map(|s| format!("{s:?}")),
            prop_oneof![
                Just("0s"),
                Just("250ms"),
                Just("10s"),
                Just("24h"),
                Just("-1s"),
                Just("soon")
            ]
            .prop_map(|d| format!("{d:?}")),
            Just("true".to_owned()),
            Just("[\"http://127.0.0.1:1\"]".to_owned()),
            Just("[]".to_owned()),
            Just("{}".to_owned()),
        ]
    }

    fn key() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            "listen",
            "admin_listen",
            "admin_token",
            "upstreams",
            "database_url",
            "database_direct_url",
            "database_pool_size",
            "database_timeout",
            "database_lock_timeout",
            "redis_url",
            "redis_timeout",
            "redis_inline_max",
            "redis_key_prefix",
            "upstream_timeout",
            "attempt_deadline",
            "hold_timeout",
            "key_ttl",
            "lease_ttl",
            "sweep_interval",
            "retry_after",
            "owner_header",
            "forward_key_header",
            "mismatch_status",
            "max_response_size",
            "probe_interval",
            "no_such_key",
        ])
    }

    proptest! {
        #[test]
        fn any_text_parses_or_names_a_key(text in "(?s).{0,200}") {
            if let Err(e) = Settings::parse_file(&text) {
                prop_assert!(!e.key.is_empty());
            }
        }

        #[test]
        fn any_settings_validate_or_name_a_key(
            pairs in proptest::collection::btree_map(key(), value(), 0..8),
            route in proptest::option::of(proptest::collection::btree_map(
                prop::sample::select(vec!["path_prefix", "methods", "body_limit", "max_attempts", "hedge_after", "first_byte_timeout", "stream_idle_timeout", "upstreams", "contract"]),
                value(),
                0..4,
            )),
        ) {
            let mut text: String = pairs.iter().map(|(k, v)| format!("{k} = {v}\n")).collect();
            if let Some(route) = route {
                text.push_str("[[routes]]\n");
                text.extend(route.iter().map(|(k, v)| format!("{k} = {v}\n")));
            }
            let outcome = Settings::parse_file(&text).and_then(|f| {
                Settings::from_sources(f, Flags { upstreams: vec!["http://127.0.0.1:1".into()], ..Flags::default() })
            });
            if let Err(e) = outcome {
                prop_assert!(!e.key.is_empty() && !e.message.is_empty(), "{:?}", e);
            }
        }
    }
}

#[test]
fn a_resume_point_header_cannot_be_part_of_the_fingerprint() {
    for name in ["Last-Event-ID", "idempotency-events-received"] {
        let text = format!(
            "upstreams = [\"http://a:1\"]\n[[routes]]\npath_prefix = \"/a\"\nsignificant_headers = [\"content-type\", \"{name}\"]\n"
        );
        let file = Settings::parse_file(&text).unwrap();
        let err = Settings::from_sources(file, Flags::default()).unwrap_err();
        assert_eq!(err.key, "routes[0].significant_headers");
        assert!(err.message.contains("remove it"), "{}", err.message);
    }
}

#[test]
fn stream_errors_and_end_events_are_read_with_their_defaults() {
    let load = |route: &str| {
        Settings::from_sources(
            Settings::parse_file(&format!("[[routes]]\n{route}")).unwrap(),
            flags_with_upstream(),
        )
    };
    let plain = load("").unwrap();
    let route = &plain.routes[0];
    assert!(route.stream_errors.enabled);
    assert!(route.stream_errors.is_retryable("overloaded_error"));
    assert!(route.stream_errors.is_retryable("rate_limit_exceeded"));
    assert!(!route.stream_errors.is_retryable("invalid_request_error"));
    assert!(route.stream_end_events.is_empty(), "any clean end is whole");
    let set = load(
        "stream_end_events = [\"[DONE]\", \"message_stop\"]\n\
         [routes.stream_errors]\nenabled = false\nretryable = [\"busy\"]",
    )
    .unwrap();
    let route = &set.routes[0];
    assert!(!route.stream_errors.enabled);
    assert_eq!(route.stream_errors.retryable, ["busy"]);
    assert_eq!(route.stream_end_events, ["[DONE]", "message_stop"]);
    let err = load("stream_end_events = [\"\"]").unwrap_err();
    assert_eq!(err.key, "routes[0].stream_end_events");
    let err = load("[routes.stream_errors]\nretryable = [\" \"]").unwrap_err();
    assert_eq!(err.key, "routes[0].stream_errors.retryable");
    let err = Settings::parse_file("[[routes]]\n[routes.stream_errors]\nretry = []").unwrap_err();
    assert!(err.to_string().contains("retry"), "{err}");
}

#[test]
fn respond_async_is_on_by_default_and_its_path_is_under_no_route() {
    let load = |toml: &str| {
        Settings::from_sources(Settings::parse_file(toml).unwrap(), flags_with_upstream())
    };
    let plain = load("[[routes]]\npath_prefix = \"/v1\"").unwrap();
    assert!(plain.routes[0].respond_async);
    assert_eq!(plain.respond_async_path, "/.well-known/idemgate/jobs");
    let off = load("[[routes]]\nrespond_async = false").unwrap();
    assert!(!off.routes[0].respond_async);
    let moved = load("respond_async_path = \"/jobs\"\n[[routes]]\npath_prefix = \"/v1\"").unwrap();
    assert_eq!(moved.respond_async_path, "/jobs");
    for bad in ["jobs", "/jobs/", "/a/../jobs", "/v1/jobs"] {
        let err = load(&format!(
            "respond_async_path = \"{bad}\"\n[[routes]]\npath_prefix = \"/v1\""
        ))
        .unwrap_err();
        assert_eq!(err.key, "respond_async_path", "{bad}");
    }
}

#[test]
fn an_mcp_route_reads_its_protocol_and_the_worked_example_loads() {
    use idemgate_idempotency::route::Protocol;
    let load = |route: &str| {
        Settings::from_sources(
            Settings::parse_file(&format!("[[routes]]\n{route}")).unwrap(),
            flags_with_upstream(),
        )
    };
    assert_eq!(load("").unwrap().routes[0].protocol, Protocol::Http);
    let mcp =
        load("protocol = \"mcp\"\nkeyed_tools = [\"charge\"]\nretryable_rpc_codes = [-32001]")
            .unwrap();
    let Protocol::Mcp(mcp) = &mcp.routes[0].protocol else {
        panic!("not mcp")
    };
    assert!(mcp.keys("charge") && !mcp.keys("lookup"));
    assert_eq!(mcp.retryable_codes, [-32001]);
    assert_eq!(
        load("protocol = \"grpc\"").unwrap_err().key,
        "routes[0].protocol"
    );
    let err = load("keyed_tools = [\"charge\"]").unwrap_err();
    assert_eq!(
        err.key, "routes[0].keyed_tools",
        "only an MCP route keys tools"
    );
    // A lookup's answer is not a tool's JSON-RPC response; a resend is.
    let lookup = "protocol = \"mcp\"\n[routes.reconcile]\npath = \"/calls/{job}\"";
    let err = load(lookup).unwrap_err();
    assert_eq!(err.key, "routes[0].reconcile");
    assert!(err.to_string().contains("resend"), "{err}");
    assert!(load("protocol = \"mcp\"\nreconcile = \"resend\"").is_ok());
    // A tool call's fingerprint is its tool and arguments: the HTTP keys
    // that shape a fingerprint would be read by no one.
    for http_only in [
        "significant_headers = [\"x-tenant\"]",
        "ignore_fields = [\"/a\"]",
        "canonical_json = true",
    ] {
        let err = load(&format!("protocol = \"mcp\"\n{http_only}")).unwrap_err();
        let name = http_only.split(' ').next().unwrap();
        assert_eq!(err.key, format!("routes[0].{name}"));
        assert!(err.to_string().contains("remove this key"), "{err}");
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/mcp");
    let text = std::fs::read_to_string(dir.join("idemgate.toml")).unwrap();
    let example =
        Settings::from_sources(Settings::parse_file(&text).unwrap(), Flags::default()).unwrap();
    assert!(matches!(example.routes[0].protocol, Protocol::Mcp(_)));
    assert!(!example.routes[0].owner.allow_anonymous);
}

/// A JWT source's `leeway`: 60 s unless written; whole seconds up to five
/// minutes; anything else names the key. JWT options on another kind of
/// source are refused, not ignored (`docs/design.md` §15).
#[test]
fn a_jwt_leeway_is_checked_at_start_up() {
    let settings = |text: &str| {
        Settings::from_sources(Settings::parse_file(text).unwrap(), flags_with_upstream())
    };
    let secret = "s".repeat(32);
    let jwt = |options: &str| {
        settings(&format!("[owner]\nsources = [{{ jwt = \"sub\", secret = {{ value = {secret:?} }}, algorithms = [\"HS256\"]{options} }}]\n"))
    };
    let leeway = |s: &Settings| match &s.owner.sources[0] {
        OwnerSource::Jwt(jwt) => jwt.validation.leeway,
        other => panic!("not a JWT source: {other:?}"),
    };
    assert_eq!(leeway(&jwt("").unwrap()), 60);
    assert_eq!(leeway(&jwt(", leeway = \"5s\"").unwrap()), 5);
    assert_eq!(leeway(&jwt(", leeway = \"0s\"").unwrap()), 0);
    for bad in ["\"10m\"", "\"1500ms\""] {
        let err = jwt(&format!(", leeway = {bad}")).unwrap_err();
        assert_eq!(err.key, "owner.sources[0].leeway", "{bad}");
        assert!(err.to_string().contains("whole seconds"), "{err}");
    }
    let err = Settings::parse_file("[owner]\nsources = [{ jwt = \"sub\", leeway = \"soon\" }]\n")
        .unwrap_err();
    assert!(err.key.ends_with("sources"), "{err}");
    assert!(err.message.contains("soon"), "{}", err.message);
    let misplaced = settings("[owner]\nsources = [{ header = \"x-user\", audience = \"api\" }]\n");
    let err = misplaced.unwrap_err();
    assert_eq!(err.key, "owner.sources[0]");
    assert!(err.message.contains("belong to a `jwt` source"), "{err}");
}

/// Two `jwt` sources reading one claim from one header are two issuers'
/// (design §15, "Several issuers"): each must name its own `issuer`, or
/// the second issuer's `alice` would be the first's; named, each knows
/// the other's, and the other sources are left as they were.
#[test]
fn two_jwt_sources_on_one_header_each_name_their_issuer() {
    let secret = "s".repeat(32);
    let source = |issuer: &str| {
        format!("{{ jwt = \"sub\", secret = {{ value = {secret:?} }}, algorithms = [\"HS256\"]{issuer} }}")
    };
    let settings = |a: &str, b: &str| {
        let text = format!(
            "[owner]\nsources = [{}, {}, {{ header = \"x-key\" }}]\n",
            source(a),
            source(b)
        );
        Settings::from_sources(Settings::parse_file(&text).unwrap(), flags_with_upstream())
    };
    let (a, b) = (", issuer = \"https://a\"", ", issuer = \"https://b\"");
    for (first, second, key) in [
        ("", b, "owner.sources[0]"),
        (a, "", "owner.sources[0]"),
        (a, a, "owner.sources[0]"),
    ] {
        let err = settings(first, second).unwrap_err();
        assert_eq!(err.key, key, "{first} {second}");
        assert!(err.message.contains("give each its own `issuer`"), "{err}");
    }
    let both = settings(a, b).unwrap();
    let beside = |n: usize| match &both.owner.sources[n] {
        OwnerSource::Jwt(jwt) => jwt.beside.clone(),
        other => panic!("not a JWT source: {other:?}"),
    };
    assert_eq!(beside(0), ["https://b"]);
    assert_eq!(beside(1), ["https://a"]);
    assert_eq!(both.owner.sources[0].label(), "jwt:authorization:sub");
    assert_eq!(
        both.owner.sources[1].label(),
        "jwt:authorization:sub:https://b"
    );
    assert_eq!(both.owner.sources[2].label(), "header:x-key");
    // A wider source between them would take a token one leaves to the
    // other.
    let text = format!(
        "[owner]\nsources = [{}, {{ header = \"x-key\" }}, {}]\n",
        source(a),
        source(b)
    );
    let apart = Settings::from_sources(Settings::parse_file(&text).unwrap(), flags_with_upstream());
    let err = apart.unwrap_err();
    assert_eq!(err.key, "owner.sources[0]");
    assert!(err.message.contains("side by side"), "{err}");
    let alone = Settings::from_sources(
        Settings::parse_file(&format!("[owner]\nsources = [{}]\n", source(a))).unwrap(),
        flags_with_upstream(),
    )
    .unwrap();
    assert_eq!(
        alone.owner.sources[0].label(),
        "jwt:authorization:sub",
        "a source alone keeps its owners"
    );
}

/// Two sources of one list whose labels are spelled alike would give their
/// callers one owner: a claim with a `:` in it spells the label of another
/// issuer's claim beside it, and a source written twice is its own twin.
/// Both are refused at start-up, naming the later source.
#[test]
fn sources_whose_owners_would_be_spelled_alike_are_refused() {
    let secret = "s".repeat(32);
    let jwt = |claim: &str, issuer: &str| {
        format!("{{ jwt = \"{claim}\", secret = {{ value = {secret:?} }}, algorithms = [\"HS256\"], issuer = \"{issuer}\" }}")
    };
    let start = |sources: Vec<String>| {
        let text = format!("[owner]\nsources = [{}]\n", sources.join(", "));
        Settings::from_sources(Settings::parse_file(&text).unwrap(), flags_with_upstream())
    };
    let spelled_alike = vec![jwt("sub", "a"), jwt("sub", "x:y"), jwt("sub:x:y", "b")];
    let err = start(spelled_alike).unwrap_err();
    assert_eq!(err.key, "owner.sources[2]");
    assert!(err.message.contains("`owner.sources[1]`"), "{err}");
    assert!(err.message.contains("jwt:authorization:sub:x:y"), "{err}");
    let twice = vec!["{ header = \"x-user\" }".to_owned(); 2];
    assert_eq!(start(twice).unwrap_err().key, "owner.sources[1]");
    let apart = vec![jwt("sub", "a"), jwt("sub", "x:y"), jwt("sub:x", "b")];
    assert!(start(apart).is_ok(), "a label of its own each");
}

/// An upstream's or a route's silence longer than `attempt_deadline` would
/// be cut short at the deadline without a word: refused, naming its key
/// and the deadline to raise. One as long as the deadline is taken.
#[test]
fn a_silence_longer_than_the_attempt_deadline_is_refused_naming_its_key() {
    let deadline = "attempt_deadline = \"1m\"\n";
    let upstream = "[[upstreams]]\nurl = \"http://a:1\"\n";
    let routes = "[[routes]]\npath_prefix = \"/a\"\n[[routes]]\npath_prefix = \"/b\"\n";
    for (text, key) in [
        (
            format!("{upstream}timeout = \"2m\"\n"),
            "upstreams[0].timeout",
        ),
        (
            format!("{upstream}first_byte_timeout = \"61s\"\n"),
            "upstreams[0].first_byte_timeout",
        ),
        (
            format!("{upstream}stream_idle_timeout = \"1h\"\n"),
            "upstreams[0].stream_idle_timeout",
        ),
        (
            format!("{upstream}{routes}first_byte_timeout = \"2m\"\n"),
            "routes[1].first_byte_timeout",
        ),
        (
            format!("{upstream}{routes}stream_idle_timeout = \"2m\"\n"),
            "routes[1].stream_idle_timeout",
        ),
    ] {
        let file = Settings::parse_file(&format!("{deadline}{text}")).unwrap();
        let err = Settings::from_sources(file, Flags::default()).unwrap_err();
        assert_eq!(err.key, key, "{text}");
        assert!(
            err.message.contains("raise attempt_deadline to at least"),
            "{}",
            err.message
        );
    }
    let as_long =
        format!("{deadline}{upstream}timeout = \"1m\"\n{routes}stream_idle_timeout = \"60s\"\n");
    Settings::from_sources(Settings::parse_file(&as_long).unwrap(), Flags::default())
        .expect("silences as long as the deadline");
}

/// Values far past any sensible one (a unit slip) are refused naming their
/// key, rather than overflowing the arithmetic done on them later (a
/// panic) or PostgreSQL's timestamps; the bounds themselves are taken.
#[test]
fn huge_timings_and_counts_are_refused_naming_their_key() {
    // About 500 billion years: humantime reads it, ten times it overflows.
    let huge = "\"500000000000years\"";
    for (key, value) in [
        // Set beside it: ten times it is then never computed.
        (
            "upstream_timeout",
            &format!("{huge}\nattempt_deadline = \"1h\"")[..],
        ),
        ("upstream_timeout", huge),
        ("attempt_deadline", "\"31d\""),
        ("hold_timeout", "\"8d\""),
        ("key_ttl", huge),
        ("key_ttl", "\"3651d\""),
        ("lease_ttl", "\"25h\""),
        ("sweep_interval", huge),
        ("probe_interval", "\"2d\""),
        ("shutdown_grace", huge),
        ("max_connections", "9223372036854775807"),
        ("max_connections", "1000001"),
    ] {
        let text = format!("{key} = {value}");
        let file = Settings::parse_file(&text).unwrap();
        let err = Settings::from_sources(file, flags_with_upstream()).unwrap_err();
        assert_eq!(err.key, key, "{text}");
        assert!(
            err.message.contains("set at most"),
            "{text}: {}",
            err.message
        );
    }
    let at_the_bounds = "upstream_timeout = \"24h\"\nattempt_deadline = \"30d\"\n\
                         hold_timeout = \"7d\"\nkey_ttl = \"3650d\"\nlease_ttl = \"24h\"\n\
                         sweep_interval = \"24h\"\nprobe_interval = \"24h\"\n\
                         shutdown_grace = \"30d\"\nmax_connections = 1000000\n";
    Settings::from_sources(
        Settings::parse_file(at_the_bounds).unwrap(),
        flags_with_upstream(),
    )
    .expect("every bound itself");
    // The defaults that follow upstream_timeout stay within theirs.
    let s = Settings::from_sources(
        Settings::parse_file("upstream_timeout = \"24h\"").unwrap(),
        flags_with_upstream(),
    )
    .unwrap();
    assert_eq!(s.attempt_deadline, Duration::from_secs(10 * 24 * 3600));
    assert_eq!(s.shutdown_grace, s.attempt_deadline);
}

/// The database's and Redis's keys are checked without their URL too (a
/// mistake is told now, not when the URL is added); a direct database URL
/// without `database_url` is refused, as Redis's TLS keys are without
/// `redis_url`: it names a connection the gateway would never make.
#[test]
fn database_and_redis_keys_are_checked_without_their_url() {
    for (text, key) in [
        ("database_pool_size = 0", "database_pool_size"),
        ("database_timeout = \"0s\"", "database_timeout"),
        ("database_lock_timeout = \"30d\"", "database_lock_timeout"),
        (
            "database_direct_url = \"postgres://u@h/db\"",
            "database_direct_url",
        ),
        ("redis_timeout = \"0s\"", "redis_timeout"),
        ("redis_key_prefix = \"a{b}:\"", "redis_key_prefix"),
    ] {
        let file = Settings::parse_file(text).unwrap();
        let err = Settings::from_sources(file, flags_with_upstream()).unwrap_err();
        assert_eq!(err.key, key, "{text}");
    }
    let err = Settings::from_sources(
        Settings::parse_file("database_direct_url = \"postgres://u@h/db\"").unwrap(),
        flags_with_upstream(),
    )
    .unwrap_err();
    assert!(
        err.message.contains("set database_url too"),
        "{}",
        err.message
    );
    let tuned = "database_pool_size = 4\ndatabase_timeout = \"1s\"\nredis_timeout = \"20ms\"\n\
                 redis_inline_max = \"8KiB\"\nredis_key_prefix = \"payments:\"\n";
    let s = Settings::from_sources(Settings::parse_file(tuned).unwrap(), flags_with_upstream())
        .expect("tuning keys for a store and a Redis not in use");
    assert!(s.redis.is_none());
}

/// An admin token short enough to guess stops start-up, naming the key and
/// never the token; an empty one turns the job API off; one of 16
/// characters or more is taken.
#[test]
fn a_short_admin_token_is_refused() {
    let load = |token: &str| {
        let text = format!("admin_token = {token:?}\n");
        Settings::from_sources(Settings::parse_file(&text).unwrap(), flags_with_upstream())
    };
    for short in ["change-me", "    short-token      "] {
        let err = load(short).unwrap_err();
        assert_eq!(err.key, "admin_token", "{short:?}");
        assert!(err.message.contains("at least 16"), "{err}");
        assert!(
            !err.message.contains("-me") && !err.message.contains("short-"),
            "{err}"
        );
    }
    assert_eq!(load("").unwrap().admin_token, None);
    assert_eq!(load("  ").unwrap().admin_token, None, "spaces are no token");
    let long = "0123456789abcdef";
    assert_eq!(load(long).unwrap().admin_token.as_deref(), Some(long));
    let read_from_a_file = format!("{long}\n");
    let token = load(&read_from_a_file).unwrap().admin_token;
    assert_eq!(token.as_deref(), Some(long), "as a header's value is read");
}
