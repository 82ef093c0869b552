//! The public conformance suite for the IETF draft
//! (`draft-ietf-httpapi-idempotency-key-header-07`): idempot.dev's Gherkin
//! feature "Idempotency-Key Header Compliance" (`docs/specs/idempotency.feature`
//! of the idempot-dev/website repository, synced into idempot-dev/idempot-js
//! as `tests/spec/idempotency.feature`), each applicable scenario encoded
//! below as a row: what was sent before, what is sent, what must come back.
//! They run against the real binary, on the embedded store and on
//! PostgreSQL + Redis, with the settings the README names for the draft:
//! `mismatch_status = 422` and a route with `in_progress = "conflict"` and
//! `require_key = true`. "The store is clean" for each scenario: each sends
//! as an owner of its own (`Authorization: Bearer scenario-N`), and its
//! orders are counted by that header at the upstream.
//!
//! Adapted:
//! - "Duplicate request sets replay header": the suite names the header
//!   `X-Idempotent-Replayed`, which the draft does not define; idemgate marks
//!   a replay `Idempotent-Replayed: true`, and the row checks that.
//! - "the idempotency record status should be \"complete\"": a job's state
//!   is `completed`, read through the admin API like the record's response.
//!
//! Not applicable (the suite's own reading, not the draft's):
//! - "Different key with same body returns 409", "Fingerprint conflict
//!   response contains error message", "Fingerprint conflict does not create
//!   duplicate resources", "Fingerprint conflict error follows RFC 7807":
//!   they refuse a new key whose body matches an earlier key's. The draft
//!   makes the key the identity of an intent (§2.2) and the fingerprint a
//!   check that one key is not reused for another request (§2.4); two keys
//!   with one body are two intents (two orders of the same thing), and
//!   idemgate runs both: `a_new_key_with_the_same_body_is_a_new_intent`.

use http::Method;

use crate::support::deployment::Deployment;
use crate::support::{send, FakeUpstream, Gate, Gateway, Reply};

const FOO: &str = r#"{"foo":"bar"}"#;
const BAZ: &str = r#"{"baz":"qux"}"#;
const KEY: &str = "abc123456789012345678";

/// The key a request carries.
#[derive(Clone, Copy)]
enum Key {
    Absent,
    Empty,
    Long,
    Of(&'static str),
}

/// One request of a scenario.
#[derive(Clone, Copy)]
struct Send {
    method: &'static str,
    key: Key,
    body: &'static str,
}

const fn post(key: Key, body: &'static str) -> Send {
    Send {
        method: "POST",
        key,
        body,
    }
}

/// What the stored record must say.
#[derive(Clone, Copy)]
struct Record {
    key: &'static str,
    state: &'static str,
    status: u64,
    body_contains: &'static str,
}

const COMPLETED: Record = Record {
    key: KEY,
    state: "completed",
    status: 200,
    body_contains: "success",
};

/// What the last request's answer, the store and the upstream must show.
#[derive(Clone, Copy)]
struct Then {
    status: u16,
    /// `application/problem+json` with `type`, `title` and `detail`.
    problem: bool,
    contains: &'static [&'static str],
    replayed: bool,
    orders: Option<usize>,
    record: Option<Record>,
}

const fn status(status: u16) -> Then {
    Then {
        status,
        problem: false,
        contains: &[],
        replayed: false,
        orders: None,
        record: None,
    }
}

const fn problem(code: u16, contains: &'static [&'static str]) -> Then {
    Then {
        problem: true,
        contains,
        ..status(code)
    }
}

struct Scenario {
    name: &'static str,
    /// "I previously sent …", in order.
    before: &'static [Send],
    /// The first of `before` is still being processed (held at the upstream).
    busy: bool,
    /// "I send …"; the last answer is checked.
    when: &'static [Send],
    then: Then,
}

const POST_FOO: Send = post(Key::Of(KEY), FOO);
const ONCE: &[Send] = &[POST_FOO];

const fn fresh(name: &'static str, when: &'static [Send], then: Then) -> Scenario {
    Scenario {
        name,
        before: &[],
        busy: false,
        when,
        then,
    }
}

const fn after_one(name: &'static str, when: &'static [Send], then: Then) -> Scenario {
    Scenario {
        before: ONCE,
        ..fresh(name, when, then)
    }
}

const RFC7807: &[&str] = &["type", "title", "detail"];

