//! Begins in batches (`docs/design.md` §13, "Batched begins and commits").
//!
//! The database stays the only arbiter: the statement is the one-by-one
//! begin's (`INSERT … ON CONFLICT (owner, key) DO NOTHING`) over arrays.
//! A batch holds each `(owner, key)` once (a second request for a key
//! follows the first and is told the job the first made or found); it is sorted
//! by `(owner, key)`, so two batches never wait on each other's index
//! locks in opposite orders; rows come back mapped to requests by owner
//! and key, never by position. A request the batch did not settle (its
//! key's job had expired, or another writer inserted it meanwhile) is
//! asked again alone, and a batch that fails is split: each of its
//! requests is asked alone, so one bad row never fails its neighbours.
//!
//! **Read first.** While most recent begins found their job (replays of
//! finished keys), a batch first reads the jobs of its keys with a
//! statement that writes nothing ([`read_found_statement`]): the begin
//! statement sets up its inserts even when it inserts nothing, a quarter of
//! what a replay cost the database (docs/performance.md, item 27). The
//! requests the read answered are done; the rest go on as before. Either
//! way the begin statement alone creates jobs, so the choice is only a
//! cost: a wrong guess costs a new key the read's round trip.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::LazyLock;

use deadpool_postgres::Pool;
use tokio_postgres::types::ToSql;
use uuid::Uuid;

use super::super::error::is_lock_timeout;
use super::super::rows::{answer, attempt_from_row};
use super::super::sql::{
    begin_one_statement, begin_statement, read_found_statement, ATTEMPT_COLUMNS, FORGOTTEN,
};
use super::super::{map_pg, Postgres};
use super::{Batched, Waiting};
use crate::{millis, Begin, StoreError, Unwritten};
use idemgate_domain::attempt::{AttemptState, NewAttempt};
use idemgate_domain::job::{Job, JobState, NewJob};

/// The column of [`JOB_COLUMNS`](super::super::sql::JOB_COLUMNS) holding a
/// found job's answer body.
const ANSWER_BODY: usize = 12;

/// A request's begin: its job and that job's first attempt.
pub(in crate::postgres) struct BeginRequest {
    pub(in crate::postgres) job: NewJob,
    pub(in crate::postgres) attempt: NewAttempt,
}

impl BeginRequest {
    /// Its `(owner, key)`, borrowed.
    fn sort_key(&self) -> (&str, &str) {
        (self.job.owner.as_str(), self.job.key.as_str())
    }
}

impl Batched for BeginRequest {
    type Key = (String, String);
    type Answer = Begin;

    fn key(&self) -> (String, String) {
        (
            self.job.owner.as_str().to_owned(),
            self.job.key.as_str().to_owned(),
        )
    }

    /// A duplicate of a key in the batch is told the job its first
    /// request made or found: what it would have read in the next batch,
    /// without waiting for it.
    const FOLLOWS: bool = true;

    fn follow(first: &Result<Begin, StoreError>) -> Result<Begin, StoreError> {
        match first {
            Ok(Begin::Created(job, _) | Begin::Existing(job)) => Ok(Begin::Existing(job.clone())),
            // It sent nothing: its caller need not settle its attempt.
            Err(_) => Err(StoreError::Unavailable(Box::new(Unwritten(
                "the begin of the same key this one waited on failed",
            )))),
        }
    }

    async fn send(pool: Pool, batch: Vec<Waiting<Self>>) {
        send(&pool, batch).await
    }
}

/// The share of recent begins that found their job, in thousandths: an
/// average moved a tenth of the way by each batch. Process-wide, as a
/// gateway has one store; it only chooses what a batch costs.
static FOUND_SHARE: AtomicU32 = AtomicU32::new(0);

/// Batches read first while more than this share of begins found their job.
const READ_FIRST_ABOVE: u32 = 500;

/// Begins the read answered, since the process started.
static ANSWERED_BY_READ: AtomicU64 = AtomicU64::new(0);

