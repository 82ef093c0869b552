//! Begins and commits of many requests at once, which PostgreSQL takes in
//! batches (`crates/store/src/postgres/batch/`): every store makes one job
//! per key however the begins are grouped, and keeps one winner's answer
//! per job however the commits are; on PostgreSQL, requests that collect
//! while the database is busy go in one statement, a key (or a job) twice
//! in it waits for the next, and a row that fails the statement fails
//! alone.

use super::*;

/// The job a begin names, made or found.
fn job_of(begin: &Begin) -> JobId {
    match begin {
        Begin::Created(job, _) | Begin::Existing(job) => job.id,
    }
}

/// Sixty keys, each begun twice, all at once: one job per key, the second
/// begin of each finding the first's (on PostgreSQL, in one batch or
/// across several, as they happen to collect).
pub(super) async fn many_keys_begun_twice_at_once_make_one_job_each(store: Arc<dyn Store>) {
    let keys: Vec<String> = (0..60).map(|n| format!("many-{n}")).collect();
    let barrier = Arc::new(Barrier::new(keys.len() * 2));
    let begins = keys.iter().chain(keys.iter()).map(|key| {
        let (store, barrier, key) = (store.clone(), barrier.clone(), key.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            let begin = store.begin_job(new_job(&key), new_attempt()).await.unwrap();
            (key, begin)
        })
    });
    let mut seen: std::collections::HashMap<String, Vec<Begin>> = Default::default();
    for done in join_all(begins).await {
        let (key, begin) = done.unwrap();
        seen.entry(key).or_default().push(begin);
    }
    assert_eq!(seen.len(), 60);
    for (key, begins) in seen {
        let ids: Vec<_> = begins.iter().map(job_of).collect();
        let made = begins
            .iter()
            .filter(|b| matches!(b, Begin::Created(..)))
            .count();
        assert_eq!(made, 1, "{key}: one job made");
        assert_eq!(ids[0], ids[1], "{key}: both begins name one job");
    }
}

/// A PostgreSQL gateway's store, and a handle on its backend to see how
/// many begins wait for a batch.
pub(super) async fn postgres_with_probe() -> (
    Arc<dyn Store>,
    idemgate_store::postgres::Postgres,
    crate::support::TestDb,
) {
    postgres_with_pool(8).await
}

/// [`postgres_with_probe`] with a pool of `pool_size` connections. Locks
/// are waited for a minute: these tests hold them on purpose, for as long
/// as they take (the timeout has a test of its own).
async fn postgres_with_pool(
    pool_size: usize,
) -> (
    Arc<dyn Store>,
    idemgate_store::postgres::Postgres,
    crate::support::TestDb,
) {
    postgres_with(pool_size, Duration::from_secs(60)).await
}

/// A store on a database of its own, with a pool of `pool_size`
/// connections whose statements wait `lock_timeout` for a lock.
async fn postgres_with(
    pool_size: usize,
    lock_timeout: Duration,
) -> (
    Arc<dyn Store>,
    idemgate_store::postgres::Postgres,
    crate::support::TestDb,
) {
    let db = crate::support::TestDb::new().await;
    let backend = idemgate_store::postgres::Postgres::new(
        &idemgate_store::postgres::PgSettings {
            pool_size,
            connect_timeout: Duration::from_secs(5),
            lock_timeout,
            ..idemgate::config::store::pg_settings(&db.url).unwrap()
        },
        uuid::Uuid::new_v4(),
    )
    .unwrap();
    backend.migrate().await.unwrap();
    let probe = backend.clone();
    (machine(backend).0, probe, db)
}

/// Waits (20 s at most) until `what` holds.
async fn until(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until the batches on their way (every slot of a kind) wait on a
/// lock another session holds.
async fn every_slot_waits_on_the_lock(db: &crate::support::TestDb) {
    let slots = idemgate_store::postgres::BATCHES_IN_FLIGHT;
    sessions_wait(
        db,
        "wait_event_type = 'Lock'",
        slots,
        "every batch slot waits on the lock",
    )
    .await;
}

/// Waits until `count` sessions of `db` wait as `wait` says (a condition
/// on `pg_stat_activity`'s wait columns).
async fn sessions_wait(db: &crate::support::TestDb, wait: &str, count: usize, what: &str) {
    let watcher = db.connect().await;
    let query = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND {wait}"
    );
    until(what, async || {
        let row = watcher.query_one(&query, &[]).await.unwrap();
        row.get::<_, i64>(0) as usize == count
    })
    .await;
}

/// The database held busy (the jobs table locked by another session) while
/// every batch slot is taken, twenty-three begins collect: twenty keys,
/// one key twice, and two keys whose jobs were given one id (a row the
/// statement must refuse). Released, the unique ones go as one statement,
/// which fails on that row and is split: every other key gets its job, one
/// of the two clashing keys too, the other an error; the key sent twice
/// has one job, its second begin following the first and told that job.
/// A duplicate of each clashing key, sent once both wait, follows it: the
/// one behind the key that failed fails too, told that it wrote nothing
/// (its caller has no never-sent record to write), the other is told its
/// first's job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_begins_that_collect_go_together_and_a_failing_row_fails_alone() {
    let (store, probe, db) = postgres_with_probe().await;
    let holder = db.connect().await;
    holder
        .batch_execute("BEGIN; LOCK TABLE jobs IN EXCLUSIVE MODE")
        .await
        .unwrap();
    let begin = |job: NewJob| {
        let store = store.clone();
        tokio::spawn(async move { store.begin_job(job, new_attempt()).await })
    };
    let first: Vec<_> = (0..idemgate_store::postgres::BATCHES_IN_FLIGHT)
        .map(|n| begin(new_job(&format!("first-{n}"))))
        .collect();
    every_slot_waits_on_the_lock(&db).await;

    let mut keys: Vec<String> = (0..20).map(|n| format!("together-{n}")).collect();
    keys.push("twice".into());
    keys.push("twice".into());
    let mut begins: Vec<_> = keys
        .iter()
        .map(|k| (k.clone(), begin(new_job(k))))
        .collect();
    let clash = JobId::new();
    for key in ["clash-a", "clash-b"] {
        let job = NewJob {
            id: clash,
            ..new_job(key)
        };
        begins.push((key.to_owned(), begin(job)));
    }
    until("the begins wait for a batch", async || {
        probe.begins_waiting() == begins.len()
    })
    .await;
    let followers: Vec<_> = ["clash-a", "clash-b"]
        .map(|key| (key, begin(new_job(key))))
        .into();
    until("the followers wait too", async || {
        probe.begins_waiting() == begins.len() + followers.len()
    })
    .await;
    holder.batch_execute("COMMIT").await.unwrap();

    for done in join_all(first).await {
        assert!(matches!(done.unwrap(), Ok(Begin::Created(..))));
    }
    let mut twice = Vec::new();
    let mut clashed = Vec::new();
    for (key, done) in begins {
        let result = done.await.unwrap();
        match key.as_str() {
            "twice" => twice.push(result.unwrap()),
            "clash-a" | "clash-b" => clashed.push(result),
            _ => assert!(
                matches!(result, Ok(Begin::Created(..))),
                "{key}: {result:?}"
            ),
        }
    }
    let made = twice
        .iter()
        .filter(|b| matches!(b, Begin::Created(..)))
        .count();
    assert_eq!(made, 1, "the key sent twice has one job");
    assert_eq!(job_of(&twice[0]), job_of(&twice[1]));
    assert_eq!(
        clashed.iter().filter(|r| r.is_ok()).count(),
        1,
        "{clashed:?}"
    );
    for ((key, follower), first) in followers.into_iter().zip(&clashed) {
        match (first, follower.await.unwrap()) {
            (Ok(first), Ok(Begin::Existing(job))) => assert_eq!(job.id, job_of(first), "{key}"),
            (Err(_), Err(e)) => assert!(e.surely_unwritten(), "{key}: {e:?}"),
            (first, follower) => panic!("{key}: {first:?}, followed by {follower:?}"),
        }
    }
    assert_eq!(probe.begins_waiting(), 0);
}

