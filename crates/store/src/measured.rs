//! Every backend call, timed and counted: the one place the store's metrics
//! are written.
//!
//! [`Machine`](super::Machine) holds its backend as a [`Measured`], so no
//! call reaches the database unmeasured, and a method added to [`Backend`]
//! does not compile until it is measured here too. Each call is labelled
//! with the backend method's name (`operation="begin"`, `"change"`, …).

use std::future::Future;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::{
    Applied, Backend, Begin, CallAt, Committed, Cursor, Decide, Lock, Records, StoreError,
    StoreErrorKind,
};
use idemgate_domain::attempt::{Attempt, NewAttempt};
use idemgate_domain::id::AttemptId;
use idemgate_domain::id::JobId;
use idemgate_domain::job::{Job, JobDetail, NewJob};
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_domain::reconcile::Lookup;
use idemgate_domain::response::StoredResponse;
use idemgate_domain::transition::{Change, Refusal};

/// A [`Backend`] whose every call is measured.
pub(super) struct Measured<B>(pub(super) B);

#[async_trait]
impl<B: Backend> Records for Measured<B> {
    async fn job(&self, id: JobId) -> Result<Option<Job>, StoreError> {
        measure("job", self.0.job(id)).await
    }

    async fn response(&self, job: JobId) -> Result<Option<StoredResponse>, StoreError> {
        measure("response", self.0.response(job)).await
    }

    async fn job_detail(&self, id: JobId) -> Result<Option<JobDetail>, StoreError> {
        measure("job_detail", self.0.job_detail(id)).await
    }

    async fn find_job(
        &self,
        owner: &Owner,
        key: &IdempotencyKey,
    ) -> Result<Option<JobDetail>, StoreError> {
        measure("find_job", self.0.find_job(owner, key)).await
    }

    async fn unknown_jobs(
        &self,
        after: Option<Cursor>,
        limit: u32,
    ) -> Result<Vec<Job>, StoreError> {
        measure("unknown_jobs", self.0.unknown_jobs(after, limit)).await
    }

    async fn unknown_attempts(
        &self,
        since: std::time::SystemTime,
        limit: u32,
    ) -> Result<Vec<(JobId, AttemptId)>, StoreError> {
        measure("unknown_attempts", self.0.unknown_attempts(since, limit)).await
    }

    async fn renew_leases(
        &self,
        attempts: &[AttemptId],
        lease: Duration,
    ) -> Result<u64, StoreError> {
        measure("renew_leases", self.0.renew_leases(attempts, lease)).await
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        measure("purge_expired", self.0.purge_expired(batch)).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        measure("ping", self.0.ping()).await
    }

    async fn watch(&self, job: JobId) -> Result<(), StoreError> {
        measure("watch", self.0.watch(job)).await
    }

    async fn record_lookup(&self, attempt: AttemptId, lookup: &Lookup) -> Result<(), StoreError> {
        measure("record_lookup", self.0.record_lookup(attempt, lookup)).await
    }

    async fn mark_call(
        &self,
        attempt: AttemptId,
        instance: uuid::Uuid,
        call: &CallAt,
        for_at_most: Duration,
    ) -> Result<(), StoreError> {
        let marking = self.0.mark_call(attempt, instance, call, for_at_most);
        measure("mark_call", marking).await
    }

    async fn unmark_call(&self, attempt: AttemptId) -> Result<(), StoreError> {
        measure("unmark_call", self.0.unmark_call(attempt)).await
    }

    async fn call_at_server(
        &self,
        session: &[u8; 32],
        call: Option<&[u8; 32]>,
        except: uuid::Uuid,
    ) -> Result<bool, StoreError> {
        let asking = self.0.call_at_server(session, call, except);
        measure("call_at_server", asking).await
    }
}

#[async_trait]
impl<B: Backend> Backend for Measured<B> {
    async fn begin(&self, job: NewJob, attempt: NewAttempt) -> Result<Begin, StoreError> {
        measure("begin", self.0.begin(job, attempt)).await
    }

    async fn commit(
        &self,
        attempt: &Attempt,
        response: &StoredResponse,
    ) -> Result<Committed, StoreError> {
        measure("commit", self.0.commit(attempt, response)).await
    }

    async fn change(
        &self,
        lock: Lock,
        decide: Decide,
    ) -> Result<Result<Applied, Refusal>, StoreError> {
        measure("change", self.0.change(lock, decide)).await
    }

    async fn expire_lapsed(&self, batch: u32) -> Result<Vec<Change>, StoreError> {
        measure("expire_lapsed", self.0.expire_lapsed(batch)).await
    }
}

