//! The metrics count what happened, once (`docs/design.md` §12, "Metrics";
//! issue 38): every end of an attempt is one increment of
//! `idemgate_attempts_ended_total{route,upstream,state,by}`, counted when
//! it happens (an unknown attempt once when it becomes unknown, and once
//! more when its late answer, a lookup, a resend or an operator settles
//! it); every commit, by whatever path, one of `idemgate_commits_total`;
//! timeouts are timed per upstream, lookups apart; and a fresh gateway
//! exposes every documented series at zero. Read from the real binary's
//! admin `/metrics`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::support::upstream::{echo_response, json_response, Recorded};
use crate::support::{eventually, post, send, FakeUpstream, Gate, Gateway, TestStore};

const ROUTE: &str = "[[routes]]\nname = \"charges\"\npath_prefix = \"/v1/charges\"\n";

/// One scrape of `/metrics`: each sample's name, labels and value.
struct Scrape(Vec<(String, BTreeMap<String, String>, f64)>);

impl Scrape {
    async fn of(gateway: &Gateway) -> Scrape {
        let url = format!("{}/metrics", gateway.admin_url);
        let reply = send(Method::GET, &url, &[], "").await;
        assert_eq!(reply.status, 200);
        Scrape::parse(&String::from_utf8_lossy(&reply.body))
    }

    fn parse(text: &str) -> Scrape {
        let mut samples = Vec::new();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let (series, value) = line.rsplit_once(' ').expect("a sample");
            let value: f64 = value.parse().expect("a number");
            let (name, labels) = match series.split_once('{') {
                None => (series, BTreeMap::new()),
                Some((name, rest)) => (name, labels(rest.trim_end_matches('}'))),
            };
            samples.push((name.to_owned(), labels, value));
        }
        Scrape(samples)
    }

    /// The sum of `name`'s samples whose labels include `with`.
    fn sum(&self, name: &str, with: &[(&str, &str)]) -> f64 {
        self.0
            .iter()
            .filter(|(n, labels, _)| {
                n == name
                    && with
                        .iter()
                        .all(|(k, v)| labels.get(*k).map(String::as_str) == Some(v))
            })
            .map(|(.., value)| value)
            .sum()
    }

    fn names(&self) -> std::collections::BTreeSet<&str> {
        self.0.iter().map(|(n, ..)| n.as_str()).collect()
    }

    /// `name`'s series, each by its labels written out.
    fn series(&self, name: &str) -> BTreeMap<String, f64> {
        self.0
            .iter()
            .filter(|(n, ..)| n == name)
            .map(|(_, labels, v)| {
                let written: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                (written.join(","), *v)
            })
            .collect()
    }
}

/// `a="x",b="y"` read into a map (label values here hold no quotes).
fn labels(text: &str) -> BTreeMap<String, String> {
    text.split("\",")
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once("=\"").expect("a label");
            (k.to_owned(), v.trim_end_matches('"').to_owned())
        })
        .collect()
}

/// What changed in `name` from `before` to `after`: each series that moved,
/// by how much.
fn moved(before: &Scrape, after: &Scrape, name: &str) -> BTreeMap<String, f64> {
    let was = before.series(name);
    after
        .series(name)
        .into_iter()
        .map(|(series, v)| {
            let delta = v - was.get(&series).copied().unwrap_or(0.0);
            (series, delta)
        })
        .filter(|(_, delta)| *delta != 0.0)
        .collect()
}

/// An `idemgate_attempts_ended_total` series of route `charges` on the
/// upstream `primary`, written as [`Scrape::series`] writes it.
fn end(state: &str, by: &str) -> String {
    format!("by={by},route=charges,state={state},upstream=primary")
}

/// An `idemgate_commits_total` series of route `charges` on `primary`.
fn commit(by: &str) -> String {
    format!("by={by},route=charges,upstream=primary")
}

fn one(series: &[String]) -> BTreeMap<String, f64> {
    series.iter().map(|s| (s.clone(), 1.0)).collect()
}

