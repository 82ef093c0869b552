//! Begins of many requests at once, which PostgreSQL takes in batches
//! (`crates/store/src/postgres/batch.rs`): every store makes one job per
//! key however the begins are grouped; on PostgreSQL, begins that collect
//! while the database is busy go in one statement, a key twice in it waits
//! for the next, and a row that fails the statement fails alone.

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
async fn postgres_with_probe() -> (
    Arc<dyn Store>,
    idemgate_store::postgres::Postgres,
    crate::support::TestDb,
) {
    let db = crate::support::TestDb::new().await;
    let backend = idemgate_store::postgres::Postgres::new(
        &idemgate_store::postgres::PgSettings {
            pool_size: 8,
            connect_timeout: Duration::from_secs(5),
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

/// The database held busy (the jobs table locked by another session) while
/// both batch slots are taken, twenty-three begins collect: twenty keys,
/// one key twice, and two keys whose jobs were given one id (a row the
/// statement must refuse). Released, the unique ones go as one statement,
/// which fails on that row and is split: every other key gets its job, one
/// of the two clashing keys too, the other an error; the key sent twice
/// has one job, its second begin finding it in the next batch.
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
    let slots = idemgate_store::postgres::BEGIN_BATCHES_IN_FLIGHT;
    let first: Vec<_> = (0..slots)
        .map(|n| begin(new_job(&format!("first-{n}"))))
        .collect();
    let watcher = db.connect().await;
    until("both batch slots wait on the lock", async || {
        let row = watcher
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
                &[],
            )
            .await
            .unwrap();
        row.get::<_, i64>(0) as usize == slots
    })
    .await;

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
    assert_eq!(probe.begins_waiting(), 0);
}
