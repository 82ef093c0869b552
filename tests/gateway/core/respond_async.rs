//! Calls longer than a connection, through the real binary (`Prefer:
//! respond-async`, RFC 7240; `docs/design.md` §10, "Answered later"): `202`
//! at once with where to poll; polled by the same owner, `202` while the job
//! runs, then its committed answer; `404` for anyone else.

use std::time::Duration;

use http::Method;

use crate::support::scripted_sse::ScriptedSse;
use crate::support::sse::{Finish, Reader};
use crate::support::{eventually, send, FakeUpstream, Gate, Gateway, Reply, TestStore};

/// A keyed POST from `owner` (its `Authorization`), with `headers` besides.
async fn post_as(url: &str, owner: &str, key: &str, headers: &[(&str, &str)]) -> Reply {
    let auth = format!("Bearer {owner}");
    let mut all = vec![
        ("idempotency-key", key),
        ("content-type", "application/json"),
        ("authorization", auth.as_str()),
    ];
    all.extend_from_slice(headers);
    send(Method::POST, url, &all, "{\"charge\":1}").await
}

async fn poll_as(gateway: &Gateway, location: &str, owner: Option<&str>) -> Reply {
    let auth = owner.map(|o| format!("Bearer {o}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    send(Method::GET, &gateway.path(location), &headers, "").await
}

async fn a_long_call_is_accepted_at_once_then_polled_to_its_answer(store: TestStore) {
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    let gateway = Gateway::builder(&store, &upstream.url()).start().await;
    let url = gateway.path("/v1/research");
    let accepted = post_as(&url, "alice", "deep-1", &[("prefer", "respond-async")]).await;
    assert_eq!(accepted.status, 202, "{accepted:?}");
    assert_eq!(accepted.header("preference-applied"), Some("respond-async"));
    assert_eq!(accepted.header("retry-after"), Some("1"));
    let job = accepted.header("idempotency-job").unwrap().to_owned();
    let location = accepted.header("location").unwrap().to_owned();
    assert_eq!(location, format!("/.well-known/idemgate/jobs/{job}"));
    assert_eq!(accepted.json()["job"], job.as_str());
    upstream.arrival().await;

    let running = poll_as(&gateway, &location, Some("alice")).await;
    assert_eq!(running.status, 202);
    assert_eq!(running.header("location"), Some(location.as_str()));
    for stranger in [Some("mallory"), None] {
        let refused = poll_as(&gateway, &location, stranger).await;
        assert_eq!(refused.status, 404, "{stranger:?}");
        assert_eq!(refused.problem(), "job-not-found");
    }
    let nowhere = "/.well-known/idemgate/jobs/00000000-0000-4000-8000-000000000000";
    assert_eq!(poll_as(&gateway, nowhere, Some("alice")).await.status, 404);
    let garbled = "/.well-known/idemgate/jobs/not-a-job";
    assert_eq!(poll_as(&gateway, garbled, Some("alice")).await.status, 404);

    gate.open(1);
    eventually(Duration::from_secs(10), "the polled answer", || async {
        poll_as(&gateway, &location, Some("alice")).await.status == 200
    })
    .await;
    let answer = poll_as(&gateway, &location, Some("alice")).await;
    assert_eq!(answer.header("idempotent-replayed"), Some("true"));
    assert_eq!(answer.json()["hit"], 1);
    assert_eq!(answer.header("idempotency-job"), Some(job.as_str()));
    assert_eq!(
        poll_as(&gateway, &location, Some("mallory")).await.status,
        404
    );
    let retried = post_as(&url, "alice", "deep-1", &[]).await;
    assert_eq!(retried.status, 200);
    assert_eq!(retried.body, answer.body, "the POST retried replays it too");
    assert_eq!(upstream.hits(), 1, "one upstream call");
}

async fn an_answer_ready_within_the_wait_is_given_at_once(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url()).start().await;
    let url = gateway.path("/v1/research");
    let prefer = [("prefer", "respond-async, wait=10")];
    let answer = post_as(&url, "alice", "quick", &prefer).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("preference-applied"), None);
    // A retry of a job that has its answer replays it, however it prefers.
    let again = post_as(&url, "alice", "quick", &[("prefer", "respond-async")]).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
}

