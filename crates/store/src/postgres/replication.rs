//! Running on a primary that can fail over (docs/design.md §13).
//!
//! - A promoted standby has every commit the old primary acknowledged only
//!   if replication was synchronous. The gateway cannot enforce that, but it
//!   looks each time it (re)connects its listener (at start-up, and after
//!   every failover) and warns when it can see the guarantee is not in place.
//! - Connections made before the database first answered "read-only"
//!   (SQLSTATE 25006: the server they reach is, or has become, a standby)
//!   are not reused: the pool makes new ones, which `target_session_attrs=
//!   read-write` points at the primary.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use deadpool_postgres::{Hook, HookError, Metrics};
use tokio_postgres::Client;

/// A clock for [`READ_ONLY_SEEN`].
static EPOCH: OnceLock<Instant> = OnceLock::new();
/// Nanoseconds after [`EPOCH`] when a write was last refused as read-only;
/// 0 when never. Process-wide: a false alarm costs a reconnection.
static READ_ONLY_SEEN: AtomicU64 = AtomicU64::new(0);

fn since_epoch(at: Instant) -> u64 {
    let epoch = *EPOCH.get_or_init(Instant::now);
    at.saturating_duration_since(epoch).as_nanos() as u64
}

/// Notes that the database refused a write as read-only.
pub(super) fn saw_read_only() {
    let now = since_epoch(Instant::now()).max(1);
    READ_ONLY_SEEN.fetch_max(now, Ordering::AcqRel);
    metrics::counter!("idemgate_database_read_only_total").increment(1);
}

/// A pool hook refusing connections made before the last read-only refusal.
pub(super) fn fence() -> Hook {
    Hook::sync_fn(|_, metrics: &Metrics| {
        let seen = READ_ONLY_SEEN.load(Ordering::Acquire);
        if seen != 0 && since_epoch(metrics.created) < seen {
            return Err(HookError::Message(
                "made before the database turned read-only".into(),
            ));
        }
        Ok(())
    })
}

/// What the gateway can see of its database's replication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replication {
    /// `synchronous_commit` as this session has it.
    pub synchronous_commit: String,
    /// `synchronous_standby_names`.
    pub standby_names: String,
    /// Whether the server is a standby.
    pub in_recovery: bool,
    /// Standbys streaming from it (`pg_stat_replication`).
    pub standbys: i64,
    /// Of which synchronous (or in a synchronous quorum).
    pub synchronous: i64,
}

impl Replication {
    /// Reads it on `client`.
    pub(super) async fn read(client: &Client) -> Result<Self, tokio_postgres::Error> {
        let row = client
            .query_one(
                "SELECT current_setting('synchronous_commit'), \
                        current_setting('synchronous_standby_names'), \
                        pg_is_in_recovery(), \
                        (SELECT count(*) FROM pg_stat_replication), \
                        (SELECT count(*) FROM pg_stat_replication \
                          WHERE sync_state IN ('sync', 'quorum'))",
                &[],
            )
            .await?;
        Ok(Replication {
            synchronous_commit: row.get(0),
            standby_names: row.get(1),
            in_recovery: row.get(2),
            standbys: row.get(3),
            synchronous: row.get(4),
        })
    }

    /// Why a failover could lose a commit this server acknowledged, if it
    /// can see why; `None` when it cannot (no standby in sight, or every
    /// commit waits for a synchronous one).
    pub fn risk(&self) -> Option<String> {
        if self.in_recovery {
            return Some(
                "the database is a standby (in recovery): every write will fail; \
                 point database_url at the primary, or list every host with \
                 target_session_attrs=read-write"
                    .into(),
            );
        }
        if self.standbys == 0 {
            return None;
        }
        let local = matches!(self.synchronous_commit.as_str(), "off" | "local");
        if self.standby_names.trim().is_empty() || local {
            return Some(format!(
                "{} standby(s) replicate this database asynchronously \
                 (synchronous_standby_names = '{}', synchronous_commit = {}): a standby \
                 promoted after a crash can miss commits the gateway acknowledged, and \
                 a retry of such a key would execute again; set synchronous_standby_names \
                 and synchronous_commit = on (or remote_apply)",
                self.standbys, self.standby_names, self.synchronous_commit
            ));
        }
        if self.synchronous == 0 {
            return Some(format!(
                "synchronous_standby_names = '{}' names no standby that is connected \
                 and synchronous ({} streaming): commits wait until one is",
                self.standby_names, self.standbys
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(commit: &str, names: &str, standbys: i64, synchronous: i64) -> Replication {
        Replication {
            synchronous_commit: commit.into(),
            standby_names: names.into(),
            in_recovery: false,
            standbys,
            synchronous,
        }
    }

    #[test]
    fn only_synchronous_replication_keeps_the_guarantee() {
        assert_eq!(seen("on", "", 0, 0).risk(), None, "no standby in sight");
        assert_eq!(seen("on", "*", 1, 1).risk(), None);
        assert_eq!(seen("remote_apply", "FIRST 1 (a, b)", 2, 1).risk(), None);
        let asynchronous = seen("on", "", 1, 0).risk().unwrap();
        assert!(asynchronous.contains("asynchronously"), "{asynchronous}");
        assert!(seen("local", "*", 1, 1)
            .risk()
            .unwrap()
            .contains("synchronous_commit = local"));
        assert!(seen("on", "nobody", 1, 0)
            .risk()
            .unwrap()
            .contains("names no standby"));
        let standby = Replication {
            in_recovery: true,
            ..seen("on", "", 0, 0)
        };
        assert!(standby.risk().unwrap().contains("standby"));
    }

    #[test]
    fn connections_older_than_a_read_only_refusal_are_not_reused() {
        let before = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        saw_read_only();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let after = Instant::now();
        let seen = READ_ONLY_SEEN.load(Ordering::Acquire);
        assert!(since_epoch(before) < seen);
        assert!(since_epoch(after) > seen);
    }
}
