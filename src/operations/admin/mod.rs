//! The admin listener: job inspection and out-of-band resolution (behind a
//! bearer token, or the console's session), the operator console under
//! `/console/`, plus `/healthz`, `/readyz` and `/metrics` (open, for probes
//! and scrapers).
//!
//! | method | path | |
//! |---|---|---|
//! | GET | `/admin/v1/jobs/{id}` | a job and its attempts |
//! | GET | `/admin/v1/jobs?owner=…&key=…` | the same, by owner (raw header value, `sha256:<hex>` or `anonymous`) and key |
//! | GET | `/admin/v1/jobs?state=unknown&limit=…&before=…` | unknown jobs, newest first, paged (`next` is the following page's `before`) |
//! | GET | `/admin/v1/upstreams` | upstreams and whether they pass their contracts' probes |
//! | POST | `/admin/v1/attempts/{id}/resolve` | `{"outcome": "failed" \| "cancelled"}` or `{"outcome": "succeeded", "response": {…}}` |

use std::convert::Infallible;
use std::sync::Arc;
use std::time::SystemTime;

use base64::Engine;
use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};

use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use subtle::ConstantTimeEq;
use uuid::Uuid;

use crate::config::UpstreamSettings;
use crate::domain::attempt::{Attempt, Resolution};
use crate::domain::id::{AttemptId, JobId};
use crate::domain::job::{Job, JobDetail};
use crate::domain::key::{IdempotencyKey, Owner};
use crate::domain::response::StoredResponse;
use crate::operations::console;
use crate::proxy::error::problem_response_with;
use crate::proxy::http::{collect_limited, full, Body};
use crate::store::{Cursor, Store};
use crate::telemetry::Chain;
use crate::upkeep::probe::ProbeBoard;
use crate::upkeep::supervise::{Status, Supervisor};
use crate::BoxError;

mod error;

use error::AdminError;

/// What the admin listener needs.
pub struct Admin {
    /// The store.
    pub store: Arc<dyn Store>,
    /// The bearer token; `None` turns the job endpoints off.
    pub token: Option<String>,
    /// Rendered on `/metrics`.
    pub metrics: PrometheusHandle,
    /// The upstreams and their contracts' probe verdicts.
    pub upstreams: Vec<Arc<UpstreamSettings>>,
    /// Probe verdicts.
    pub probes: Arc<ProbeBoard>,
    /// The background tasks, whose health `/readyz` reports.
    pub tasks: Supervisor,
}

/// Largest resolution body accepted.
const MAX_BODY: usize = 16 * 1024 * 1024;

impl Admin {
    /// Answers one admin request.
    pub async fn handle<B>(self: Arc<Self>, req: Request<B>) -> Result<Response<Body>, Infallible>
    where
        B: http_body::Body<Data = Bytes> + Send,
        B::Error: Into<BoxError>,
    {
        Ok(self
            .route(req)
            .await
            .unwrap_or_else(AdminError::into_response))
    }

