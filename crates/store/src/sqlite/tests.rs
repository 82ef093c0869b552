use super::*;

/// Operations queued while the store's thread is busy share one commit;
/// one that fails inside the batch undoes only its own writes, and the
/// others' are durable.
#[tokio::test]
async fn queued_operations_share_one_commit_and_fail_alone() {
    let dir = tempfile::tempdir().unwrap();
    let store = Sqlite::open(&dir.path().join("batch.db")).await.unwrap();
    store
        .call(|conn| {
            conn.execute_batch("CREATE TABLE t (v TEXT NOT NULL)")
                .map_err(map_sqlite)
        })
        .await
        .unwrap();
    let before = store.batches.load(Ordering::SeqCst);
    // Hold the thread until the three operations below are queued.
    let (release, held) = std::sync::mpsc::channel::<()>();
    let (started, running) = tokio::sync::oneshot::channel();
    let blocker = tokio::spawn({
        let store = store.clone();
        async move {
            store
                .call(move |_| {
                    let _ = started.send(());
                    held.recv().ok();
                    Ok(())
                })
                .await
        }
    });
    running.await.unwrap();
    let insert = |v: &'static str, fail: bool| {
        let store = store.clone();
        async move {
            store
                .call(move |conn| {
                    let tx = immediate(conn)?;
                    tx.execute("INSERT INTO t (v) VALUES (?1)", [v])
                        .map_err(map_sqlite)?;
                    if fail {
                        return Err(StoreError::Contended);
                    }
                    tx.commit().map_err(map_sqlite)
                })
                .await
        }
    };
    let (mut a, mut b, mut c) = (
        Box::pin(insert("a", false)),
        Box::pin(insert("b", true)),
        Box::pin(insert("c", false)),
    );
    // Polled once, each is queued behind the blocker.
    assert!(futures_util::poll!(&mut a).is_pending());
    assert!(futures_util::poll!(&mut b).is_pending());
    assert!(futures_util::poll!(&mut c).is_pending());
    release.send(()).unwrap();
    blocker.await.unwrap().unwrap();
    assert!(a.await.is_ok());
    assert!(matches!(b.await, Err(StoreError::Contended)));
    assert!(c.await.is_ok());
    assert_eq!(
        store.batches.load(Ordering::SeqCst) - before,
        2,
        "the blocker's batch, then one for the three"
    );
    drop(store);
    // Reopened from the file: what was answered as written is there.
    let reopened = Sqlite::open(&dir.path().join("batch.db")).await.unwrap();
    let rows: Vec<String> = reopened
        .call(|conn| {
            let mut stmt = conn
                .prepare("SELECT v FROM t ORDER BY v")
                .map_err(map_sqlite)?;
            let rows = stmt
                .query_map([], |r| r.get(0))
                .map_err(map_sqlite)?
                .collect::<Result<_, _>>()
                .map_err(map_sqlite);
            rows
        })
        .await
        .unwrap();
    assert_eq!(rows, ["a", "c"]);
}

/// The bundled SQLite is one with the fixes released through 2026 (3.46.0,
/// bundled until then, predates them): a downgrade of rusqlite fails here.
#[test]
fn the_bundled_sqlite_is_recent() {
    assert!(
        rusqlite::version_number() >= 3_050_000,
        "bundled SQLite {} is older than 3.50",
        rusqlite::version()
    );
}
