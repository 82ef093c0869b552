//! Side-effect-free routes may move on (`on_unknown = "new_attempt"`,
//! `docs/design.md` §5): a retry of a job whose outcome is unknown starts a
//! new attempt at once instead of meeting `409`; of simultaneous retries
//! exactly one does, the others are held and get its answer. The default
//! stays blocking.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::upstream::echo_response;
use crate::support::{eventually, post, FakeUpstream, Gate, Gateway, TestStore};

const ROUTES: &str = r#"
[[routes]]
name = "embeddings"
path_prefix = "/v1/embeddings"
side_effect_free = true
on_unknown = "new_attempt"

[[routes]]
name = "charges"
path_prefix = "/v1/charges"
"#;

/// An upstream whose first POST is silent until `first` opens and whose
/// second waits for `second`; later ones answer at once. All echo.
async fn upstream(first: &Gate, second: &Gate) -> (FakeUpstream, Arc<AtomicUsize>) {
    let posts = Arc::new(AtomicUsize::new(0));
    let (first, second, counted) = (first.clone(), second.clone(), posts.clone());
    let upstream = FakeUpstream::start(move |r| {
        let (first, second, posts) = (first.clone(), second.clone(), counted.clone());
        async move {
            match posts.fetch_add(1, Ordering::SeqCst) {
                0 => first.pass().await,
                1 => second.pass().await,
                _ => {}
            }
            echo_response(&r)
        }
    })
    .await;
    (upstream, posts)
}

async fn gateway(store: &TestStore, upstream: &FakeUpstream) -> Gateway {
    Gateway::builder(store, &upstream.url())
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"30s\"")
        .tables(ROUTES)
        .start()
        .await
}

async fn simultaneous_retries_of_an_unknown_job_start_one_new_attempt(store: TestStore) {
    let (first, second) = (Gate::new(), Gate::new());
    let (upstream, posts) = upstream(&first, &second).await;
    let gateway = gateway(&store, &upstream).await;
    let url = gateway.path("/v1/embeddings");

    let unknown = post(&url, "embed-1", r#"{"input": "a"}"#).await;
    assert_eq!(unknown.status, 504);
    let job = unknown.job().unwrap();
    assert_eq!(gateway.job(&job).await["state"], "unknown");

    // Two retries at once: one moves on (attempt 2, held at the upstream),
    // the other is held on the running job.
    let retry = || {
        let url = url.clone();
        tokio::spawn(async move { post(&url, "embed-1", r#"{"input": "a"}"#).await })
    };
    let (a, b) = (retry(), retry());
    let second_call = upstream.arrival().await;
    let second_call = if second_call.header("idempotency-attempt") == Some("1") {
        upstream.arrival().await
    } else {
        second_call
    };
    assert_eq!(second_call.header("idempotency-attempt"), Some("2"));
    assert_eq!(second_call.header("idempotency-key"), Some(job.as_str()));
    eventually(
        Duration::from_secs(20),
        "the other retry to be held on the running job",
        || async { gateway.metric("idemgate_held_requests").await == 1.0 },
    )
    .await;
    assert_eq!(gateway.job(&job).await["state"], "running");
    second.open(1);
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    for reply in [&a, &b] {
        assert_eq!(reply.status, 200, "{:?}", reply.json());
        assert_eq!(reply.json()["attempt"], "2");
        assert_eq!(reply.job().as_deref(), Some(job.as_str()));
    }
    assert_eq!(posts.load(Ordering::SeqCst), 2, "one new attempt, not two");

    // The first attempt's late answer loses to the committed one.
    first.open(1);
    eventually(
        Duration::from_secs(10),
        "the late first attempt to be superseded",
        || async { gateway.job(&job).await["attempts"][0]["state"] == "superseded" },
    )
    .await;
    let detail = gateway.job(&job).await;
    assert_eq!(detail["state"], "completed");
    assert_eq!(detail["attempts"][1]["state"], "succeeded");
    let replay = post(&url, "embed-1", r#"{"input": "a"}"#).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.json()["attempt"], "2");
}

async fn a_route_that_does_not_move_on_keeps_blocking(store: TestStore) {
    let (first, second) = (Gate::new(), Gate::new());
    let (upstream, posts) = upstream(&first, &second).await;
    let gateway = gateway(&store, &upstream).await;
    let url = gateway.path("/v1/charges");
    let unknown = post(&url, "charge-1", "{}").await;
    assert_eq!(unknown.status, 504);
    let retry = post(&url, "charge-1", "{}").await;
    assert_eq!(retry.status, 409);
    assert_eq!(retry.problem(), "attempt-outcome-unknown");
    assert_eq!(posts.load(Ordering::SeqCst), 1);
    first.open(1);
    second.open(1);
}

async fn moving_on_is_refused_at_start_up_where_a_call_has_effects(store: TestStore) {
    let stderr = Gateway::builder(&store, "http://127.0.0.1:9")
        .tables("[[routes]]\npath_prefix = \"/v1/charges\"\non_unknown = \"new_attempt\"\n")
        .start_and_fail()
        .await;
    assert!(stderr.contains("routes[0].on_unknown"), "{stderr}");
    assert!(stderr.contains("side_effect_free = true"), "{stderr}");
}

crate::on_each_deployment!(
    [embedded, postgres]
    simultaneous_retries_of_an_unknown_job_start_one_new_attempt,
    a_route_that_does_not_move_on_keeps_blocking,
    moving_on_is_refused_at_start_up_where_a_call_has_effects,
);
