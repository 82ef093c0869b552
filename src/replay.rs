//! Turning upstream answers into stored responses and stored responses back
//! into answers.

use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, Response, StatusCode};

use crate::http::{full, Body, IDEMPOTENCY_JOB, IDEMPOTENT_REPLAYED};
use crate::job::{JobId, StoredResponse};
use crate::upstream::Fetched;

/// What is kept of an upstream answer: status, end-to-end headers (the
/// upstream service already removed hop-by-hop ones; the length is
/// recomputed from the stored body) and the body bytes.
pub fn capture(fetched: &Fetched) -> StoredResponse {
    let headers = fetched
        .parts
        .headers
        .iter()
        .filter(|(name, _)| **name != header::CONTENT_LENGTH)
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                Bytes::copy_from_slice(value.as_bytes()),
            )
        })
        .collect();
    StoredResponse {
        status: fetched.parts.status.as_u16(),
        headers,
        body: fetched.body.clone(),
    }
}

/// The answer for a stored response: the one first sent (`replayed` false)
/// or a replay of it (`Idempotent-Replayed: true`), both naming the job.
pub fn response(stored: &StoredResponse, job: JobId, replayed: bool) -> Response<Body> {
    let mut response = Response::new(full(stored.body.clone()));
    *response.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value.clone()),
        ) {
            headers.append(name, value);
        }
    }
    set_job(&mut response, job);
    if replayed {
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    response
}

/// Names the job on an answer.
pub fn set_job<B>(response: &mut Response<B>, job: JobId) {
    if let Ok(v) = HeaderValue::from_str(&job.to_string()) {
        response.headers_mut().insert(IDEMPOTENCY_JOB, v);
    }
}
