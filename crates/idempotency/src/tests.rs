//! The idempotency layer driven end to end in one process: the in-memory
//! store (wrapped to inject faults), a scripted upstream service, and paused
//! time. No sockets.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;
use tokio::sync::Notify;

use std::sync::Arc;
use std::task::{Context, Poll};

use http::Response;
use tower::{Layer, Service};
use uuid::Uuid;

use super::*;
use crate::route::Route;
use crate::testing;
use idemgate_domain::attempt::{Attempt, AttemptFailure, AttemptState, NewAttempt, Resolution};
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::job::{Job, JobDetail, JobState, NewJob};
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_domain::response::StoredResponse;
use idemgate_proxy::http::Body;
use idemgate_proxy::upstream::Target;
use idemgate_proxy::upstream::UpstreamError;
use idemgate_store::memory::Memory;
use idemgate_store::{Begin, CommitOutcome, Machine, StoreError};
use idemgate_store::{Doorbell, Records, Store};

/// Which store calls fail, and signals when they happen.
#[derive(Default)]
struct Faults {
    fail_hedges: bool,
    fail_claims: bool,
    /// Whether the store says another replica has every MCP call marked,
    /// how long it takes to say, and how many times it was asked.
    calls_marked: bool,
    ask_takes: Duration,
    marks_asked: std::sync::atomic::AtomicUsize,
    /// How long a mark's insert takes, and the marks' writes in the order
    /// they landed.
    mark_takes: Duration,
    marks_written: Mutex<Vec<&'static str>>,
    /// How long each mark written was to be good for.
    marked_for: Mutex<Vec<Duration>>,
    hedged: Notify,
    begun: Notify,
    /// Whether a hedge's claim, once written, waits to be told to answer
    /// (its reply still on its way back), and the telling.
    hold_hedge_replies: bool,
    hedge_replies: Notify,
    /// Whether the next claim waits, before it is written, to be told to
    /// go on; the signal that it waits, and the telling.
    hold_a_claim: std::sync::atomic::AtomicBool,
    claim_held: Notify,
    claim_goes: Notify,
}

/// The in-memory store with faults injected.
struct Faulty {
    inner: Machine<Memory>,
    faults: Arc<Faults>,
}

fn down() -> StoreError {
    StoreError::Unavailable("injected: the store is down".into())
}

#[async_trait]
impl Records for Faulty {
    async fn job(&self, id: JobId) -> Result<Option<Job>, StoreError> {
        self.inner.job(id).await
    }
    async fn response(
        &self,
        job: JobId,
    ) -> Result<Option<idemgate_domain::response::StoredResponse>, StoreError> {
        self.inner.response(job).await
    }
    async fn job_detail(&self, id: JobId) -> Result<Option<JobDetail>, StoreError> {
        self.inner.job_detail(id).await
    }
    async fn find_job(
        &self,
        owner: &Owner,
        key: &IdempotencyKey,
    ) -> Result<Option<JobDetail>, StoreError> {
        self.inner.find_job(owner, key).await
    }
    async fn unknown_jobs(
        &self,
        after: Option<idemgate_store::Cursor>,
        limit: u32,
    ) -> Result<Vec<idemgate_domain::job::Job>, StoreError> {
        self.inner.unknown_jobs(after, limit).await
    }
    async fn unknown_attempts(
        &self,
        since: std::time::SystemTime,
        limit: u32,
    ) -> Result<Vec<(JobId, AttemptId)>, StoreError> {
        self.inner.unknown_attempts(since, limit).await
    }
    async fn renew_leases(
        &self,
        attempts: &[AttemptId],
        lease: Duration,
    ) -> Result<u64, StoreError> {
        self.inner.renew_leases(attempts, lease).await
    }
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.inner.purge_expired(batch).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }
    async fn watch(&self, job: JobId) -> Result<(), StoreError> {
        self.inner.watch(job).await
    }

    async fn mark_call(
        &self,
        attempt: AttemptId,
        instance: uuid::Uuid,
        call: &idemgate_store::CallAt,
        for_at_most: Duration,
    ) -> Result<(), StoreError> {
        tokio::time::sleep(self.faults.mark_takes).await;
        self.faults.marks_written.lock().unwrap().push("mark");
        self.faults.marked_for.lock().unwrap().push(for_at_most);
        self.inner
            .mark_call(attempt, instance, call, for_at_most)
            .await
    }

    async fn unmark_call(&self, attempt: AttemptId) -> Result<(), StoreError> {
        self.faults.marks_written.lock().unwrap().push("unmark");
        self.inner.unmark_call(attempt).await
    }

    async fn call_at_server(
        &self,
        session: &[u8; 32],
        call: Option<&[u8; 32]>,
        except: uuid::Uuid,
    ) -> Result<bool, StoreError> {
        self.faults.marks_asked.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(self.faults.ask_takes).await;
        let marked = self.inner.call_at_server(session, call, except).await?;
        Ok(marked || self.faults.calls_marked)
    }
    async fn record_lookup(
        &self,
        attempt: AttemptId,
        lookup: &idemgate_domain::reconcile::Lookup,
    ) -> Result<(), StoreError> {
        self.inner.record_lookup(attempt, lookup).await
    }
}