/// Times a backend call (`idemgate_store_seconds{operation}`) and counts
/// its failures (`idemgate_store_errors_total{operation, kind}`: the store
/// unreachable or failing; refusals and misses are answers, not failures).
async fn measure<T>(
    operation: &'static str,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let start = Instant::now();
    let result = call.await;
    metrics::histogram!("idemgate_store_seconds", "operation" => operation)
        .record(start.elapsed().as_secs_f64());
    if let Err(e) = &result {
        let kind = match e.kind() {
            StoreErrorKind::Unavailable => Some("unavailable"),
            StoreErrorKind::Internal => Some("internal"),
            _ => None,
        };
        if let Some(kind) = kind {
            metrics::counter!("idemgate_store_errors_total", "operation" => operation, "kind" => kind)
                .increment(1);
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use bytes::Bytes;
    use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};

    use super::*;
    use crate::memory::Memory;
    use crate::{Doorbell, Machine, Store};
    use idemgate_domain::attempt::{AttemptFailure, Resolution};
    use idemgate_domain::fingerprint::Fingerprint;
    use idemgate_domain::key::OwnerSalt;

    fn new_job() -> NewJob {
        NewJob {
            id: JobId::new(),
            owner: Owner::of(
                &OwnerSalt::new(b"test salt, not a secret"),
                &[b"Bearer measured"],
            ),
            key: IdempotencyKey::new("measured").unwrap(),
            fingerprint: Fingerprint([7; 32]),
            route: "default".into(),
            ttl: Duration::from_secs(3600),
        }
    }

    fn new_attempt() -> NewAttempt {
        NewAttempt {
            id: AttemptId::new(),
            upstream: "primary".into(),
            instance: uuid::Uuid::new_v4(),
            lease: Duration::from_secs(30),
            deadline: Duration::from_secs(300),
        }
    }

    /// Runs `f` with `recorder` as this thread's, on a runtime of this thread.
    fn recorded<F: Future>(recorder: &PrometheusRecorder, f: F) -> F::Output {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        metrics::with_local_recorder(recorder, || runtime.block_on(f))
    }

    /// `metric`'s samples as rendered, by their labels.
    fn samples(recorder: &PrometheusRecorder, metric: &str) -> BTreeMap<String, u64> {
        let prefix = format!("{metric}{{");
        recorder
            .handle()
            .render()
            .lines()
            .filter_map(|line| line.strip_prefix(&prefix))
            .filter_map(|rest| rest.split_once("} "))
            .map(|(labels, value)| (labels.to_owned(), value.parse().unwrap()))
            .collect()
    }

    fn operations(counts: &[(&str, u64)]) -> BTreeMap<String, u64> {
        counts
            .iter()
            .map(|(op, n)| (format!("operation=\"{op}\""), *n))
            .collect()
    }

    #[test]
    fn every_store_operation_is_measured_under_its_backend_call() {
        let recorder = PrometheusBuilder::new().build_recorder();
        recorded(&recorder, async {
            let store = Machine::new(Memory::default(), Arc::new(Doorbell::default()));
            let Begin::Created(job, first) =
                store.begin_job(new_job(), new_attempt()).await.unwrap()
            else {
                panic!("the key was new");
            };
            let hedge = store
                .hedge_attempt(job.id, job.version, new_attempt())
                .await
                .unwrap()
                .unwrap();
            let answer = StoredResponse {
                status: 200,
                headers: vec![],
                body: Bytes::from_static(b"ok"),
            };
            store.commit(&first, &answer).await.unwrap();
            let failure = AttemptFailure::Unknown {
                detail: "timed out".into(),
            };
            store.fail_attempt(hedge.id, failure).await.unwrap();
            // Refused and missing: answers, measured but not failures.
            let claimed = store.claim_attempt(job.id, 1, new_attempt()).await;
            assert!(claimed.unwrap().is_none());
            let resolved = store
                .resolve_attempt(AttemptId::new(), Resolution::Failed)
                .await;
            assert!(matches!(resolved, Err(StoreError::NotFound(_))));
            store.job(job.id).await.unwrap();
            store.job_detail(job.id).await.unwrap();
            store.find_job(&job.owner, &job.key).await.unwrap();
            store.unknown_jobs(None, 10).await.unwrap();
            store
                .unknown_attempts(std::time::SystemTime::UNIX_EPOCH, 10)
                .await
                .unwrap();
            // Nothing to renew asks nothing of the backend.
            store
                .renew_leases(&[], Duration::from_secs(1))
                .await
                .unwrap();
            store
                .renew_leases(&[hedge.id], Duration::from_secs(1))
                .await
                .unwrap();
            store.expire_leases(10).await.unwrap();
            store.purge_expired(10).await.unwrap();
            store.ping().await.unwrap();
            store.watch(job.id).await.unwrap();
        });
        assert_eq!(
            samples(&recorder, "idemgate_store_seconds_count"),
            operations(&[
                ("begin", 1),
                ("change", 4),
                ("commit", 1),
                ("expire_lapsed", 1),
                ("find_job", 1),
                ("job", 1),
                ("job_detail", 1),
                ("ping", 1),
                ("purge_expired", 1),
                ("renew_leases", 1),
                ("unknown_attempts", 1),
                ("unknown_jobs", 1),
                ("watch", 1),
            ])
        );
        assert_eq!(
            samples(&recorder, "idemgate_store_errors_total"),
            BTreeMap::new()
        );
    }

    #[test]
    fn failures_are_counted_by_kind_and_answers_are_not() {
        let recorder = PrometheusBuilder::new().build_recorder();
        recorded(&recorder, async {
            let down = || StoreError::Unavailable("down".into());
            let _ = measure::<()>("ping", async { Err(down()) }).await;
            let _ = measure::<()>("job", async { Err(StoreError::Corrupt("job state")) }).await;
            let _ = measure::<()>("change", async { Err(StoreError::NotFound("job")) }).await;
            let _ = measure::<()>("begin", async { Err(StoreError::Contended) }).await;
        });
        let expected: BTreeMap<String, u64> = [
            ("operation=\"job\",kind=\"internal\"".to_owned(), 1),
            ("operation=\"ping\",kind=\"unavailable\"".to_owned(), 1),
        ]
        .into();
        assert_eq!(samples(&recorder, "idemgate_store_errors_total"), expected);
    }
}
