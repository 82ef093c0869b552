use super::*;

/// The embedded database holds every stored answer: made by the gateway,
/// its directory, file, lock and WAL are this user's only, whatever the
/// umask. An existing file keeps its mode.
#[cfg(unix)]
#[tokio::test]
async fn a_new_database_is_readable_by_its_user_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("made/here/idemgate.db");
    let store = Sqlite::open(&path).await.unwrap();
    store
        .call(|conn| {
            conn.execute_batch("CREATE TABLE t (v TEXT)")
                .map_err(map_sqlite)
        })
        .await
        .unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir.path().join("made")), 0o700);
    assert_eq!(mode(path.parent().unwrap()), 0o700);
    for file in ["idemgate.db", "idemgate.db.lock", "idemgate.db-wal"] {
        assert_eq!(mode(&path.with_file_name(file)), 0o600, "{file}");
    }
    drop(store);
    let kept = dir.path().join("kept.db");
    std::fs::write(&kept, b"").unwrap();
    std::fs::set_permissions(&kept, std::fs::Permissions::from_mode(0o640)).unwrap();
    let _store = Sqlite::open(&kept).await.unwrap();
    assert_eq!(mode(&kept), 0o640);
}

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

/// Issue 38: an attempt an operator resolved before who was recorded reads
/// back as an unnamed operator's, at its finish, the status they typed no
/// longer standing as the upstream's; a lookup's settlement keeps the
/// upstream's status and has no operator.
#[tokio::test]
async fn attempts_resolved_before_who_was_recorded_read_as_an_unnamed_operators() {
    use crate::Records;
    mod before {
        refinery::embed_migrations!("../../migrations/sqlite");
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    let job = JobId(uuid::Uuid::new_v4());
    let (by_hand, looked_up) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    {
        let mut conn = Connection::open(&path).unwrap();
        before::migrations::runner()
            .set_target(refinery::Target::Version(3))
            .run(&mut conn)
            .unwrap();
        conn.execute(
            "INSERT INTO jobs (id, owner, key, fingerprint, route, state, version, attempt_count, \
                               completed_by, response_status, response_headers, response_body, \
                               created_at, updated_at, expires_at) \
             VALUES (?1, 'anonymous', 'k', ?2, 'default', 'completed', 3, 2, ?3, 201, NULL, x'', \
                     1000, 5000, 99999999999999)",
            params![job.0.to_string(), vec![0u8; 32], by_hand.to_string()],
        )
        .unwrap();
        let attempt = "INSERT INTO attempts (id, job_id, number, upstream, state, job_version, \
                       instance, started_at, finished_at, lease_expires_at, deadline_at, \
                       upstream_status, detail) \
                       VALUES (?1, ?2, ?3, 'primary', ?4, 1, 'x', 1000, ?5, 2000, 9000, ?6, ?7)";
        conn.execute(
            attempt,
            params![
                looked_up.to_string(),
                job.0.to_string(),
                1,
                "failed",
                3000,
                404,
                "reconciled: the upstream answered for it (a lookup, or a resend it deduplicated)"
            ],
        )
        .unwrap();
        conn.execute(
            attempt,
            params![
                by_hand.to_string(),
                job.0.to_string(),
                2,
                "succeeded",
                5000,
                201,
                "resolved by an operator"
            ],
        )
        .unwrap();
    }
    let store = Sqlite::open(&path).await.unwrap();
    let detail = store.job_detail(job).await.unwrap().unwrap();
    let (first, second) = (&detail.attempts[0], &detail.attempts[1]);
    assert_eq!(first.upstream_status, Some(404));
    assert!(first.resolved_by.is_none());
    assert_eq!(second.upstream_status, None, "typed by an operator");
    let resolved = second.resolved_by.as_deref().unwrap();
    assert_eq!(
        resolved.operator,
        idemgate_domain::attempt::UNRECORDED_OPERATOR
    );
    assert_eq!(Some(resolved.at), second.finished_at);
    assert_eq!(detail.job.response.unwrap().status, 201);
}
