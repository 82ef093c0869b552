//! Background tasks under watch (`docs/design.md`, §8).
//!
//! The gateway's upkeep (lease renewal, the sweeper, probes, the wake-up
//! listeners) runs beside the request path, where nobody would notice it
//! stop. Each runs under a [`Supervisor`]:
//!
//! - a task that panics, fails or ends is logged and started again after a
//!   backoff (100 ms doubling to 5 s, back to 100 ms once a run lasted a
//!   minute), until shutdown;
//! - a task that beats its [`Heartbeat`] less often than it promised is
//!   *stuck*;
//! - `/readyz` reports every task, and fails while one is dead after a panic
//!   or stuck. A task that ended with an error (a listener that lost its
//!   database or Redis) is reconnecting, which is reported but does not fail
//!   readiness: the store's own health is checked separately, and Redis is
//!   only ever a fast path.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use idemgate_domain::BoxError;
use idemgate_telemetry::Chain;

const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// A run that lasted this long counts as healthy: the next failure starts
/// the backoff afresh.
const HEALTHY_RUN: Duration = Duration::from_secs(60);

/// Starts and watches background tasks.
#[derive(Clone)]
pub struct Supervisor {
    tasks: Arc<Mutex<Vec<Arc<Watched>>>>,
    shutdown: CancellationToken,
}

/// How a task promises to show it is alive.
#[derive(Debug, Clone, Copy)]
pub enum Beats {
    /// It waits on events that may not come for a long time (a listener);
    /// it cannot be stuck, only dead.
    Never,
    /// It beats at least this often while it runs.
    Every(Duration),
}

/// Handed to a task so it can say it is alive.
#[derive(Clone)]
pub struct Heartbeat(Arc<Watched>);

struct Watched {
    name: &'static str,
    beats: Beats,
    health: Mutex<Health>,
}

#[derive(Debug, Clone)]
struct Health {
    status: Status,
    last_beat: Instant,
    restarts: u64,
    last_failure: Option<String>,
}

/// Where a task stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Running.
    Running,
    /// Ended with an error (a lost connection) and waiting to start again.
    Reconnecting,
    /// Panicked (a defect) and waiting to start again.
    Dead,
}

/// One task's state, for `/readyz`.
#[derive(Debug, Clone)]
pub struct Report {
    /// Its name.
    pub name: &'static str,
    /// Where it stands.
    pub status: Status,
    /// Running, but not beating as often as it promised.
    pub stuck: bool,
    /// How often it was started again.
    pub restarts: u64,
    /// Why it last ended.
    pub last_failure: Option<String>,
}

impl Report {
    /// Whether this task keeps the gateway from being ready.
    pub fn blocks_readiness(&self) -> bool {
        self.status == Status::Dead || self.stuck
    }
}

impl Heartbeat {
    /// Says the task is alive now.
    pub fn beat(&self) {
        self.0.lock().last_beat = Instant::now();
    }
}

impl Watched {
    fn lock(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn report(&self) -> Report {
        let health = self.lock().clone();
        let stuck = match self.beats {
            Beats::Never => false,
            Beats::Every(every) => {
                health.status == Status::Running && health.last_beat.elapsed() > every
            }
        };
        Report {
            name: self.name,
            status: health.status,
            stuck,
            restarts: health.restarts,
            last_failure: health.last_failure,
        }
    }
}

impl Supervisor {
    /// A supervisor whose tasks all stop when `shutdown` is cancelled.
    pub fn new(shutdown: CancellationToken) -> Self {
        Supervisor {
            tasks: Arc::default(),
            shutdown,
        }
    }