    async fn route<B>(&self, req: Request<B>) -> Result<Response<Body>, AdminError>
    where
        B: http_body::Body<Data = Bytes> + Send,
        B::Error: Into<BoxError>,
    {
        let path = req.uri().path().to_owned();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        match (req.method(), segments.as_slice()) {
            (&Method::GET, ["healthz"]) => {
                Ok(json_response(StatusCode::OK, &json!({"status": "ok"})))
            }
            (&Method::GET, ["readyz"]) => self.readiness().await,
            (&Method::GET, ["metrics"]) => {
                let mut response = Response::new(full(self.metrics.render()));
                response.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4"),
                );
                Ok(response)
            }
            (_, ["console", ..]) => self.console(req, &segments[1..]).await,
            (_, ["admin", "v1", ..]) => {
                self.authorize(&req)?;
                self.api(req, &segments[2..]).await
            }
            _ => Err(AdminError::NoSuchEndpoint),
        }
    }

    fn authorize<B>(&self, req: &Request<B>) -> Result<(), AdminError> {
        let Some(token) = &self.token else {
            return Err(AdminError::Disabled);
        };
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        let console =
            console::from_console(req.headers()) && console::signed_in(req.headers(), token);
        if bool::from(given.as_bytes().ct_eq(token.as_bytes())) || console {
            Ok(())
        } else {
            Err(AdminError::Unauthorized)
        }
    }

    /// The console's pages, sign-in and sign-out (see [`console`]).
    async fn console<B>(&self, req: Request<B>, rest: &[&str]) -> Result<Response<Body>, AdminError>
    where
        B: http_body::Body<Data = Bytes> + Send,
        B::Error: Into<BoxError>,
    {
        let Some(token) = &self.token else {
            return Ok(console::disabled());
        };
        let signed_in = console::signed_in(req.headers(), token);
        Ok(match (req.method(), rest) {
            (&Method::GET, []) => console::asset("", signed_in),
            (&Method::GET, [file]) => console::asset(file, signed_in),
            (&Method::POST, ["login"]) => {
                let form = collect_limited(req.into_body(), 4096)
                    .await
                    .map_err(|e| AdminError::bad_request(e.to_string()))?;
                console::sign_in(&form, token)
            }
            (&Method::POST, ["logout"]) => console::sign_out(),
            _ => console::not_found(),
        })
    }

    /// Ready when the store answers and no background task is dead or
    /// stuck; the body lists every task either way.
    async fn readiness(&self) -> Result<Response<Body>, AdminError> {
        let tasks = self.tasks.report();
        let failing: Vec<String> = tasks
            .iter()
            .filter(|t| t.blocks_readiness())
            .map(|t| match (t.status, &t.last_failure) {
                (Status::Dead, Some(why)) => format!("{} is dead ({why})", t.name),
                _ => format!("{} is stuck", t.name),
            })
            .collect();
        let store = self.store.ping().await;
        let listed: Vec<Value> = tasks
            .iter()
            .map(|t| {
                json!({
                    "name": t.name,
                    "status": match t.status {
                        Status::Running if t.stuck => "stuck",
                        Status::Running => "running",
                        Status::Reconnecting => "reconnecting",
                        Status::Dead => "dead",
                    },
                    "restarts": t.restarts,
                    "last_failure": t.last_failure,
                })
            })
            .collect();
        let detail = match (&store, failing.is_empty()) {
            (Ok(()), true) => {
                return Ok(json_response(
                    StatusCode::OK,
                    &json!({"status": "ready", "tasks": listed}),
                ))
            }
            (Err(e), _) => format!("the store is unreachable: {}", Chain(e)),
            (Ok(()), false) => format!("background tasks failing: {}", failing.join("; ")),
        };
        let members = Map::from_iter([("tasks".to_owned(), Value::Array(listed))]);
        Ok(problem_response_with(
            StatusCode::SERVICE_UNAVAILABLE,
            "not-ready",
            "Not ready",
            &detail,
            None,
            members,
        ))
    }

    async fn api<B>(&self, req: Request<B>, rest: &[&str]) -> Result<Response<Body>, AdminError>
    where
        B: http_body::Body<Data = Bytes> + Send,
        B::Error: Into<BoxError>,
    {
        match (req.method().clone(), rest) {
            (Method::GET, ["jobs", id]) => {
                let id = parse_uuid(id)?;
                let detail = self.store.job_detail(JobId(id)).await?;
                found(detail, "no job with this id")
            }
            (Method::GET, ["jobs"]) => {
                let query = req.uri().query().unwrap_or("");
                let mut owner = None;
                let mut key = None;
                let mut listing = Listing::default();
                for (k, v) in form_urlencoded::parse(query.as_bytes()) {
                    match k.as_ref() {
                        "owner" => owner = Some(v.into_owned()),
                        "key" => key = Some(v.into_owned()),
                        "state" => listing.state = Some(v.into_owned()),
                        "limit" => listing.limit = Some(v.into_owned()),
                        "before" => listing.before = Some(v.into_owned()),
                        _ => {}
                    }
                }
                if listing.state.is_some() {
                    return self.list(listing).await;
                }
                let owner = Owner::from_admin_query(owner.as_deref().unwrap_or(Owner::ANONYMOUS));
                let key = key.ok_or_else(|| {
                    AdminError::bad_request("the `key` query parameter is required")
                })?;
                let key = IdempotencyKey::parse(key.as_bytes())
                    .map_err(|e| AdminError::bad_request(e.to_string()))?;
                let detail = self.store.find_job(&owner, &key).await?;
                found(detail, "no job for this owner and key")
            }
            (Method::GET, ["upstreams"]) => {
                Ok(json_response(StatusCode::OK, &self.upstreams_json()))
            }
            (Method::POST, ["attempts", id, "resolve"]) => {
                let id = AttemptId(parse_uuid(id)?);
                let body = collect_limited(req.into_body(), MAX_BODY)
                    .await
                    .map_err(|e| AdminError::bad_request(e.to_string()))?;
                let resolution = parse_resolution(&body)?;
                let detail = self.store.resolve_attempt(id, resolution).await?;
                tracing::info!(attempt = %id, job = %detail.job.id, state = %detail.job.state, "attempt resolved by an operator");
                Ok(json_response(StatusCode::OK, &job_json(&detail)))
            }
            _ => Err(AdminError::NoSuchEndpoint),
        }
    }
}

