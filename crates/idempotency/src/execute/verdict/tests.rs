//! What an upstream's answer means for its attempt, decided without I/O.

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;

use std::sync::Arc;

use super::*;
use crate::testing;
use idemgate_domain::contract::{Contract, Shape};

/// One route over one upstream, without a contract.
fn plain() -> Arc<Route> {
    testing::route(&["http://a:1"], |_| {})
}

/// The route with the worked chat example's response schema as its
/// contract (`config/chat/response.schema.json`).
fn chat() -> Arc<Route> {
    let schema: serde_json::Value = serde_json::from_str(include_str!(
        "../../../../../config/chat/response.schema.json"
    ))
    .unwrap();
    let contract = Contract {
        name: "chat".into(),
        shape: Shape {
            schema: jsonschema::validator_for(&schema).unwrap(),
            embedded: None,
        },
        events: None,
        probes: Vec::new(),
        recover_after: 2,
    };
    testing::route(&["http://a:1"], |r| {
        r.contract = Some(Arc::new(contract));
        r.side_effect_free = true;
    })
}

fn answered(status: u16, body: &'static str) -> Result<Fetched, UpstreamError> {
    let (mut parts, ()) = Response::new(()).into_parts();
    parts.status = StatusCode::from_u16(status).unwrap();
    Ok(Fetched {
        parts,
        body: Bytes::from_static(body.as_bytes()),
    })
}

#[test]
fn refused_before_sending_is_a_safe_failure() {
    let verdict = classify(
        Err(UpstreamError::Refused("refused".into())),
        &plain(),
        None,
    );
    assert!(matches!(
        verdict,
        Verdict::Fail(
            AttemptFailure::Failed { status: None, .. },
            Uncommitted::Error(_)
        )
    ));
}

#[test]
fn anything_that_may_have_reached_the_upstream_is_unknown() {
    for error in [
        UpstreamError::Broken("reset".into()),
        UpstreamError::TimedOut(Duration::from_secs(1)),
        UpstreamError::ResponseTooLarge { limit: 10 },
    ] {
        assert!(matches!(
            classify(Err(error), &plain(), None),
            Verdict::Unknown(AttemptFailure::Unknown { .. }, _)
        ));
    }
}

#[test]
fn a_retryable_status_is_passed_on_uncommitted() {
    match classify(answered(503, "busy"), &plain(), None) {
        Verdict::Fail(AttemptFailure::Failed { status, .. }, Uncommitted::Response(r)) => {
            assert_eq!(status, Some(503));
            assert_eq!(r.status(), 503);
        }
        other => panic!("{other:?}"),
    }
}

/// A `101` to a request that asked for no upgrade is never committed:
/// replayed, it would switch every retry's connection.
#[test]
fn an_informational_answer_is_unknown_not_committed() {
    assert!(matches!(
        classify(answered(101, ""), &plain(), None),
        Verdict::Unknown(AttemptFailure::Unknown { .. }, _)
    ));
}

#[test]
fn other_answers_errors_included_are_committed() {
    for status in [200, 201, 400, 404, 500] {
        assert!(
            matches!(classify(answered(status, "{}"), &plain(), None), Verdict::Commit(s) if s.status == status),
            "{status}"
        );
    }
}

#[test]
fn a_success_that_breaks_the_contract_is_rejected_and_an_error_is_not_checked() {
    let chat = chat();
    assert!(matches!(
        classify(answered(200, "not json"), &chat, None),
        Verdict::Fail(
            AttemptFailure::Rejected { status: 200, .. },
            Uncommitted::Error(_)
        )
    ));
    assert!(
        matches!(
            classify(answered(400, "not json"), &chat, None),
            Verdict::Commit(_)
        ),
        "error answers are the upstream's own verdict"
    );
}

/// On a route that is not `side_effect_free`, a `2xx` that broke the
/// contract says the upstream acted: unknown, never a safe failure to
/// fail over from or run again.
#[test]
fn a_success_that_breaks_the_contract_of_a_route_with_effects_is_unknown() {
    let mut route = (*chat()).clone();
    route.side_effect_free = false;
    assert!(matches!(
        classify(answered(200, "not json"), &route, None),
        Verdict::Unknown(AttemptFailure::Unknown { detail }, _) if detail.contains("side_effect_free")
    ));
}

/// An MCP route.
fn mcp(retryable_codes: Vec<i64>) -> Arc<Route> {
    testing::route(&["http://a:1"], |r| {
        r.protocol = Protocol::Mcp(crate::route::Mcp {
            keyed_tools: None,
            retryable_codes,
        })
    })
}

fn json(status: u16, body: &'static str) -> Result<Fetched, UpstreamError> {
    let mut fetched = answered(status, body)?;
    fetched.parts.headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    Ok(fetched)
}

#[test]
fn an_mcp_server_refusing_the_message_before_dispatching_it_is_a_safe_failure() {
    let route = mcp(Vec::new());
    let not_found =
        r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Session not found"}}"#;
    for (status, body) in [
        (404, not_found),
        (400, ""),
        (400, "Bad Request: Missing session ID"),
    ] {
        match classify(json(status, body), &route, Some(b"7")) {
            Verdict::Fail(AttemptFailure::Failed { status: s, .. }, Uncommitted::Response(r)) => {
                assert_eq!((s, r.status().as_u16()), (Some(status), status), "{body}")
            }
            other => panic!("{status} {body}: {other:?}"),
        }
    }
    let tools_error = r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32602,"message":"bad"}}"#;
    assert!(
        matches!(
            classify(json(400, tools_error), &route, Some(b"7")),
            Verdict::Commit(_)
        ),
        "the call's own response is its answer, whatever the status"
    );
    assert!(
        matches!(
            classify(json(404, not_found), &plain(), Some(b"7")),
            Verdict::Commit(_)
        ),
        "an HTTP route's 404 is an answer"
    );
}