/// A begin sent again with the ids it was first sent with (what the batch
/// does when its statement committed but its answer was lost: the
/// connection dropped after the commit) finds the job it made: it is told
/// "created", with its own attempt, alone and inside a batch, not
/// "existing", which would leave it waiting on an attempt nobody runs
/// until the lease lapsed into `unknown`. Another request for the key
/// still finds the job, and once the attempt has committed so does a
/// resend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_begin_whose_answer_was_lost_finds_its_own_job_created() {
    let (store, probe, db) = postgres_with_probe().await;
    let (job, attempt) = (new_job("mine"), new_attempt());
    let first = store.begin_job(job.clone(), attempt.clone()).await.unwrap();
    let Begin::Created(made, ours) = first else {
        panic!("{first:?}")
    };
    let is_ours = |begin: &Begin| matches!(begin, Begin::Created(j, a) if j.id == made.id && a.id == ours.id && a.state == AttemptState::Started);
    let alone = store.begin_job(job.clone(), attempt.clone()).await.unwrap();
    assert!(is_ours(&alone), "alone: {alone:?}");

    // In a batch: the begins collect while every slot waits on a lock.
    let holder = db.connect().await;
    holder
        .batch_execute("BEGIN; LOCK TABLE jobs IN EXCLUSIVE MODE")
        .await
        .unwrap();
    let begin = |job: NewJob, attempt: NewAttempt| {
        let store = store.clone();
        tokio::spawn(async move { store.begin_job(job, attempt).await })
    };
    let fillers: Vec<_> = (0..idemgate_store::postgres::BATCHES_IN_FLIGHT)
        .map(|n| begin(new_job(&format!("filler-{n}")), new_attempt()))
        .collect();
    every_slot_waits_on_the_lock(&db).await;
    let resent = begin(job.clone(), attempt.clone());
    let others: Vec<_> = (0..5)
        .map(|n| begin(new_job(&format!("beside-{n}")), new_attempt()))
        .collect();
    until("the begins wait for a batch", async || {
        probe.begins_waiting() == 6
    })
    .await;
    holder.batch_execute("COMMIT").await.unwrap();
    let resent = resent.await.unwrap().unwrap();
    assert!(is_ours(&resent), "in a batch: {resent:?}");
    for done in join_all(fillers.into_iter().chain(others)).await {
        assert!(matches!(done.unwrap(), Ok(Begin::Created(..))));
    }

    let other = store
        .begin_job(new_job("mine"), new_attempt())
        .await
        .unwrap();
    assert!(
        matches!(&other, Begin::Existing(j) if j.id == made.id),
        "{other:?}"
    );
    store.commit(&ours, &answer_with("mine", 1)).await.unwrap();
    let after = store.begin_job(job, attempt).await.unwrap();
    assert!(
        matches!(&after, Begin::Existing(j) if j.id == made.id && j.state == JobState::Completed),
        "after the commit: {after:?}"
    );
}

/// A lease renewal never waits on an attempt another transaction holds
/// (a batch of commits locks up to 64 attempts while it settles them, and
/// a renewal waiting there, in the opposite order, could deadlock with
/// it): with one attempt's row locked by another session, a renewal of it
/// and another returns at once, the free attempt's lease moved, the
/// locked one's left for the next renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_lease_renewal_skips_an_attempt_being_settled() {
    let (store, _probe, db) = postgres_with_probe().await;
    let (_, held) = created(store.as_ref(), "held").await;
    let (_, free) = created(store.as_ref(), "free").await;
    let lease_of = async |id: AttemptId| -> std::time::SystemTime {
        let row = db
            .connect()
            .await
            .query_one(
                "SELECT lease_expires_at FROM attempts WHERE id = $1",
                &[&id.0],
            )
            .await
            .unwrap();
        row.get(0)
    };
    let (held_before, free_before) = (lease_of(held.id).await, lease_of(free.id).await);
    let holder = db.connect().await;
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM attempts WHERE id = '{}' FOR UPDATE",
            held.id.0
        ))
        .await
        .unwrap();
    let renewed = tokio::time::timeout(
        Duration::from_secs(10),
        store.renew_leases(&[held.id, free.id], Duration::from_secs(600)),
    )
    .await
    .expect("the renewal waited on the locked attempt")
    .unwrap();
    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(renewed, 1);
    assert_eq!(lease_of(held.id).await, held_before);
    assert!(lease_of(free.id).await > free_before);
}

/// Three jobs on a store whose statements wait 300 ms for a lock: one
/// free, one another session holds, and one whose attempt a third session
/// holds (an operator's `UPDATE attempts` left open); each job's rows
/// first made due by `due`, an update of the three job ids ($1).
struct Held {
    store: Arc<dyn Store>,
    _db: crate::support::TestDb,
    free: JobId,
    held_job: JobId,
    held_attempt: JobId,
    holders: [tokio_postgres::Client; 2],
}

impl Held {
    async fn new(due: &str) -> Self {
        let (store, _probe, db) = postgres_with(4, Duration::from_millis(300)).await;
        let (free, _) = created(store.as_ref(), "free").await;
        let (held_job, _) = created(store.as_ref(), "held-job").await;
        let (held_attempt, attempt) = created(store.as_ref(), "held-attempt").await;
        let ids = vec![free.id.0, held_job.id.0, held_attempt.id.0];
        let holders = [db.connect().await, db.connect().await];
        holders[0].execute(due, &[&ids]).await.unwrap();
        let holds = [
            format!(
                "UPDATE attempts SET detail = 'by hand' WHERE id = '{}'",
                attempt.id.0
            ),
            format!(
                "SELECT 1 FROM jobs WHERE id = '{}' FOR UPDATE",
                held_job.id.0
            ),
        ];
        for (holder, hold) in holders.iter().zip(holds) {
            holder
                .batch_execute(&format!("BEGIN; {hold}"))
                .await
                .unwrap();
        }
        Held {
            store,
            _db: db,
            free: free.id,
            held_job: held_job.id,
            held_attempt: held_attempt.id,
            holders,
        }
    }

    async fn let_go(&self) {
        for holder in &self.holders {
            holder.batch_execute("COMMIT").await.unwrap();
        }
    }
}

/// The purge never waits on an expired job another transaction holds (a
/// commit batch locks its jobs in id order, the purge would take them in
/// expiry order), nor on one whose attempt another transaction holds (the
/// delete cascades to the attempts). With both held, a purge deletes the
/// free expired job at once, and the next, once the holders let go, the
/// other two. Waiting on the held attempt, every purge timed out and
/// rolled back, the free job's delete with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_the_purge_skips_jobs_and_attempts_other_transactions_hold() {
    let held = Held::new(&expired_and_answered("now() - interval '1 minute'")).await;
    let store = &held.store;
    let purged = store.purge_expired(100).await;
    assert_eq!(purged.expect("the purge went past the held rows"), 1);
    assert!(store.job(held.free).await.unwrap().is_none());
    assert!(store.job(held.held_job).await.unwrap().is_some());
    assert!(store.job(held.held_attempt).await.unwrap().is_some());

    held.let_go().await;
    assert_eq!(store.purge_expired(100).await.unwrap(), 2);
    assert!(store.job(held.held_job).await.unwrap().is_none());
    assert!(store.job(held.held_attempt).await.unwrap().is_none());
}

