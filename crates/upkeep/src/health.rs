//! The health of what the gateway depends on, the store and Redis, checked
//! every few seconds by a supervised task and reported (`/readyz`'s body,
//! `idemgate_dependency_up`, a log line when it changes) without failing
//! readiness (`docs/design.md` §8).
//!
//! Every replica shares its store and its Redis: if their health failed
//! readiness, one database blip would take every replica out of its Service
//! at once (and in sidecar mode the API's own pods), plain traffic included.
//! A replica whose store does not answer still serves requests without a
//! key, and answers keyed ones `503` at once; that is its readiness.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use crate::supervise::Heartbeat;
use idemgate_domain::BoxError;

/// Asks one dependency whether it answers.
pub type Ping =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

/// How often each dependency is asked, and how long it may take.
pub const INTERVAL: Duration = Duration::from_secs(2);
const PING_TIMEOUT: Duration = Duration::from_secs(2);

/// One dependency's last known health.
#[derive(Debug, Clone)]
pub struct Health {
    /// Its name: `store` or `redis`.
    pub name: &'static str,
    /// Whether it answered the last check; `None` before the first.
    pub up: Option<bool>,
    /// Since when it has been as it is.
    pub since: SystemTime,
    /// Why the last check failed, while it is down.
    pub error: Option<String>,
}

/// What the gateway depends on, and how each is.
pub struct Dependencies {
    checks: Vec<(&'static str, Ping)>,
    board: RwLock<Vec<Health>>,
}

impl Dependencies {
    /// Dependencies asked with these pings, none checked yet.
    pub fn new(checks: Vec<(&'static str, Ping)>) -> Self {
        let board = checks
            .iter()
            .map(|(name, _)| Health {
                name,
                up: None,
                since: SystemTime::now(),
                error: None,
            })
            .collect();
        Dependencies {
            checks,
            board: RwLock::new(board),
        }
    }

    /// Each dependency's last known health.
    pub fn report(&self) -> Vec<Health> {
        self.board.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Checks every dependency each [`INTERVAL`], for as long as it runs (a
    /// supervised task, stopped at shutdown).
    pub async fn watch(self: Arc<Self>, beat: Heartbeat) -> Result<(), BoxError> {
        let mut tick = tokio::time::interval(INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            beat.beat();
            for (index, (name, ping)) in self.checks.iter().enumerate() {
                let answer = match tokio::time::timeout(PING_TIMEOUT, ping()).await {
                    Ok(answer) => answer,
                    Err(_) => Err(format!("no answer within {PING_TIMEOUT:?}")),
                };
                self.record(index, name, answer);
            }
        }
    }

    fn record(&self, index: usize, name: &'static str, answer: Result<(), String>) {
        let up = answer.is_ok();
        metrics::gauge!("idemgate_dependency_up", "dependency" => name).set(f64::from(up));
        let mut board = self.board.write().unwrap_or_else(|e| e.into_inner());
        let health = &mut board[index];
        let changed = health.up != Some(up);
        if changed {
            health.since = SystemTime::now();
        }
        match (&answer, changed) {
            (Err(e), true) => {
                tracing::warn!(dependency = name, error = %e, "{name} does not answer; {} (readiness is unchanged)", consequence(name))
            }
            (Ok(()), true) if health.up.is_some() => {
                tracing::info!(dependency = name, "{name} answers again")
            }
            _ => {}
        }
        health.up = Some(up);
        health.error = answer.err();
    }
}

/// What a dependency being down means for requests, as its log line says
/// it: the store is the arbiter (`docs/design.md` §9), Redis only a fast
/// path (§13).
fn consequence(name: &str) -> &'static str {
    match name {
        "redis" => {
            "nothing is lost: replays and wake-ups come from memory and the store until it is back"
        }
        _ => "keyed requests get 503 until it does, requests without a key still pass",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_check_is_recorded_with_its_reason_and_a_later_answer_clears_it() {
        let ping: Ping = Arc::new(|| Box::pin(async { Ok(()) }));
        let deps = Dependencies::new(vec![("store", ping)]);
        assert_eq!(deps.report()[0].up, None, "nothing known before a check");
        deps.record(0, "store", Err("refused".into()));
        let down = deps.report()[0].clone();
        assert_eq!(
            (down.up, down.error.as_deref()),
            (Some(false), Some("refused"))
        );
        deps.record(0, "store", Err("refused again".into()));
        assert_eq!(
            deps.report()[0].since,
            down.since,
            "still down: since unchanged"
        );
        deps.record(0, "store", Ok(()));
        let up = &deps.report()[0];
        assert_eq!((up.up, up.error.as_deref()), (Some(true), None));
        assert!(up.since >= down.since);
    }
}