/// An upstream that reads each request's head and never answers, and
/// counts the requests that came and the connections the gateway closed
/// (it gave up: the attempt's deadline passed).
struct SilentUpstream {
    url: String,
    arrived: Arc<AtomicUsize>,
    closed: Arc<AtomicUsize>,
}

impl SilentUpstream {
    async fn start() -> SilentUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (arrived, closed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let counts = (arrived.clone(), closed.clone());
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let (arrived, closed) = (counts.0.clone(), counts.1.clone());
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 4096];
                    let head = |seen: &[u8]| seen.windows(4).any(|w| w == b"\r\n\r\n");
                    while let Ok(n @ 1..) = stream.read(&mut buf).await {
                        let had = head(&seen);
                        seen.extend_from_slice(&buf[..n]);
                        if !had && head(&seen) {
                            arrived.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    let _ = stream.shutdown().await;
                    closed.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        SilentUpstream {
            url,
            arrived,
            closed,
        }
    }

    /// Waits until `n` requests came and the gateway closed `n` connections.
    async fn hung_up_on(&self, n: usize) {
        eventually(
            Duration::from_secs(10),
            "the gateway to hang up",
            || async {
                self.arrived.load(Ordering::SeqCst) == n && self.closed.load(Ordering::SeqCst) == n
            },
        )
        .await;
    }
}

/// The JSON log lines whose message is `message`.
fn logged(log: &std::path::Path, message: &str) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .map(|line| line["fields"].clone())
        .filter(|fields| fields["message"] == message)
        .collect()
}

#[tokio::test]
async fn two_unknown_attempts_count_as_two_and_are_logged_once_each() {
    let store = TestStore::embedded();
    let upstream = SilentUpstream::start().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    // Unknown after 300 ms of silence; given up at the deadline, 1 s in,
    // which used to count and log each attempt a second time.
    let gateway = Gateway::builder(&store, &upstream.url)
        .tables(ROUTE)
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"1s\"")
        .set("access_log", "true")
        .env(
            "RUST_LOG",
            "warn,idemgate::access=info,idemgate_idempotency::execute::ends=info",
        )
        .env("IDEMGATE_LOG_FORMAT", "json")
        .stderr_to(log.path())
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    let before = Scrape::of(&gateway).await;
    let mut attempts = Vec::new();
    for key in ["unknown-1", "unknown-2"] {
        let reply = post(&url, key, "{}").await;
        assert_eq!(reply.status, 504, "{key}");
        assert_eq!(reply.problem(), "attempt-outcome-unknown");
        let job = gateway.job(&reply.job().unwrap()).await;
        attempts.push(job["attempts"][0]["id"].as_str().unwrap().to_owned());
    }
    // Both deadlines passed: the gateway hung up on both calls, after
    // which nothing of either attempt is left to count.
    upstream.hung_up_on(2).await;
    let after = Scrape::of(&gateway).await;
    let ended = moved(&before, &after, "idemgate_attempts_ended_total");
    assert_eq!(ended, BTreeMap::from([(end("unknown", "deadline"), 2.0)]));
    assert_eq!(after.sum("idemgate_commits_total", &[]), 0.0);
    // Each call timed once, as a timeout of its upstream.
    let timed = moved(&before, &after, "idemgate_upstream_response_seconds_count");
    assert_eq!(
        timed,
        BTreeMap::from([("outcome=timeout,upstream=primary".to_owned(), 2.0)])
    );

    let ends = logged(log.path(), "attempt ended without a result");
    let mut logged_attempts: Vec<&str> = ends
        .iter()
        .map(|l| l["attempt"].as_str().unwrap())
        .collect();
    logged_attempts.sort_unstable();
    let mut expected: Vec<&str> = attempts.iter().map(String::as_str).collect();
    expected.sort_unstable();
    assert_eq!(logged_attempts, expected, "one line per attempt: {ends:#?}");
    for line in &ends {
        assert_eq!(line["state"], "unknown", "{line}");
        assert_eq!(line["by"], "deadline", "{line}");
        assert_eq!(line["upstream"], "primary", "{line}");
        assert_eq!(line["route"], "charges", "{line}");
    }
    // The access line of each names the attempt and its upstream.
    let access = eventually_logged(log.path(), "request answered", 2).await;
    for (line, attempt) in access.iter().zip(&attempts) {
        assert_eq!(line["status"], 504, "{line}");
        assert_eq!(line["attempt_id"], attempt.as_str(), "{line}");
        assert_eq!(line["upstream"], "primary", "{line}");
        assert_eq!(line["attempt"], 1, "{line}");
    }
}