/// The sweeper of lapsed leases skips a job it cannot lock, and a job one
/// of whose attempts another transaction holds: the free lapsed lease is
/// made `unknown` at once, and the held ones by the sweep after the holders
/// let go. Waiting on the held attempt, every sweep timed out and rolled
/// back, the free job's with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_the_sweep_skips_jobs_and_attempts_other_transactions_hold() {
    let held = Held::new(
        "UPDATE attempts SET lease_expires_at = now() - interval '1 minute' WHERE job_id = ANY($1)",
    )
    .await;
    let swept = held.store.expire_leases(100).await;
    assert_eq!(swept.expect("the sweep went past the held rows"), 1);
    let state = async |id| held.store.job(id).await.unwrap().unwrap().state;
    assert_eq!(state(held.free).await, JobState::Unknown);
    assert_eq!(state(held.held_job).await, JobState::Running);
    assert_eq!(state(held.held_attempt).await, JobState::Running);

    held.let_go().await;
    assert_eq!(held.store.expire_leases(100).await.unwrap(), 2);
    assert_eq!(state(held.held_job).await, JobState::Unknown);
    assert_eq!(state(held.held_attempt).await, JobState::Unknown);
}

/// The rows a statement makes due: the free job's last (one minute ago),
/// the two held ones' first (two minutes ago), so that a sweep or purge
/// of one job at a time meets the held ones before the free one.
/// An update of the jobs $1 that expires them at `at` with their
/// attempts settled: jobs the purge may forget (one whose attempt may
/// still answer is kept; `docs/design.md` §11, "not forgotten").
fn expired_and_answered(at: &str) -> String {
    format!(
        "WITH settled AS (UPDATE attempts SET state = 'failed', finished_at = now() \
                          WHERE job_id = ANY($1)) \
         UPDATE jobs SET expires_at = {at}, updated_at = {at}, state = 'open' WHERE id = ANY($1)"
    )
}

const FREE_LAST: &str =
    "now() - CASE WHEN {id} = $1[1] THEN interval '1 minute' ELSE interval '2 minutes' END";

/// A sweep of one lapsed lease at a time still reaches the free one when
/// the leases that lapsed before it belong to held rows: the held rows do
/// not use up its batch. Limited before it skipped them, the sweep chose
/// the oldest lapsed leases, skipped them, and made nothing `unknown`,
/// tick after tick, for as long as a batch's worth of rows were held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_held_rows_do_not_use_up_a_sweeps_batch() {
    let due = FREE_LAST.replace("{id}", "job_id");
    let held = Held::new(&format!(
        "UPDATE attempts SET lease_expires_at = {due} WHERE job_id = ANY($1)"
    ))
    .await;
    let swept = held.store.expire_leases(1).await;
    assert_eq!(swept.expect("the sweep went past the held rows"), 1);
    let state = async |id| held.store.job(id).await.unwrap().unwrap().state;
    assert_eq!(state(held.free).await, JobState::Unknown);
    assert_eq!(state(held.held_job).await, JobState::Running);
    assert_eq!(state(held.held_attempt).await, JobState::Running);
    held.let_go().await;
    assert_eq!(held.store.expire_leases(2).await.unwrap(), 2);
}

/// A sweep that skips a job another transaction holds leaves that job's
/// lapsed attempt unlocked, for as long as the sweep's own transaction
/// lasts: the job's holder may be about to settle the attempt, and would
/// otherwise wait on the sweep (and, past its lock timeout, roll back).
/// The sweep's transaction is held open by a table lock its write of the
/// free job's attempt waits on; meanwhile the held job's attempt must be
/// free to lock. Locking the attempt before its job (the locking clauses
/// the other way round), the sweep took the attempt, then skipped its job,
/// and kept the attempt locked until it committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_sweep_leaves_the_attempt_of_a_held_job_unlocked() {
    let (store, _probe, db) = postgres_with(4, Duration::from_secs(20)).await;
    let (free, _) = created(store.as_ref(), "free").await;
    let (held, held_attempt) = created(store.as_ref(), "held").await;
    let [holder, blocker, prober] = [db.connect().await, db.connect().await, db.connect().await];
    // The held job's lease lapsed first: the sweep meets its rows first.
    let due = FREE_LAST.replace("{id}", "job_id");
    let lapsed = format!("UPDATE attempts SET lease_expires_at = {due} WHERE job_id = ANY($1)");
    holder
        .execute(&lapsed, &[&vec![free.id.0, held.id.0]])
        .await
        .unwrap();
    let hold = format!(
        "BEGIN; SELECT 1 FROM jobs WHERE id = '{}' FOR UPDATE",
        held.id.0
    );
    holder.batch_execute(&hold).await.unwrap();
    // SHARE lets the sweep lock rows, not write them.
    let block = "BEGIN; LOCK TABLE attempts IN SHARE MODE";
    blocker.batch_execute(block).await.unwrap();
    let sweep = tokio::spawn({
        let store = store.clone();
        async move { store.expire_leases(10).await }
    });
    sessions_wait(
        &db,
        "wait_event_type = 'Lock'",
        1,
        "the sweep waits to write",
    )
    .await;

    let probe = format!(
        "BEGIN; SELECT 1 FROM attempts WHERE id = '{}' FOR NO KEY UPDATE NOWAIT",
        held_attempt.id.0
    );
    let probed = prober.batch_execute(&probe).await;
    prober.batch_execute("ROLLBACK").await.unwrap();
    blocker.batch_execute("COMMIT").await.unwrap();
    let swept = sweep.await.unwrap();
    probed.expect("the held job's attempt was free while the sweep ran");
    assert_eq!(swept.unwrap(), 1, "the free job swept");
    let state = async |id| store.job(id).await.unwrap().unwrap().state;
    assert_eq!(state(free.id).await, JobState::Unknown);
    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(state(held.id).await, JobState::Running);
}

/// The purge of one expired job at a time likewise reaches the free job
/// behind an older one another transaction holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_held_job_does_not_use_up_a_purges_batch() {
    let due = FREE_LAST.replace("{id}", "id");
    let held = Held::new(&format!("{} AND id <> $1[3]", expired_and_answered(&due))).await;
    let purged = held.store.purge_expired(1).await;
    assert_eq!(purged.expect("the purge went past the held job"), 1);
    assert!(held.store.job(held.free).await.unwrap().is_none());
    assert!(held.store.job(held.held_job).await.unwrap().is_some());
}

/// One tick of the sweeper sweeps every lapsed lease it can, however the
/// leases are shared among jobs: 260 hedged jobs, two lapsed attempts
/// each (520, past the sweep's batch of 500), are all made `unknown` by
/// one `sweep_once`. Before, the first batch's 500 attempts named 250
/// jobs, fewer than a batch, and the tick ended with 10 jobs left for the
/// next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_one_tick_sweeps_hedged_jobs_past_a_batch() {
    let (store, _probe, db) = postgres_with_probe().await;
    let mut ids = Vec::new();
    for i in 0..260 {
        let (job, _) = created(store.as_ref(), &format!("hedged-{i}")).await;
        let hedge = store.hedge_attempt(job.id, job.version, new_attempt());
        assert!(hedge.await.unwrap().is_some(), "hedged");
        ids.push(job.id.0);
    }
    // Each job's two leases lapsed together, the jobs in order: the first
    // 500 attempts are 250 whole jobs.
    let client = db.connect().await;
    client
        .execute(
            "UPDATE attempts a SET lease_expires_at = now() - interval '1 minute' \
             - o.n * interval '1 millisecond' \
             FROM unnest($1::uuid[]) WITH ORDINALITY AS o(id, n) WHERE a.job_id = o.id",
            &[&ids],
        )
        .await
        .unwrap();
    idemgate_upkeep::sweeper::sweep_once(store.as_ref()).await;
    let unknown: i64 = client
        .query_one("SELECT count(*) FROM jobs WHERE state = 'unknown'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(unknown, 260, "every hedged job in one tick");
}