async fn a_route_that_answers_in_one_piece_waits(store: TestStore) {
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |_| true).await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .tables("[[routes]]\npath_prefix = \"/v1\"\nrespond_async = false\n")
        .start()
        .await;
    let url = gateway.path("/v1/research");
    let call = tokio::spawn(async move {
        post_as(&url, "alice", "whole", &[("prefer", "respond-async")]).await
    });
    upstream.arrival().await;
    gate.open(1);
    let answer = call.await.unwrap();
    assert_eq!(answer.status, 200, "the answer, never a 202");
    assert_eq!(answer.header("preference-applied"), None);
}

async fn a_stream_polled_while_it_runs_is_joined_live(store: TestStore) {
    let gate = Gate::new();
    let events: Vec<String> = (1..=3)
        .map(|n| format!("data: {{\"n\":{n}}}\n\n"))
        .collect();
    let upstream = ScriptedSse::head_held(vec![events.clone()], gate.clone()).await;
    let gateway = Gateway::builder(&store, &upstream.url()).start().await;
    let url = gateway.path("/v1/chat");
    let accepted = post_as(&url, "alice", "long-stream", &[("prefer", "respond-async")]).await;
    assert_eq!(accepted.status, 202);
    let location = accepted.header("location").unwrap().to_owned();
    gate.open(1);
    let stream = gateway.path(&location);
    let joined = [
        ("authorization", "Bearer alice"),
        ("accept", "text/event-stream"),
    ];
    eventually(Duration::from_secs(10), "the stream's head", || async {
        let mut reader = Reader::get_with(&stream, &joined).await;
        if reader.status != 200 {
            return false;
        }
        reader.read_until(events[0].len()).await;
        gate.open(2);
        assert_eq!(reader.finish().await, Finish::Complete);
        assert_eq!(String::from_utf8(reader.read).unwrap(), events.concat());
        true
    })
    .await;
    assert_eq!(upstream.hits(), 1);
}

/// On a route that allows anonymous owners, a request without credentials
/// is never accepted with a `202`: its job's owner is everyone's, so a
/// poll would hand its answer to whoever learns the job id (which the
/// upstream and the access log see). It waits for its answer; a poll of
/// its job, by anyone, is `404`.
async fn an_anonymous_job_is_neither_accepted_nor_polled(store: TestStore) {
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .tables("[[routes]]\npath_prefix = \"/v1/open\"\n[routes.owner]\nallow_anonymous = true\n")
        .start()
        .await;
    let headers = [
        ("idempotency-key", "open-1"),
        ("content-type", "application/json"),
        ("prefer", "respond-async, wait=0"),
    ];
    let url = gateway.path("/v1/open/charges");
    let answered = send(Method::POST, &url, &headers, "{\"charge\":1}").await;
    assert_eq!(answered.status, 200, "{answered:?}");
    assert_eq!(answered.header("preference-applied"), None);
    let job = answered.job().unwrap();
    let location = format!("/.well-known/idemgate/jobs/{job}");
    for anyone in [None, Some("alice")] {
        let polled = poll_as(&gateway, &location, anyone).await;
        assert_eq!(polled.status, 404, "{anyone:?}");
    }
    // A proven owner on the same route is still accepted and polled.
    let accepted = post_as(
        &url,
        "alice",
        "open-2",
        &[("prefer", "respond-async, wait=0")],
    )
    .await;
    let location = accepted.header("location").map(str::to_owned);
    if accepted.status == 202 {
        let location = location.unwrap();
        eventually(Duration::from_secs(10), "alice's answer", || async {
            poll_as(&gateway, &location, Some("alice")).await.status == 200
        })
        .await;
    } else {
        assert_eq!(accepted.status, 200, "{accepted:?}");
    }
}

crate::on_each_deployment!(
    [embedded, postgres]
    a_long_call_is_accepted_at_once_then_polled_to_its_answer,
    an_anonymous_job_is_neither_accepted_nor_polled,
    an_answer_ready_within_the_wait_is_given_at_once,
    a_route_that_answers_in_one_piece_waits,
    a_stream_polled_while_it_runs_is_joined_live,
);