/// Waits until `n` lines with `message` are logged, and returns them.
async fn eventually_logged(log: &std::path::Path, message: &str, n: usize) -> Vec<Value> {
    eventually(Duration::from_secs(5), message, || async {
        logged(log, message).len() >= n
    })
    .await;
    logged(log, message)
}

/// Waits until `name`'s series have moved from `before` as `expected` says.
async fn settles(gateway: &Gateway, before: &Scrape, name: &str, expected: &BTreeMap<String, f64>) {
    let what = format!("{name} to move by {expected:?}");
    eventually(Duration::from_secs(10), &what, || async {
        moved(before, &Scrape::of(gateway).await, name) == *expected
    })
    .await;
}

#[tokio::test]
async fn an_answer_counts_one_success_and_one_commit_and_a_retryable_status_one_failure() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::start(|r: Recorded| async move {
        if r.path.ends_with("/busy") {
            return json_response(503, serde_json::json!({"error": "busy"}));
        }
        echo_response(&r)
    })
    .await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .tables(ROUTE)
        .start()
        .await;
    let before = Scrape::of(&gateway).await;
    let answered = post(&gateway.path("/v1/charges"), "answered-1", "{}").await;
    assert_eq!(answered.status, 200);
    let after = Scrape::of(&gateway).await;
    let ended = moved(&before, &after, "idemgate_attempts_ended_total");
    assert_eq!(ended, one(&[end("succeeded", "upstream")]));
    let commits = moved(&before, &after, "idemgate_commits_total");
    assert_eq!(commits, one(&[commit("upstream")]));
    let timed = moved(&before, &after, "idemgate_upstream_response_seconds_count");
    assert_eq!(
        timed,
        one(&["outcome=answered,upstream=primary".to_owned()])
    );

    // A replay ends no attempt.
    let replayed = post(&gateway.path("/v1/charges"), "answered-1", "{}").await;
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    let busy = post(&gateway.path("/v1/charges/busy"), "busy-1", "{}").await;
    assert_eq!(busy.status, 503);
    let last = Scrape::of(&gateway).await;
    let ended = moved(&after, &last, "idemgate_attempts_ended_total");
    assert_eq!(ended, one(&[end("failed", "upstream")]));
    assert!(moved(&after, &last, "idemgate_commits_total").is_empty());
}

/// An upstream whose first POST answers only once `late` opens; later
/// POSTs (resends) are echoed, and lookups answered 200.
async fn late_upstream(late: &Gate) -> FakeUpstream {
    late_upstream_looked_up(late, 200).await
}

/// The same, lookups answered `looked_up`.
async fn late_upstream_looked_up(late: &Gate, looked_up: u16) -> FakeUpstream {
    let late = late.clone();
    let posts = Arc::new(AtomicUsize::new(0));
    FakeUpstream::start(move |r: Recorded| {
        let (late, posts) = (late.clone(), posts.clone());
        async move {
            if r.method == "GET" {
                return json_response(looked_up, serde_json::json!({"looked_up": r.path}));
            }
            if posts.fetch_add(1, Ordering::SeqCst) == 0 {
                late.pass().await;
            }
            echo_response(&r)
        }
    })
    .await
}

/// A gateway that calls an attempt unknown after 300 ms of silence, with
/// `route` (TOML).
async fn patient_gateway(store: &TestStore, upstream: &FakeUpstream, route: &str) -> Gateway {
    Gateway::builder(store, &upstream.url())
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"30s\"")
        .tables(route)
        .start()
        .await
}