/// Begins of keys whose jobs hold answers of 16 KiB, 48 at once and
/// round after round, keep the store's one connection: a batch of found
/// jobs carries their answers, but the connection keeps buffers only as
/// large as its largest row. Counted by their sum (over 256 KiB), every
/// such batch closed its connection, and the next statement opened a new
/// session (a new server process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_batches_of_found_answers_keep_their_connection() {
    let (store, _probe, db) = postgres_with(1, Duration::from_secs(60)).await;
    let keys: Vec<String> = (0..48).map(|n| format!("kept-{n}")).collect();
    let answer = StoredResponse {
        body: Bytes::from(vec![b'x'; 16 << 10]),
        ..answer_with("kept", 1)
    };
    for key in &keys {
        let (_, attempt) = created(store.as_ref(), key).await;
        let committed = store.commit(&attempt, &answer).await.unwrap();
        assert_eq!(committed, CommitOutcome::Committed);
    }
    let round = async || {
        let barrier = Arc::new(Barrier::new(keys.len()));
        let begins = keys.iter().map(|key| {
            let (store, barrier, key) = (store.clone(), barrier.clone(), key.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.begin_job(new_job(&key), new_attempt()).await
            })
        });
        for done in join_all(begins).await {
            let Begin::Existing(job) = done.unwrap().unwrap() else {
                panic!("a new job for a key that has one")
            };
            assert_eq!(job.response.map(|r| r.body.len()), Some(16 << 10));
        }
    };
    round().await;
    let watcher = db.connect().await;
    let sessions = "SELECT COALESCE(array_agg(pid ORDER BY pid), '{}') FROM pg_stat_activity \
                    WHERE datname = current_database() AND pid <> pg_backend_pid()";
    let before: Vec<i32> = watcher.query_one(sessions, &[]).await.unwrap().get(0);
    for _ in 0..3 {
        round().await;
    }
    let after: Vec<i32> = watcher.query_one(sessions, &[]).await.unwrap().get(0);
    assert_eq!(before.len(), 1, "the pool's one connection: {before:?}");
    assert_eq!(after, before, "the same session throughout");
}

/// Begins of keys whose jobs exist, round after round, turn on the read a
/// batch makes before its begin statement (`batch/begin.rs`, "read
/// first"); then, in a round of forty such begins, ten new keys each begun
/// twice, and a key whose job expired, all at once: every found key names
/// its own job, each new key gets one job that both its begins name, and
/// the expired key a new job: the read answers only what the begin
/// statement would have, and creates nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_replays_read_first_and_new_keys_among_them_still_get_one_job() {
    let (store, _probe, db) = postgres_with_probe().await;
    let found: Vec<String> = (0..40).map(|n| format!("found-{n}")).collect();
    let mut jobs = std::collections::HashMap::new();
    for key in &found {
        let begin = store.begin_job(new_job(key), new_attempt()).await.unwrap();
        assert!(matches!(begin, Begin::Created(..)), "{key}");
        jobs.insert(key.clone(), job_of(&begin));
    }
    let expired = NewJob {
        ttl: Duration::from_millis(1),
        ..new_job("expired")
    };
    let Begin::Created(old, attempt) = store.begin_job(expired, new_attempt()).await.unwrap()
    else {
        panic!("the expiring key existed");
    };
    let failed = AttemptFailure::Failed {
        status: Some(503),
        detail: "busy".into(),
    };
    store.fail_attempt(attempt.id, failed).await.unwrap();
    let old = old.id;
    // Changed a moment ago, as if long before: past the settled grace.
    db.connect()
        .await
        .execute(
            "UPDATE jobs SET updated_at = now() - interval '1 minute' WHERE id = $1",
            &[&old.0],
        )
        .await
        .unwrap();
    let round = |keys: Vec<String>| {
        let barrier = Arc::new(Barrier::new(keys.len()));
        let begins = keys.into_iter().map(|key| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let begin = store.begin_job(new_job(&key), new_attempt()).await;
                (key, begin.unwrap())
            })
        });
        join_all(begins)
    };
    // Other tests in this process move the share too (it is the process's);
    // replays alone turn the read on within a few batches.
    let before = idemgate_store::postgres::Postgres::begins_answered_by_read();
    for _ in 0..60 {
        for done in round(found.clone()).await {
            let (key, begin) = done.unwrap();
            assert!(matches!(begin, Begin::Existing(_)), "{key}: {begin:?}");
            assert_eq!(job_of(&begin), jobs[&key], "{key}: its own job");
        }
        if idemgate_store::postgres::Postgres::begins_answered_by_read() >= before + 40 {
            break;
        }
    }
    assert!(
        idemgate_store::postgres::Postgres::begins_answered_by_read() >= before + 40,
        "replays never turned the read on"
    );

    let new: Vec<String> = (0..10).map(|n| format!("new-{n}")).collect();
    let mut keys = found.clone();
    keys.extend(new.iter().cloned());
    keys.extend(new.iter().cloned());
    keys.push("expired".into());
    let mut seen: std::collections::HashMap<String, Vec<Begin>> = Default::default();
    for done in round(keys).await {
        let (key, begin) = done.unwrap();
        seen.entry(key).or_default().push(begin);
    }
    for key in &found {
        let begins = &seen[key];
        assert!(matches!(begins[..], [Begin::Existing(_)]), "{key}");
        assert_eq!(job_of(&begins[0]), jobs[key], "{key}: its own job");
    }
    for key in &new {
        let begins = &seen[key];
        let made = begins
            .iter()
            .filter(|b| matches!(b, Begin::Created(..)))
            .count();
        assert_eq!(made, 1, "{key}: one job made: {begins:?}");
        assert_eq!(job_of(&begins[0]), job_of(&begins[1]), "{key}");
    }
    let fresh = &seen["expired"];
    assert!(matches!(fresh[..], [Begin::Created(..)]), "{fresh:?}");
    assert_ne!(job_of(&fresh[0]), old, "the expired job is not replayed");
}

/// An answer with `headers` headers (none at all for 0) and a body naming
/// `tag`: commits in one batch each carry their own.
fn answer_with(tag: &str, headers: usize) -> StoredResponse {
    StoredResponse {
        status: 200 + headers as u16,
        headers: (0..headers)
            .map(|n| (format!("x-{n}"), Bytes::from(format!("{tag}-{n}"))))
            .collect(),
        body: Bytes::from(format!("{{\"tag\":\"{tag}\"}}")),
    }
}

