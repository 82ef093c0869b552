//! Why an admin request failed, by who caused it, and the one mapping of
//! each cause to its problem answer. The answer itself is rendered by
//! [`idemgate_proxy::problem::problem_response`], as the proxy's are: one
//! problem+json format on both listeners.

use http::{header, HeaderValue, Response, StatusCode};

use idemgate_proxy::http::Body;
use idemgate_proxy::problem::problem_response;
use idemgate_store::{StoreError, StoreErrorKind};
use idemgate_telemetry::Chain;

/// How soon a caller told `job-busy` may try again: the holder is often a
/// batch or an operator's transaction that lets go within a second.
const JOB_BUSY_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// An admin answer that is not a success. Its `Display` is the problem's
/// `detail`.
#[derive(Debug, thiserror::Error)]
pub(super) enum AdminError {
    /// The operator's configuration: no admin token, so the API is off.
    #[error("no admin token is configured; set admin_token (--admin-token, IDEMGATE_ADMIN_TOKEN)")]
    Disabled,
    /// The caller: neither the bearer token nor a console session.
    #[error("a valid `Authorization: Bearer <admin token>` header is required")]
    Unauthorized,
    /// The caller: a path or method the admin listener does not serve.
    #[error("no such admin endpoint")]
    NoSuchEndpoint,
    /// The caller: a malformed request (an id, a query, a resolution).
    #[error("{0}")]
    BadRequest(String),
    /// The caller: no job matches; says what was looked for.
    #[error("{0}")]
    JobNotFound(&'static str),
    /// The caller: no attempt has the id given; says what it is instead
    /// when it is a job's.
    #[error("{0}")]
    AttemptNotFound(String),
    /// The caller: too many failed console sign-ins from its address
    /// lately; it may try again after this long (`docs/design.md` §14).
    #[error("too many failed sign-ins from your address: try again in {} s", .0.as_secs().max(1))]
    SignInThrottled(std::time::Duration),
    /// The store: its error, whole chain, is the detail (a missing attempt
    /// and a refused resolution are the store's answers too).
    #[error("{}", Chain(.0))]
    Store(StoreError),
    /// The store is up, but another transaction held the job past
    /// `database_lock_timeout` ([`StoreError::is_lock_wait`]); nothing was
    /// written.
    #[error(
        "another transaction held this job past database_lock_timeout; nothing was written: \
         try again, or find the holder (docs/runbook.md, IdemgateOutcomeWritesRetried) ({})",
        Chain(.0)
    )]
    JobBusy(StoreError),
}

impl AdminError {
    /// A malformed request, saying what is wrong with it.
    pub(super) fn bad_request(detail: impl Into<String>) -> Self {
        AdminError::BadRequest(detail.into())
    }

    /// Status, problem type slug and title.
    fn problem(&self) -> (StatusCode, &'static str, &'static str) {
        match self {
            AdminError::Disabled => (
                StatusCode::FORBIDDEN,
                "admin-disabled",
                "Admin API disabled",
            ),
            AdminError::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized"),
            AdminError::NoSuchEndpoint => (StatusCode::NOT_FOUND, "not-found", "Not found"),
            AdminError::BadRequest(_) => (
                StatusCode::BAD_REQUEST,
                "invalid-admin-request",
                "Invalid admin request",
            ),
            AdminError::JobNotFound(_) => (StatusCode::NOT_FOUND, "job-not-found", "Job not found"),
            AdminError::AttemptNotFound(_) => (StatusCode::NOT_FOUND, "not-found", "Not found"),
            AdminError::SignInThrottled(_) => (
                StatusCode::TOO_MANY_REQUESTS,
                "sign-in-throttled",
                "Too many failed sign-ins",
            ),
            AdminError::JobBusy(_) => (StatusCode::CONFLICT, "job-busy", "Job busy"),
            AdminError::Store(e) => match e.kind() {
                StoreErrorKind::NotFound => (StatusCode::NOT_FOUND, "not-found", "Not found"),
                StoreErrorKind::Conflict => (
                    StatusCode::CONFLICT,
                    "resolution-conflict",
                    "Cannot resolve",
                ),
                StoreErrorKind::Unavailable => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "store-unavailable",
                    "Store unavailable",
                ),
                StoreErrorKind::Internal => (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal-error",
                    "Internal error",
                ),
            },
        }
    }

    /// The problem+json answer; a 401 says the scheme it wants.
    pub(super) fn into_response(self) -> Response<Body> {
        let (status, slug, title) = self.problem();
        let retry_after = match &self {
            AdminError::SignInThrottled(wait) => Some(*wait),
            AdminError::JobBusy(_) => Some(JOB_BUSY_RETRY),
            _ => None,
        };
        let mut response = problem_response(status, slug, title, &self.to_string(), retry_after);
        if matches!(self, AdminError::Unauthorized) {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<StoreError> for AdminError {
    fn from(e: StoreError) -> Self {
        match e.is_lock_wait() {
            true => AdminError::JobBusy(e),
            false => AdminError::Store(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use serde_json::{json, Value};

    use super::*;

    async fn rendered(e: AdminError) -> (StatusCode, Option<String>, Value) {
        let response = e.into_response();
        let status = response.status();
        let challenge = response
            .headers()
            .get(header::WWW_AUTHENTICATE)
            .map(|v| v.to_str().unwrap().to_owned());
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, challenge, serde_json::from_slice(&body).unwrap())
    }

    fn problem(status: u16, slug: &str, title: &str, detail: &str) -> Value {
        json!({
            "type": format!("https://idemgate.dev/problems/{slug}"),
            "title": title,
            "status": status,
            "detail": detail,
        })
    }

    /// Clients match on these: every cause keeps its status, type and title.
    #[tokio::test]
    async fn each_cause_answers_its_problem() {
        let cases = [
            (
                AdminError::Disabled,
                problem(403, "admin-disabled", "Admin API disabled", "no admin token is configured; set admin_token (--admin-token, IDEMGATE_ADMIN_TOKEN)"),
            ),
            (
                AdminError::NoSuchEndpoint,
                problem(404, "not-found", "Not found", "no such admin endpoint"),
            ),
            (
                AdminError::bad_request("limit must be a number from 1 to 500"),
                problem(400, "invalid-admin-request", "Invalid admin request", "limit must be a number from 1 to 500"),
            ),
            (
                AdminError::JobNotFound("no job with this id"),
                problem(404, "job-not-found", "Job not found", "no job with this id"),
            ),
            (
                StoreError::NotFound("attempt").into(),
                problem(404, "not-found", "Not found", "attempt not found"),
            ),
            (
                StoreError::Contended.into(),
                problem(409, "resolution-conflict", "Cannot resolve", "the key kept changing under the request"),
            ),
            (
                StoreError::Unavailable("connection refused".into()).into(),
                problem(503, "store-unavailable", "Store unavailable", "the store is unavailable: connection refused"),
            ),
            (
                StoreError::internal("boom").into(),
                problem(500, "internal-error", "Internal error", "the store failed: boom"),
            ),
        ];
        for (error, expected) in cases {
            let (status, challenge, body) = rendered(error).await;
            assert_eq!(body, expected);
            assert_eq!(status.as_u16(), expected["status"]);
            assert_eq!(challenge, None);
        }
        let (status, challenge, body) = rendered(AdminError::Unauthorized).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert_eq!(challenge.as_deref(), Some("Bearer"));
        assert_eq!(
            body,
            problem(
                401,
                "unauthorized",
                "Unauthorized",
                "a valid `Authorization: Bearer <admin token>` header is required"
            )
        );
    }
}