fn read_first() -> bool {
    FOUND_SHARE.load(Ordering::Relaxed) > READ_FIRST_ABOVE
}

/// Begins a read made before the begin statement answered, in this
/// process (what a test checks the read happened by).
pub(in crate::postgres) fn answered_by_read() -> u64 {
    ANSWERED_BY_READ.load(Ordering::Relaxed)
}

/// Moves [`FOUND_SHARE`] toward `found` of `asked`.
fn observe(found: usize, asked: usize) {
    let _ = FOUND_SHARE.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |share| {
        Some(next_share(share, found, asked))
    });
}

/// The share after a batch in which `found` of `asked` begins found their
/// job: a tenth of the way toward that batch's share.
fn next_share(share: u32, found: usize, asked: usize) -> u32 {
    if asked == 0 {
        return share;
    }
    let now = u32::try_from(found.min(asked) * 1000 / asked).unwrap_or(1000);
    (share * 9 + now) / 10
}

/// Sends `batch` as one statement and answers each request; those it did
/// not settle, or all of them if it failed, are asked again alone. While
/// most begins find their job, the batch is read first (module docs).
async fn send(pool: &Pool, mut batch: Vec<Waiting<BeginRequest>>) {
    // Compared in place: `key` would copy both strings at every comparison.
    batch.sort_by(|a, b| a.request.sort_key().cmp(&b.request.sort_key()));
    let asked = batch.len();
    let mut found = 0;
    if read_first() {
        let before = batch.len();
        batch = answer_found(pool, batch).await;
        found = before - batch.len();
        ANSWERED_BY_READ.fetch_add(found as u64, Ordering::Relaxed);
    }
    if batch.len() <= 1 {
        // Alone, the one-row statement is the cheaper (`begin_one_statement`).
        found += answer_alone(pool, batch).await;
        return observe(found, asked);
    }
    let unsettled = match begin_many(pool, &batch).await {
        Ok(mut settled) => {
            let mut unsettled = Vec::new();
            for waiting in batch {
                match settled.remove(&waiting.request.key()) {
                    Some(begin) if finds_itself(&begin, &waiting.request.job) => {
                        unsettled.push(waiting)
                    }
                    Some(begin) => {
                        found += usize::from(matches!(begin, Begin::Existing(_)));
                        waiting.answer(Ok(begin));
                    }
                    None => unsettled.push(waiting),
                }
            }
            unsettled
        }
        Err(_) => batch,
    };
    found += answer_alone(pool, unsettled).await;
    observe(found, asked);
}

/// Asks each of `requests` alone, at once, and answers it; returns how
/// many found their job.
async fn answer_alone(pool: &Pool, requests: Vec<Waiting<BeginRequest>>) -> usize {
    let alone = requests.into_iter().map(|waiting| async move {
        let BeginRequest { job, attempt } = &waiting.request;
        let answer = begin_alone(pool, job, attempt).await;
        let found = matches!(answer, Ok(Begin::Existing(_)));
        waiting.answer(answer);
        found
    });
    let found = futures_util::future::join_all(alone).await;
    found.into_iter().filter(|&f| f).count()
}

/// Reads the jobs of `batch`'s keys and answers the requests whose job
/// exists and has not expired; returns the others (all of them if the
/// read failed: the begin statement answers them as it would have).
async fn answer_found(
    pool: &Pool,
    batch: Vec<Waiting<BeginRequest>>,
) -> Vec<Waiting<BeginRequest>> {
    let Ok(mut found) = read_found(pool, &batch).await else {
        return batch;
    };
    let mut rest = Vec::new();
    for waiting in batch {
        match found.remove(&waiting.request.key()) {
            // Its own job: the begin statement tells it apart ([`own_begin`]).
            Some(begin) if finds_itself(&begin, &waiting.request.job) => rest.push(waiting),
            Some(job) => waiting.answer(Ok(job)),
            None => rest.push(waiting),
        }
    }
    rest
}