/// Forty jobs committed at once, each with an answer of its own (zero to
/// three headers), and ten of them raced by a hedge: every job keeps
/// exactly one winner's answer, whole (on PostgreSQL, commits collected in
/// one statement or across several, mapped back by job).
pub(super) async fn many_jobs_committed_at_once_keep_each_its_own_answer(store: Arc<dyn Store>) {
    let mut commits = Vec::new();
    for n in 0..40 {
        let (job, first) = created(store.as_ref(), &format!("commit-{n}")).await;
        commits.push((job.id, first, answer_with(&format!("{n}-a"), n % 4)));
        if n % 4 == 1 {
            let hedge = store
                .hedge_attempt(job.id, job.version, new_attempt())
                .await
                .unwrap()
                .expect("a hedge of a running job");
            commits.push((job.id, hedge, answer_with(&format!("{n}-b"), 3)));
        }
    }
    let barrier = Arc::new(Barrier::new(commits.len()));
    let sent = commits.iter().cloned().map(|(job, attempt, answer)| {
        let (store, barrier) = (store.clone(), barrier.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            let outcome = store.commit(&attempt, &answer).await.unwrap();
            (job, attempt.id, answer, outcome)
        })
    });
    let mut winners: std::collections::HashMap<JobId, Vec<(AttemptId, StoredResponse)>> =
        Default::default();
    for done in join_all(sent).await {
        let (job, attempt, answer, outcome) = done.unwrap();
        let won = winners.entry(job).or_default();
        if outcome == CommitOutcome::Committed {
            won.push((attempt, answer));
        }
    }
    assert_eq!(winners.len(), 40);
    for (job, won) in winners {
        assert_eq!(won.len(), 1, "job {job}: one winner");
        let (attempt, answer) = &won[0];
        let detail = store.job_detail(job).await.unwrap().unwrap();
        assert_eq!(detail.job.completed_by, Some(*attempt));
        assert_eq!(detail.job.response.as_ref(), Some(answer), "job {job}");
        for other in &detail.attempts {
            let expected = if other.id == *attempt {
                AttemptState::Succeeded
            } else {
                AttemptState::Superseded
            };
            assert_eq!(other.state, expected, "job {job}, attempt {}", other.id);
        }
    }
}

/// The database held busy while every commit slot is taken, twenty-three
/// commits collect: twenty jobs, a job's two attempts, and one answer the
/// database refuses (a header name holding a NUL byte). Released, the
/// statement carrying them fails on that row and is split: the twenty
/// commit, each its own answer; of the two attempts one wins and the other
/// is superseded; the refused one fails alone and leaves its job running,
/// with nothing half-written, so a good answer commits it afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_commits_that_collect_go_together_and_a_failing_row_fails_alone() {
    let (store, probe, db) = postgres_with_probe().await;
    let slots = idemgate_store::postgres::BATCHES_IN_FLIGHT;
    let mut started = Vec::new();
    for n in 0..22 + slots {
        started.push(created(store.as_ref(), &format!("collect-{n}")).await);
    }
    let (twice, first) = started.pop().unwrap();
    let hedge = store
        .hedge_attempt(twice.id, twice.version, new_attempt())
        .await
        .unwrap()
        .unwrap();
    let (refused_job, refused) = started.pop().unwrap();
    let fillers: Vec<_> = started.drain(..slots).collect();

    let holder = db.connect().await;
    holder
        .batch_execute("BEGIN; LOCK TABLE jobs IN EXCLUSIVE MODE")
        .await
        .unwrap();
    let commit = |attempt: idemgate_domain::attempt::Attempt, answer: StoredResponse| {
        let store = store.clone();
        tokio::spawn(async move { store.commit(&attempt, &answer).await })
    };
    let fillers: Vec<_> = fillers
        .into_iter()
        .map(|(_, a)| commit(a, answer_with("filler", 1)))
        .collect();
    every_slot_waits_on_the_lock(&db).await;

    let together: Vec<_> = started
        .iter()
        .enumerate()
        .map(|(n, (job, a))| {
            let answer = answer_with(&format!("together-{n}"), n % 4);
            (job.id, answer.clone(), commit(a.clone(), answer))
        })
        .collect();
    let pair = [
        commit(first.clone(), answer_with("first", 2)),
        commit(hedge.clone(), answer_with("hedge", 0)),
    ];
    let mut bad = answer_with("refused", 1);
    bad.headers
        .push(("x-nul\0".into(), Bytes::from_static(b"v")));
    let refused_commit = commit(refused.clone(), bad);
    until("the commits wait for a batch", async || {
        probe.commits_waiting() == together.len() + 3
    })
    .await;
    holder.batch_execute("COMMIT").await.unwrap();

    for done in join_all(fillers).await {
        assert_eq!(done.unwrap().unwrap(), CommitOutcome::Committed);
    }
    for (job, answer, done) in together {
        assert_eq!(done.await.unwrap().unwrap(), CommitOutcome::Committed);
        let stored = store.job(job).await.unwrap().unwrap();
        assert_eq!(stored.response, Some(answer), "job {job}: its own answer");
    }
    let [a, b] = pair;
    let outcomes = [a.await.unwrap().unwrap(), b.await.unwrap().unwrap()];
    assert!(
        outcomes.contains(&CommitOutcome::Committed)
            && outcomes.contains(&CommitOutcome::Superseded),
        "one winner of two attempts: {outcomes:?}"
    );
    assert!(
        refused_commit.await.unwrap().is_err(),
        "the refused row fails"
    );
    let left = store.job(refused_job.id).await.unwrap().unwrap();
    assert_eq!(left.state, JobState::Running, "nothing half-written");
    assert_eq!(left.response, None);
    let good = answer_with("good", 1);
    assert_eq!(
        store.commit(&refused, &good).await.unwrap(),
        CommitOutcome::Committed
    );
    assert_eq!(probe.commits_waiting(), 0);
}

/// A job's row held by another session (an operator's transaction left
/// open) holds up that job's commit only: every other commit of the
/// replica goes on meanwhile, whether the held job's commit went alone
/// (a lone commit holds the batch slot while it runs) or in a batch with
/// them. Released, the held job commits its own answer. Before commits
/// skipped locked jobs, the others waited for the holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_job_held_by_another_session_holds_up_only_its_own_commit() {
    only_its_own_commit_waits(Holding::Job).await;
}

/// The same for an attempt's row held by another session (an operator's
/// `UPDATE attempts` left open): the commits' statements skip a held
/// attempt as they skip a held job. Before, they waited on it for the
/// lock timeout while holding the replica's commit slot, and a failing
/// batch was split and waited again (`docs/design.md` §13, "A locked job
/// is skipped").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_an_attempt_held_by_another_session_holds_up_only_its_own_commit() {
    only_its_own_commit_waits(Holding::Attempt).await;
}

/// The row another session holds in [`only_its_own_commit_waits`].
#[derive(Clone, Copy)]
enum Holding {
    Job,
    Attempt,
}

impl Holding {
    /// The statement that holds the row, left open.
    fn statement(self, attempt: &idemgate_domain::attempt::Attempt) -> String {
        match self {
            Holding::Job => format!(
                "BEGIN; SELECT 1 FROM jobs WHERE id = '{}' FOR UPDATE",
                attempt.job_id.0
            ),
            Holding::Attempt => format!(
                "BEGIN; UPDATE attempts SET detail = 'by hand' WHERE id = '{}'",
                attempt.id.0
            ),
        }
    }

    /// The table whose lock holds a filler's commit (and the commits that
    /// collect behind it) without meeting the holder's lock.
    fn other_table(self) -> &'static str {
        match self {
            Holding::Job => "attempts",
            Holding::Attempt => "jobs",
        }
    }
}