#[rustfmt::skip]
const SCENARIOS: &[Scenario] = &[
    // Header Validation (Section 2.1 - Syntax)
    fresh("Missing Idempotency-Key header on POST returns 400", &[post(Key::Absent, FOO)], problem(400, &["section-2.1"])),
    fresh("Empty Idempotency-Key header returns 400", &[post(Key::Empty, FOO)], problem(400, &["section-2.1", "type", "title", "detail"])),
    fresh("Idempotency-Key exceeding 255 characters returns 400", &[post(Key::Long, FOO)], problem(400, &["section-2.1", "type", "title", "detail"])),
    fresh("Idempotency-Key with commas returns 400", &[post(Key::Of("key,with,commas,longer-than-twenty-chars"), FOO)], problem(400, &["section-2.1", "type", "title", "detail"])),
    fresh("Valid Idempotency-Key is accepted", &[post(Key::Of("8e03978e-40d5-43e8-bc93-6894a57f9324"), FOO)], status(200)),
    // First Request Handling (Section 2.6 - Idempotency Enforcement)
    fresh("First request creates idempotency record", ONCE, Then { record: Some(COMPLETED), ..status(200) }),
    fresh("First request stores response status", ONCE, Then { record: Some(COMPLETED), ..status(200) }),
    fresh("First request stores response body", ONCE, Then { record: Some(COMPLETED), ..status(200) }),
    fresh("First request creates expected resource", ONCE, Then { orders: Some(1), ..status(200) }),
    fresh("First request returns correct response body", ONCE, Then { contains: &["success"], ..status(200) }),
    // Duplicate Request Handling (Section 2.6 - Retry)
    after_one("Duplicate request returns cached response", ONCE, Then { contains: &["success"], ..status(200) }),
    after_one("Duplicate request sets replay header", ONCE, Then { replayed: true, ..status(200) }),
    after_one("Duplicate request does not create additional idempotency records", ONCE, Then { record: Some(COMPLETED), ..status(200) }),
    after_one("Duplicate request does not duplicate resource creation", ONCE, Then { orders: Some(1), ..status(200) }),
    after_one("Multiple duplicate requests return cached response", &[POST_FOO, POST_FOO, POST_FOO], Then { orders: Some(1), ..status(200) }),
    // Key Reuse Conflict (Section 2.2 - Uniqueness)
    after_one("Same key with different body returns 422", &[post(Key::Of(KEY), BAZ)], problem(422, &["section-2.2"])),
    after_one("Key reuse conflict response contains error message", &[post(Key::Of(KEY), BAZ)], problem(422, &["section-2.2", "title"])),
    // Concurrent Request Handling (Section 2.6 - Concurrent Request)
    Scenario { busy: true, ..after_one("Request during processing returns 409", ONCE, problem(409, &["section-2.6"])) },
    Scenario { busy: true, ..after_one("Concurrent request response contains error message", ONCE, problem(409, &["section-2.6", "processed"])) },
    // Error Response Format (Section 2.7 - Error Handling)
    fresh("Missing key error follows RFC 7807", &[post(Key::Absent, FOO)], problem(400, RFC7807)),
    after_one("Key reuse error follows RFC 7807", &[post(Key::Of(KEY), BAZ)], problem(422, RFC7807)),
    // Edge Cases
    fresh("GET requests bypass idempotency processing", &[Send { method: "GET", key: Key::Of(KEY), body: "" }], status(200)),
    fresh("PUT requests bypass idempotency processing", &[Send { method: "PUT", key: Key::Of(KEY), body: FOO }], status(200)),
    fresh("DELETE requests bypass idempotency processing", &[Send { method: "DELETE", key: Key::Of(KEY), body: "" }], status(200)),
    fresh("Empty request body is handled", &[post(Key::Of(KEY), "")], status(200)),
    fresh("PATCH requests are protected by idempotency", &[Send { method: "PATCH", key: Key::Of(KEY), body: FOO }], Then { record: Some(COMPLETED), ..status(200) }),
];

/// "A POST endpoint at /api that creates an order": every request answers
/// 200 `{"success": true}`; one carrying `x-hold` waits for the gate.
async fn orders(gate: &Gate) -> FakeUpstream {
    let gate = gate.clone();
    FakeUpstream::start(move |r| {
        let gate = gate.clone();
        async move {
            if r.header("x-hold").is_some() {
                gate.pass().await;
            }
            crate::support::upstream::json_response(
                200,
                serde_json::json!({"success": true, "order": r.hit}),
            )
        }
    })
    .await
}

async fn exchange(gateway: &Gateway, owner: &str, send: Send, hold: bool) -> Reply {
    let long = "k".repeat(256);
    let mut headers = vec![
        ("authorization", owner),
        ("content-type", "application/json"),
    ];
    match send.key {
        Key::Absent => {}
        Key::Empty => headers.push(("idempotency-key", "")),
        Key::Long => headers.push(("idempotency-key", &long)),
        Key::Of(key) => headers.push(("idempotency-key", key)),
    }
    if hold {
        headers.push(("x-hold", "1"));
    }
    let method = Method::from_bytes(send.method.as_bytes()).unwrap();
    send_to(gateway, method, &headers, send.body).await
}

async fn send_to(gateway: &Gateway, method: Method, headers: &[(&str, &str)], body: &str) -> Reply {
    send(method, &gateway.path("/api"), headers, body.to_owned()).await
}