/// The read of [`answer_found`]: each found, unexpired job by its owner
/// and key.
async fn read_found(
    pool: &Pool,
    batch: &[Waiting<BeginRequest>],
) -> Result<HashMap<(String, String), Begin>, StoreError> {
    let client = Postgres::pooled(pool).await?;
    let statement = client
        .prepare_cached(read_found_statement())
        .await
        .map_err(map_pg)?;
    let (owners, keys): (Vec<&str>, Vec<&str>) = batch.iter().map(|w| w.request.sort_key()).unzip();
    let rows = client
        .query(&statement, &[&owners, &keys])
        .await
        .map_err(map_pg)?;
    settled(client, rows)
}

/// One statement for all of `batch`: each request's begin, by its owner
/// and key, where the statement settled it (a job made, or one that
/// exists and has not expired).
async fn begin_many(
    pool: &Pool,
    batch: &[Waiting<BeginRequest>],
) -> Result<HashMap<(String, String), Begin>, StoreError> {
    let client = Postgres::pooled(pool).await?;
    let statement = client
        .prepare_cached(begin_statement())
        .await
        .map_err(map_pg)?;
    let columns = Columns::of(batch.iter().map(|w| (&w.request.job, &w.request.attempt)));
    let rows = client
        .query(&statement, &columns.params())
        .await
        .map_err(map_pg)?;
    settled(client, rows)
}