async fn only_its_own_commit_waits(holding: Holding) {
    let (store, probe, db) = postgres_with_probe().await;
    let commit = |attempt: idemgate_domain::attempt::Attempt, answer: StoredResponse| {
        let store = store.clone();
        tokio::spawn(async move { store.commit(&attempt, &answer).await })
    };
    let others_commit_meanwhile = async |round: &str| {
        let mut others = Vec::new();
        for n in 0..5 {
            let (job, attempt) = created(store.as_ref(), &format!("{round}-other-{n}")).await;
            let answer = answer_with(&format!("{round}-{n}"), 1);
            others.push((job.id, answer.clone(), commit(attempt, answer)));
        }
        others
    };
    type Pending = tokio::task::JoinHandle<Result<CommitOutcome, StoreError>>;
    let committed = async |others: Vec<(JobId, StoredResponse, Pending)>| {
        for (job, answer, done) in others {
            let outcome = tokio::time::timeout(Duration::from_secs(10), done)
                .await
                .expect("a commit waited for another job's lock")
                .unwrap();
            assert_eq!(outcome.unwrap(), CommitOutcome::Committed);
            let stored = store.job(job).await.unwrap().unwrap();
            assert_eq!(stored.response, Some(answer));
        }
    };
    let hold = async |attempt: &idemgate_domain::attempt::Attempt| {
        let holder = db.connect().await;
        let statement = holding.statement(attempt);
        holder.batch_execute(&statement).await.unwrap();
        holder
    };

    // Alone: the held job's commit is the only one asked, so it goes alone.
    let (held, attempt) = created(store.as_ref(), "held-alone").await;
    let holder = hold(&attempt).await;
    let waits = commit(attempt, answer_with("held-alone", 1));
    every_slot_waits_on_the_lock(&db).await;
    committed(others_commit_meanwhile("alone").await).await;
    assert!(!waits.is_finished(), "the held job waits for its holder");
    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(waits.await.unwrap().unwrap(), CommitOutcome::Committed);
    let stored = store.job(held.id).await.unwrap().unwrap();
    assert_eq!(stored.response, Some(answer_with("held-alone", 1)));

    // In a batch: the commits collect while a filler's commit waits on a
    // table the holder does not touch.
    let (held, attempt) = created(store.as_ref(), "held-batched").await;
    let (_, filler) = created(store.as_ref(), "filler").await;
    let mut others = Vec::new();
    for n in 0..5 {
        others.push(created(store.as_ref(), &format!("batched-other-{n}")).await);
    }
    let table = db.connect().await;
    let lock = format!(
        "BEGIN; LOCK TABLE {} IN EXCLUSIVE MODE",
        holding.other_table()
    );
    table.batch_execute(&lock).await.unwrap();
    let holder = hold(&attempt).await;
    let filler = commit(filler, answer_with("filler", 0));
    every_slot_waits_on_the_lock(&db).await;
    let waits = commit(attempt, answer_with("held-batched", 1));
    let others: Vec<_> = others
        .into_iter()
        .enumerate()
        .map(|(n, (job, attempt))| {
            let answer = answer_with(&format!("batched-{n}"), 1);
            (job.id, answer.clone(), commit(attempt, answer))
        })
        .collect();
    until("the commits wait for a batch", async || {
        probe.commits_waiting() == 6
    })
    .await;
    table.batch_execute("COMMIT").await.unwrap();
    assert_eq!(filler.await.unwrap().unwrap(), CommitOutcome::Committed);
    committed(others).await;
    assert!(!waits.is_finished(), "the held job waits for its holder");
    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(waits.await.unwrap().unwrap(), CommitOutcome::Committed);
    let stored = store.job(held.id).await.unwrap().unwrap();
    assert_eq!(stored.response, Some(answer_with("held-batched", 1)));
    assert_eq!(probe.commits_waiting(), 0);
}

/// Commits waiting on jobs another session holds (an operator's
/// transaction left open on two of them) give their connections back after
/// the lock timeout, failing as transient, so a pool of two still commits
/// a third job meanwhile; once the holder lets go, the held jobs commit
/// when asked again, as the gateway asks until the store takes an outcome.
/// Waiting without a timeout, the two held the whole pool for as long as
/// the holder did, and the third commit got no connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_commits_waiting_on_held_jobs_give_their_connections_back() {
    let (store, _probe, db) = postgres_with(2, Duration::from_secs(2)).await;
    let mut held = Vec::new();
    for n in 0..2 {
        held.push(created(store.as_ref(), &format!("held-{n}")).await);
    }
    let (free, free_attempt) = created(store.as_ref(), "free").await;
    let holder = db.connect().await;
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM jobs WHERE id IN ('{}', '{}') FOR UPDATE",
            held[0].0.id.0, held[1].0.id.0
        ))
        .await
        .unwrap();
    let waiting: Vec<_> = held
        .iter()
        .map(|(job, attempt)| {
            let (store, attempt) = (store.clone(), attempt.clone());
            let answer = answer_with(job.key.as_str(), 1);
            tokio::spawn(async move { store.commit(&attempt, &answer).await })
        })
        .collect();
    let lock = "wait_event_type = 'Lock'";
    sessions_wait(
        &db,
        lock,
        2,
        "both commits wait on the holder, the pool taken",
    )
    .await;

    let outcome = store.commit(&free_attempt, &answer_with("free", 1)).await;
    assert_eq!(
        outcome.expect("the third commit got a connection"),
        CommitOutcome::Committed
    );
    let stored = store.job(free.id).await.unwrap().unwrap();
    assert_eq!(stored.response, Some(answer_with("free", 1)));
    for waited in waiting {
        let error = waited.await.unwrap().expect_err("the holder still holds");
        assert!(error.is_transient(), "{error:?}");
        let chain = idemgate_telemetry::Chain(&error).to_string();
        assert!(chain.contains("lock timeout"), "{chain}");
    }

    holder.batch_execute("COMMIT").await.unwrap();
    for (job, attempt) in &held {
        let answer = answer_with(job.key.as_str(), 1);
        assert_eq!(
            store.commit(attempt, &answer).await.unwrap(),
            CommitOutcome::Committed
        );
        let stored = store.job(job.id).await.unwrap().unwrap();
        assert_eq!(stored.response, Some(answer), "job {}", job.key);
    }
}

/// A commit skipped because another transaction held its job decides
/// under the lock on what that transaction wrote. Here the holder settles
/// the very attempt (as an operator's resolution would: the job completed
/// by it, the attempt succeeded). The late commit is superseded and
/// writes nothing: the attempt stays succeeded, as the holder left it.
/// Read in the statement that waited for the lock, the attempt was still
/// `started` (only the job row is read again after a wait), and the
/// job's winner was marked superseded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_skipped_commit_decides_on_what_the_holder_wrote() {
    let (store, _probe, db) = postgres_with_probe().await;
    let (job, attempt) = created(store.as_ref(), "settled-while-held").await;
    let holder = db.connect().await;
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM jobs WHERE id = '{job}' FOR UPDATE; \
             UPDATE jobs SET state = 'completed', completed_by = '{attempt}', \
                    response_status = 200, response_body = 'by hand', version = version + 1 \
             WHERE id = '{job}'; \
             UPDATE attempts SET state = 'succeeded', detail = 'resolved by hand' \
             WHERE id = '{attempt}'",
            job = job.id.0,
            attempt = attempt.id.0,
        ))
        .await
        .unwrap();
    let late = {
        let (store, attempt) = (store.clone(), attempt.clone());
        tokio::spawn(async move { store.commit(&attempt, &answer_with("late", 1)).await })
    };
    every_slot_waits_on_the_lock(&db).await;
    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(late.await.unwrap().unwrap(), CommitOutcome::Superseded);

    let row = db
        .connect()
        .await
        .query_one(
            "SELECT a.state, a.detail, j.state, j.response_body FROM attempts a \
             JOIN jobs j ON j.id = a.job_id WHERE a.id = $1",
            &[&attempt.id.0],
        )
        .await
        .unwrap();
    let (state, detail): (String, Option<String>) = (row.get(0), row.get(1));
    let (job_state, body): (String, Vec<u8>) = (row.get(2), row.get(3));
    assert_eq!(
        (state.as_str(), detail.as_deref()),
        ("succeeded", Some("resolved by hand")),
        "the job's winner as the holder left it"
    );
    assert_eq!(
        (job_state.as_str(), body.as_slice()),
        ("completed", &b"by hand"[..])
    );
}