/// Runs one scenario as the owner `Bearer scenario-{n}`.
async fn run(
    env: &Deployment,
    gateway: &Gateway,
    upstream: &FakeUpstream,
    gate: &Gate,
    n: usize,
    s: &Scenario,
) {
    let owner = format!("Bearer scenario-{n}");
    let (held, before) = match s.before.split_first() {
        Some((first, rest)) if s.busy => (Some(*first), rest),
        _ => (None, s.before),
    };
    for previous in before {
        let reply = exchange(gateway, &owner, *previous, false).await;
        assert_eq!(reply.status, 200, "{}: sent before", s.name);
    }
    let reply = match held {
        None => last(gateway, &owner, s.when).await,
        // The first request waits at the upstream while the others are sent.
        Some(first) => {
            let (first, reply) = tokio::join!(exchange(gateway, &owner, first, true), async {
                upstream_busy(upstream, &owner).await;
                let reply = last(gateway, &owner, s.when).await;
                gate.open(1);
                reply
            });
            assert_eq!(first.status, 200, "{}: the first request", s.name);
            reply
        }
    };
    check(env, gateway, upstream, &owner, s, &reply).await;
}

/// Waits until this owner's first request is at the upstream.
async fn upstream_busy(upstream: &FakeUpstream, owner: &str) {
    crate::support::eventually(
        std::time::Duration::from_secs(10),
        "the first request at the upstream",
        || async {
            upstream
                .recorded()
                .iter()
                .any(|r| r.header("authorization") == Some(owner))
        },
    )
    .await;
}

async fn last(gateway: &Gateway, owner: &str, when: &[Send]) -> Reply {
    let mut reply = None;
    for send in when {
        reply = Some(exchange(gateway, owner, *send, false).await);
    }
    reply.expect("a scenario sends something")
}

async fn check(
    env: &Deployment,
    gateway: &Gateway,
    upstream: &FakeUpstream,
    owner: &str,
    s: &Scenario,
    reply: &Reply,
) {
    let (name, then) = (s.name, s.then);
    let text = String::from_utf8_lossy(&reply.body).into_owned();
    assert_eq!(reply.status, then.status, "{name}: {text}");
    if then.problem {
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json"),
            "{name}"
        );
        let body = reply.json();
        for member in ["type", "title", "detail"] {
            assert!(body[member].is_string(), "{name}: no {member} in {text}");
        }
    }
    for needle in then.contains {
        assert!(text.contains(needle), "{name}: {needle:?} not in {text}");
    }
    if then.replayed {
        assert_eq!(reply.header("idempotent-replayed"), Some("true"), "{name}");
    }
    if let Some(expected) = then.orders {
        let orders = upstream
            .recorded()
            .iter()
            .filter(|r| r.header("authorization") == Some(owner) && r.method == "POST")
            .count();
        assert_eq!(orders, expected, "{name}: orders");
    }
    if let Some(record) = then.record {
        check_record(env, gateway, owner, name, record).await;
    }
}

async fn check_record(
    env: &Deployment,
    gateway: &Gateway,
    owner: &str,
    name: &str,
    record: Record,
) {
    let query = format!(
        "/admin/v1/jobs?owner={}&key={}",
        owner.replace(' ', "%20"),
        record.key
    );
    let found = gateway.admin(Method::GET, &query, "").await;
    assert_eq!(found.status, 200, "{name}: no record for {}", record.key);
    let job = found.json();
    assert_eq!(job["state"], record.state, "{name}");
    assert_eq!(job["response"]["status"], record.status, "{name}");
    let body = job["response"]["body"].as_str().unwrap_or_default();
    assert!(body.contains(record.body_contains), "{name}: {body}");
    let count = format!(
        "SELECT count(*) FROM jobs WHERE owner = '{}' AND key = '{}'",
        job["owner"].as_str().unwrap(),
        record.key
    );
    assert_eq!(env.store.column(&count).await, ["1"], "{name}: one record");
}

/// A gateway set as the README says for the draft, in front of the orders.
async fn draft_gateway(env: &Deployment, upstream: &FakeUpstream) -> Gateway {
    env.gateway(&upstream.url())
        .set("mismatch_status", "422")
        .tables(
            "[[routes]]\nname = \"orders\"\npath_prefix = \"/api\"\nmethods = [\"POST\", \"PATCH\"]\n\
             require_key = true\nin_progress = \"conflict\"\n",
        )
        .start()
        .await
}

async fn every_applicable_scenario_passes(env: Deployment) {
    let gate = Gate::new();
    let upstream = orders(&gate).await;
    let gateway = draft_gateway(&env, &upstream).await;
    for (n, scenario) in SCENARIOS.iter().enumerate() {
        run(&env, &gateway, &upstream, &gate, n, scenario).await;
    }
}

async fn a_new_key_with_the_same_body_is_a_new_intent(env: Deployment) {
    let gate = Gate::new();
    let upstream = orders(&gate).await;
    let gateway = draft_gateway(&env, &upstream).await;
    let owner = "Bearer two-orders";
    for key in ["key1-12345678901234567", "key2-12345678901234567"] {
        let reply = exchange(&gateway, owner, post(Key::Of(key), FOO), false).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("idempotent-replayed"), None);
    }
    assert_eq!(upstream.hits(), 2, "two keys, two orders");
}

crate::on_each_deployment!(
    [embedded, postgres_redis]
    every_applicable_scenario_passes,
    a_new_key_with_the_same_body_is_a_new_intent,
);