/// Posts one request that goes unknown, and checks it counted one unknown
/// end, by the gateway's silence, and one timeout of the upstream.
async fn goes_unknown(gateway: &Gateway, before: &Scrape) -> String {
    let first = post(&gateway.path("/v1/charges"), "late-1", "{}").await;
    assert_eq!(first.status, 504);
    let unknown = Scrape::of(gateway).await;
    // A lookup or resend starts as the attempt goes unknown and may have
    // settled it by now; its own end is for the caller to check.
    let ended: BTreeMap<String, f64> = moved(before, &unknown, "idemgate_attempts_ended_total")
        .into_iter()
        .filter(|(series, _)| series.contains("state=unknown"))
        .collect();
    assert_eq!(ended, one(&[end("unknown", "deadline")]));
    let timed = moved(before, &unknown, "idemgate_upstream_response_seconds_count");
    assert_eq!(timed, one(&["outcome=timeout,upstream=primary".to_owned()]));
    first.job().unwrap()
}

#[tokio::test]
async fn a_late_answer_settles_an_unknown_attempt_once_by_its_upstream() {
    let store = TestStore::embedded();
    let late = Gate::new();
    let upstream = late_upstream(&late).await;
    let gateway = patient_gateway(&store, &upstream, ROUTE).await;
    let before = Scrape::of(&gateway).await;
    let job = goes_unknown(&gateway, &before).await;
    late.open(1);
    eventually(
        Duration::from_secs(10),
        "the late answer committed",
        || async { gateway.job(&job).await["state"] == "completed" },
    )
    .await;
    // Counted as the commit returns, a moment after the job reads
    // completed: waited for, not scraped at once.
    let ended = one(&[end("unknown", "deadline"), end("succeeded", "upstream")]);
    settles(&gateway, &before, "idemgate_attempts_ended_total", &ended).await;
    let commits = one(&[commit("upstream")]);
    settles(&gateway, &before, "idemgate_commits_total", &commits).await;
    let after = Scrape::of(&gateway).await;
    // The late head is not timed again: the call was timed as a timeout.
    let timed = moved(&before, &after, "idemgate_upstream_response_seconds_count");
    assert_eq!(timed, one(&["outcome=timeout,upstream=primary".to_owned()]));
}

#[tokio::test]
async fn a_lookup_settles_an_unknown_attempt_once_and_is_timed_apart() {
    let store = TestStore::embedded();
    let late = Gate::new();
    let upstream = late_upstream(&late).await;
    let route = format!("{ROUTE}[routes.reconcile]\npath = \"/v1/charges/lookup/{{job}}\"\n");
    let gateway = patient_gateway(&store, &upstream, &route).await;
    let before = Scrape::of(&gateway).await;
    goes_unknown(&gateway, &before).await;
    let expected = one(&[end("unknown", "deadline"), end("succeeded", "lookup")]);
    settles(
        &gateway,
        &before,
        "idemgate_attempts_ended_total",
        &expected,
    )
    .await;
    let after = Scrape::of(&gateway).await;
    let commits = moved(&before, &after, "idemgate_commits_total");
    assert_eq!(commits, one(&[commit("lookup")]));
    let asked = moved(&before, &after, "idemgate_reconcile_seconds_count");
    assert_eq!(
        asked,
        one(&["by=lookup,outcome=answered,upstream=primary".to_owned()])
    );
    let timed = moved(&before, &after, "idemgate_upstream_response_seconds_count");
    assert_eq!(timed, one(&["outcome=timeout,upstream=primary".to_owned()]));
    // Its late answer, lost to the lookup, is not counted again.
    late.open(1);
    eventually(
        Duration::from_secs(10),
        "the late answer to lose",
        || async {
            Scrape::of(&gateway)
                .await
                .sum("idemgate_commits_superseded_total", &[])
                == 1.0
        },
    )
    .await;
    let last = Scrape::of(&gateway).await;
    assert!(moved(&after, &last, "idemgate_attempts_ended_total").is_empty());
    assert!(moved(&after, &last, "idemgate_commits_total").is_empty());
}

