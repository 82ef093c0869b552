//! How long an upstream took to answer a request's head, observed once per
//! request (`docs/design.md` §12, "Metrics"): `answered` when the head
//! came, `error` when the connection failed first, `timeout` when the
//! caller stopped waiting for it (a silence past `first_byte_timeout`, the
//! attempt deadline, a lookup's timeout). A head that comes after the
//! caller gave up is not observed again; a request dropped for any other
//! reason (its client went away, another attempt won) is not observed.
//!
//! Attempts and passed-through requests are timed into
//! `idemgate_upstream_response_seconds{upstream,outcome}`; lookups and
//! resends of unknown attempts into
//! `idemgate_reconcile_seconds{upstream,by,outcome}`, so that they do not
//! blur the latency clients see.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// How the wait for a head ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// The head came.
    Answered,
    /// The connection failed before a head (refused, reset).
    Error,
    /// The caller stopped waiting.
    Timeout,
}

impl Waited {
    const ALL: [Waited; 3] = [Waited::Answered, Waited::Error, Waited::Timeout];

    fn as_str(self) -> &'static str {
        match self {
            Waited::Answered => "answered",
            Waited::Error => "error",
            Waited::Timeout => "timeout",
        }
    }
}

/// One histogram per [`Waited`], of one upstream (looked up once).
#[derive(Clone)]
pub struct Timings([metrics::Histogram; 3]);

impl Timings {
    /// `idemgate_upstream_response_seconds` of `upstream`: each series
    /// exists from the moment the upstream is configured.
    pub fn upstream(upstream: &str) -> Self {
        Timings(Waited::ALL.map(|waited| {
            metrics::histogram!(
                "idemgate_upstream_response_seconds",
                "upstream" => upstream.to_owned(),
                "outcome" => waited.as_str()
            )
        }))
    }

    /// `idemgate_reconcile_seconds` of `upstream`, asked `by` a lookup or
    /// a resend.
    pub fn reconcile(upstream: &str, by: &'static str) -> Self {
        Timings(Waited::ALL.map(|waited| {
            metrics::histogram!(
                "idemgate_reconcile_seconds",
                "upstream" => upstream.to_owned(),
                "by" => by,
                "outcome" => waited.as_str()
            )
        }))
    }

    fn of(&self, waited: Waited) -> &metrics::Histogram {
        &self.0[waited as usize]
    }
}

/// The clock of one request on its way: its own (a passed-through
/// request: no allocation), or the caller's [`Stopwatch`].
pub(super) enum Clock {
    Own(Instant, Arc<Timings>),
    Shared(Stopwatch),
}

impl Clock {
    /// Starts the clock of a request to the upstream timed by `upstream`.
    pub(super) fn start(watch: Option<Stopwatch>, upstream: &Arc<Timings>) -> Clock {
        match watch {
            None => Clock::Own(Instant::now(), upstream.clone()),
            Some(watch) => {
                watch.start(upstream);
                Clock::Shared(watch)
            }
        }
    }

    /// The wait for the head ended as `waited`.
    pub(super) fn observe(&self, waited: Waited) {
        match self {
            Clock::Own(sent, timings) => timings.of(waited).record(sent.elapsed().as_secs_f64()),
            Clock::Shared(watch) => watch.observe(waited),
        }
    }
}

/// Times one request to its head, once. Put into the request's extensions
/// by a caller that watches the clock itself (and may give up first, by
/// [`Stopwatch::timed_out`]); a request without one gets its own.
#[derive(Clone, Default)]
pub struct Stopwatch(Arc<Inner>);

#[derive(Default)]
struct Inner {
    /// Where it is timed into: the caller's choice, else the upstream's.
    timings: OnceLock<Timings>,
    /// When the request was handed to the connection pool.
    sent: OnceLock<Instant>,
    observed: AtomicBool,
}

impl Stopwatch {
    /// A stopwatch that times into `timings` whichever upstream it goes to.
    pub fn into(timings: Timings) -> Self {
        let watch = Stopwatch::default();
        let _ = watch.0.timings.set(timings);
        watch
    }

    /// The request is being sent: the clock starts (once).
    fn start(&self, upstream: &Timings) {
        let _ = self.0.timings.get_or_init(|| upstream.clone());
        let _ = self.0.sent.get_or_init(Instant::now);
    }

    /// The wait ended as `waited`: observed unless it was already, or the
    /// request was never sent.
    pub fn observe(&self, waited: Waited) {
        let (Some(timings), Some(sent)) = (self.0.timings.get(), self.0.sent.get()) else {
            return;
        };
        if !self.0.observed.swap(true, Ordering::AcqRel) {
            timings.of(waited).record(sent.elapsed().as_secs_f64());
        }
    }

    /// The caller stopped waiting for the head.
    pub fn timed_out(&self) {
        self.observe(Waited::Timeout);
    }
}
