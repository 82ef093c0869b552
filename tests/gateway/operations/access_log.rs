//! The access log (`docs/design.md` §12, "Access log"): one JSON line per
//! request at `info` under the target `idemgate::access`, read from the
//! real binary's stderr; none when `access_log = false`.

use std::time::Duration;

use http::Method;
use serde_json::Value;

use crate::support::{eventually, post, send, FakeUpstream, Gateway, TestStore};

const ROUTE: &str = "[[routes]]\nname = \"charges\"\npath_prefix = \"/v1/charges\"\n";

/// The access lines logged so far, parsed.
fn access_lines(log: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|line| line["target"] == "idemgate::access")
        .map(|line| line["fields"].clone())
        .collect()
}

/// Waits until `n` access lines are logged, and returns them.
async fn wait_for_lines(log: &std::path::Path, n: usize) -> Vec<Value> {
    eventually(Duration::from_secs(5), "the access lines", || async {
        access_lines(log).len() >= n
    })
    .await;
    access_lines(log)
}

#[tokio::test]
async fn each_request_is_logged_once_with_its_outcome_job_and_upstream() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let gateway = Gateway::builder(&store, &upstream.url())
        .tables(ROUTE)
        .set("access_log", "true")
        .env("RUST_LOG", "warn,idemgate::access=info")
        .env("IDEMGATE_LOG_FORMAT", "json")
        .stderr_to(log.path())
        .start()
        .await;
    // A query can carry a secret: the log names the path without it.
    let url = gateway.path("/v1/charges?api_key=secret");
    let body = r#"{"amount":1}"#;
    let executed = post(&url, "access-key-1", body).await;
    assert_eq!(executed.status, 200);
    let job = executed.job().expect("a job");
    let lines = wait_for_lines(log.path(), 1).await;
    let replayed = post(&url, "access-key-1", body).await;
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    let lines2 = wait_for_lines(log.path(), lines.len() + 1).await;
    // A client's own request id, long and with a quote: kept in part,
    // escaped, in a line that still parses.
    let long_id = format!("\"{}", "i".repeat(300));
    let passed = send(Method::GET, &url, &[("x-request-id", &long_id)], "").await;
    assert_eq!(passed.status, 200);
    let lines3 = wait_for_lines(log.path(), lines2.len() + 1).await;
    // Give a duplicate line time to show up before counting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lines = access_lines(log.path());
    assert_eq!(lines.len(), 3, "one line per request: {lines:#?}");
    assert_eq!(lines, lines3);

    let first = &lines[0];
    assert_eq!(first["method"], "POST", "{first}");
    assert_eq!(first["route"], "charges", "{first}");
    assert_eq!(first["path"], "/v1/charges", "{first}");
    assert_eq!(first["status"], 200, "{first}");
    assert_eq!(first["outcome"], "executed", "{first}");
    assert_eq!(first["job"], job.as_str(), "{first}");
    assert_eq!(first["attempt"], 1, "{first}");
    assert!(first["attempt_id"].is_string(), "{first}");
    assert_eq!(first["upstream"], "primary", "{first}");
    assert_eq!(first["request_bytes"], body.len(), "{first}");
    assert_eq!(first["response_bytes"], executed.body.len(), "{first}");
    assert_eq!(first["complete"], true, "{first}");
    assert!(first["duration_ms"].as_f64().is_some(), "{first}");
    // The id the answer carries ties the line to the request's other lines.
    let request_id = executed.header("x-request-id").expect("a request id");
    assert_eq!(first["request_id"], request_id, "{first}");

    let replay = &lines[1];
    assert_eq!(replay["route"], "charges", "{replay}");
    assert_eq!(replay["status"], 200, "{replay}");
    assert_eq!(replay["outcome"], "replayed", "{replay}");
    assert_eq!(replay["job"], job.as_str(), "{replay}");
    // A replay calls no upstream and runs no attempt.
    assert!(replay.get("attempt").is_none(), "{replay}");
    assert!(replay.get("upstream").is_none(), "{replay}");
    assert_eq!(replay["response_bytes"], replayed.body.len(), "{replay}");

    let pass = &lines[2];
    assert_eq!(pass["method"], "GET", "{pass}");
    // GET is not among the route's methods: it is on no route.
    assert!(pass.get("route").is_none(), "{pass}");
    assert_eq!(pass["status"], 200, "{pass}");
    assert_eq!(pass["outcome"], "passed_through", "{pass}");
    assert!(pass.get("job").is_none(), "{pass}");
    assert_eq!(pass["upstream"], "primary", "{pass}");
    assert_eq!(pass["response_bytes"], passed.body.len(), "{pass}");
    assert_eq!(pass["request_id"], long_id[..128], "{pass}");

    let logged = std::fs::read_to_string(log.path()).unwrap();
    assert!(!logged.contains("secret"), "{logged}");
    assert!(!logged.contains("access-key-1"), "{logged}");
}