/// A lookup's `404` proves no effect only once the call is over (its
/// lookups while it is out are held back, `docs/design.md` §5): here the
/// call ends at a 2 s attempt deadline, and the lookup asked then settles
/// the attempt.
#[tokio::test]
async fn a_lookup_that_finds_no_effect_counts_one_failure_by_the_lookup() {
    let store = TestStore::embedded();
    let late = Gate::new();
    let upstream = late_upstream_looked_up(&late, 404).await;
    let route = format!("{ROUTE}[routes.reconcile]\npath = \"/v1/charges/lookup/{{job}}\"\n");
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"2s\"")
        .tables(&route)
        .start()
        .await;
    let before = Scrape::of(&gateway).await;
    goes_unknown(&gateway, &before).await;
    let expected = one(&[end("unknown", "deadline"), end("failed", "lookup")]);
    settles(
        &gateway,
        &before,
        "idemgate_attempts_ended_total",
        &expected,
    )
    .await;
    assert!(moved(
        &before,
        &Scrape::of(&gateway).await,
        "idemgate_commits_total"
    )
    .is_empty());
    late.open(1);
}

#[tokio::test]
async fn a_resend_settles_an_unknown_attempt_once() {
    let store = TestStore::embedded();
    let late = Gate::new();
    let upstream = late_upstream(&late).await;
    let route = format!("{ROUTE}reconcile = \"resend\"\n");
    let gateway = patient_gateway(&store, &upstream, &route).await;
    let before = Scrape::of(&gateway).await;
    goes_unknown(&gateway, &before).await;
    let expected = one(&[end("unknown", "deadline"), end("succeeded", "resend")]);
    settles(
        &gateway,
        &before,
        "idemgate_attempts_ended_total",
        &expected,
    )
    .await;
    let after = Scrape::of(&gateway).await;
    let commits = moved(&before, &after, "idemgate_commits_total");
    assert_eq!(commits, one(&[commit("resend")]));
    let asked = moved(&before, &after, "idemgate_reconcile_seconds_count");
    assert_eq!(
        asked,
        one(&["by=resend,outcome=answered,upstream=primary".to_owned()])
    );
    late.open(1);
}

