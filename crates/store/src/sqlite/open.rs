//! Opening the file: the lock that keeps one gateway per file, pragmas,
//! migrations, and the attempts a stopped gateway left `started`.

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::AtomicUsize;
use std::sync::{mpsc, Arc};

use rusqlite::Connection;

use super::change::change_blocking;
use super::group_commit::writer;
use super::rows::{map_sqlite, uuid};
use super::Sqlite;
use crate::{Decide, Lock, StoreError};
use idemgate_domain::attempt::{AttemptFailure, AttemptState};
use idemgate_domain::id::AttemptId;
use idemgate_domain::transition::{self};

mod embedded {
    refinery::embed_migrations!("../../migrations/sqlite");
}

impl Sqlite {
    pub(super) fn open_blocking(path: PathBuf) -> Result<Self, StoreError> {
        let unavailable = |what: String, e: std::io::Error| {
            StoreError::Unavailable(format!("{what}: {e}").into())
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            private_dir()
                .create(dir)
                .map_err(|e| unavailable(format!("cannot create {}", dir.display()), e))?;
        }
        let lock_path = {
            let mut p = path.clone().into_os_string();
            p.push(".lock");
            PathBuf::from(p)
        };
        let lock = private_file()
            .open(&lock_path)
            .map_err(|e| unavailable(format!("cannot open {}", lock_path.display()), e))?;
        // Made here, before SQLite opens it, so that it is born readable by
        // this user only (its WAL and shared-memory files take its mode): it
        // holds every stored answer, and the owner salt's file sits beside it.
        let file = private_file()
            .open(&path)
            .map_err(|e| unavailable(format!("cannot open {}", path.display()), e))?;
        warn_if_shared(&file, &path);
        lock.try_lock().map_err(|_| {
            StoreError::Unavailable(
                format!(
                    "another idemgate is using {}; the embedded store serves one gateway \
                     (use PostgreSQL, database_url, to run several replicas)",
                    path.display()
                )
                .into(),
            )
        })?;
        let mut conn = Connection::open(&path).map_err(map_sqlite)?;
        conn.execute_batch(
            "PRAGMA journal_mode = WAL; \
             PRAGMA synchronous = FULL; \
             PRAGMA foreign_keys = ON; \
             PRAGMA busy_timeout = 5000;",
        )
        .map_err(map_sqlite)?;
        let report = embedded::migrations::runner()
            .set_abort_divergent(true)
            .run(&mut conn)
            .map_err(|e| StoreError::Internal(Box::new(e)))?;
        for m in report.applied_migrations() {
            tracing::info!(migration = %m, "applied migration");
        }
        abandon_orphans(&mut conn)?;
        let (ops, queue) = mpsc::channel();
        let batches = Arc::new(AtomicUsize::new(0));
        let counted = batches.clone();
        std::thread::Builder::new()
            .name("idemgate-sqlite".into())
            .spawn(move || writer(conn, queue, counted))
            .map_err(|e| unavailable("cannot start the store's thread".into(), e))?;
        Ok(Sqlite {
            ops,
            batches,
            path,
            _lock: Arc::new(lock),
        })
    }
}

/// Opens a file, made readable and writable by this user only if it is
/// new; an existing file keeps the mode its operator gave it.
fn private_file() -> std::fs::OpenOptions {
    let mut file = File::options();
    file.create(true).truncate(false).write(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut file, 0o600);
    file
}

/// Warns when the database, made before the gateway made it private or
/// by hand, is open to other users of the machine: it is left as it is
/// (its mode is the operator's), and the warning says how to close it.
fn warn_if_shared(file: &File, path: &std::path::Path) {
    #[cfg(unix)]
    if let Ok(meta) = file.metadata() {
        let mode = std::os::unix::fs::PermissionsExt::mode(&meta.permissions());
        if mode & 0o077 != 0 {
            tracing::warn!(path = %path.display(), mode = format!("{:o}", mode & 0o777), "the embedded store's file, which holds every stored answer, is open to other users (read or write); chmod 600 it and its -wal and -shm files");
        }
    }
}

/// Makes a directory and its missing parents, each made for this user
/// only; existing ones are left as they are.
fn private_dir() -> std::fs::DirBuilder {
    let mut dir = std::fs::DirBuilder::new();
    dir.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut dir, 0o700);
    dir
}

/// Attempts a previous run left `started` can no longer be told apart from
/// ones that acted: each becomes `unknown`.
fn abandon_orphans(conn: &mut Connection) -> Result<(), StoreError> {
    let orphans: Vec<AttemptId> = {
        let mut stmt = conn
            .prepare("SELECT id FROM attempts WHERE state = ?1")
            .map_err(map_sqlite)?;
        let ids = stmt
            .query_map([AttemptState::Started.as_str()], |r| r.get::<_, String>(0))
            .map_err(map_sqlite)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(map_sqlite)?;
        ids.iter()
            .map(|id| uuid(id).map(AttemptId))
            .collect::<Result<_, _>>()?
    };
    for attempt in orphans {
        let failure = AttemptFailure::Unknown {
            detail: "the gateway stopped while this attempt was in flight".into(),
        };
        let decide: Decide = Box::new(move |s, _| transition::settle(s, attempt, &failure));
        if change_blocking(conn, Lock::JobOf(attempt), decide)?.is_ok() {
            tracing::warn!(%attempt, "attempt left in flight by a previous run; outcome unknown");
        }
    }
    Ok(())
}
