//! What an MCP route makes of a message a client can spell two ways
//! (`docs/design.md` §19), through the real binary: a tool call naming a
//! member twice, a batch on a route that requires keys, and a key header
//! spelled badly beside a body that needs none.

use http::Method;
use serde_json::{json, Value};

use crate::support::mcp::{tool_call, Answering, FakeMcp};
use crate::support::{send, Gateway, Reply, TestStore};

async fn gateway(store: &TestStore, server: &FakeMcp, keys: &str) -> Gateway {
    Gateway::builder(store, &server.url())
        .tables(&format!(
            "[[routes]]\npath_prefix = \"/mcp\"\nprotocol = \"mcp\"\n{keys}"
        ))
        .start()
        .await
}

/// POSTs `body` to the MCP endpoint with `extra` headers.
async fn post(gateway: &Gateway, body: impl Into<bytes::Bytes>, extra: &[(&str, &str)]) -> Reply {
    let mut headers = vec![
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("mcp-session-id", "s1"),
    ];
    headers.extend_from_slice(extra);
    send(Method::POST, &gateway.path("/mcp"), &headers, body).await
}

/// The problem type a JSON-RPC error answer carries as its `data`, with
/// the `id` it is addressed to.
fn rpc_problem(reply: &Reply) -> (Value, String) {
    assert_eq!(
        reply.status,
        200,
        "{:?}",
        String::from_utf8_lossy(&reply.body)
    );
    let answer = reply.json();
    let kind = answer["error"]["data"]["type"].as_str().unwrap_or_default();
    (answer["id"].clone(), kind.to_owned())
}

/// A tool call that names `arguments` twice is read two ways: the first by
/// the gateway's scanner, the last by most servers (and JSON.parse,
/// Python's json): fingerprinted as `{"amount": 1}`, it would charge 500,
/// and a retry with another second `arguments` would be replayed as the
/// same intent. It is refused `400 …/ambiguous-json` (as a member named
/// twice inside the arguments is), naming the member, and nothing runs; so
/// is an `id` named twice, and a name the envelope is read by spelled
/// another way but for case. Before, the server ran it.
async fn a_tool_call_naming_a_member_twice_is_refused(store: TestStore) {
    let server = FakeMcp::start(Answering::Json, None).await;
    let gateway = gateway(&store, &server, "").await;
    let twice = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"amount":1},"arguments":{"amount":500},"_meta":{"idempotencyKey":"k"}}}"#;
    let id_twice = r#"{"jsonrpc":"2.0","id":1,"id":2,"method":"tools/call","params":{"name":"charge","arguments":{},"_meta":{"idempotencyKey":"k2"}}}"#;
    // Spelled another way but for case: a server that matches names
    // without case (Go's encoding/json) reads `Method` as the method, a
    // tool call the gateway would have passed as another message, unkeyed,
    // and `Name` as the tool.
    let method = r#"{"jsonrpc":"2.0","id":1,"Method":"tools/call","params":{"name":"charge","arguments":{}}}"#;
    let name = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"lookup","Name":"charge","arguments":{},"_meta":{"idempotencyKey":"k3"}}}"#;
    for (body, member) in [
        (twice, "/params/arguments"),
        (id_twice, "/id"),
        (method, "/Method"),
        (name, "/params/Name"),
    ] {
        let refused = post(&gateway, body.to_owned(), &[]).await;
        assert_eq!(refused.status, 400);
        assert_eq!(refused.problem(), "ambiguous-json");
        assert!(
            refused.problem_detail().contains(member),
            "{}",
            refused.problem_detail()
        );
    }
    assert_eq!(server.runs("charge"), 0);
}

/// On a route that requires keys, a batch holding a tool call is refused,
/// keyed or not: its calls would run unkeyed on every retry. Before, an
/// unkeyed one-call batch passed through and ran.
async fn a_batch_is_refused_where_keys_are_required(store: TestStore) {
    let server = FakeMcp::start(Answering::Json, None).await;
    let gateway = gateway(&store, &server, "require_key = true\n").await;
    let batch = json!([tool_call(json!(1), "charge", json!({"amount": 5}), None)]);
    let refused = post(&gateway, batch.to_string(), &[]).await;
    assert_eq!(
        refused.status,
        400,
        "{:?}",
        String::from_utf8_lossy(&refused.body)
    );
    assert_eq!(refused.problem(), "keyed-batch");
    assert_eq!(server.runs("charge"), 0);
}

/// An `Idempotency-Key` header spelled badly (here empty) is refused only
/// for a keyed tool call whose body carries no key, and then as the call's
/// JSON-RPC error: `initialize` passes through as it came, and a call with
/// a key in its `_meta` runs by that key. Before, each was answered an
/// HTTP `400` problem.
async fn a_bad_key_header_is_refused_only_where_it_is_the_key(store: TestStore) {
    let server = FakeMcp::start(Answering::Json, None).await;
    let gateway = gateway(&store, &server, "").await;
    let empty = [("idempotency-key", "")];
    let initialize = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {}});
    let passed = post(&gateway, initialize.to_string(), &empty).await;
    assert_eq!(
        passed.status,
        200,
        "{:?}",
        String::from_utf8_lossy(&passed.body)
    );
    assert_eq!(passed.json()["result"]["serverInfo"]["name"], "fake");

    let keyed = tool_call(json!(1), "charge", json!({"amount": 5}), Some("in-body"));
    let ran = post(&gateway, keyed.to_string(), &empty).await;
    assert_eq!(ran.status, 200);
    assert!(ran.json()["result"].is_object(), "{:?}", ran.json());
    assert_eq!(server.runs("charge"), 1);

    let unkeyed = tool_call(json!(2), "charge", json!({"amount": 5}), None);
    let (id, kind) = rpc_problem(&post(&gateway, unkeyed.to_string(), &empty).await);
    assert_eq!(id, 2);
    assert!(kind.ends_with("/invalid-idempotency-key"), "{kind}");
    assert_eq!(server.runs("charge"), 1);
}