/// Runs each of `work` on a task of its own, all released at once.
async fn at_once<T, F>(work: Vec<F>) -> Vec<T>
where
    T: Send + 'static,
    F: std::future::Future<Output = T> + Send + 'static,
{
    let barrier = Arc::new(Barrier::new(work.len()));
    let tasks = work.into_iter().map(|work| {
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            work.await
        })
    });
    join_all(tasks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

/// Rounds of sixteen begins at once, then their sixteen commits at once:
/// batches of both kinds, and the one-row statements beside them.
async fn begin_and_commit_at_once(store: &Arc<dyn Store>, round: &str) {
    let begins = (0..16).map(|n| {
        let (store, key) = (store.clone(), format!("{round}-{n}"));
        async move {
            match store.begin_job(new_job(&key), new_attempt()).await.unwrap() {
                Begin::Created(_, attempt) => (key, attempt),
                Begin::Existing(_) => panic!("{key} existed"),
            }
        }
    });
    let made = at_once(begins.collect()).await;
    let commits = made.into_iter().map(|(key, attempt)| {
        let store = store.clone();
        async move {
            let outcome = store.commit(&attempt, &answer_with(&key, 1)).await;
            assert!(outcome.is_ok(), "{key}: {outcome:?}");
        }
    });
    at_once(commits.collect()).await;
}

/// The plans of the batch statements are cached per connection (one
/// here, so each statement runs on it often enough for PostgreSQL to keep
/// a generic plan), made while `jobs` holds a few rows, where a sequential
/// scan is the cheapest way to join a batch's keys to it; the table then
/// grows by 5,000 jobs and the same statements run again. The gateway's
/// sessions keep to the indexes however small the table was (design §13,
/// "Plans made on a small table"): once they have closed (their
/// statistics written), no row of `jobs` or `attempts` was read by a
/// sequential scan, and the rows fetched through indexes are a few per
/// request, fewer than one whole scan of the grown table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_batches_keep_to_the_indexes_however_small_the_table_was() {
    let (store, probe, db) = postgres_with_pool(1).await;
    for round in 0..12 {
        begin_and_commit_at_once(&store, &format!("small-{round}")).await;
    }
    let admin = db.connect().await;
    admin
        .batch_execute(
            "INSERT INTO jobs (id, owner, key, fingerprint, route, state, version, \
                               attempt_count, expires_at) \
             SELECT gen_random_uuid(), 'grown', 'grown-' || n, '\\x00', 'default', \
                    'running', 1, 1, now() + interval '1 day' \
             FROM generate_series(1, 5000) AS n",
        )
        .await
        .unwrap();
    for round in 0..12 {
        begin_and_commit_at_once(&store, &format!("grown-{round}")).await;
    }
    drop((store, probe));
    // A closing session writes its statistics before it leaves
    // pg_stat_activity: once only this one is left, the counts are whole.
    until("the gateway's sessions have closed", async || {
        let row = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid() \
                   AND backend_type = 'client backend'",
                &[],
            )
            .await
            .unwrap();
        row.get::<_, i64>(0) == 0
    })
    .await;
    let rows = admin
        .query(
            "SELECT relname::text, seq_tup_read, coalesce(idx_scan, 0), \
                    coalesce(idx_tup_fetch, 0) \
             FROM pg_stat_user_tables WHERE relname IN ('jobs', 'attempts') ORDER BY relname",
            &[],
        )
        .await
        .unwrap();
    let counts: Vec<(String, i64, i64, i64)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    for (table, seq_read, index_scans, fetched) in &counts {
        assert_eq!(
            *seq_read, 0,
            "{table}: rows read by sequential scans; {counts:?}"
        );
        assert!(*index_scans >= 24 * 16, "{table}: {counts:?}");
        assert!(*fetched < 5_000, "{table}: a whole index read; {counts:?}");
    }
}

/// Each batch statement is planned once on a connection, not once a
/// batch (design §13, "One plan a statement"). Left to itself PostgreSQL
/// keeps a statement's generic plan only while it costs no more than the
/// custom plans it made first, and a batch's generic plan is costed for
/// ten keys where the small batches of a light load are costed for one or
/// two: the read of finished jobs was then planned anew for every batch, a
/// third of what a replay cost the database. On a server of its own with
/// `pg_stat_statements` (planning counted), one pooled connection takes
/// batches of one to six keys, new and then replayed, twenty rounds; every
/// statement over arrays is planned at most a few times however often it
/// ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_batch_statements_are_planned_once_a_connection() {
    let pg = crate::support::postgres::ThrowawayPostgres::start_with(&[
        "shared_preload_libraries=pg_stat_statements",
        "pg_stat_statements.track_planning=on",
    ])
    .await;
    let admin = pg.socket_client().await;
    admin
        .batch_execute("CREATE EXTENSION pg_stat_statements")
        .await
        .unwrap();
    let backend = idemgate_store::postgres::Postgres::new(
        &idemgate_store::postgres::PgSettings {
            pool_size: 1,
            ..idemgate::config::store::pg_settings(&pg.url()).unwrap()
        },
        uuid::Uuid::new_v4(),
    )
    .unwrap();
    backend.migrate().await.unwrap();
    let store = machine(backend).0;
    for round in 0..20 {
        let keys: Vec<String> = (0..1 + round % 6)
            .map(|n| format!("plan-{round}-{n}"))
            .collect();
        let begins = keys.iter().map(|key| {
            let (store, key) = (store.clone(), key.clone());
            async move { store.begin_job(new_job(&key), new_attempt()).await.unwrap() }
        });
        let commits = at_once(begins.collect()).await.into_iter().map(|begin| {
            let store = store.clone();
            async move {
                let Begin::Created(_, attempt) = begin else {
                    panic!("a new key found a job: {begin:?}")
                };
                store
                    .commit(&attempt, &answer_with("plan", 1))
                    .await
                    .unwrap();
            }
        });
        at_once(commits.collect()).await;
        let replays = keys.iter().map(|key| {
            let (store, key) = (store.clone(), key.clone());
            async move { store.begin_job(new_job(&key), new_attempt()).await.unwrap() }
        });
        for begin in at_once(replays.collect()).await {
            assert!(matches!(begin, Begin::Existing(_)), "{begin:?}");
        }
    }
    let rows = admin
        .query(
            "SELECT query, calls, plans FROM pg_stat_statements \
             WHERE query LIKE '%unnest(%' AND calls >= 10 ORDER BY calls DESC",
            &[],
        )
        .await
        .unwrap();
    let counts: Vec<(String, i64, i64)> = rows
        .iter()
        .map(|r| {
            (
                r.get::<_, String>(0).chars().take(60).collect(),
                r.get(1),
                r.get(2),
            )
        })
        .collect();
    assert!(!counts.is_empty(), "no batch statement ran ten times");
    for (query, calls, plans) in &counts {
        assert!(
            *plans <= 3,
            "planned {plans} times in {calls} calls: {query}…; {counts:?}"
        );
    }
}