#[async_trait]
impl Store for Faulty {
    async fn finish_writes(&self) {
        self.inner.finish_writes().await
    }
    async fn begin_job(&self, job: NewJob, attempt: NewAttempt) -> Result<Begin, StoreError> {
        let begun = self.inner.begin_job(job, attempt).await;
        // Recorded; the answer is still on its way back over the network
        // when the test hangs up.
        self.faults.begun.notify_one();
        tokio::time::sleep(Duration::from_millis(10)).await;
        begun
    }
    async fn claim_attempt(
        &self,
        job: JobId,
        version: i64,
        attempt: NewAttempt,
    ) -> Result<Option<Attempt>, StoreError> {
        if self.faults.fail_claims {
            return Err(down());
        }
        if self.faults.hold_a_claim.swap(false, Ordering::SeqCst) {
            self.faults.claim_held.notify_one();
            self.faults.claim_goes.notified().await;
        }
        self.inner.claim_attempt(job, version, attempt).await
    }
    async fn hedge_attempt(
        &self,
        job: JobId,
        version: i64,
        attempt: NewAttempt,
    ) -> Result<Option<Attempt>, StoreError> {
        self.faults.hedged.notify_one();
        if self.faults.fail_hedges {
            return Err(down());
        }
        let claimed = self.inner.hedge_attempt(job, version, attempt).await;
        if self.faults.hold_hedge_replies {
            self.faults.hedge_replies.notified().await;
        }
        claimed
    }
    async fn move_on_attempt(
        &self,
        job: JobId,
        version: i64,
        attempt: NewAttempt,
    ) -> Result<Option<Attempt>, StoreError> {
        self.inner.move_on_attempt(job, version, attempt).await
    }
    async fn commit(
        &self,
        attempt: &Attempt,
        response: &StoredResponse,
    ) -> Result<CommitOutcome, StoreError> {
        self.inner.commit(attempt, response).await
    }
    async fn fail_attempt(
        &self,
        attempt: AttemptId,
        failure: AttemptFailure,
    ) -> Result<bool, StoreError> {
        self.inner.fail_attempt(attempt, failure).await
    }
    async fn resolve_attempt(
        &self,
        attempt: AttemptId,
        resolution: Resolution,
    ) -> Result<JobDetail, StoreError> {
        self.inner.resolve_attempt(attempt, resolution).await
    }
    async fn reconcile_attempt(
        &self,
        attempt: AttemptId,
        resolution: Resolution,
    ) -> Result<JobDetail, StoreError> {
        self.inner.reconcile_attempt(attempt, resolution).await
    }
    async fn expire_leases(&self, batch: u32) -> Result<u64, StoreError> {
        self.inner.expire_leases(batch).await
    }
}

/// An upstream service whose answers wait until the test releases the
/// upstream they went to; each answers `200 <upstream name>`, or, once
/// for each time it is told to, `503 <upstream name>`; or, told to
/// stream, an event stream whose last event waits for the release of
/// `<upstream name>-end`.
#[derive(Clone, Default)]
struct Scripted {
    gates: Arc<Mutex<HashMap<String, Arc<Notify>>>>,
    busy: Arc<Mutex<Vec<String>>>,
    streams: Arc<Mutex<Vec<String>>>,
    calls: Arc<AtomicUsize>,
}

impl Scripted {
    fn gate(&self, upstream: &str) -> Arc<Notify> {
        self.gates
            .lock()
            .unwrap()
            .entry(upstream.to_owned())
            .or_default()
            .clone()
    }

    fn release(&self, upstream: &str) {
        self.gate(upstream).notify_one();
    }

    fn answer_busy(&self, upstream: &str) {
        self.busy.lock().unwrap().push(upstream.to_owned());
    }

    fn answer_streams(&self, upstream: &str) {
        self.streams.lock().unwrap().push(upstream.to_owned());
    }