#[test]
fn an_mcp_answer_without_the_calls_response_or_with_its_cancellation_is_unknown() {
    let route = mcp(vec![-32603]);
    let terminated = r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32603,"message":"Session terminated before the request completed"}}"#;
    let cancelled =
        r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32800,"message":"Request cancelled"}}"#;
    let other = r#"{"jsonrpc":"2.0","id":8,"result":{}}"#;
    for (status, body) in [(500, terminated), (200, cancelled), (200, other), (200, "")] {
        assert!(
            matches!(
                classify(json(status, body), &route, Some(b"7")),
                Verdict::Unknown(AttemptFailure::Unknown { .. }, _)
            ),
            "{status} {body}"
        );
    }
    let retryable = r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32603,"message":"down"}}"#;
    assert!(
        matches!(
            classify(json(200, retryable), &route, Some(b"7")),
            Verdict::Fail(AttemptFailure::Failed { .. }, Uncommitted::Response(_))
        ),
        "the call's own error, of a retryable code"
    );
    let result = r#"{"jsonrpc":"2.0","id":7,"result":{"isError":true}}"#;
    assert!(matches!(
        classify(json(200, result), &route, Some(b"7")),
        Verdict::Commit(_)
    ));
}

#[test]
fn an_mcp_stream_is_whole_only_with_the_calls_response() {
    let route = mcp(vec![-32603]);
    let stored = |status: u16, body: &str| StoredResponse {
        status,
        headers: vec![(
            "content-type".into(),
            Bytes::from_static(b"text/event-stream"),
        )],
        body: Bytes::from(body.to_owned()),
    };
    let progress =
        "event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\n";
    let answered = |message: &str| format!("{progress}event: message\ndata: {message}\n\n");
    let call = Some(&b"7"[..]);
    assert_eq!(
        ended(
            &route,
            &stored(200, &answered(r#"{"jsonrpc":"2.0","id":7,"result":{}}"#)),
            call
        ),
        Ended::Whole
    );
    assert!(matches!(
        ended(&route, &stored(200, progress), call),
        Ended::Unknown(_)
    ));
    let cancelled = answered(r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32800}}"#);
    assert!(matches!(
        ended(&route, &stored(200, &cancelled), call),
        Ended::Unknown(_)
    ));
    let retryable = answered(r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32603}}"#);
    assert_eq!(
        ended(&route, &stored(200, &retryable), call),
        Ended::Error(InBand {
            kind: "-32603".into(),
            retryable: true,
            after_a_tool: false,
        })
    );
    let tools = answered(r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32602}}"#);
    assert_eq!(
        ended(&route, &stored(200, &tools), call),
        Ended::Error(InBand {
            kind: "-32602".into(),
            retryable: false,
            after_a_tool: false,
        })
    );
    assert!(matches!(
        ended(&route, &stored(404, progress), call),
        Ended::Refused(_)
    ));
}

/// A transient error after a tool the provider ran is the answer, as the
/// tool would run again; on a route its operator calls side-effect free,
/// it is retried as before.
#[test]
fn an_error_after_a_tool_the_provider_ran_is_retried_only_without_effects() {
    let stored = StoredResponse {
        status: 200,
        headers: vec![(
            "content-type".into(),
            Bytes::from_static(b"text/event-stream"),
        )],
        body: Bytes::from_static(
            b"event: response.mcp_call.completed\ndata: {}\n\n\
              event: error\ndata: {\"type\":\"error\",\"code\":\"server_error\"}\n\n",
        ),
    };
    let kind = "server_error".to_owned();
    assert_eq!(
        ended(&plain(), &stored, None),
        Ended::Error(InBand {
            kind: kind.clone(),
            retryable: false,
            after_a_tool: true,
        })
    );
    let free = testing::route(&["http://a:1"], |r| r.side_effect_free = true);
    assert_eq!(
        ended(&free, &stored, None),
        Ended::Error(InBand {
            kind,
            retryable: true,
            after_a_tool: true,
        })
    );
}

/// An event stream its upstream encoded (though asked for it uncompressed)
/// cannot show its end events: on a route that names them its end is not
/// known, and it is not committed as whole; on one that names none it is
/// judged by its status, as before.
#[test]
fn an_encoded_stream_on_a_route_with_end_events_is_not_whole() {
    let stored = StoredResponse {
        status: 200,
        headers: vec![
            (
                "content-type".into(),
                Bytes::from_static(b"text/event-stream"),
            ),
            ("content-encoding".into(), Bytes::from_static(b"gzip")),
        ],
        body: Bytes::from_static(b"\x1f\x8b"),
    };
    let ends = testing::route(&["http://a:1"], |r| {
        r.stream_end_events = vec!["[DONE]".into()];
    });
    assert!(matches!(ended(&ends, &stored, None), Ended::Unknown(why) if why.contains("encoded")));
    assert_eq!(ended(&plain(), &stored, None), Ended::Whole);
}