/// The begins `rows` settled, by owner and key; `client` released.
fn settled(
    client: deadpool_postgres::Client,
    rows: Vec<tokio_postgres::Row>,
) -> Result<HashMap<(String, String), Begin>, StoreError> {
    // Found jobs carry their answers (up to INLINE_ANSWER each). The read
    // buffer grows to one row, not to the batch (each row is split off it
    // as it is decoded), so the largest answer is what the connection
    // keeps, as after a replay's read. Summed, a batch of 32 found answers
    // of 16 KiB closed its connection every time, and replays of such
    // answers paid a new session a batch.
    let carried = rows
        .iter()
        .map(|row| {
            row.get::<_, Option<&[u8]>>(ANSWER_BODY)
                .map_or(0, <[u8]>::len)
        })
        .max()
        .unwrap_or(0);
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
/// whose winner the next round reads. A job it finds under the request's
/// own job id is the one its batch made, committed though the batch's
/// answer was lost ([`own_begin`]).
///
/// A begin that fails once it has a connection is asked once more, on
/// another: the statement may have committed with its reply lost, and
/// asked again it finds its own job. Answered `503` instead, the client
/// would find on its retry a started attempt nobody runs, and be held on it
/// until its lease lapsed into `unknown` (`docs/design.md` §13, "A lost
/// reply"). A lock waited for past the lock timeout is not asked again:
/// that statement certainly rolled back, and a second wait would hold the
/// begins' batch slot as long again ("A lock waited for").
async fn begin_alone(pool: &Pool, job: &NewJob, attempt: &NewAttempt) -> Result<Begin, StoreError> {
    let client = Postgres::pooled(pool).await?;
    match begin_on(&client, job, attempt).await {
        Err(e) if e.is_transient() && !is_lock_timeout(&e) => {
            drop(client);
            let client = Postgres::pooled(pool).await?;
            begin_on(&client, job, attempt).await
        }
        done => done,
    }
}

/// [`begin_alone`]'s rounds on one connection.
async fn begin_on(
    client: &deadpool_postgres::Client,
    job: &NewJob,
    attempt: &NewAttempt,
) -> Result<Begin, StoreError> {
    let statement = client
        .prepare_cached(begin_one_statement())
        .await
        .map_err(map_pg)?;
    let params: [&(dyn ToSql + Sync); 13] = [
        &job.id.0,
        &job.owner.as_str(),
        &job.key.as_str(),
        &job.fingerprint.0.as_slice(),
        &job.route,
        &millis(job.ttl),
        &attempt.id.0,
        &attempt.upstream,
        &attempt.instance,
        &millis(attempt.lease),
        &millis(attempt.deadline),
        &JobState::Running.as_str(),
        &AttemptState::Started.as_str(),
    ];
    for _ in 0..3 {
        let row = client
            .query_opt(&statement, &params)
            .await
            .map_err(map_pg)?;
        let Some(row) = row else { continue };
        match answer(&row)? {
            Some(Begin::Existing(found)) if found.id == job.id => {
                return own_begin(client, found, attempt).await;
            }
            Some(begin) => return Ok(begin),
            None => {}
        }
        // Expired but not purged yet: forgotten, the key starts afresh
        // (unless an attempt started meanwhile; then the next read finds it).
        // Prepared once a connection, as every statement of this path is:
        // a text statement is parsed and described in a round trip of its
        // own first (docs/performance.md, item 36).
        static FORGET: LazyLock<String> =
            LazyLock::new(|| format!("DELETE FROM jobs j WHERE j.id = $1 AND {FORGOTTEN}"));
        let forget = client
            .prepare_cached(FORGET.as_str())
            .await
            .map_err(map_pg)?;
        client
            .execute(&forget, &[&row.get::<_, Uuid>(0)])
            .await
            .map_err(map_pg)?;
    }
    Err(StoreError::Contended)
}

/// Whether `begin` found the very job `job` would have made (its id):
/// one made by an earlier send of this request whose answer was lost,
/// which [`own_begin`] tells apart from a duplicate's.
fn finds_itself(begin: &Begin, job: &NewJob) -> bool {
    matches!(begin, Begin::Existing(found) if found.id == job.id)
}

/// The begin of a request whose batch committed its job (`found`, under
/// the request's own id) but failed before it answered: the connection
/// lost after the commit, or a row of the batch unreadable. Told that the
/// job merely exists, the request would wait on its own attempt, which
/// nothing runs, until its lease lapsed into `unknown`; so while that
/// attempt is still the job's only one and still started, the request is
/// told what the batch would have said: created, with its attempt.
/// Anything else (the attempt already taken over) stays `Existing`.
async fn own_begin(
    client: &deadpool_postgres::Client,
    found: Job,
    attempt: &NewAttempt,
) -> Result<Begin, StoreError> {
    let statement =
        format!("SELECT {ATTEMPT_COLUMNS} FROM attempts a WHERE a.id = $1 AND a.job_id = $2");
    let row = client
        .query_opt(&statement, &[&attempt.id.0, &found.id.0])
        .await
        .map_err(map_pg)?;
    let ours = match row {
        Some(row) => attempt_from_row(&row, 0)?,
        None => return Ok(Begin::Existing(found)),
    };
    let untouched = found.state == JobState::Running
        && found.attempt_count == 1
        && ours.state == AttemptState::Started
        && ours.job_version == found.version;
    Ok(if untouched {
        Begin::Created(found, ours)
    } else {
        Begin::Existing(found)
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Replays turn the read on within a few batches, new keys turn it off
    /// as fast, and an even mix leaves it off (a new key's extra round trip
    /// is paid only where most begins are replays).
    #[test]
    fn the_read_comes_first_only_while_most_begins_find_their_job() {
        let after = |mut share: u32, batches: usize, found: usize, asked: usize| {
            for _ in 0..batches {
                share = next_share(share, found, asked);
            }
            share
        };
        let replays = after(0, 7, 10, 10);
        assert!(replays > READ_FIRST_ABOVE, "{replays}");
        assert!(after(0, 6, 10, 10) <= READ_FIRST_ABOVE);
        let new_keys = after(replays, 7, 0, 10);
        assert!(new_keys <= READ_FIRST_ABOVE, "{new_keys}");
        assert!(after(1000, 100, 5, 10) <= READ_FIRST_ABOVE);
        assert!(after(0, 100, 6, 10) > READ_FIRST_ABOVE);
        assert_eq!(next_share(700, 3, 0), 700, "an empty batch moves nothing");
    }
}
