//! Paths matched as the upstream reads them (`docs/design.md` §2): every
//! spelling of a route's path meets the route's rules or is refused, and
//! the upstream is sent the normal path with the query as it came. Sent as
//! raw bytes over TCP, since HTTP clients tidy some spellings themselves.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::deployment::Deployment;
use crate::support::{FakeUpstream, Gateway, TestStore, ThrowawayRedis};

/// Spellings of `/v1/charges` itself.
const SPELLINGS: [&str; 12] = [
    "/v1/charges",
    "//v1/charges",
    "/v1//charges",
    "/v1/./charges",
    "/v1/x/../charges",
    "/v1/x/y/../../charges",
    "/v1/%63harges",
    "/%76%31/charges",
    "/v1/%2e/charges",
    "/v1/x/%2E%2E/charges",
    "/v1/x/.%2e/charges",
    // Absolute form, as a forward proxy would send it.
    "http://gateway.test//v1/./charges",
];

/// Spellings of other paths under the route: its rules apply to them too.
const UNDER_THE_ROUTE: [&str; 5] = [
    "/v1/charges/",
    "/v1/charges/.",
    "/v1/charges/x/..",
    "/V1/Charges",
    "/v1//CHARGES//ch_1",
];

/// Spellings upstreams read in different ways.
const AMBIGUOUS: [&str; 12] = [
    "/v1/charges%2Fx",
    "/v1%2fcharges",
    "/v1/charges%5C",
    "/v1/charges%00",
    "/v1\\charges",
    "/v1/charges;jsessionid=1",
    "/v1/x/..;/charges",
    "/../v1/charges",
    "/v1/../../v1/charges",
    "/%2e%2e/v1/charges",
    "/v1/%zzcharges",
    "/v1/charges%4",
];

/// The query every keyed request carries: encodings and dots that must
/// reach the upstream as they were sent.
const QUERY: &str = "?a=%2f&b=..&c=%63";

/// An answer read off the wire.
pub(super) struct Raw {
    pub(super) status: u16,
    headers: Vec<(String, String)>,
    pub(super) body: String,
}

impl Raw {
    pub(super) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Asserts a problem answer of type `slug`.
    pub(super) fn assert_problem(&self, status: u16, slug: &str, sent: &str) {
        assert_eq!(self.status, status, "{sent}: {}", self.body);
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{sent}"
        );
        let ty = format!("\"https://idemgate.dev/problems/{slug}\"");
        assert!(self.body.contains(&ty), "{sent}: {}", self.body);
    }
}

/// Sends `POST <target>` (or another method) exactly as written.
pub(super) async fn raw(gateway: &Gateway, method: &str, target: &str, key: Option<&str>) -> Raw {
    let authority = gateway.url.trim_start_matches("http://");
    let key = key.map_or(String::new(), |k| format!("idempotency-key: {k}\r\n"));
    let request = format!(
        "{method} {target} HTTP/1.1\r\nhost: {authority}\r\nconnection: close\r\n\
         content-type: application/json\r\n{key}content-length: 2\r\n\r\n{{}}"
    );
    raw_bytes(gateway, &request).await
}

/// Sends `request` exactly as written and reads the answer until the
/// gateway closes the connection (20 s at most).
pub(super) async fn raw_bytes(gateway: &Gateway, request: &str) -> Raw {
    let authority = gateway.url.trim_start_matches("http://");
    let mut stream = TcpStream::connect(authority).await.unwrap();
    let line = request.lines().next().unwrap_or_default().to_owned();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut out))
        .await
        .unwrap_or_else(|_| panic!("no answer to {line} within 20 s"))
        .unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{line}: not an HTTP answer: {text:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Raw {
        status,
        headers,
        body: body.to_owned(),
    }
}

/// A gateway with one route, `POST /v1/charges`, that requires a key; on
/// PostgreSQL it replays from Redis (its memory of answers off).
pub(super) async fn gateway(
    store: &TestStore,
    redis: Option<&ThrowawayRedis>,
    upstream: &str,
) -> Gateway {
    let builder = Gateway::builder(store, upstream).tables(
        "[[routes]]\nname = \"charges\"\npath_prefix = \"/v1/charges\"\n\
         methods = [\"POST\"]\nrequire_key = true\n",
    );
    match redis {
        Some(redis) => builder.replaying_from_redis(&redis.url()).start().await,
        None => builder.start().await,
    }
}