#[tokio::test]
async fn with_the_access_log_off_no_line_is_written_and_the_variable_turns_it_on() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    // Off by default (docs/performance.md, item 20).
    let default = Gateway::builder(&store, &upstream.url()).tables(ROUTE);
    let checked = default.run("check").await;
    let printed = String::from_utf8_lossy(&checked.stdout);
    assert!(printed.contains("access_log = off"), "{printed}");
    let builder = Gateway::builder(&store, &upstream.url())
        .tables(ROUTE)
        .set("access_log", "false")
        .env("RUST_LOG", "warn,idemgate::access=info")
        .env("IDEMGATE_LOG_FORMAT", "json");
    let checked = builder.clone().run("check").await;
    let printed = String::from_utf8_lossy(&checked.stdout);
    assert!(printed.contains("access_log = off"), "{printed}");

    let log = tempfile::NamedTempFile::new().unwrap();
    let mut gateway = builder.clone().stderr_to(log.path()).start().await;
    let keyed = post(&gateway.path("/v1/charges"), "off-1", "{}").await;
    assert_eq!(keyed.status, 200);
    let passed = send(Method::GET, &gateway.path("/v1/charges"), &[], "").await;
    assert_eq!(passed.status, 200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(access_lines(log.path()), Vec::<Value>::new());
    // Gone before the next starts: the embedded store serves one process.
    gateway.kill().await;

    // The variable wins over the file, as every flag's twin does.
    let log = tempfile::NamedTempFile::new().unwrap();
    let gateway = builder
        .env("IDEMGATE_ACCESS_LOG", "true")
        .stderr_to(log.path())
        .start()
        .await;
    let passed = send(Method::GET, &gateway.path("/v1/charges"), &[], "").await;
    assert_eq!(passed.status, 200);
    let lines = wait_for_lines(log.path(), 1).await;
    assert_eq!(lines[0]["outcome"], "passed_through", "{lines:#?}");
}

/// The access line is written by a formatter of its own, yet as any event
/// is: in the text format, in `tracing`'s shape (quoted strings, bare
/// numbers), and not at all when `RUST_LOG` turns its target off.
#[tokio::test]
async fn the_text_line_reads_as_the_logs_others_and_its_filter_silences_it() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let builder = Gateway::builder(&store, &upstream.url())
        .tables(ROUTE)
        .set("access_log", "true");

    let log = tempfile::NamedTempFile::new().unwrap();
    let mut gateway = builder
        .clone()
        .env("RUST_LOG", "info")
        .stderr_to(log.path())
        .start()
        .await;
    let reply = send(Method::GET, &gateway.path("/v1/text/\"odd\""), &[], "").await;
    assert_eq!(reply.status, 200);
    let id = reply
        .header("x-request-id")
        .expect("a request id")
        .to_owned();
    eventually(Duration::from_secs(5), "the access line", || {
        let log = log.path().to_owned();
        async move {
            std::fs::read_to_string(log)
                .unwrap()
                .lines()
                .any(|line| line.contains("idemgate::access"))
        }
    })
    .await;
    let logged = std::fs::read_to_string(log.path()).unwrap();
    let line = logged
        .lines()
        .find(|line| line.contains("idemgate::access"))
        .expect("an access line");
    let (time, rest) = line.split_once("  INFO ").expect("a time, then the level");
    assert!(humantime::parse_rfc3339(time).is_ok(), "{line}");
    let expected = format!(
        "idemgate::access: request answered method=GET path=\"/v1/text/%22odd%22\" \
         status=200 outcome=\"passed_through\" upstream=\"primary\" request_id=\"{id}\" duration_ms="
    );
    assert!(rest.starts_with(&expected), "{line}\n{expected}");
    assert!(
        rest.ends_with(&format!(
            " request_bytes=0 response_bytes={} complete=true",
            reply.body.len()
        )),
        "{line}"
    );
    // Gone before the next starts: the embedded store serves one process.
    gateway.kill().await;

    // Filtered out by its target, while the rest of `info` is written.
    let log = tempfile::NamedTempFile::new().unwrap();
    let gateway = builder
        .env("RUST_LOG", "info,idemgate::access=off")
        .stderr_to(log.path())
        .start()
        .await;
    let reply = send(Method::GET, &gateway.path("/v1/text"), &[], "").await;
    assert_eq!(reply.status, 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let logged = std::fs::read_to_string(log.path()).unwrap();
    assert!(logged.contains(" INFO "), "{logged}");
    assert!(!logged.contains("idemgate::access"), "{logged}");
}

