//! Console sessions, kept in this process's memory (`docs/design.md`, §14).
//!
//! A session id is 256 bits from the operating system's CSPRNG; the
//! browser's cookie carries it, and the table keeps only its SHA-256, so a
//! memory dump of the gateway hands out no live session. A session ends
//! when it is signed out, idle too long, old enough, or evicted as the
//! oldest of a full table; expired ones are swept when a session is opened.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

// The OS's CSPRNG, through the crate that already draws the sealing nonces
// (`idemgate_store::seal`): nothing hand-rolled.
use aes_gcm::aead::rand_core::RngCore;
use aes_gcm::aead::OsRng;
use sha2::{Digest, Sha256};

/// How long sessions live, and how many there may be.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Unused this long, a session ends.
    pub idle: Duration,
    /// This long after sign-in, a session ends however busy.
    pub absolute: Duration,
    /// Sessions at most; a sign-in past it evicts the oldest.
    pub max: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            idle: Duration::from_secs(3600),
            absolute: Duration::from_secs(8 * 3600),
            max: 1000,
        }
    }
}

/// The sessions of this process.
pub(super) struct Sessions {
    table: Mutex<HashMap<[u8; 32], Session>>,
    limits: Limits,
}

#[derive(Debug, Clone)]
struct Session {
    opened: Instant,
    seen: Instant,
    /// The name the operator gave at sign-in, recorded with what they
    /// resolve.
    name: Option<String>,
}

impl Session {
    fn live(&self, now: Instant, limits: &Limits) -> bool {
        now.saturating_duration_since(self.seen) < limits.idle
            && now.saturating_duration_since(self.opened) < limits.absolute
    }
}

impl Sessions {
    /// An empty table.
    pub(super) fn new(limits: Limits) -> Self {
        Sessions {
            table: Mutex::default(),
            limits,
        }
    }

    /// Its limits.
    pub(super) fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Opens a session: its id, for the cookie (never kept here).
    #[cfg(test)]
    fn open(&self) -> String {
        self.open_at(Instant::now())
    }

    /// Opens a session for the operator who gave `name` at sign-in.
    pub(super) fn open_named(&self, name: Option<String>) -> String {
        let id = self.open_at(Instant::now());
        if let Some(session) = self.table().get_mut(&digest(&id)) {
            session.name = name;
        }
        id
    }

    /// The name given at sign-in to the live session `id`, if any.
    pub(super) fn name(&self, id: &str) -> Option<String> {
        let now = Instant::now();
        let table = self.table();
        let session = table
            .get(&digest(id))
            .filter(|s| s.live(now, &self.limits))?;
        session.name.clone()
    }

    /// Whether `id` names a live session; using it keeps it from idling out.
    pub(super) fn check(&self, id: &str) -> bool {
        self.check_at(id, Instant::now())
    }

    /// Ends the session `id`, if there is one.
    pub(super) fn close(&self, id: &str) {
        self.table().remove(&digest(id));
    }

    fn open_at(&self, now: Instant) -> String {
        let mut bytes = [0u8; 32];
        OsRng.fill_bytes(&mut bytes);
        let id = hex::encode(bytes);
        let mut table = self.table();
        table.retain(|_, session| session.live(now, &self.limits));
        // Past the cap, the oldest goes (a scan: sign-ins are rare, and the
        // table small).
        while table.len() >= self.limits.max.max(1) {
            let oldest = table.iter().min_by_key(|(_, s)| s.opened).map(|(k, _)| *k);
            let Some(oldest) = oldest else { break };
            table.remove(&oldest);
        }
        let session = Session {
            opened: now,
            seen: now,
            name: None,
        };
        table.insert(digest(&id), session);
        id
    }

    fn check_at(&self, id: &str, now: Instant) -> bool {
        // Looked up by digest: a lookup's timing can tell at most how a
        // guess's SHA-256 compares with stored ones, which does not help
        // find an id that hashes to them.
        let key = digest(id);
        let mut table = self.table();
        match table.get_mut(&key) {
            Some(session) if session.live(now, &self.limits) => {
                session.seen = now;
                true
            }
            Some(_) => {
                table.remove(&key);
                false
            }
            None => false,
        }
    }

    fn table(&self) -> MutexGuard<'_, HashMap<[u8; 32], Session>> {
        // Every change under the lock is one insert or removal: a panic
        // elsewhere cannot leave the table half-changed.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.table().len()
    }
}

fn digest(id: &str) -> [u8; 32] {
    Sha256::digest(id.as_bytes()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    fn sessions(max: usize) -> Sessions {
        Sessions::new(Limits {
            idle: 60 * MINUTE,
            absolute: 8 * 60 * MINUTE,
            max,
        })
    }

    #[test]
    fn ids_are_random_256_bit_and_only_their_digests_are_kept() {
        let s = sessions(10);
        let (a, b) = (s.open(), s.open());
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        let table = s.table();
        assert!(table.contains_key(&digest(&a)));
        assert!(!table.keys().any(|k| hex::encode(k) == a));
    }

    #[test]
    fn a_closed_session_is_refused() {
        let s = sessions(10);
        let (a, b) = (s.open(), s.open());
        assert!(s.check(&a) && s.check(&b));
        s.close(&a);
        assert!(!s.check(&a), "signed out");
        assert!(s.check(&b), "another session stays");
        assert!(!s.check("not-a-session"));
        assert!(!s.check(""));
    }

    #[test]
    fn sessions_end_when_idle_and_when_old_however_busy() {
        let s = sessions(10);
        let t0 = Instant::now();
        let idle = s.open_at(t0);
        assert!(s.check_at(&idle, t0 + 59 * MINUTE));
        // Used at 59 minutes: idle since then.
        assert!(s.check_at(&idle, t0 + 118 * MINUTE));
        assert!(!s.check_at(&idle, t0 + 179 * MINUTE), "idle an hour");
        assert_eq!(s.len(), 0, "an expired session found is removed");

        let busy = s.open_at(t0);
        for minutes in (30..480).step_by(30) {
            assert!(s.check_at(&busy, t0 + minutes * MINUTE), "{minutes} min");
        }
        assert!(!s.check_at(&busy, t0 + 480 * MINUTE), "eight hours old");
    }

    #[test]
    fn a_full_table_evicts_the_oldest_and_sweeps_the_expired() {
        let s = sessions(3);
        let t0 = Instant::now();
        let ids: Vec<String> = (0..3).map(|i| s.open_at(t0 + i * MINUTE)).collect();
        let newest = s.open_at(t0 + 3 * MINUTE);
        assert!(!s.check_at(&ids[0], t0 + 4 * MINUTE), "the oldest evicted");
        assert!(s.check_at(&ids[1], t0 + 4 * MINUTE));
        assert!(s.check_at(&ids[2], t0 + 4 * MINUTE));
        assert!(s.check_at(&newest, t0 + 4 * MINUTE));
        assert_eq!(s.len(), 3);
        // Two hours on, all idle: opening one sweeps them.
        s.open_at(t0 + 130 * MINUTE);
        assert_eq!(s.len(), 1);
    }
}
