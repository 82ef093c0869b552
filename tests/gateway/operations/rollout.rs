//! A rollout: SIGTERM while attempts run. The gateway stops accepting, lets
//! what it started run to its own deadline, commits it, and only then
//! exits; a replica started after it replays every answer, and nothing is
//! `unknown` (docs/design.md §12, "Termination").

use std::time::Duration;

use serde_json::json;

use crate::support::sse::{Finish, Reader, SseUpstream};
use crate::support::upstream::json_response;
use crate::support::{post, FakeUpstream, Gateway, TestStore};

/// Twenty tokens, one a second after the first: a twenty-second stream.
const TOKENS: [&str; 19] = [
    "A", " roll", "out", " must", " not", " cut", " this", " stream", " in", " half", ",", " nor",
    " leave", " its", " out", "come", " unknown", " to", " anyone",
];

fn gateway(
    store: &TestStore,
    slow: &FakeUpstream,
    sse: &SseUpstream,
) -> crate::support::gateway::Builder {
    Gateway::builder(store, &slow.url())
        .unset("upstreams")
        .set("upstream_timeout", "\"30s\"")
        .tables(&format!(
            "[[upstreams]]\nname = \"slow\"\nurl = \"{}\"\n\
             [[upstreams]]\nname = \"sse\"\nurl = \"{}\"\n\
             [[routes]]\nname = \"charges\"\npath_prefix = \"/v1/charges\"\nupstreams = [\"slow\"]\n\
             [[routes]]\nname = \"chat\"\npath_prefix = \"/v1/chat\"\nupstreams = [\"sse\"]\n",
            slow.url(),
            sse.url()
        ))
}

#[tokio::test]
async fn a_15_s_answer_and_a_20_s_stream_in_flight_at_sigterm_both_commit() {
    let store = TestStore::embedded();
    let slow = FakeUpstream::start(|_| async {
        tokio::time::sleep(Duration::from_secs(15)).await;
        json_response(200, json!({"charged": true}))
    })
    .await;
    let sse = SseUpstream::openai(&TOKENS, Duration::from_secs(1)).await;
    let mut first = gateway(&store, &slow, &sse).start().await;

    // The plain request's client gives up once the upstream has it: its
    // attempt runs on without anyone waiting on a connection.
    let plain = tokio::spawn({
        let url = first.path("/v1/charges");
        async move { post(&url, "rollout-plain", "{}").await }
    });
    slow.arrival().await;
    plain.abort();
    // The stream's client stays and reads to the end.
    let mut stream = Reader::post(&first.path("/v1/chat"), "rollout-stream", "{}").await;
    assert_eq!(stream.status, 200);
    let job = stream.header("idempotency-job").unwrap().to_owned();
    stream.read_until(1).await;
    let reading = tokio::spawn(async move {
        let finish = stream.finish_within(Duration::from_secs(40)).await;
        (finish, stream.read)
    });

    let exited = first.terminate().await;
    assert!(exited.success(), "a clean exit after the drain: {exited:?}");
    let (finish, streamed) = reading.await.unwrap();
    assert_eq!(
        finish,
        Finish::Complete,
        "the stream was not cut by the drain"
    );
    let streamed = String::from_utf8(streamed).unwrap();
    assert!(streamed.ends_with("data: [DONE]\n\n"), "{streamed}");

    // The next replica (same store) has both outcomes and replays them.
    let next = gateway(&store, &slow, &sse).start().await;
    let replayed = post(&next.path("/v1/charges"), "rollout-plain", "{}").await;
    assert_eq!(replayed.status, 200);
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    assert_eq!(replayed.json(), json!({"charged": true}));
    let mut again = Reader::post(&next.path("/v1/chat"), "rollout-stream", "{}").await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.finish().await, Finish::Complete);
    assert_eq!(String::from_utf8(again.read).unwrap(), streamed);
    assert_eq!((slow.hits(), sse.hits()), (1, 1), "each ran once");

    for id in [replayed.job().unwrap(), job] {
        let job = next.job(&id).await;
        assert_eq!(job["state"], "completed", "{job}");
        for attempt in job["attempts"].as_array().unwrap() {
            assert_eq!(attempt["state"], "succeeded", "{job}");
        }
    }
}