/// A POST the gateway cannot read as JSON in UTF-8 could be a keyed tool
/// call that a lenient server reads (Python's `json.loads` takes UTF-16,
/// Node's body parsers inflate gzip) and runs on every retry: it is
/// refused `400 …/unreadable-message`. A message whose envelope names a
/// member twice is refused whatever its method, alone or in a batch: the
/// last `method` made it a ping here, the first a tool call to a parser
/// that keeps it. A UTF-8 byte order mark is read past, so the call after
/// it is keyed, and a keyed call without an id is refused. Before, each
/// passed through unkeyed, and the tool ran again on every retry (an
/// attacker's review).
async fn a_message_read_two_ways_or_not_at_all_is_refused(store: TestStore) {
    let server = FakeMcp::start(Answering::Json, None).await;
    let gateway = gateway(&store, &server, "").await;
    let call = tool_call(json!(1), "charge", json!({"amount": 5}), Some("bom"));
    let bom = [b"\xEF\xBB\xBF".as_slice(), call.to_string().as_bytes()].concat();
    let first = post(&gateway, bom.clone(), &[]).await;
    let again = post(&gateway, bom, &[]).await;
    assert!(first.job().is_some(), "keyed: {:?}", first.headers);
    assert_eq!(first.job(), again.job());
    let ran = server.runs("charge");

    let utf16 = tool_call(json!(2), "charge", json!({}), Some("u16")).to_string();
    let utf16: Vec<u8> = [0xFF, 0xFE]
        .into_iter()
        .chain(utf16.encode_utf16().flat_map(u16::to_le_bytes))
        .collect();
    let gzip = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03not json".to_vec();
    let charset = [("content-type", "application/json; charset=utf-16")];
    let encoded = [("content-encoding", "gzip"), ("idempotency-key", "gz")];
    for (body, extra) in [(utf16, &charset[..]), (gzip, &encoded[..])] {
        let refused = post(&gateway, body, extra).await;
        assert_eq!(refused.status, 400, "{extra:?}");
        assert_eq!(refused.problem(), "unreadable-message");
    }
    // Nor does a type spelled loosely let it by, as the Python SDK reads
    // it (`NaN` is JSON to Python, not to the gateway).
    let nan = r#"{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"charge","arguments":{"amount":NaN},"_meta":{"idempotencyKey":"nan"}}}"#;
    for kind in [
        "application/json, text/plain",
        "Application/JSON-RPC; charset=utf-16le",
    ] {
        let typed = [("content-type", kind)];
        let refused = send(Method::POST, &gateway.path("/mcp"), &typed, nan).await;
        assert_eq!(refused.status, 400, "{kind}");
        assert_eq!(refused.problem(), "unreadable-message");
    }
    // A form is no message: it passes, as an OAuth `/token` under a route
    // of `/` must.
    let form = [("content-type", "application/x-www-form-urlencoded")];
    let body = "grant_type=client_credentials";
    let passed = send(Method::POST, &gateway.path("/mcp"), &form, body).await;
    assert_ne!(passed.status, 400, "{:?}", passed.body);

    let method = r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"charge","arguments":{},"_meta":{"idempotencyKey":"m2"}},"method":"ping"}"#;
    let id = r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"charge","arguments":{},"_meta":{"idempotencyKey":"i2"}},"id":null}"#;
    let batch = format!("[{method}]");
    for (body, member) in [(method, "/method"), (id, "/id"), (&batch, "/0/method")] {
        let refused = post(&gateway, body.to_owned(), &[]).await;
        assert_eq!(refused.status, 400, "{body}");
        assert_eq!(refused.problem(), "ambiguous-json");
        let detail = refused.problem_detail();
        assert!(detail.contains(member), "{member}: {detail}");
    }
    // A keyed call spelled as a notification (no id, or a null one): no
    // answer could be addressed to it (so a problem, not a JSON-RPC
    // error), and it passed, running every time.
    let null_id = r#"{"jsonrpc":"2.0","id":null,"method":"tools/call","params":{"name":"charge","arguments":{}}}"#;
    let no_id = r#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"charge","arguments":{},"_meta":{"idempotencyKey":"n1"}}}"#;
    let header = [("idempotency-key", "n0")];
    for (body, extra) in [(null_id, &header[..]), (no_id, &[][..])] {
        let refused = post(&gateway, body.to_owned(), extra).await;
        assert_eq!(refused.status, 400, "{body}");
        assert_eq!(refused.problem(), "keyed-call-without-id");
    }
    assert_eq!(server.runs("charge"), ran, "nothing more ran");
}

crate::on_each_deployment!(
    [embedded, postgres]
    a_message_read_two_ways_or_not_at_all_is_refused,
    a_tool_call_naming_a_member_twice_is_refused,
    a_batch_is_refused_where_keys_are_required,
    a_bad_key_header_is_refused_only_where_it_is_the_key,
);
