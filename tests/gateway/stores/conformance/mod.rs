//! One behavioural suite for every store, run against each implementation.
//
// The same functions run against each store (instantiated at the bottom),
// and drive the races the gateway relies on directly, with barriers rather
// than timing.

mod answers;
mod batches;
mod lifecycle;
mod marks;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use tokio::sync::Barrier;

use idemgate_domain::attempt::{AttemptFailure, AttemptState, NewAttempt, Resolution};
use idemgate_domain::fingerprint::Fingerprint;
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::job::{JobState, NewJob};
use idemgate_domain::key::{IdempotencyKey, Owner, OwnerSalt};
use idemgate_domain::reconcile::{Lookup, LookupResult};
use idemgate_domain::response::StoredResponse;
use idemgate_domain::transition::Refusal;
use idemgate_store::{Begin, CommitOutcome, Doorbell, Store, StoreError};

use answers::*;
use batches::*;
use lifecycle::*;

fn new_job(key: &str) -> NewJob {
    NewJob {
        id: JobId::new(),
        owner: Owner::of(
            &OwnerSalt::new(b"test salt, not a secret"),
            &[b"Bearer conformance"],
        ),
        key: IdempotencyKey::new(key).unwrap(),
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

fn response(tag: &str) -> StoredResponse {
    StoredResponse {
        status: 200,
        headers: vec![
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
            ("x-tag".into(), Bytes::from(tag.to_owned())),
        ],
        body: Bytes::from(format!("{{\"winner\":\"{tag}\"}}")),
    }
}

async fn created(
    store: &dyn Store,
    key: &str,
) -> (idemgate_domain::job::Job, idemgate_domain::attempt::Attempt) {
    match store.begin_job(new_job(key), new_attempt()).await.unwrap() {
        Begin::Created(job, attempt) => (job, attempt),
        Begin::Existing(_) => panic!("key {key} already existed"),
    }
}

/// Instantiates every conformance test for one store. `$make` is an async
/// expression giving `(Arc<dyn Store>, Arc<Doorbell>, guard)`; the guard
/// lives as long as the test.
macro_rules! conformance_suite {
    ($module:ident, $make:path) => {
        mod $module {
            use super::*;
            conformance_suite!(@tests $make;
                begin_creates_once_then_finds,
                concurrent_begins_create_exactly_one_job,
                concurrent_commits_have_exactly_one_winner,
                concurrent_claims_of_an_open_job_make_one_attempt,
                unknown_blocks_but_a_late_answer_still_commits,
                unknown_jobs_are_listed_newest_first_a_page_at_a_time,
                resolution_moves_the_version_so_the_late_answer_is_superseded,
                resolution_as_succeeded_commits_through_the_cas,
                a_failed_resolution_beside_a_running_hedge_lets_the_hedge_commit,
                a_commit_retried_after_it_landed_is_told_it_committed,
                a_large_commit_retried_after_it_landed_is_told_it_committed,
                a_hedge_failing_next_to_an_unknown_attempt_keeps_the_job_blocked,
                lapsed_leases_turn_attempts_unknown,
                expired_jobs_are_purged_and_their_keys_start_afresh,
                a_job_is_not_forgotten_while_an_attempt_may_still_answer,
                job_detail_is_one_consistent_read,
                a_hedge_resolved_failed_leaves_the_job_to_the_first_attempt,
                one_sweep_expires_a_batch_of_jobs,
                evidence_of_a_safe_failure_settles_an_attempt_its_lapsed_lease_made_unknown,
                lookups_are_recorded_and_reconcile_applies_only_to_an_unknown_attempt,
                concurrent_moves_on_from_an_unknown_job_make_one_attempt,
                unknown_attempts_are_listed_by_start_after_a_time,
                many_keys_begun_twice_at_once_make_one_job_each,
                many_jobs_committed_at_once_keep_each_its_own_answer,
            );
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn every_change_of_a_jobs_state_rings_once() {
                let (store, doorbell, _guard) = $make().await;
                super::every_change_of_a_jobs_state_rings_once(store, doorbell).await;
            }
        }
    };
    (@tests $make:path; $($test:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                let (store, _doorbell, _guard) = $make().await;
                super::$test(store).await;
            }
        )*
    };
}

fn machine<B: idemgate_store::Backend>(backend: B) -> (Arc<dyn Store>, Arc<Doorbell>) {
    let doorbell = Arc::new(Doorbell::default());
    (
        Arc::new(idemgate_store::Machine::new(backend, doorbell.clone())),
        doorbell,
    )
}

async fn postgres_store() -> (Arc<dyn Store>, Arc<Doorbell>, crate::support::TestDb) {
    let db = crate::support::TestDb::new().await;
    let backend = idemgate_store::postgres::Postgres::new(
        &idemgate_store::postgres::PgSettings {
            pool_size: 20,
            connect_timeout: Duration::from_secs(5),
            ..idemgate::config::store::pg_settings(&db.url).unwrap()
        },
        uuid::Uuid::new_v4(),
    )
    .unwrap();
    backend.migrate().await.unwrap();
    let (store, doorbell) = machine(backend);
    (store, doorbell, db)
}

conformance_suite!(postgres, postgres_store);

/// On PostgreSQL, a commit of a job someone in another process waits on is
/// announced (NOTIFY and the announcer), and one nobody waits on is not.
#[tokio::test]
async fn on_postgres_only_watched_commits_are_announced() {
    let (store, doorbell, db) = postgres_store().await;
    let (announced, mut announcements) = tokio::sync::mpsc::unbounded_channel();
    doorbell.announce_to(announced);
    let (_, quiet) = created(store.as_ref(), "quiet").await;
    store.commit(&quiet, &response("q")).await.unwrap();
    assert!(announcements.try_recv().is_err());
    let (job, watched) = created(store.as_ref(), "watched").await;
    store.watch(job.id).await.unwrap();
    store.commit(&watched, &response("w")).await.unwrap();
    assert_eq!(announcements.try_recv().ok(), Some(job.id));
    let rows = db
        .connect()
        .await
        .query("SELECT key FROM jobs WHERE watched ORDER BY key", &[])
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "only the watched job was marked");
}