/// `GET /admin/v1/jobs?state=unknown&limit=…&before=…`, as given.
#[derive(Default)]
struct Listing {
    state: Option<String>,
    limit: Option<String>,
    before: Option<String>,
}

impl Admin {
    /// The operator's inbox: unknown jobs, newest first, a page at a time;
    /// `next` (when there may be more) is the `before` of the next page.
    async fn list(&self, listing: Listing) -> Result<Response<Body>, AdminError> {
        if listing.state.as_deref() != Some("unknown") {
            return Err(AdminError::bad_request(
                "only state=unknown is listed (the jobs waiting for an operator); find others by id or by owner and key",
            ));
        }
        let limit = match listing.limit.as_deref() {
            None => 50,
            Some(n) => n
                .parse::<u32>()
                .ok()
                .filter(|n| (1..=500).contains(n))
                .ok_or_else(|| AdminError::bad_request("limit must be a number from 1 to 500"))?,
        };
        let after = listing.before.as_deref().map(parse_cursor).transpose()?;
        let jobs = self.store.unknown_jobs(after, limit).await?;
        let next = (jobs.len() == limit as usize)
            .then(|| jobs.last().map(|j| cursor_text(Cursor::after(j))))
            .flatten();
        Ok(json_response(
            StatusCode::OK,
            &json!({
                "jobs": jobs.iter().map(job_summary).collect::<Vec<_>>(),
                "next": next,
            }),
        ))
    }

