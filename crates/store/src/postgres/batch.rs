//! Batched arbitration (`docs/design.md` §13, "Batched begins"): the begins
//! of concurrent requests on this replica go to PostgreSQL together, one
//! statement, one round trip and one commit for all of them, instead of
//! each paying its own.
//!
//! No timer decides when a batch leaves. An idle batcher sends a request
//! at once, alone; requests collect only while [`IN_FLIGHT`] batches are
//! already on their way, and the next batch takes all that collected (up
//! to [`MAX_BATCH`]). So a lone request waits for nothing, and under load
//! each commit carries as many begins as arrived during the last one.
//!
//! The database stays the only arbiter: the statement is the one-by-one
//! begin's (`INSERT … ON CONFLICT (owner, key) DO NOTHING`) over arrays.
//! A batch holds each `(owner, key)` once (a second request for a key
//! waits for the next batch, where it finds the first's job); it is sorted
//! by `(owner, key)`, so two batches never wait on each other's index
//! locks in opposite orders; rows come back mapped to requests by owner
//! and key, never by position. A request the batch did not settle (its
//! key's job had expired, or another writer inserted it meanwhile) is
//! asked again alone, and a batch that fails is split: each of its
//! requests is asked alone, so one bad row never fails its neighbours.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use deadpool_postgres::Pool;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio_postgres::types::ToSql;
use uuid::Uuid;

use super::rows::answer;
use super::sql::begin_statement;
use super::{map_pg, Postgres};
use crate::{millis, Begin, StoreError};
use idemgate_domain::attempt::{AttemptState, NewAttempt};
use idemgate_domain::job::{JobState, NewJob};

/// Batches on their way at once. Two: one in the database while the next
/// collects, so the database is never idle waiting for the gateway, and
/// the pool keeps its other connections for commits and reads.
pub const IN_FLIGHT: usize = 2;

/// The column of [`JOB_COLUMNS`](super::sql::JOB_COLUMNS) holding a
/// found job's answer body.
const ANSWER_BODY: usize = 12;

/// The most begins one statement carries.
pub(super) const MAX_BATCH: usize = 64;

/// A request's `(owner, key)`, borrowed.
fn sort_key(p: &Pending) -> (&str, &str) {
    (p.job.owner.as_str(), p.job.key.as_str())
}

/// A begin waiting for its batch.
struct Pending {
    job: NewJob,
    attempt: NewAttempt,
    reply: oneshot::Sender<Result<Begin, StoreError>>,
}

impl Pending {
    fn key(&self) -> (String, String) {
        (
            self.job.owner.as_str().to_owned(),
            self.job.key.as_str().to_owned(),
        )
    }
}

/// The handle requests send their begins through; its task forms and sends
/// the batches.
pub(super) struct Batcher {
    queue: mpsc::UnboundedSender<Pending>,
    /// Begins sent and not yet in a batch on its way.
    waiting: Arc<AtomicUsize>,
}

impl Batcher {
    /// Starts the batching task on the current runtime.
    pub(super) fn start(pool: Pool) -> Self {
        let (queue, arrivals) = mpsc::unbounded_channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        tokio::spawn(collect(pool, arrivals, waiting.clone()));
        Batcher { queue, waiting }
    }

