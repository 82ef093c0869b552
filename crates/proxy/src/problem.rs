//! Problem answers (RFC 9457): every answer the gateway makes up itself is
//! `application/problem+json` with a stable `type` under [`PROBLEM_BASE`].
//! Each layer types its errors by who caused them and maps them to a status,
//! slug and title in one table of its own (the idempotency layer's
//! `error.rs`, the admin API's); this is where they all become answers, so
//! every problem carries the same members and the same headers.

use std::time::Duration;

use http::{header, HeaderValue, Response, StatusCode};
use serde_json::{Map, Value};

use crate::http::{full, Body, Outcome};

/// Problem types are this base followed by a slug.
pub const PROBLEM_BASE: &str = "https://idemgate.dev/problems/";

/// Renders a problem+json answer.
pub fn problem_response(
    status: StatusCode,
    slug: &str,
    title: &str,
    detail: &str,
    retry_after: Option<Duration>,
) -> Response<Body> {
    problem_response_with(status, slug, title, detail, retry_after, Map::new())
}

/// Renders a problem+json answer with extension `members` beside the
/// standard ones (RFC 9457, section 3.2), as `/readyz` lists its tasks; a
/// member named like a standard one is dropped.
pub fn problem_response_with(
    status: StatusCode,
    slug: &str,
    title: &str,
    detail: &str,
    retry_after: Option<Duration>,
    members: Map<String, Value>,
) -> Response<Body> {
    let mut body = serde_json::json!({
        "type": format!("{PROBLEM_BASE}{slug}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    if let Value::Object(standard) = &mut body {
        for (name, value) in members {
            standard.entry(name).or_insert(value);
        }
    }
    let mut response = Response::new(full(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    if let Some(after) = retry_after {
        let secs = after.as_secs_f64().ceil().max(1.0) as u64;
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    if status == StatusCode::REQUEST_TIMEOUT {
        // RFC 9110 §15.5.9: the connection is closed after a 408.
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    if status == StatusCode::UNAUTHORIZED {
        // RFC 9110 §15.5.2: a 401 says how to authenticate.
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"idemgate\""),
        );
    }
    response.extensions_mut().insert(Outcome::Problem);
    response
}