    /// Runs `make(heartbeat)` as task `name`, again after every end, until
    /// shutdown. The future it makes is dropped at shutdown.
    pub fn spawn<F, Fut>(&self, name: &'static str, beats: Beats, mut make: F)
    where
        F: FnMut(Heartbeat) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
    {
        // At zero from the start: one series per task (docs/design.md §12).
        metrics::counter!("idemgate_task_restarts_total", "task" => name).increment(0);
        let watched = Arc::new(Watched {
            name,
            beats,
            health: Mutex::new(Health {
                status: Status::Running,
                last_beat: Instant::now(),
                restarts: 0,
                last_failure: None,
            }),
        });
        self.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(watched.clone());
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            let mut backoff = FIRST_BACKOFF;
            loop {
                let started = Instant::now();
                {
                    let mut health = watched.lock();
                    health.status = Status::Running;
                    health.last_beat = started;
                }
                let mut run = tokio::spawn(make(Heartbeat(watched.clone())));
                let ended = tokio::select! {
                    () = shutdown.cancelled() => {
                        run.abort();
                        return;
                    }
                    ended = &mut run => ended,
                };
                if shutdown.is_cancelled() {
                    return;
                }
                let (status, why) = match ended {
                    Ok(Ok(())) => (Status::Reconnecting, "ended".to_owned()),
                    Ok(Err(e)) => (Status::Reconnecting, Chain(e.as_ref()).to_string()),
                    Err(e) if e.is_panic() => (Status::Dead, panic_message(e.into_panic())),
                    Err(e) => (Status::Dead, e.to_string()),
                };
                if started.elapsed() >= HEALTHY_RUN {
                    backoff = FIRST_BACKOFF;
                }
                {
                    let mut health = watched.lock();
                    health.status = status;
                    health.restarts += 1;
                    health.last_failure = Some(why.clone());
                }
                metrics::counter!("idemgate_task_restarts_total", "task" => name).increment(1);
                // A lost connection is said once per outage, not every retry.
                match status {
                    Status::Dead => {
                        tracing::error!(task = name, panic = %why, retry_in = ?backoff, "background task panicked; restarting it")
                    }
                    _ if backoff == FIRST_BACKOFF => {
                        tracing::warn!(task = name, error = %why, "background task stopped; restarting it")
                    }
                    _ => {
                        tracing::debug!(task = name, error = %why, retry_in = ?backoff, "background task still failing")
                    }
                }
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        });
    }

    /// Every task's state.
    pub fn report(&self) -> Vec<Report> {
        self.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|t| t.report())
            .collect()
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(payload) => payload.downcast_ref::<&str>().map_or_else(
            || "a panic without a message".to_owned(),
            |s| (*s).to_owned(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find(s: &Supervisor, name: &str) -> Report {
        s.report().into_iter().find(|r| r.name == name).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicking_task_is_dead_then_restarted() {
        let s = Supervisor::new(CancellationToken::new());
        let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = runs.clone();
        s.spawn("doomed", Beats::Never, move |_| {
            let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move {
                if n < 2 {
                    panic!("boom {n}");
                }
                std::future::pending::<()>().await;
                Ok(())
            }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        let r = find(&s, "doomed");
        assert_eq!(r.status, Status::Dead);
        assert!(r.blocks_readiness());
        assert_eq!(r.last_failure.as_deref(), Some("boom 0"));
        // Backoff 100 ms, then 200 ms: the third run lives.
        tokio::time::sleep(Duration::from_millis(400)).await;
        let r = find(&s, "doomed");
        assert_eq!(r.status, Status::Running);
        assert_eq!(r.restarts, 2);
        assert!(!r.blocks_readiness());
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_that_stops_beating_is_stuck() {
        let s = Supervisor::new(CancellationToken::new());
        s.spawn(
            "sleepy",
            Beats::Every(Duration::from_secs(1)),
            |beat| async move {
                beat.beat();
                std::future::pending::<()>().await;
                Ok(())
            },
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!find(&s, "sleepy").stuck);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let r = find(&s, "sleepy");
        assert!(r.stuck && r.blocks_readiness());
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_that_fails_reconnects_without_blocking_readiness() {
        let s = Supervisor::new(CancellationToken::new());
        s.spawn("listener", Beats::Never, |_| async {
            Err::<(), BoxError>("connection refused".into())
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        let r = find(&s, "listener");
        assert_eq!(r.status, Status::Reconnecting);
        assert!(!r.blocks_readiness());
        assert_eq!(r.last_failure.as_deref(), Some("connection refused"));
    }
}
