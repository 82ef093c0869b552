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
    testing::route(&["http://a:1"], |r| r.contract = Some(Arc::new(contract)))
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
    let verdict = classify(Err(UpstreamError::Refused("refused".into())), &plain());
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
            classify(Err(error), &plain()),
            Verdict::Unknown(AttemptFailure::Unknown { .. }, _)
        ));
    }
}

#[test]
fn a_retryable_status_is_passed_on_uncommitted() {
    match classify(answered(503, "busy"), &plain()) {
        Verdict::Fail(AttemptFailure::Failed { status, .. }, Uncommitted::Response(r)) => {
            assert_eq!(status, Some(503));
            assert_eq!(r.status(), 503);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn other_answers_errors_included_are_committed() {
    for status in [200, 201, 400, 404, 500] {
        assert!(
            matches!(classify(answered(status, "{}"), &plain()), Verdict::Commit(s) if s.status == status),
            "{status}"
        );
    }
}

#[test]
fn a_success_that_breaks_the_contract_is_rejected_and_an_error_is_not_checked() {
    let chat = chat();
    assert!(matches!(
        classify(answered(200, "not json"), &chat),
        Verdict::Fail(
            AttemptFailure::Rejected { status: 200, .. },
            Uncommitted::Error(_)
        )
    ));
    assert!(
        matches!(
            classify(answered(400, "not json"), &chat),
            Verdict::Commit(_)
        ),
        "error answers are the upstream's own verdict"
    );
}
