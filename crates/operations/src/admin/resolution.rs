//! The body of `POST /admin/v1/attempts/{id}/resolve`: what an operator
//! says an attempt of unknown outcome did, checked into a [`Resolution`].

use base64::Engine;
use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use serde::Deserialize;

use super::error::AdminError;
use idemgate_domain::attempt::Resolution;
use idemgate_domain::response::StoredResponse;
use idemgate_proxy::http::{gateway_answer_header, hop};

/// A resolution as posted: `{"outcome": "failed"}`, `{"outcome":
/// "cancelled"}` or `{"outcome": "succeeded", "response": {…}}`.
#[derive(Deserialize)]
#[serde(tag = "outcome", rename_all = "lowercase", deny_unknown_fields)]
enum ResolveRequest {
    Failed,
    Cancelled,
    Succeeded { response: ResponseInput },
}

/// The response a succeeded attempt gave, as the operator types it: the
/// body as text or as base64.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResponseInput {
    status: u16,
    #[serde(default)]
    headers: Vec<(String, String)>,
    body: Option<String>,
    body_base64: Option<String>,
}

/// The resolution `body` posts, or what is wrong with it.
pub(super) fn parse(body: &[u8]) -> Result<Resolution, AdminError> {
    let request: ResolveRequest = serde_json::from_slice(body).map_err(|e| {
        AdminError::bad_request(format!(
            "invalid resolution ({e}); send {{\"outcome\": \"failed\"}}, {{\"outcome\": \"cancelled\"}} \
             or {{\"outcome\": \"succeeded\", \"response\": {{\"status\": 200, \"headers\": [], \"body\": \"…\"}}}}"
        ))
    })?;
    match request {
        ResolveRequest::Failed => Ok(Resolution::Failed),
        ResolveRequest::Cancelled => Ok(Resolution::Cancelled),
        ResolveRequest::Succeeded { response } => response.into_stored().map(Resolution::Succeeded),
    }
}

impl ResponseInput {
    fn into_stored(self) -> Result<StoredResponse, AdminError> {
        if !(200..=599).contains(&self.status) {
            return Err(AdminError::bad_request(
                "response.status must be a final HTTP status (200 to 599)",
            ));
        }
        let body = match (self.body, self.body_base64) {
            (Some(text), None) => Bytes::from(text),
            (None, Some(b64)) => Bytes::from(
                base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .map_err(|e| AdminError::bad_request(format!("response.body_base64: {e}")))?,
            ),
            (None, None) => Bytes::new(),
            (Some(_), Some(_)) => {
                return Err(AdminError::bad_request(
                    "give response.body or response.body_base64, not both",
                ))
            }
        };
        let mut headers = Vec::with_capacity(self.headers.len());
        for (name, value) in self.headers {
            let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                AdminError::bad_request(format!("response header {name:?} is not a header name"))
            })?;
            HeaderValue::from_str(&value).map_err(|_| {
                AdminError::bad_request(format!("response header {name} has an invalid value"))
            })?;
            if hop::frames(&name) {
                return Err(AdminError::bad_request(format!(
                    "response header {name} frames one message on one connection; leave it \
                     out (each replay is framed by its own body)"
                )));
            }
            if gateway_answer_header(&name) {
                return Err(AdminError::bad_request(format!(
                    "response header {name} is the gateway's own to set on each answer; leave it out"
                )));
            }
            headers.push((name.as_str().to_owned(), Bytes::from(value)));
        }
        Ok(StoredResponse {
            status: self.status,
            headers,
            body,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(body: &str) -> String {
        match parse(body.as_bytes()) {
            Err(AdminError::BadRequest(detail)) => detail,
            other => panic!("{body}: {other:?}"),
        }
    }

    #[test]
    fn the_three_outcomes_are_read() {
        assert!(matches!(
            parse(br#"{"outcome": "failed"}"#),
            Ok(Resolution::Failed)
        ));
        assert!(matches!(
            parse(br#"{"outcome": "cancelled"}"#),
            Ok(Resolution::Cancelled)
        ));
        let body = br#"{"outcome": "succeeded", "response": {"status": 201,
            "headers": [["Content-Type", "text/plain"]], "body_base64": "/w=="}}"#;
        let Ok(Resolution::Succeeded(response)) = parse(body) else {
            panic!("a succeeded resolution");
        };
        assert_eq!(response.status, 201);
        assert_eq!(
            response.headers,
            vec![("content-type".to_owned(), Bytes::from("text/plain"))]
        );
        assert_eq!(response.body, Bytes::from_static(&[0xff]));
    }

    #[test]
    fn a_malformed_resolution_says_what_is_wrong() {
        assert!(refused("nope").starts_with("invalid resolution ("));
        let succeeded = |response: &str| {
            refused(&format!(
                r#"{{"outcome": "succeeded", "response": {response}}}"#
            ))
        };
        for status in [99, 101, 600] {
            assert_eq!(
                succeeded(&format!(r#"{{"status": {status}}}"#)),
                "response.status must be a final HTTP status (200 to 599)"
            );
        }
        for name in [
            "Content-Length",
            "transfer-encoding",
            "Connection",
            "upgrade",
        ] {
            let framed =
                format!(r#"{{"status": 200, "headers": [["{name}", "2"]], "body": "hello"}}"#);
            assert!(
                succeeded(&framed).contains("frames one message on one connection"),
                "{name}"
            );
        }
        for name in [
            "Idempotency-Job",
            "idempotent-replayed",
            "Idempotency-Events-Skipped",
        ] {
            let own = format!(r#"{{"status": 200, "headers": [["{name}", "1"]]}}"#);
            assert!(succeeded(&own).contains("the gateway's own"), "{name}");
        }
        assert_eq!(
            succeeded(r#"{"status": 200, "body": "a", "body_base64": "YQ=="}"#),
            "give response.body or response.body_base64, not both"
        );
        assert!(succeeded(r#"{"status": 200, "body_base64": "!"}"#)
            .starts_with("response.body_base64: "));
        assert_eq!(
            succeeded(r#"{"status": 200, "headers": [["a b", "x"]]}"#),
            r#"response header "a b" is not a header name"#
        );
        assert_eq!(
            succeeded(r#"{"status": 200, "headers": [["a", "x\ny"]]}"#),
            "response header a has an invalid value"
        );
    }
}