    /// Every upstream, with its verdict under each contract it is probed for.
    fn upstreams_json(&self) -> Value {
        let verdicts = self.probes.snapshot();
        let list: Vec<Value> = self
            .upstreams
            .iter()
            .map(|u| {
                let contracts: Vec<Value> = verdicts
                    .iter()
                    .filter(|((name, _), _)| name == u.name())
                    .map(|((_, contract), v)| {
                        json!({
                            "contract": contract,
                            "passed": v.passed,
                            "checked_at": time(v.checked_at),
                            "failures": v.failures.iter().map(|(probe, why)| json!({"probe": probe, "why": why})).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                json!({"name": u.name(), "url": u.base.to_string(), "contracts": contracts})
            })
            .collect();
        json!({ "upstreams": list })
    }
}

/// A resolution as posted: `{"outcome": "failed"}`, `{"outcome":
/// "cancelled"}` or `{"outcome": "succeeded", "response": {…}}`.
#[derive(Deserialize)]
#[serde(tag = "outcome", rename_all = "lowercase", deny_unknown_fields)]
enum ResolveRequest {
    Failed,
    Cancelled,
    Succeeded { response: ResponseInput },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResponseInput {
    status: u16,
    #[serde(default)]
    headers: Vec<(String, String)>,
    body: Option<String>,
    body_base64: Option<String>,
}

fn parse_resolution(body: &[u8]) -> Result<Resolution, AdminError> {
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
        if !(100..=599).contains(&self.status) {
            return Err(AdminError::bad_request(
                "response.status must be an HTTP status",
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
            let name = http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                AdminError::bad_request(format!("response header {name:?} is not a header name"))
            })?;
            HeaderValue::from_str(&value).map_err(|_| {
                AdminError::bad_request(format!("response header {name} has an invalid value"))
            })?;
            headers.push((name.as_str().to_owned(), Bytes::from(value)));
        }
        Ok(StoredResponse {
            status: self.status,
            headers,
            body,
        })
    }
}

/// A job's view, or 404 saying what was looked for.
fn found(detail: Option<JobDetail>, missing: &'static str) -> Result<Response<Body>, AdminError> {
    detail
        .map(|d| json_response(StatusCode::OK, &job_json(&d)))
        .ok_or_else(|| AdminError::JobNotFound(missing))
}

fn job_json(detail: &JobDetail) -> Value {
    let job = &detail.job;
    json!({
        "id": job.id.to_string(),
        "owner": job.owner.as_str(),
        "key": job.key.as_str(),
        "fingerprint": job.fingerprint.to_string(),
        "route": job.route,
        "state": job.state.as_str(),
        "version": job.version,
        "attempt_count": job.attempt_count,
        "completed_by": job.completed_by.map(|a| a.to_string()),
        "created_at": time(job.created_at),
        "expires_at": time(job.expires_at),
        "response": job.response.as_ref().map(response_json),
        "attempts": detail.attempts.iter().map(attempt_json).collect::<Vec<_>>(),
    })
}

/// A job without its attempts or response, for listings.
fn job_summary(job: &Job) -> Value {
    json!({
        "id": job.id.to_string(),
        "owner": job.owner.as_str(),
        "key": job.key.as_str(),
        "route": job.route,
        "state": job.state.as_str(),
        "attempt_count": job.attempt_count,
        "created_at": time(job.created_at),
        "expires_at": time(job.expires_at),
    })
}

/// A listing's cursor as text: the job's creation in microseconds since
/// the epoch, a dot, the job id.
fn cursor_text(cursor: Cursor) -> String {
    let micros = cursor
        .created_at
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros());
    format!("{micros}.{}", cursor.job)
}

fn parse_cursor(text: &str) -> Result<Cursor, AdminError> {
    let invalid = || AdminError::bad_request("before must be the `next` of a previous page");
    let (micros, id) = text.split_once('.').ok_or_else(invalid)?;
    let micros: u64 = micros.parse().map_err(|_| invalid())?;
    Ok(Cursor {
        created_at: SystemTime::UNIX_EPOCH + std::time::Duration::from_micros(micros),
        job: JobId(id.parse().map_err(|_| invalid())?),
    })
}

fn attempt_json(a: &Attempt) -> Value {
    json!({
        "id": a.id.to_string(),
        "number": a.number,
        "upstream": a.upstream,
        "state": a.state.as_str(),
        "job_version": a.job_version,
        "started_at": time(a.started_at),
        "finished_at": a.finished_at.map(time),
        "lease_expires_at": time(a.lease_expires_at),
        "upstream_status": a.upstream_status,
        "detail": a.detail,
    })
}

fn response_json(r: &StoredResponse) -> Value {
    let headers: Vec<Value> = r
        .headers
        .iter()
        .map(|(n, v)| json!([n, String::from_utf8_lossy(v)]))
        .collect();
    let mut out = json!({"status": r.status, "headers": headers});
    match std::str::from_utf8(&r.body) {
        Ok(text) => out["body"] = json!(text),
        Err(_) => {
            out["body_base64"] = json!(base64::engine::general_purpose::STANDARD.encode(&r.body))
        }
    }
    out
}

fn time(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

fn parse_uuid(s: &str) -> Result<Uuid, AdminError> {
    s.parse()
        .map_err(|_| AdminError::bad_request(format!("{s:?} is not an id")))
}

fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    let mut response = Response::new(full(value.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::Mutex;
    use std::time::Duration;

    use async_trait::async_trait;
    use http_body_util::BodyExt;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::domain::attempt::{AttemptFailure, NewAttempt};
    use crate::domain::job::{Job, NewJob};
    use crate::store::{Begin, CommitOutcome, Records, StoreError};
    use crate::upkeep::supervise::Beats;

    /// A store that answers pings and panics when swept.
    struct SweepPanics;

    #[async_trait]
    impl Records for SweepPanics {
        async fn job(&self, _: JobId) -> Result<Option<Job>, StoreError> {
            unimplemented!()
        }
        async fn job_detail(&self, _: JobId) -> Result<Option<JobDetail>, StoreError> {
            unimplemented!()
        }
        async fn find_job(
            &self,
            _: &Owner,
            _: &IdempotencyKey,
        ) -> Result<Option<JobDetail>, StoreError> {
            unimplemented!()
        }
        async fn unknown_jobs(
            &self,
            _: Option<crate::store::Cursor>,
            _: u32,
        ) -> Result<Vec<crate::domain::job::Job>, StoreError> {
            unimplemented!()
        }
        async fn renew_leases(&self, _: &[AttemptId], _: Duration) -> Result<u64, StoreError> {
            unimplemented!()
        }
        async fn purge_expired(&self, _: u32) -> Result<u64, StoreError> {
            Ok(0)
        }
        async fn ping(&self) -> Result<(), StoreError> {
            Ok(())
        }
        async fn watch(&self, _: JobId) -> Result<(), StoreError> {
            Ok(())
        }
    }

    #[async_trait]
    impl Store for SweepPanics {
        async fn begin_job(&self, _: NewJob, _: NewAttempt) -> Result<Begin, StoreError> {
            unimplemented!()
        }
        async fn claim_attempt(
            &self,
            _: JobId,
            _: i64,
            _: NewAttempt,
        ) -> Result<Option<Attempt>, StoreError> {
            unimplemented!()
        }
        async fn hedge_attempt(
            &self,
            _: JobId,
            _: i64,
            _: NewAttempt,
        ) -> Result<Option<Attempt>, StoreError> {
            unimplemented!()
        }
        async fn commit(
            &self,
            _: &Attempt,
            _: &StoredResponse,
        ) -> Result<CommitOutcome, StoreError> {
            unimplemented!()
        }
        async fn fail_attempt(&self, _: AttemptId, _: AttemptFailure) -> Result<(), StoreError> {
            unimplemented!()
        }
        async fn resolve_attempt(
            &self,
            _: AttemptId,
            _: Resolution,
        ) -> Result<JobDetail, StoreError> {
            unimplemented!()
        }
        async fn expire_leases(&self, _: u32) -> Result<u64, StoreError> {
            panic!("injected: the sweep hit a defect")
        }
    }

    /// Everything logged by the lib's tests (one global subscriber: a
    /// per-thread one misses events whose callsites other test threads
    /// registered first).
    #[derive(Clone, Default)]
    struct Logs(Arc<Mutex<Vec<u8>>>);

    fn logs() -> Logs {
        static LOGS: std::sync::OnceLock<Logs> = std::sync::OnceLock::new();
        LOGS.get_or_init(|| {
            let logs = Logs::default();
            let writer = logs.clone();
            let subscriber = tracing_subscriber::fmt()
                .with_writer(move || writer.clone())
                .with_ansi(false)
                .finish();
            let _ = tracing::subscriber::set_global_default(subscriber);
            logs
        })
        .clone()
    }

    impl Write for Logs {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    async fn readyz(admin: &Arc<Admin>) -> (StatusCode, Value) {
        let request = Request::get("/readyz")
            .body(http_body_util::Empty::<Bytes>::new())
            .unwrap();
        let response = admin.clone().handle(request).await.unwrap();
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&body).unwrap())
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicking_background_task_shows_in_readyz_and_the_logs() {
        let logs = logs();

        let store: Arc<dyn Store> = Arc::new(SweepPanics);
        let tasks = Supervisor::new(CancellationToken::new());
        let sweeping = store.clone();
        tasks.spawn(
            "sweeper",
            Beats::Every(Duration::from_secs(60)),
            move |beat| crate::upkeep::sweeper::run(sweeping.clone(), Duration::from_secs(5), beat),
        );
        let admin = Arc::new(Admin {
            store,
            token: None,
            metrics: crate::telemetry::metrics(),
            upstreams: Vec::new(),
            probes: Arc::default(),
            tasks,
        });
        tokio::time::sleep(Duration::from_millis(10)).await;

        let (status, body) = readyz(&admin).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        let detail = body["detail"].as_str().unwrap();
        assert!(detail.contains("sweeper is dead"), "{detail}");
        assert!(
            detail.contains("injected: the sweep hit a defect"),
            "{detail}"
        );
        assert_eq!(body["tasks"][0]["status"], "dead");

        let logged = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
        assert!(
            logged
                .lines()
                .any(|line| line.contains("background task panicked")
                    && line.contains("task=\"sweeper\"")
                    && line.contains("injected: the sweep hit a defect")),
            "{logged}"
        );
        // It is started again after its backoff (and panics again).
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            readyz(&admin).await.1["tasks"][0]["restarts"]
                .as_u64()
                .unwrap()
                >= 2
        );
    }

    #[tokio::test]
    async fn readyz_lists_healthy_tasks_and_answers_200() {
        let tasks = Supervisor::new(CancellationToken::new());
        tasks.spawn("idle", Beats::Never, |_| std::future::pending());
        let admin = Arc::new(Admin {
            store: Arc::new(SweepPanics),
            token: None,
            metrics: crate::telemetry::metrics(),
            upstreams: Vec::new(),
            probes: Arc::default(),
            tasks,
        });
        let (status, body) = readyz(&admin).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body["tasks"][0]["name"], "idle");
        assert_eq!(body["tasks"][0]["status"], "running");
    }
}