    /// Begins sent and not yet in a batch on its way.
    pub(super) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Begins `job` with `attempt` in the next batch.
    pub(super) async fn begin(
        &self,
        job: NewJob,
        attempt: NewAttempt,
    ) -> Result<Begin, StoreError> {
        let (reply, answer) = oneshot::channel();
        let stopped = || StoreError::Unavailable("the begin batcher stopped".into());
        self.waiting.fetch_add(1, Ordering::Relaxed);
        self.queue
            .send(Pending {
                job,
                attempt,
                reply,
            })
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

/// The batching loop: waits for a request, then for a batch slot (while
/// it waits, requests collect), then sends what collected.
async fn collect(
    pool: Pool,
    mut arrivals: mpsc::UnboundedReceiver<Pending>,
    waiting: Arc<AtomicUsize>,
) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut carried: VecDeque<Pending> = VecDeque::new();
    loop {
        let first = match carried.pop_front() {
            Some(first) => first,
            None => match arrivals.recv().await {
                Some(first) => first,
                None => return,
            },
        };
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let batch = gather(first, &mut carried, &mut arrivals);
        waiting.fetch_sub(batch.len(), Ordering::Relaxed);
        let pool = pool.clone();
        tokio::spawn(async move {
            send(&pool, batch).await;
            drop(slot);
        });
    }
}

/// `first` and what waits after it, each `(owner, key)` once, at most
/// [`MAX_BATCH`]; a second request for a key in the batch is carried to
/// the next one.
fn gather(
    first: Pending,
    carried: &mut VecDeque<Pending>,
    arrivals: &mut mpsc::UnboundedReceiver<Pending>,
) -> Vec<Pending> {
    let mut keys = HashSet::from([first.key()]);
    let mut batch = vec![first];
    let mut later = Vec::new();
    let mut waiting = std::mem::take(carried);
    while batch.len() < MAX_BATCH {
        let Some(next) = waiting.pop_front().or_else(|| arrivals.try_recv().ok()) else {
            break;
        };
        if keys.insert(next.key()) {
            batch.push(next);
        } else {
            later.push(next);
        }
    }
    carried.extend(later);
    carried.extend(waiting);
    batch
}

/// Sends `batch` as one statement and answers each request; those it did
/// not settle, or all of them if it failed, are asked again alone.
async fn send(pool: &Pool, mut batch: Vec<Pending>) {
    // Compared in place: `key` would copy both strings at every comparison.
    batch.sort_by(|a, b| sort_key(a).cmp(&sort_key(b)));
    let unsettled = match begin_many(pool, &batch).await {
        Ok(mut settled) => {
            let mut unsettled = Vec::new();
            for pending in batch {
                match settled.remove(&pending.key()) {
                    Some(begin) => {
                        let _ = pending.reply.send(Ok(begin));
                    }
                    None => unsettled.push(pending),
                }
            }
            unsettled
        }
        Err(_) => batch,
    };
    let alone = unsettled.into_iter().map(|pending| async move {
        let answer = begin_alone(pool, &pending.job, &pending.attempt).await;
        let _ = pending.reply.send(answer);
    });
    futures_util::future::join_all(alone).await;
}

/// One statement for all of `batch`: each request's begin, by its owner
/// and key, where the statement settled it (a job made, or one that
/// exists and has not expired).
async fn begin_many(
    pool: &Pool,
    batch: &[Pending],
) -> Result<HashMap<(String, String), Begin>, StoreError> {
    let client = pool
        .get()
        .await
        .map_err(|e| StoreError::Unavailable(Box::new(e)))?;
    let statement = client
        .prepare_cached(&begin_statement())
        .await
        .map_err(map_pg)?;
    let columns = Columns::of(batch.iter().map(|p| (&p.job, &p.attempt)));
    let rows = client
        .query(&statement, &columns.params())
        .await
        .map_err(map_pg)?;
    // Found jobs carry their answers (up to INLINE_ANSWER each), so a batch
    // of them can leave a connection with buffers that size: released as a
    // replay's would be.
    let carried = rows
        .iter()
        .map(|row| {
            row.get::<_, Option<&[u8]>>(ANSWER_BODY)
                .map_or(0, <[u8]>::len)
        })
        .sum();
    Postgres::release(client, carried);
    let mut settled = HashMap::with_capacity(rows.len());
    for row in rows {
        let key: (String, String) = (row.get(1), row.get(2));
        if let Some(begin) = answer(&row)? {
            settled.insert(key, begin);
        }
    }
    Ok(settled)
}

/// One request's begin, alone: bounded, since each round either answers,
/// deletes the expired job that blocked the key, or lost an insert race
/// whose winner the next round reads.
pub(super) async fn begin_alone(
    pool: &Pool,
    job: &NewJob,
    attempt: &NewAttempt,
) -> Result<Begin, StoreError> {
    let client = pool
        .get()
        .await
        .map_err(|e| StoreError::Unavailable(Box::new(e)))?;
    let statement = client
        .prepare_cached(&begin_statement())
        .await
        .map_err(map_pg)?;
    let columns = Columns::of([(job, attempt)]);
    for _ in 0..3 {
        let row = client
            .query_opt(&statement, &columns.params())
            .await
            .map_err(map_pg)?;
        let Some(row) = row else { continue };
        if let Some(begin) = answer(&row)? {
            return Ok(begin);
        }
        // Expired but not purged yet: forgotten, the key starts afresh.
        client
            .execute(
                "DELETE FROM jobs WHERE id = $1 AND expires_at <= now()",
                &[&row.get::<_, Uuid>(0)],
            )
            .await
            .map_err(map_pg)?;
    }
    Err(StoreError::Contended)
}

/// The statement's array parameters, one element per request.
#[derive(Default)]
struct Columns<'a> {
    job_ids: Vec<Uuid>,
    owners: Vec<&'a str>,
    keys: Vec<&'a str>,
    fingerprints: Vec<&'a [u8]>,
    routes: Vec<&'a str>,
    ttls: Vec<i64>,
    attempt_ids: Vec<Uuid>,
    upstreams: Vec<&'a str>,
    instances: Vec<Uuid>,
    leases: Vec<i64>,
    deadlines: Vec<i64>,
    job_state: &'static str,
    attempt_state: &'static str,
}

impl<'a> Columns<'a> {
    fn of(requests: impl IntoIterator<Item = (&'a NewJob, &'a NewAttempt)>) -> Self {
        let mut c = Columns {
            job_state: JobState::Running.as_str(),
            attempt_state: AttemptState::Started.as_str(),
            ..Columns::default()
        };
        for (job, attempt) in requests {
            c.job_ids.push(job.id.0);
            c.owners.push(job.owner.as_str());
            c.keys.push(job.key.as_str());
            c.fingerprints.push(job.fingerprint.0.as_slice());
            c.routes.push(&job.route);
            c.ttls.push(millis(job.ttl));
            c.attempt_ids.push(attempt.id.0);
            c.upstreams.push(&attempt.upstream);
            c.instances.push(attempt.instance);
            c.leases.push(millis(attempt.lease));
            c.deadlines.push(millis(attempt.deadline));
        }
        c
    }

    fn params(&self) -> [&(dyn ToSql + Sync); 13] {
        [
            &self.job_ids,
            &self.owners,
            &self.keys,
            &self.fingerprints,
            &self.routes,
            &self.ttls,
            &self.attempt_ids,
            &self.upstreams,
            &self.instances,
            &self.leases,
            &self.deadlines,
            &self.job_state,
            &self.attempt_state,
        ]
    }
}
