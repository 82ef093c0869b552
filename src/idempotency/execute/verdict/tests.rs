//! What an upstream's answer means for its attempt, decided without I/O.

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;

use std::sync::Arc;

use super::*;
use crate::config::{Flags, Settings};

fn route(extra: &str) -> Arc<Route> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/chat");
    let text = format!(
        "upstreams = [\"http://a:1\"]\n\
         [contracts.chat]\nschema = \"response.schema.json\"\n\
         [[routes]]\npath_prefix = \"/\"\n{extra}"
    );
    let file = Settings::parse_file(&text).unwrap().relative_to(dir);
    Settings::from_sources(file, Flags::default())
        .unwrap()
        .routes[0]
        .clone()
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
    let verdict = classify(Err(UpstreamError::Refused("refused".into())), &route(""));
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
            classify(Err(error), &route("")),
            Verdict::Unknown(AttemptFailure::Unknown { .. }, _)
        ));
    }
}

#[test]
fn a_retryable_status_is_passed_on_uncommitted() {
    match classify(answered(503, "busy"), &route("")) {
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
            matches!(classify(answered(status, "{}"), &route("")), Verdict::Commit(s) if s.status == status),
            "{status}"
        );
    }
}

#[test]
fn a_success_that_breaks_the_contract_is_rejected_and_an_error_is_not_checked() {
    let chat = route("contract = \"chat\"");
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