#[tokio::test]
async fn an_operators_resolution_counts_once_by_the_operator() {
    let store = TestStore::embedded();
    let late = Gate::new();
    let upstream = late_upstream(&late).await;
    let gateway = patient_gateway(&store, &upstream, ROUTE).await;
    let before = Scrape::of(&gateway).await;
    let job = goes_unknown(&gateway, &before).await;
    let attempt = gateway.job(&job).await["attempts"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let body = r#"{"outcome": "succeeded", "response": {"status": 200, "body": "{}"}}"#;
    let resolved = gateway.resolve(&attempt, body).await;
    assert_eq!(resolved.status, 200, "{:?}", resolved.json());
    let after = Scrape::of(&gateway).await;
    let ended = moved(&before, &after, "idemgate_attempts_ended_total");
    assert_eq!(
        ended,
        one(&[end("unknown", "deadline"), end("succeeded", "operator")])
    );
    let commits = moved(&before, &after, "idemgate_commits_total");
    assert_eq!(commits, one(&[commit("operator")]));
    // Its late answer, lost to the operator, is not counted again.
    late.open(1);
    eventually(
        Duration::from_secs(10),
        "the late answer to lose",
        || async {
            Scrape::of(&gateway)
                .await
                .sum("idemgate_commits_superseded_total", &[])
                == 1.0
        },
    )
    .await;
    let last = Scrape::of(&gateway).await;
    assert!(moved(&after, &last, "idemgate_attempts_ended_total").is_empty());
}

#[tokio::test]
async fn a_lapsed_lease_counts_once_on_the_replica_whose_sweeper_found_it() {
    let store = TestStore::postgres().await;
    let silent = Gate::new();
    let upstream = FakeUpstream::gated_echo(&silent, |_| true).await;
    let replica = |lease: &str| {
        Gateway::builder(&store, &upstream.url())
            .tables(ROUTE)
            .set("upstream_timeout", "\"60s\"")
            .set("attempt_deadline", "\"120s\"")
            .set("lease_ttl", &format!("{lease:?}"))
    };
    let mut dying = replica("1s").start().await;
    let sweeper = replica("30s").start().await;
    let before = Scrape::of(&sweeper).await;
    let url = dying.path("/v1/charges");
    let request = tokio::spawn(async move { post(&url, "lapse-1", "{}").await });
    upstream.arrival().await;
    dying.kill().await;
    let _ = request.await;
    let expected = one(&[end("unknown", "deadline")]);
    settles(
        &sweeper,
        &before,
        "idemgate_attempts_ended_total",
        &expected,
    )
    .await;
    assert!(moved(
        &before,
        &Scrape::of(&sweeper).await,
        "idemgate_commits_total"
    )
    .is_empty());
    silent.open(1);
}

/// The documented series (the catalogue's names), read from its source.
fn documented() -> Vec<(String, String)> {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/telemetry/src/catalogue.rs");
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .filter_map(|line| {
            let rest = line.trim().strip_prefix("(\"idemgate_")?;
            let (name, rest) = rest.split_once('"')?;
            let kind = rest.split("Kind::").nth(1)?.split(',').next()?;
            Some((format!("idemgate_{name}"), kind.to_owned()))
        })
        .collect()
}

/// Series a fresh gateway without Redis, contracts or a silent store does
/// not expose, and why (`docs/design.md` §12, "Metrics").
const NOT_AT_START: [&str; 6] = [
    // Its `type` label is the upstream's text: unbounded, made at the first.
    "idemgate_stream_errors_total",
    // Per upstream and contract a route relies on probes for: none here.
    "idemgate_upstream_probes_passing",
    "idemgate_upstream_eligible",
    "idemgate_probe_runs_total",
    // Only with Redis.
    "idemgate_fastpath_seconds",
    // Set by the first health check, which may not have run yet: a 0
    // before it would say the store is down.
    "idemgate_dependency_up",
];

#[tokio::test]
async fn a_fresh_gateway_exposes_every_documented_series_at_zero() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let route = format!(
        "{ROUTE}[routes.reconcile]\npath = \"/v1/charges/lookup/{{job}}\"\n\
         [[routes]]\nname = \"tools\"\npath_prefix = \"/v1/tools\"\nreconcile = \"resend\"\n"
    );
    let gateway = Gateway::builder(&store, &upstream.url())
        .tables(&route)
        .start()
        .await;
    let scrape = Scrape::of(&gateway).await;
    let names = scrape.names();
    let documented = documented();
    assert!(documented.len() > 40, "{documented:?}");
    for (name, kind) in &documented {
        if NOT_AT_START.contains(&name.as_str()) {
            continue;
        }
        let exposed = match kind.as_str() {
            "Histogram" => format!("{name}_count"),
            _ => name.clone(),
        };
        assert!(
            names.contains(exposed.as_str()),
            "{exposed} is not exposed at start-up"
        );
        if name.ends_with("_total") {
            assert_eq!(scrape.sum(name, &[]), 0.0, "{name}");
        }
    }
    // Per route and upstream, every way an attempt can end, and commit.
    for (state, by) in [
        ("succeeded", "upstream"),
        ("failed", "upstream"),
        ("unknown", "upstream"),
        ("unknown", "deadline"),
        ("succeeded", "lookup"),
        ("failed", "lookup"),
        ("succeeded", "operator"),
    ] {
        let labels = [
            ("route", "charges"),
            ("upstream", "primary"),
            ("state", state),
            ("by", by),
        ];
        let series = scrape.series("idemgate_attempts_ended_total");
        let want = format!("by={by},route=charges,state={state},upstream=primary");
        assert_eq!(series.get(&want), Some(&0.0), "{labels:?}");
    }
    let tools = scrape.series("idemgate_commits_total");
    assert_eq!(
        tools.get("by=resend,route=tools,upstream=primary"),
        Some(&0.0)
    );
    assert_eq!(tools.get("by=lookup,route=tools,upstream=primary"), None);
    for outcome in ["answered", "timeout", "error"] {
        let series = format!("outcome={outcome},upstream=primary");
        let timed = scrape.series("idemgate_upstream_response_seconds_count");
        assert_eq!(timed.get(&series), Some(&0.0), "{series}");
    }
}