/// A keyed request that failed over is logged once, naming the attempt
/// whose answer it got (the second) and that attempt's upstream.
#[tokio::test]
async fn a_failed_over_request_names_the_attempt_and_upstream_that_answered() {
    let store = TestStore::embedded();
    let fallback = FakeUpstream::echo().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    // The primary refuses connections: the default route fails over.
    let gateway = Gateway::builder(&store, "http://127.0.0.1:1")
        .set(
            "upstreams",
            &format!("[\"http://127.0.0.1:1\", {:?}]", fallback.url()),
        )
        .set("access_log", "true")
        .env("RUST_LOG", "warn,idemgate::access=info")
        .env("IDEMGATE_LOG_FORMAT", "json")
        .stderr_to(log.path())
        .start()
        .await;
    let reply = post(&gateway.path("/v1/orders"), "failed-over", "{}").await;
    assert_eq!(reply.status, 200);
    let lines = wait_for_lines(log.path(), 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(access_lines(log.path()).len(), 1, "{lines:#?}");
    let line = &lines[0];
    assert_eq!(line["route"], "default", "{line}");
    assert_eq!(line["outcome"], "executed", "{line}");
    assert_eq!(line["job"], reply.job().unwrap().as_str(), "{line}");
    assert_eq!(line["attempt"], 2, "{line}");
    assert_eq!(line["upstream"], "fallback-1", "{line}");
}

/// The log's lines are written in batches by a thread of their own
/// (`docs/design.md` §12, "Access log"): a graceful stop (SIGTERM) writes
/// every line still waiting, each whole and once, the gateway's last line
/// (logged a moment before the process ends) included.
#[tokio::test]
async fn a_graceful_stop_writes_every_line_whole_and_once() {
    const WORKERS: usize = 8;
    const EACH: usize = 100;
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut gateway = Gateway::builder(&store, &upstream.url())
        .set("access_log", "true")
        .env("RUST_LOG", "info")
        .env("IDEMGATE_LOG_FORMAT", "json")
        .stderr_to(log.path())
        .start()
        .await;
    let workers = (0..WORKERS).map(|worker| {
        let url = gateway.path(&format!("/v1/items/{worker}"));
        async move {
            for n in 0..EACH {
                let reply = send(Method::GET, &format!("{url}/{n}"), &[], "").await;
                assert_eq!(reply.status, 200);
            }
        }
    });
    futures_util::future::join_all(workers).await;
    assert!(gateway.terminate().await.success());

    let logged = std::fs::read_to_string(log.path()).unwrap();
    let lines: Vec<Value> = logged
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line:?}")))
        .collect();
    let last = lines.last().expect("lines");
    assert_eq!(last["fields"]["message"], "gateway stopped", "{last}");
    let mut paths: Vec<String> = access_lines(log.path())
        .iter()
        .map(|line| line["path"].as_str().expect("a path").to_owned())
        .collect();
    paths.sort();
    let mut sent: Vec<String> = (0..WORKERS)
        .flat_map(|worker| (0..EACH).map(move |n| format!("/v1/items/{worker}/{n}")))
        .collect();
    sent.sort();
    assert_eq!(paths, sent, "one line per request");
}
