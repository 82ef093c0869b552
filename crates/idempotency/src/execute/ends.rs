//! How one attempt's task counts and logs its ends (`docs/design.md` §12,
//! "Metrics"): each end once, when the store took it, never before (a
//! write that never gets in is counted by the sweeper, as a lapsed lease)
//! and never again (a second `unknown`, or an end the store refused
//! because a lookup or an operator had settled the attempt meanwhile).
//! The attempt span's `outcome` is written once, when the task ends.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use idemgate_domain::attempt::{AttemptFailure, AttemptState};
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_store::Store;
use idemgate_telemetry::ends::{self, By};

/// The ends of one attempt, as its task saw them.
pub(super) struct Ends {
    pub(super) route: String,
    pub(super) upstream: String,
    pub(super) attempt: AttemptId,
    pub(super) job: JobId,
    /// Whether the task has recorded the attempt `unknown`: the store
    /// takes no second `unknown` (`transition::settles_from`), so none is
    /// written, counted or logged.
    unknown: AtomicBool,
    /// The last state the task decided, written on its span at its end.
    last: Mutex<Option<AttemptState>>,
}

impl Ends {
    pub(super) fn new(route: &str, upstream: &str, attempt: AttemptId, job: JobId) -> Self {
        Ends {
            route: route.to_owned(),
            upstream: upstream.to_owned(),
            attempt,
            job,
            unknown: AtomicBool::new(false),
            last: Mutex::new(None),
        }
    }

    /// The task decided `state`. `false` when that is a second `unknown`,
    /// which is not recorded at all.
    pub(super) fn decide(&self, state: AttemptState) -> bool {
        if state == AttemptState::Unknown && self.unknown.swap(true, Ordering::AcqRel) {
            return false;
        }
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(state);
        true
    }

    /// Writes the task's last decision as the span's `outcome`, once.
    pub(super) fn write_outcome(&self) {
        if let Some(state) = *self.last.lock().unwrap_or_else(|e| e.into_inner()) {
            tracing::Span::current().record("outcome", state.as_str());
        }
    }

    /// The store took `failure`: counted and logged.
    pub(super) fn failed(&self, failure: &AttemptFailure, by: By) {
        let state = failure.state();
        ends::ended(&self.route, &self.upstream, state.as_str(), by);
        // A rejected answer's detail quotes the answer: it is kept for the
        // operator in the store, never logged.
        let detail = match failure {
            AttemptFailure::Rejected { .. } => "broke the route's contract",
            other => other.detail(),
        };
        tracing::info!(
            attempt = %self.attempt, job = %self.job, route = %self.route,
            upstream = %self.upstream, state = %state, by = by.as_str(), detail,
            "attempt ended without a result"
        );
    }

    /// The store took the attempt's answer as its job's result.
    pub(super) fn committed(&self) {
        let state = AttemptState::Succeeded.as_str();
        ends::ended(&self.route, &self.upstream, state, By::Upstream);
    }

    /// The attempt's answer lost the commit: counted as `superseded` when
    /// that is what the store made of the attempt (a lookup or an operator
    /// that settled it first made it something else, already counted).
    pub(super) async fn lost(&self, store: &dyn Store) {
        let Ok(Some(detail)) = store.job_detail(self.job).await else {
            return;
        };
        let superseded = detail
            .attempts
            .iter()
            .any(|a| a.id == self.attempt && a.state == AttemptState::Superseded);
        if superseded {
            let state = AttemptState::Superseded.as_str();
            ends::ended(&self.route, &self.upstream, state, By::Upstream);
        }
    }
}

/// Sets every route's ends, commits and lookups at zero, per upstream it
/// may use, before the first request: a panel or a rate over them reads 0,
/// not "no data" (`docs/design.md` §12, "Metrics").
pub(crate) fn zero(routes: &[std::sync::Arc<crate::route::Route>]) {
    use crate::route::Reconcile;
    use idemgate_domain::reconcile::LookupResult;
    use idemgate_proxy::upstream::Timings;
    use idemgate_telemetry::ends::Settles;
    for route in routes {
        let upstreams = || route.upstreams().map(|u| u.name());
        let (settles, by) = match route.reconcile {
            None => {
                ends::zero(&route.name, upstreams(), Settles::ByOperator);
                continue;
            }
            Some(Reconcile::Lookup { .. }) => (Settles::ByLookup, By::Lookup),
            Some(Reconcile::Resend) => (Settles::ByResend, By::Resend),
        };
        ends::zero(&route.name, upstreams(), settles);
        for upstream in upstreams() {
            let _ = Timings::reconcile(upstream, by.as_str());
        }
        for result in [
            LookupResult::SettledSucceeded,
            LookupResult::SettledNoEffect,
            LookupResult::StillUnknown,
            LookupResult::Error,
        ] {
            // A resend never proves "no effect" (docs/design.md §5).
            if by == By::Resend && result == LookupResult::SettledNoEffect {
                continue;
            }
            metrics::counter!(
                "idemgate_reconcile_lookups_total",
                "route" => route.name.clone(),
                "by" => by.as_str(),
                "result" => result.as_str()
            )
            .increment(0);
        }
    }
}