/// Migrations wait for their advisory lock however long another process
/// holds it (a replica migrating for minutes), not the sessions' lock
/// timeout: given up, a replica's start-up would report the database
/// unreachable, and `idemgate migrate` would fail. Then they run once it
/// is let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_migrations_wait_for_another_migrator_past_the_lock_timeout() {
    let lock_timeout = Duration::from_millis(200);
    let db = crate::support::TestDb::new().await;
    let backend = idemgate_store::postgres::Postgres::new(
        &idemgate_store::postgres::PgSettings {
            lock_timeout,
            ..idemgate::config::store::pg_settings(&db.url).unwrap()
        },
        uuid::Uuid::new_v4(),
    )
    .unwrap();
    let migrator = db.connect().await;
    // The lock `Postgres::migrate` takes (crates/store/src/postgres/migrate.rs).
    migrator
        .execute("SELECT pg_advisory_lock(501639806)", &[])
        .await
        .unwrap();
    let migrating = tokio::spawn(async move { backend.migrate().await });
    let advisory = "wait_event = 'advisory'";
    sessions_wait(
        &db,
        advisory,
        1,
        "the migration waits for the advisory lock",
    )
    .await;
    tokio::time::sleep(lock_timeout * 5).await;
    assert!(
        !migrating.is_finished(),
        "gave up after the lock timeout: {:?}",
        migrating.await
    );
    migrator
        .execute("SELECT pg_advisory_unlock(501639806)", &[])
        .await
        .unwrap();
    migrating
        .await
        .unwrap()
        .expect("migrated once the lock was let go");
    let tables = migrator
        .query_one("SELECT count(*) FROM jobs", &[])
        .await
        .unwrap();
    assert_eq!(tables.get::<_, i64>(0), 0);
}

/// A begin that finds a key's job expired and forgotten deletes it under
/// the job's lock; a claim of that job by another request that commits
/// while the delete waits for the lock is not lost with it. The delete's
/// test of the attempts reads its statement's old snapshot, which cannot
/// see the claim's attempt; the job's `updated_at`, the claim's own, is
/// checked again on the row the delete locked, and keeps it for
/// `SETTLED_GRACE` (docs/design.md §11, "not forgotten"). Before, the
/// claimed attempt went with the job, and the begin made a new job beside
/// the call already at the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_claim_racing_the_delete_of_its_expired_job_keeps_it() {
    let (store, _probe, db) = postgres_with(4, Duration::from_secs(10)).await;
    let mut short = new_job("racing");
    short.ttl = Duration::from_millis(1);
    let Begin::Created(job, first) = store.begin_job(short, new_attempt()).await.unwrap() else {
        panic!("the key existed");
    };
    let failed = AttemptFailure::Failed {
        status: Some(503),
        detail: "busy".into(),
    };
    store.fail_attempt(first.id, failed).await.unwrap();
    let admin = db.connect().await;
    let backdate = "UPDATE jobs SET updated_at = now() - interval '1 minute', \
                    expires_at = now() - interval '1 minute' WHERE id = $1";
    admin.execute(backdate, &[&job.id.0]).await.unwrap();
    // The claim, by hand, held open: the job's row locked and moved on, its
    // second attempt started.
    let claimer = db.connect().await;
    let claim = format!(
        "BEGIN; \
         UPDATE jobs SET version = version + 1, attempt_count = 2, state = 'running', \
                         updated_at = now() WHERE id = '{job}'; \
         INSERT INTO attempts (id, job_id, number, upstream, state, job_version, instance, \
                               lease_expires_at, deadline_at) \
         VALUES (gen_random_uuid(), '{job}', 2, 'primary', 'started', 2, gen_random_uuid(), \
                 now() + interval '30 seconds', now() + interval '5 minutes')",
        job = job.id.0
    );
    claimer.batch_execute(&claim).await.unwrap();
    let begin = tokio::spawn({
        let store = store.clone();
        async move { store.begin_job(new_job("racing"), new_attempt()).await }
    });
    sessions_wait(
        &db,
        "wait_event_type = 'Lock'",
        1,
        "the delete waits for the claim",
    )
    .await;
    claimer.batch_execute("COMMIT").await.unwrap();
    match begin.await.unwrap().unwrap() {
        Begin::Existing(found) => assert_eq!(found.id, job.id),
        Begin::Created(..) => panic!("the claimed job was deleted and a second one begun"),
    }
    let detail = store
        .job_detail(job.id)
        .await
        .unwrap()
        .expect("the job kept");
    let states: Vec<_> = detail.attempts.iter().map(|a| a.state).collect();
    assert_eq!(states, [AttemptState::Failed, AttemptState::Started]);
}

/// Two worker threads, each a runtime of its own with its own lane of the
/// pool (`worker_runtime = "per_thread"`), begin the same twenty keys at
/// the same instant: each key gets one job, created on one lane and found
/// by the other, whatever their batches were. Each lane sent its begins
/// through connections of its own, and a pool of nine is split five and
/// four.
#[test]
fn on_postgres_begins_from_two_workers_lanes_make_one_job_a_key() {
    let setup = tokio::runtime::Runtime::new().unwrap();
    let (store, probe, _db) = setup.block_on(async {
        let db = crate::support::TestDb::new().await;
        let backend = idemgate_store::postgres::Postgres::for_workers(
            &idemgate_store::postgres::PgSettings {
                pool_size: 9,
                connect_timeout: Duration::from_secs(5),
                ..idemgate::config::store::pg_settings(&db.url).unwrap()
            },
            uuid::Uuid::new_v4(),
            2,
        )
        .unwrap();
        backend.migrate().await.unwrap();
        let probe = backend.clone();
        (machine(backend).0, probe, db)
    });
    let keys: Vec<String> = (0..20).map(|n| format!("both-lanes-{n}")).collect();
    let together = Arc::new(std::sync::Barrier::new(2));
    let workers: Vec<_> = (0..2)
        .map(|worker| {
            let (store, probe, keys, together) =
                (store.clone(), probe.clone(), keys.clone(), together.clone());
            std::thread::spawn(move || {
                idemgate_domain::worker::enter(worker);
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                runtime.block_on(async {
                    together.wait();
                    let begins = keys
                        .iter()
                        .map(|key| store.begin_job(new_job(key), new_attempt()));
                    let begun: Vec<Begin> = join_all(begins)
                        .await
                        .into_iter()
                        .map(Result::unwrap)
                        .collect();
                    (begun, probe.connections_by_worker())
                })
            })
        })
        .collect();
    let results: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    for (n, key) in keys.iter().enumerate() {
        let (mut created, mut found) = (Vec::new(), Vec::new());
        for (begun, _) in &results {
            match &begun[n] {
                Begin::Created(job, _) => created.push(job.id),
                Begin::Existing(job) => found.push(job.id),
            }
        }
        assert_eq!(
            created.len(),
            1,
            "{key}: created {created:?}, found {found:?}"
        );
        assert_eq!(found, created, "{key}: found another job");
    }
    // Lane 0 (five connections) served worker 0, lane 1 (four) worker 1.
    let (zero, one) = (&results[0].1, &results[1].1);
    assert!(
        zero[0] >= 1 && one[1] >= 1,
        "worker 0 saw {zero:?}, worker 1 {one:?}"
    );
    assert!(zero[0] <= 5 && one[1] <= 4, "{zero:?} {one:?}");
}