    /// `data: first`, then, once `<name>-end` is released, `data: last`.
    fn stream(&self, name: &str) -> Response<Body> {
        use http_body_util::BodyExt;
        let end = self.gate(&format!("{name}-end"));
        let frames = futures_util::stream::unfold(0, move |sent| {
            let end = end.clone();
            async move {
                let event = match sent {
                    0 => "data: first\n\n",
                    1 => {
                        end.notified().await;
                        "data: last\n\n"
                    }
                    _ => return None,
                };
                let frame = http_body::Frame::data(Bytes::from_static(event.as_bytes()));
                Some((Ok::<_, idemgate_proxy::http::BodyError>(frame), sent + 1))
            }
        });
        let mut response = Response::new(http_body_util::StreamBody::new(frames).boxed());
        let events = http::HeaderValue::from_static("text/event-stream");
        response
            .headers_mut()
            .insert(http::header::CONTENT_TYPE, events);
        response
    }

    fn service(&self) -> UpstreamService {
        let script = self.clone();
        UpstreamService::new(tower::service_fn(move |req: Request<Body>| {
            let script = script.clone();
            async move {
                script.calls.fetch_add(1, Ordering::SeqCst);
                let name = req
                    .extensions()
                    .get::<Target>()
                    .map(|t| t.0.name().to_owned())
                    .unwrap_or_default();
                script.gate(&name).notified().await;
                let busy = {
                    let mut busy = script.busy.lock().unwrap();
                    let at = busy.iter().position(|b| *b == name);
                    at.map(|at| busy.remove(at)).is_some()
                };
                if !busy && script.streams.lock().unwrap().contains(&name) {
                    return Ok(script.stream(&name));
                }
                let status = if busy { 503 } else { 200 };
                let mut response = Response::new(idemgate_proxy::http::full(name));
                *response.status_mut() = http::StatusCode::from_u16(status).unwrap();
                Ok::<_, UpstreamError>(response)
            }
        }))
    }
}

/// Two upstreams, failing over from the first to the second.
fn failover() -> Arc<Route> {
    testing::route(&["http://a:1", "http://b:1"], |_| {})
}

fn gateway(
    route: Arc<Route>,
    faults: Faults,
) -> (
    Idempotency<UpstreamService>,
    Arc<Faults>,
    Arc<dyn Store>,
    Scripted,
) {
    let (layer, faults, store) = layer(route, faults);
    let upstream = Scripted::default();
    let service = layer.layer(upstream.service());
    (service, faults, store, upstream)
}

/// The layer over the faulty in-memory store, with one `route` (whose
/// requests are one tenant's, sent without credentials: owners are tested
/// through the binary).
fn layer(route: Arc<Route>, faults: Faults) -> (IdempotencyLayer, Arc<Faults>, Arc<dyn Store>) {
    let doorbell = Arc::new(Doorbell::default());
    let faults = Arc::new(faults);
    let store: Arc<dyn Store> = Arc::new(Faulty {
        inner: Machine::new(Memory::default(), doorbell.clone()),
        faults: faults.clone(),
    });
    let shared = Arc::new(Shared::new(
        testing::config(vec![route]),
        Runtime {
            store: store.clone(),
            doorbell,
            fastpath: None,
            probes: Arc::default(),
            leases: Arc::default(),
            instance: Uuid::nil(),
            trust: Arc::new(idemgate_trust::Trust::with_salt(
                idemgate_domain::key::OwnerSalt::new(b"test salt, not a secret"),
            )),
            budget: idemgate_proxy::budget::Budget::new(256 << 20),
        },
    ));
    (IdempotencyLayer::new(shared), faults, store)
}

fn keyed(key: &str) -> Request<Body> {
    Request::post("/v1/jobs")
        .header("idempotency-key", key)
        .body(idemgate_proxy::http::full("{}"))
        .unwrap()
}

async fn read(response: Response<Body>) -> (u16, Bytes) {
    let status = response.status().as_u16();
    (
        status,
        response.into_body().collect().await.unwrap().to_bytes(),
    )
}

#[tokio::test(start_paused = true)]
async fn a_store_error_during_a_hedge_claim_answers_with_the_primarys_commit() {
    let faults = Faults {
        fail_hedges: true,
        ..Faults::default()
    };
    let (mut service, faults, _, upstream) = gateway(testing::hedged(), faults);
    let request = tokio::spawn(service.call(keyed("k")));
    // The hedge timer fires, and the store fails the hedge's claim…
    faults.hedged.notified().await;
    // …while the primary is still running; then it answers.
    upstream.release("primary");
    let (status, body) = read(request.await.unwrap().unwrap()).await;
    assert_eq!((status, body.as_ref()), (200, b"primary".as_ref()));
}

