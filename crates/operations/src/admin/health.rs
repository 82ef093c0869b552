//! The open endpoints, for probes and scrapers: `/healthz` (the process
//! answers), `/readyz` (no background task is dead or stuck; the store's
//! and Redis' health listed, `docs/design.md`, §8) and `/metrics`
//! (Prometheus).

use http::{header, HeaderValue, Response, StatusCode};
use serde_json::{json, Map, Value};

use super::views::json_response;
use super::Admin;
use idemgate_proxy::http::{full, Body};
use idemgate_proxy::problem::problem_response_with;
use idemgate_upkeep::health::Health;
use idemgate_upkeep::supervise::{Report, Status};

/// `GET /healthz`: alive, whatever the store says.
pub(super) fn healthz() -> Response<Body> {
    json_response(StatusCode::OK, &json!({"status": "ok"}))
}

impl Admin {
    /// `GET /readyz`: ready unless a background task is dead or stuck (a
    /// fault of this process). The store's and Redis' health are listed
    /// but never fail it: every replica shares them, and a replica whose
    /// store is down still passes requests without a key through (§8).
    pub(super) async fn readiness(&self) -> Response<Body> {
        let tasks = self.tasks.report();
        let failing: Vec<String> = tasks
            .iter()
            .filter(|t| t.blocks_readiness())
            .map(|t| match (t.status, &t.last_failure) {
                (Status::Dead, Some(why)) => format!("{} is dead ({why})", t.name),
                _ => format!("{} is stuck", t.name),
            })
            .collect();
        let dependencies = self.dependencies.report();
        let degraded = dependencies.iter().any(|d| d.up == Some(false));
        let listed: Vec<Value> = tasks.iter().map(task).collect();
        let deps = Map::from_iter(
            dependencies
                .iter()
                .map(|d| (d.name.to_owned(), dependency(d))),
        );
        if failing.is_empty() {
            let status = if degraded { "degraded" } else { "ready" };
            return json_response(
                StatusCode::OK,
                &json!({"status": status, "tasks": listed, "dependencies": deps}),
            );
        }
        let detail = format!("background tasks failing: {}", failing.join("; "));
        let members = Map::from_iter([
            ("tasks".to_owned(), Value::Array(listed)),
            ("dependencies".to_owned(), Value::Object(deps)),
        ]);
        problem_response_with(
            StatusCode::SERVICE_UNAVAILABLE,
            "not-ready",
            "Not ready",
            &detail,
            None,
            members,
        )
    }

    /// `GET /metrics`: every series, in Prometheus' text format.
    pub(super) fn metrics(&self) -> Response<Body> {
        let mut response = Response::new(full(self.metrics.render()));
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        );
        response
    }
}

/// A dependency as `/readyz` lists it.
fn dependency(d: &Health) -> Value {
    let since = d
        .since
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |t| t.as_secs());
    json!({
        "status": match d.up {
            None => "unchecked",
            Some(true) => "up",
            Some(false) => "down",
        },
        "since_unix": since,
        "error": d.error,
    })
}

/// A background task as `/readyz` lists it.
fn task(t: &Report) -> Value {
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
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::Mutex;
    use std::time::Duration;

    use async_trait::async_trait;
    use http_body_util::BodyExt;
    use tokio_util::sync::CancellationToken;

    use idemgate_domain::key::OwnerSalt;
    use idemgate_trust::Trust;

    use std::sync::Arc;

    use bytes::Bytes;
    use http::Request;

    use super::*;
    use crate::console::{self, Console};
    use idemgate_domain::attempt::{Attempt, AttemptFailure, NewAttempt, Resolution};
    use idemgate_domain::id::{AttemptId, JobId};
    use idemgate_domain::job::{Job, JobDetail, NewJob};
    use idemgate_domain::key::{IdempotencyKey, Owner};
    use idemgate_domain::response::StoredResponse;
    use idemgate_store::{Begin, CommitOutcome, Cursor, Records, Store, StoreError};
    use idemgate_upkeep::health::Dependencies;
    use idemgate_upkeep::supervise::{Beats, Supervisor};

    /// A store that answers pings and panics when swept.
    struct SweepPanics;

    #[async_trait]
    impl Records for SweepPanics {
        async fn job(&self, _: JobId) -> Result<Option<Job>, StoreError> {
            unimplemented!()
        }
        async fn response(
            &self,
            _: JobId,
        ) -> Result<Option<idemgate_domain::response::StoredResponse>, StoreError> {
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
        async fn unknown_jobs(&self, _: Option<Cursor>, _: u32) -> Result<Vec<Job>, StoreError> {
            unimplemented!()
        }
        async fn unknown_attempts(
            &self,
            _: std::time::SystemTime,
            _: u32,
        ) -> Result<Vec<(JobId, AttemptId)>, StoreError> {
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
        async fn record_lookup(
            &self,
            _: AttemptId,
            _: &idemgate_domain::reconcile::Lookup,
        ) -> Result<(), StoreError> {
            unimplemented!()
        }
        async fn mark_call(
            &self,
            _: AttemptId,
            _: uuid::Uuid,
            _: &idemgate_store::CallAt,
            _: Duration,
        ) -> Result<(), StoreError> {
            unimplemented!()
        }
        async fn unmark_call(&self, _: AttemptId) -> Result<(), StoreError> {
            unimplemented!()
        }
        async fn call_at_server(
            &self,
            _: &[u8; 32],
            _: Option<&[u8; 32]>,
            _: uuid::Uuid,
        ) -> Result<bool, StoreError> {
            unimplemented!()
        }
    }

    #[async_trait]
    impl Store for SweepPanics {
        async fn finish_writes(&self) {}
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
        async fn move_on_attempt(
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
        async fn fail_attempt(&self, _: AttemptId, _: AttemptFailure) -> Result<bool, StoreError> {
            unimplemented!()
        }
        async fn resolve_attempt(
            &self,
            _: AttemptId,
            _: Resolution,
        ) -> Result<JobDetail, StoreError> {
            unimplemented!()
        }
        async fn reconcile_attempt(
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
            move |beat| {
                idemgate_upkeep::sweeper::run(sweeping.clone(), Duration::from_secs(5), beat)
            },
        );
        let admin = Arc::new(Admin {
            store,
            token: None,
            console: Console::new(console::Config::default()),
            metrics: idemgate_telemetry::metrics(),
            upstreams: Vec::new(),
            probes: Arc::default(),
            tasks,
            dependencies: Arc::new(Dependencies::new(Vec::new())),
            trust: Arc::new(Trust::with_salt(OwnerSalt::new(b"test salt, not a secret"))),
            reconciling: Default::default(),
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
            console: Console::new(console::Config::default()),
            metrics: idemgate_telemetry::metrics(),
            upstreams: Vec::new(),
            probes: Arc::default(),
            tasks,
            dependencies: Arc::new(Dependencies::new(Vec::new())),
            trust: Arc::new(Trust::with_salt(OwnerSalt::new(b"test salt, not a secret"))),
            reconciling: Default::default(),
        });
        let (status, body) = readyz(&admin).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body["tasks"][0]["name"], "idle");
        assert_eq!(body["tasks"][0]["status"], "running");
    }
}
