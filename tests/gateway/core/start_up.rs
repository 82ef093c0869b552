//! What a gateway starts with and reports: files, variables and flags in
//! their order, bad configuration naming its key, logs and metrics.

use http::Method;

use crate::support::{post, send, FakeUpstream, Gateway, TestStore};

#[tokio::test]
async fn variables_override_the_file_and_flags_override_variables() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    // The file's value alone would stop start-up; the variable wins over it.
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("hold_timeout", "\"0s\"")
        .env("IDEMGATE_HOLD_TIMEOUT", "2s")
        .start()
        .await;
    assert_eq!(
        post(&gateway.path("/x"), "precedence", "{}").await.status,
        200
    );
    drop(gateway);

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args([
            "serve",
            "--upstream",
            "http://127.0.0.1:1",
            "--hold-timeout",
            "0s",
        ])
        .env("IDEMGATE_HOLD_TIMEOUT", "2s")
        .env("IDEMGATE_EMBEDDED_PATH", "/nonexistent/never-opened.db")
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    assert!(!out.status.success(), "the flag wins over the variable");
    assert!(String::from_utf8_lossy(&out.stderr).contains("hold_timeout"));
}

#[tokio::test]
async fn bad_configuration_stops_start_up_naming_the_key() {
    let store = TestStore::embedded();
    let cases = [
        ("upstream_timeout", "\"soon\"", "upstream_timeout"),
        ("mismatch_status", "400", "422"),
        ("upstreams", "[\"ftp://api.example\"]", "upstreams[0]"),
        ("upstream_timout", "\"1s\"", "upstream_timout"),
        ("lease_ttl", "\"10ms\"", "lease_ttl"),
        ("worker_threads", "0", "worker_threads"),
        ("worker_runtime", "\"pooled\"", "worker_runtime"),
    ];
    for (key, value, named) in cases {
        let err = Gateway::builder(&store, "http://127.0.0.1:1")
            .set(key, value)
            .start_and_fail()
            .await;
        assert!(err.contains(named), "{key} = {value}: {err}");
    }
    let err = Gateway::builder(&store, "http://127.0.0.1:1")
        .tables("[[routes]]\nmethods = [\"GET\"]\n")
        .start_and_fail()
        .await;
    assert!(err.contains("routes[0].methods"), "{err}");
    let err = Gateway::builder(&store, "http://127.0.0.1:1")
        .unset("upstreams")
        .tables("[[upstreams]]\nurl = \"http://127.0.0.1:1\"\nidle_timeout = \"soon\"\n")
        .start_and_fail()
        .await;
    assert!(err.contains("idle_timeout"), "{err}");

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args([
            "serve",
            "--upstream",
            "http://127.0.0.1:1",
            "--hold-timeout",
            "0s",
        ])
        .env_remove("IDEMGATE_DATABASE_URL")
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("hold_timeout"));
}

/// At the default `info` logs only a request with a key is logged inside a
/// span of its own (id, method, path); one without a key is only proxied,
/// and its span is made at `debug` (at `info` it cost a fifth of a
/// passed-through request's CPU: docs/performance.md, item 16). The upstream
/// refuses both: the keyed failure's line names its request, the
/// passed-through one's is logged without it, until `idemgate=debug` asks
/// for its span.
#[tokio::test]
async fn only_keyed_requests_are_logged_in_a_span_at_the_default_level() {
    for (level, passed_through_in_span) in [("info", false), ("info,idemgate=debug", true)] {
        let store = TestStore::embedded();
        let log = tempfile::NamedTempFile::new().unwrap();
        let gateway = Gateway::builder(&store, "http://127.0.0.1:1")
            .env("RUST_LOG", level)
            .stderr_to(log.path())
            .start()
            .await;
        let keyed = send(
            Method::POST,
            &gateway.path("/v1/keyed"),
            &[("idempotency-key", "k"), ("x-request-id", "keyed-request")],
            "{}",
        )
        .await;
        let plain = send(
            Method::POST,
            &gateway.path("/v1/plain"),
            &[("x-request-id", "plain-request")],
            "{}",
        )
        .await;
        assert!(keyed.status >= 500 && plain.status >= 500, "{level}");
        crate::support::eventually(
            std::time::Duration::from_secs(5),
            "both failures logged",
            || async {
                let logged = std::fs::read_to_string(log.path()).unwrap();
                logged.matches("response failed").count() == 2
            },
        )
        .await;
        let logged = std::fs::read_to_string(log.path()).unwrap();
        assert!(
            logged.contains("request_id=keyed-request"),
            "{level}: {logged}"
        );
        assert_eq!(
            logged.contains("request_id=plain-request"),
            passed_through_in_span,
            "{level}: {logged}"
        );
    }
}

/// A client's `X-Request-Id` with spaces and braces cannot close the
/// request's span in the text log and forge a field of its own (a job id
/// another request's): its other characters show as `_`. The answer still
/// echoes it as sent.
#[tokio::test]
async fn a_request_id_cannot_forge_log_fields() {
    let store = TestStore::embedded();
    let log = tempfile::NamedTempFile::new().unwrap();
    let gateway = Gateway::builder(&store, "http://127.0.0.1:1")
        .env("RUST_LOG", "info")
        .stderr_to(log.path())
        .start()
        .await;
    let forged = "abc} job.id=00000000-0000-0000-0000-000000000000 request{request_id=x";
    let keyed = send(
        Method::POST,
        &gateway.path("/v1/keyed"),
        &[("idempotency-key", "k"), ("x-request-id", forged)],
        "{}",
    )
    .await;
    assert!(keyed.status >= 500);
    assert_eq!(keyed.header("x-request-id"), Some(forged));
    crate::support::eventually(
        std::time::Duration::from_secs(5),
        "the failure logged",
        || async {
            let logged = std::fs::read_to_string(log.path()).unwrap();
            logged.contains("response failed")
        },
    )
    .await;
    let logged = std::fs::read_to_string(log.path()).unwrap();
    assert!(
        logged.contains(
            "request_id=abc__job.id=00000000-0000-0000-0000-000000000000_request_request_id=x"
        ),
        "{logged}"
    );
    assert!(
        !logged.contains(" job.id=00000000-0000-0000-0000-000000000000"),
        "{logged}"
    );
}

#[tokio::test]
async fn every_series_has_help_text_and_latencies_are_timed_by_outcome_and_upstream() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    assert_eq!(
        post(&gateway.path("/v1/charges"), "timed", "{}")
            .await
            .status,
        200
    );
    let passed = send(Method::GET, &gateway.path("/v1/models"), &[], "").await;
    assert_eq!(passed.status, 200);
    let text = send(
        Method::GET,
        &format!("{}/metrics", gateway.admin_url),
        &[],
        "",
    )
    .await;
    let text = String::from_utf8_lossy(&text.body).into_owned();
    let typed: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split(' ').next().unwrap())
        .collect();
    assert!(typed.len() > 20, "{text}");
    for name in typed {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("# HELP {name} "))),
            "{name} has no # HELP line"
        );
    }
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        text.contains(&format!("idemgate_build_info{{version=\"{version}\"}} 1")),
        "{text}"
    );
    for series in [
        "idemgate_request_duration_seconds_count{outcome=\"executed\"} 1",
        "idemgate_request_duration_seconds_count{outcome=\"passed_through\"} 1",
        "idemgate_upstream_response_seconds_count{upstream=\"primary\",outcome=\"answered\"} 2",
    ] {
        assert!(text.contains(series), "missing {series} in:\n{text}");
    }
}