/// Rows damaged behind the gateway's back are typed errors, never a panic
/// or a silently different response.
#[tokio::test]
async fn corrupt_rows_are_typed_errors_on_both_stores() {
    use crate::support::TestStore;
    for store in [TestStore::postgres().await, TestStore::embedded()] {
        let (subject, damage): (Arc<dyn Store>, &[&str]) = match &store {
            TestStore::Postgres(db) => {
                let backend = idemgate_store::postgres::Postgres::new(
                    &idemgate_store::postgres::PgSettings {
                        pool_size: 2,
                        connect_timeout: Duration::from_secs(5),
                        ..idemgate::config::store::pg_settings(&db.url).unwrap()
                    },
                    uuid::Uuid::new_v4(),
                )
                .unwrap();
                backend.migrate().await.unwrap();
                (
                    machine(backend).0,
                    &[
                        "UPDATE jobs SET fingerprint = '\\x010203' WHERE id = '{id}'",
                        "UPDATE jobs SET response_header_names = ARRAY['a'] WHERE id = '{id}'",
                    ],
                )
            }
            TestStore::Embedded(dir) => {
                let backend = idemgate_store::sqlite::Sqlite::open(&dir.path().join("idemgate.db"))
                    .await
                    .unwrap();
                (
                    machine(backend).0,
                    &[
                        "UPDATE jobs SET fingerprint = x'010203' WHERE id = '{id}'",
                        "UPDATE jobs SET response_headers = x'000000ff61' WHERE id = '{id}'",
                        "UPDATE jobs SET completed_by = 'not-a-uuid' WHERE id = '{id}'",
                    ],
                )
            }
            TestStore::External(_) => unreachable!(),
        };
        for (n, sql) in damage.iter().enumerate() {
            let (job, attempt) = created(subject.as_ref(), &format!("damaged-{n}")).await;
            subject.commit(&attempt, &response("ok")).await.unwrap();
            assert!(subject.job(job.id).await.unwrap().is_some());
            store
                .execute(&sql.replace("{id}", &job.id.to_string()))
                .await;
            let read = subject.job(job.id).await;
            assert!(
                matches!(read, Err(StoreError::Corrupt(_))),
                "{sql}: {read:?}"
            );
        }
    }
}

async fn embedded_store() -> (Arc<dyn Store>, Arc<Doorbell>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let backend = idemgate_store::sqlite::Sqlite::open(&dir.path().join("idemgate.db"))
        .await
        .unwrap();
    let (store, doorbell) = machine(backend);
    (store, doorbell, dir)
}

conformance_suite!(embedded, embedded_store);

async fn memory_store() -> (Arc<dyn Store>, Arc<Doorbell>, ()) {
    let (store, doorbell) = machine(idemgate_store::memory::Memory::default());
    (store, doorbell, ())
}

conformance_suite!(memory, memory_store);