/// The race is decided while a hedge's claim is out, the claim already
/// written: the hedge is never sent (before, it ran to its end beside the
/// winner, a paid call, or beside a stream whose commit it could beat),
/// and it is settled `superseded`.
#[tokio::test(start_paused = true)]
async fn a_hedge_claimed_after_the_race_was_decided_is_never_sent() {
    let faults = Faults {
        hold_hedge_replies: true,
        ..Faults::default()
    };
    let (mut service, faults, store, upstream) = gateway(testing::hedged(), faults);
    let request = tokio::spawn(service.call(keyed("k")));
    // The hedge timer fires; its claim is written, its reply held…
    faults.hedged.notified().await;
    // …while the primary answers and wins.
    upstream.release("primary");
    let (status, body) = read(request.await.unwrap().unwrap()).await;
    assert_eq!((status, body.as_ref()), (200, b"primary".as_ref()));
    faults.hedge_replies.notify_one();
    let (owner, key) = (Owner::anonymous(), IdempotencyKey::new("k").unwrap());
    let mut hedge = None;
    for _ in 0..100 {
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        let found = store.find_job(&owner, &key).await.unwrap().unwrap();
        let settled = found.attempts.iter().find(|a| a.number == 2);
        if let Some(a) = settled.filter(|a| a.state != AttemptState::Started) {
            hedge = Some(a.clone());
            break;
        }
    }
    let hedge = hedge.expect("the hedge's attempt is settled");
    assert_eq!(hedge.state, AttemptState::Superseded, "{hedge:?}");
    assert!(hedge.detail.as_deref().unwrap_or("").contains("never sent"));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        upstream.calls.load(Ordering::SeqCst),
        1,
        "only the primary was called"
    );
}

/// A request whose first attempt failed is beaten to the job's next
/// attempt by its own retry, whose answer then streams: the request joins
/// that stream, the job's answer, rather than answering its own stale
/// failure (before, it answered `503` beside the stream).
#[tokio::test(start_paused = true)]
async fn a_request_beaten_to_its_next_attempt_joins_the_winners_stream() {
    let faults = Faults {
        hold_a_claim: true.into(),
        ..Faults::default()
    };
    let (mut service, faults, _, upstream) = gateway(failover(), faults);
    upstream.answer_busy("primary");
    upstream.answer_streams("primary");
    let first = tokio::spawn(service.call(keyed("k")));
    upstream.release("primary");
    // Its failover's claim is about to be written when the retry comes…
    faults.claim_held.notified().await;
    let retry = tokio::spawn(service.call(keyed("k")));
    upstream.release("primary");
    let retry = retry.await.unwrap().unwrap();
    assert_eq!(retry.status(), 200);
    // …and claims first; the retry's answer streams.
    faults.claim_goes.notify_one();
    upstream.release("primary-end");
    let (status, body) = read(first.await.unwrap().unwrap()).await;
    assert_eq!(
        (status, body.as_ref()),
        (200, b"data: first\n\ndata: last\n\n".as_ref()),
        "the stream, not its own 503: {body:?}"
    );
    let (_, streamed) = read(retry).await;
    assert_eq!(streamed, body);
    assert_eq!(upstream.calls.load(Ordering::SeqCst), 2, "no third call");
}