async fn every_spelling_of_the_route_meets_its_rules_without_a_key(
    Deployment { store, redis }: Deployment,
) {
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, redis.as_ref(), &upstream.url()).await;
    for target in SPELLINGS.iter().chain(&UNDER_THE_ROUTE) {
        let reply = raw(&gateway, "POST", target, None).await;
        reply.assert_problem(400, "idempotency-key-missing", target);
    }
    assert_eq!(upstream.hits(), 0, "no spelling slipped past the route");
    assert_eq!(store.job_count().await, 0);
    // The control: a path beside the route is passed through without a key.
    assert_eq!(
        raw(&gateway, "POST", "/v1/chargesX", None).await.status,
        200
    );
    assert_eq!(upstream.recorded()[0].path, "/v1/chargesX");
}

async fn every_spelling_with_one_key_is_one_job_run_once_on_the_normal_path(
    Deployment { store, redis }: Deployment,
) {
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, redis.as_ref(), &upstream.url()).await;
    let mut job = None;
    for (i, spelling) in SPELLINGS.iter().enumerate() {
        let target = format!("{spelling}{QUERY}");
        let reply = raw(&gateway, "POST", &target, Some("order-1")).await;
        assert_eq!(reply.status, 200, "{target}: {}", reply.body);
        let replayed = reply.header("idempotent-replayed") == Some("true");
        assert_eq!(replayed, i > 0, "{target}: only the first runs");
        let this = reply.header("idempotency-job").map(str::to_owned);
        assert!(this.is_some(), "{target}");
        assert_eq!(*job.get_or_insert(this.clone()), this, "{target}: one job");
    }
    assert_eq!(upstream.hits(), 1);
    assert_eq!(
        upstream.recorded()[0].path,
        format!("/v1/charges{QUERY}"),
        "the upstream got the normal path and the query as sent"
    );
    assert_eq!(store.job_count().await, 1);
    // Case is kept: the route's rules apply, but this is another request.
    let other = raw(
        &gateway,
        "POST",
        &format!("/V1/Charges{QUERY}"),
        Some("order-1"),
    )
    .await;
    other.assert_problem(409, "idempotency-key-mismatch", "/V1/Charges");
    assert_eq!(upstream.hits(), 1);
}

async fn ambiguous_spellings_are_refused_and_reach_nothing(
    Deployment { store, redis }: Deployment,
) {
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, redis.as_ref(), &upstream.url()).await;
    for spelling in AMBIGUOUS {
        let target = format!("{spelling}{QUERY}");
        let reply = raw(&gateway, "POST", &target, Some("order-2")).await;
        reply.assert_problem(400, "ambiguous-path", &target);
        assert!(reply.body.contains("send"), "{target}: {}", reply.body);
    }
    // Traffic that would pass through is refused too: the upstream might
    // have read it as the route's path.
    for spelling in ["/v1/charges%2Fx", "/static/..;/v1/charges"] {
        let reply = raw(&gateway, "GET", spelling, None).await;
        reply.assert_problem(400, "ambiguous-path", spelling);
    }
    assert_eq!(upstream.hits(), 0, "nothing forwarded");
    assert_eq!(store.job_count().await, 0, "nothing recorded");
}

async fn a_passed_through_request_goes_upstream_on_its_normal_path(
    Deployment { store, redis }: Deployment,
) {
    let upstream = FakeUpstream::echo().await;
    let gateway = gateway(&store, redis.as_ref(), &upstream.url()).await;
    for target in [
        "/a//b/./c/../%7euser/caf%c3%a9?x=%2e%2e&y=%2F",
        "/plain/path?q=1",
    ] {
        assert_eq!(raw(&gateway, "GET", target, None).await.status, 200);
    }
    let paths: Vec<String> = upstream.recorded().into_iter().map(|r| r.path).collect();
    assert_eq!(
        paths,
        ["/a/b/~user/caf%C3%A9?x=%2e%2e&y=%2F", "/plain/path?q=1"]
    );
    assert_eq!(store.job_count().await, 0);
}

/// A route prefix spelled other than in normal form could never match:
/// the gateway refuses to start, naming the key and the spelling to write.
#[tokio::test]
async fn a_route_prefix_not_in_normal_form_stops_start_up() {
    let store = TestStore::embedded();
    let stderr = Gateway::builder(&store, "http://127.0.0.1:1")
        .tables("[[routes]]\npath_prefix = \"/v1//%63harges\"\nrequire_key = true\n")
        .start_and_fail()
        .await;
    assert!(stderr.contains("routes[0].path_prefix"), "{stderr}");
    assert!(stderr.contains(r#"write "/v1/charges""#), "{stderr}");
}

crate::on_each_deployment!(
    [embedded, postgres_redis]
    every_spelling_of_the_route_meets_its_rules_without_a_key,
    every_spelling_with_one_key_is_one_job_run_once_on_the_normal_path,
    ambiguous_spellings_are_refused_and_reach_nothing,
    a_passed_through_request_goes_upstream_on_its_normal_path,
);
