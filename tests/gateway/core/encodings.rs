//! Content codings (`docs/design.md` §11, "A keyed answer is asked for
//! uncompressed"): a keyed request asks its upstream for the answer
//! uncompressed, whatever its client accepts, so that the answer can be
//! judged and checked, and every duplicate can read its replay; a request
//! without a key keeps the client's `Accept-Encoding`.

use bytes::Bytes;
use http::Method;
use http_body_util::Full;
use serde_json::{json, Value};

use crate::support::upstream::Recorded;
use crate::support::{send, FakeUpstream, Gateway, Reply, TestStore};

/// Not gzip, only marked so: the gateway never decodes, and what matters
/// is that it never has to read one.
const COMPRESSED: &[u8] = b"\x1f\x8b\x08\0 compressed, unreadable";

/// An answer negotiated as real upstreams do: compressed when the request
/// accepts `gzip`, `plain` JSON otherwise.
pub(super) fn negotiated(r: &Recorded, plain: &Value) -> http::Response<Full<Bytes>> {
    let gzip = r
        .header("accept-encoding")
        .is_some_and(|a| a.contains("gzip"));
    let builder = http::Response::builder().header("content-type", "application/json");
    let (builder, body) = if gzip {
        let marked = builder.header("content-encoding", "gzip");
        (marked, Bytes::from_static(COMPRESSED))
    } else {
        (builder, Bytes::from(plain.to_string()))
    };
    builder.body(Full::new(body)).unwrap()
}

async fn post(url: &str, key: Option<&str>, accept: Option<&str>, body: &str) -> Reply {
    let mut headers = vec![("content-type", "application/json")];
    headers.extend(key.map(|k| ("idempotency-key", k)));
    headers.extend(accept.map(|a| ("accept-encoding", a)));
    send(Method::POST, url, &headers, body.to_owned()).await
}

/// A route whose contract reads every `2xx`: the first client accepts
/// `gzip` (as the OpenAI and Anthropic SDKs do), its answer is checked and
/// committed uncompressed, and duplicates that accept another coding or
/// none replay it readable. Had the client's header gone on, the contract
/// would have found the answer "not JSON" and rejected it.
async fn a_keyed_answer_is_asked_for_uncompressed_and_every_duplicate_reads_it(store: TestStore) {
    let answer = json!({"id": "chatcmpl-1", "choices": []});
    let upstream = {
        let answer = answer.clone();
        FakeUpstream::start(move |r| std::future::ready(negotiated(&r, &answer))).await
    };
    let schemas = tempfile::tempdir().unwrap();
    let schema = json!({"type": "object", "required": ["id", "choices"]});
    std::fs::write(schemas.path().join("chat.json"), schema.to_string()).unwrap();
    let gateway = Gateway::builder(&store, &upstream.url())
        .tables(
            "[contracts.chat]\nschema = \"chat.json\"\n\n\
             [[routes]]\npath_prefix = \"/v1\"\ncontract = \"chat\"\n",
        )
        .files_from(schemas.path())
        .start()
        .await;
    let url = gateway.path("/v1/chat/completions");

    let first = post(&url, Some("c1"), Some("gzip, deflate"), "{}").await;
    assert_eq!(
        first.status,
        200,
        "{:?}",
        String::from_utf8_lossy(&first.body)
    );
    assert_eq!(first.header("content-encoding"), None);
    assert_eq!(first.json(), answer);
    assert_eq!(
        upstream.recorded()[0].header("accept-encoding"),
        Some("identity")
    );

    for accept in [Some("br"), None, Some("gzip")] {
        let again = post(&url, Some("c1"), accept, "{}").await;
        assert_eq!(again.status, 200, "{accept:?}");
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(again.header("content-encoding"), None, "{accept:?}");
        assert_eq!(again.json(), answer, "{accept:?}");
    }
    assert_eq!(upstream.hits(), 1);

    // Without a key nothing is recorded: the client's coding goes on.
    let passed = post(&url, None, Some("gzip"), "{}").await;
    assert_eq!(passed.header("content-encoding"), Some("gzip"));
    assert_eq!(passed.body.as_ref(), COMPRESSED);
    assert_eq!(
        upstream.recorded()[1].header("accept-encoding"),
        Some("gzip")
    );
}

/// On an MCP route a tool call's answer is judged by the response it
/// carries: an error the route retries reopens the job, and the agent's
/// retry runs the tool again. The agent's client accepts `gzip`; had that
/// gone on, the error would have come compressed, been judged by its `200`
/// alone, and been committed and replayed for good.
async fn a_tool_calls_error_is_read_though_its_client_accepts_gzip(store: TestStore) {
    let upstream = FakeUpstream::start(|r: Recorded| async move {
        let call: Value = serde_json::from_slice(&r.body).unwrap();
        let id = call["id"].clone();
        let message = if r.hit == 1 {
            json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32603, "message": "busy"}})
        } else {
            json!({"jsonrpc": "2.0", "id": id, "result": {"content": [], "isError": false}})
        };
        negotiated(&r, &message)
    })
    .await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .tables(
            "[[routes]]\npath_prefix = \"/mcp\"\nprotocol = \"mcp\"\n\
             retryable_rpc_codes = [-32603]\n",
        )
        .start()
        .await;
    let call = |id: u32| {
        crate::support::mcp::tool_call(json!(id), "charge", json!({"amount": 5}), Some("pay"))
            .to_string()
    };
    let headers = [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("accept-encoding", "gzip, deflate"),
        ("mcp-session-id", "s1"),
    ];
    let url = gateway.path("/mcp");
    let busy = send(Method::POST, &url, &headers, call(1)).await;
    assert_eq!(busy.json()["error"]["code"], -32603, "the error, passed on");
    assert_eq!(busy.header("idempotent-replayed"), None);

    let retried = send(Method::POST, &url, &headers, call(2)).await;
    assert_eq!(retried.status, 200);
    let retried = retried.json();
    assert_eq!(retried["id"], 2);
    assert_eq!(retried["result"]["isError"], false, "{retried}");
    assert_eq!(
        upstream.hits(),
        2,
        "the error was not kept: the tool ran again"
    );
    let asked: Vec<_> = upstream
        .recorded()
        .iter()
        .map(|r| r.header("accept-encoding").map(str::to_owned))
        .collect();
    assert_eq!(
        asked,
        [Some("identity".to_owned()), Some("identity".to_owned())]
    );
}

crate::on_each_deployment!(
    [embedded, postgres]
    a_keyed_answer_is_asked_for_uncompressed_and_every_duplicate_reads_it,
    a_tool_calls_error_is_read_though_its_client_accepts_gzip,
);