#[tokio::test(start_paused = true)]
async fn a_store_error_claiming_a_failover_answers_the_upstreams_safe_failure() {
    let faults = Faults {
        fail_claims: true,
        ..Faults::default()
    };
    let (mut service, _, _, upstream) = gateway(failover(), faults);
    upstream.answer_busy("primary");
    let request = tokio::spawn(service.call(keyed("k")));
    upstream.release("primary");
    let (status, body) = read(request.await.unwrap().unwrap()).await;
    assert_eq!(
        (status, body.as_ref()),
        (503, b"primary".as_ref()),
        "the upstream's own retryable answer, not a store error"
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_that_hangs_up_right_after_the_job_is_begun_does_not_block_its_key() {
    let (mut service, faults, store, upstream) = gateway(failover(), Faults::default());
    let request = tokio::spawn(service.call(keyed("gone")));
    faults.begun.notified().await;
    // The client goes away the moment its job is recorded.
    request.abort();
    let _ = request.await;
    upstream.release("primary");
    let owner = Owner::anonymous();
    let key = IdempotencyKey::new("gone").unwrap();
    let mut job = None;
    for _ in 0..100 {
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        let found = store.find_job(&owner, &key).await.unwrap().unwrap();
        if found.job.state == JobState::Completed {
            job = Some(found);
            break;
        }
    }
    let job = job.expect("the attempt ran and committed without its client");
    assert_eq!(upstream.calls.load(Ordering::SeqCst), 1);
    assert_eq!(job.job.response.unwrap().body, "primary");
}

/// An upstream handle that is never ready, and must then not be called.
#[derive(Clone)]
struct NeverReady;

impl Service<Request<Body>> for NeverReady {
    type Response = Response<Body>;
    type Error = UpstreamError;
    type Future = std::future::Ready<Result<Response<Body>, UpstreamError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), UpstreamError>> {
        Poll::Ready(Err(UpstreamError::Refused(
            "no connection can be made".into(),
        )))
    }

    fn call(&mut self, _req: Request<Body>) -> Self::Future {
        panic!("called although it said it was not ready");
    }
}

/// A pass-through request goes to the layer's own upstream handle, so that
/// handle's readiness error is its answer (a problem saying nothing was
/// sent), and the handle is not called.
#[tokio::test]
async fn a_pass_through_request_gets_the_upstream_handles_readiness_error() {
    let (layer, _, _) = layer(failover(), Faults::default());
    let service = layer.layer(NeverReady);
    let request = Request::post("/v1/jobs")
        .body(idemgate_proxy::http::full("{}"))
        .unwrap();
    let response = tower::ServiceExt::oneshot(service, request).await.unwrap();
    assert_eq!(response.status(), http::StatusCode::BAD_GATEWAY);
    assert_eq!(
        response.headers()[http::header::CONTENT_TYPE],
        "application/problem+json"
    );
}

/// Many `DELETE`s of one MCP session, held while another replica's call of
/// it is marked, share their asks of the store, on their way (the store
/// takes 100 ms to answer) or answered: over a 10 s hold, twenty ask about
/// as often as one would (without the sharing, each asks eight times: 160
/// in all, as many when only answers are shared).
#[tokio::test(start_paused = true)]
async fn held_session_ends_share_their_asks_of_the_store() {
    let (_, faults, store) = layer(
        testing::route(&["http://127.0.0.1:9"], |_| {}),
        Faults {
            calls_marked: true,
            ask_takes: Duration::from_millis(100),
            ..Faults::default()
        },
    );
    let calls = Arc::new(crate::mcp::Calls::default());
    let end = || {
        Request::delete("/mcp")
            .header("mcp-session-id", "s1")
            .extension(crate::opt_in::SessionEnd {
                route: "mcp".into(),
            })
            .body(idemgate_proxy::http::full(""))
            .unwrap()
    };
    let started = tokio::time::Instant::now();
    let ends = (0..20).map(|_| {
        let (calls, store, end) = (calls.clone(), store.clone(), end());
        tokio::spawn(async move {
            let limit = Duration::from_secs(10);
            calls.quiet(&store, Uuid::nil(), &end, limit).await;
        })
    });
    futures_util::future::join_all(ends).await;
    assert!(
        started.elapsed() >= Duration::from_secs(10),
        "held for the limit"
    );
    let asks = faults.marks_asked.load(Ordering::SeqCst);
    assert!((5..=20).contains(&asks), "{asks} asks");
}

/// A mark whose insert the call was not held for (the store slower than
/// its patience) is taken off only once the insert has landed: taken off
/// first, the late insert would stand until the attempt's deadline and
/// hold the session's end at every other replica that long. The late
/// insert is counted, for the operator to see what the log says. The mark
/// is good for a lease, which the attempt's renewals renew.
#[test]
fn a_late_mark_is_taken_off_after_it_lands() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || runtime.block_on(late_mark()));
    let rendered = recorder.handle().render();
    assert!(
        rendered.contains(r#"idemgate_mcp_store_timeouts_total{question="mark"} 1"#),
        "{rendered}"
    );
}

async fn late_mark() {
    let (_, faults, store) = layer(
        testing::route(&["http://127.0.0.1:9"], |_| {}),
        Faults {
            mark_takes: Duration::from_secs(5),
            ..Faults::default()
        },
    );
    let session = http::HeaderValue::from_static("s1");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let by = (idemgate_domain::id::AttemptId::new(), Uuid::nil());
    let started = tokio::time::Instant::now();
    let lease = Duration::from_secs(30);
    let good = (deadline, lease);
    let marked = crate::mcp::mark(&store, by, ("mcp", Some(&session)), b"1", good).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "not held for the insert"
    );
    assert!(faults.marks_written.lock().unwrap().is_empty());
    // The call ends at once.
    drop(marked);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(*faults.marks_written.lock().unwrap(), ["mark", "unmark"]);
    // Good for a lease (which renewals renew), not to the deadline.
    assert_eq!(*faults.marked_for.lock().unwrap(), [lease]);
}
