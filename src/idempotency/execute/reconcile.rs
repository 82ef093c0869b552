//! Reconciling an attempt of unknown outcome by asking its upstream
//! (`docs/design.md` §5, "Unknown attempts are looked up").
//!
//! On a route with `[routes.reconcile]`, once an attempt is recorded
//! `unknown` in this process, a task of its own `GET`s the route's lookup
//! path on the attempt's upstream (with the upstream's headers, as the
//! attempt was sent): at once, then 1 s doubling to 30 s, until the
//! attempt's deadline. What each answer means is decided by
//! [`crate::domain::reconcile::verdict`]:
//!
//! - `2xx`: the attempt took effect: the lookup's answer (status, end-to-end
//!   headers, body) is committed by [`Store::reconcile_attempt`], the same
//!   CAS as an operator's resolution; held duplicates are woken by it;
//! - `404`/`410`: it had no effect: the attempt is `failed`, the job reopens;
//! - anything else, or no answer: still unknown; asked again.
//!
//! Every lookup is recorded on the attempt and counted in
//! `idemgate_reconcile_lookups_total{route,result}`. The task stops as soon
//! as the attempt is settled some other way (its late answer, an operator).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderName, HeaderValue, Method, Request};
use tokio::time::Instant;
use tracing::Instrument;

use super::UpstreamService;
use crate::config::{Reconcile, Route, UpstreamId};
use crate::domain::attempt::{AttemptState, Resolution};
use crate::domain::id::{AttemptId, JobId};
use crate::domain::reconcile::{backoff, verdict, Lookup, LookupResult};
use crate::domain::response::StoredResponse;
use crate::domain::transition::Refusal;
use crate::idempotency::replay;
use crate::proxy::http::{full, ProvenClient};
use crate::proxy::upstream::{self, Target};
use crate::store::{Lapsed, Store, StoreError};
use crate::telemetry::Chain;

/// Everything a lookup task needs, gathered when the attempt starts.
pub(super) struct Reconciler {
    pub(super) store: Arc<dyn Store>,
    pub(super) upstream: UpstreamService,
    pub(super) target: UpstreamId,
    /// The route's name (the metric's `route` label).
    pub(super) route: String,
    pub(super) reconcile: Reconcile,
    pub(super) job: JobId,
    pub(super) attempt: AttemptId,
    /// The attempt's deadline: no lookup after it.
    pub(super) deadline: Instant,
    /// How long one lookup may take (the upstream's timeout).
    pub(super) timeout: Duration,
    pub(super) max_response_size: usize,
    /// The header the job id is forwarded in, as on the attempt.
    pub(super) key_header: HeaderName,
    /// The client's proof, when it gave one: an upstream holding the
    /// operator's credential gets them on the lookup as on the attempt.
    pub(super) proven: Option<ProvenClient>,
}

impl super::Runner {
    /// Looks up, on their upstreams, the attempts the sweeper makes
    /// `unknown` (their gateway died), on routes that reconcile; runs until
    /// `lapsed` closes.
    pub(crate) async fn reconcile_lapsed(
        self: Arc<Self>,
        mut lapsed: tokio::sync::mpsc::UnboundedReceiver<Lapsed>,
        routes: Vec<Arc<Route>>,
        upstream: UpstreamService,
    ) {
        while let Some(l) = lapsed.recv().await {
            match self.reconciler_for(l, &routes, &upstream).await {
                Ok(Some(reconciler)) => {
                    let span =
                        tracing::info_span!("reconcile", attempt.id = %l.attempt, job.id = %l.job);
                    tokio::spawn(reconciler.run().instrument(span));
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(attempt = %l.attempt, error = %Chain(&e), "could not read an attempt whose lease lapsed; it is not looked up")
                }
            }
        }
    }

    /// The lookup task for a lapsed attempt, when its route reconciles and
    /// its upstream is still configured.
    async fn reconciler_for(
        &self,
        lapsed: Lapsed,
        routes: &[Arc<Route>],
        upstream: &UpstreamService,
    ) -> Result<Option<Reconciler>, StoreError> {
        let Some(detail) = self.store.job_detail(lapsed.job).await? else {
            return Ok(None);
        };
        let Some(attempt) = detail.attempts.iter().find(|a| a.id == lapsed.attempt) else {
            return Ok(None);
        };
        let Some(route) = routes.iter().find(|r| r.name == detail.job.route) else {
            return Ok(None);
        };
        let Some(reconcile) = &route.reconcile else {
            return Ok(None);
        };
        let Some(target) = route.upstreams().find(|u| u.name() == attempt.upstream) else {
            return Ok(None);
        };
        // The attempt's deadline, on this process's clock.
        let left = (attempt.started_at + self.config.deadline)
            .duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO);
        Ok(Some(Reconciler {
            store: self.store.clone(),
            upstream: upstream.clone(),
            target: target.id.clone(),
            route: route.name.clone(),
            reconcile: reconcile.clone(),
            job: lapsed.job,
            attempt: lapsed.attempt,
            deadline: Instant::now() + left,
            timeout: target.timeout,
            max_response_size: self.config.max_response_size,
            key_header: self.config.forward_key_header.clone(),
            // Only proven clients use a route whose upstream holds a
            // credential (docs/design.md §15): the attempt was sent with it.
            proven: route
                .require_client
                .then(|| ProvenClient(Arc::from("reconcile"))),
        }))
    }
}

/// What became of the attempt after one lookup.
enum Next {
    /// Settled (by this lookup, or by someone else meanwhile): stop.
    Stop,
    /// Still unknown: ask again.
    Again,
}

impl Reconciler {
    /// Asks until the attempt is settled or its deadline passes.
    pub(super) async fn run(self) {
        let mut n = 0u32;
        while Instant::now() < self.deadline {
            if !self.still_unknown().await {
                return;
            }
            n += 1;
            if let Next::Stop = self.ask().await {
                return;
            }
            let wait = backoff(n);
            if Instant::now() + wait >= self.deadline {
                break;
            }
            tokio::time::sleep(wait).await;
        }
        if n > 0 {
            tracing::info!(attempt = %self.attempt, job = %self.job, lookups = n, "attempt deadline passed with its outcome still unknown; it waits for an operator");
        }
    }

    /// Whether the attempt is still `unknown` (a store error counts as yes:
    /// the lookup and the CAS decide anyway).
    async fn still_unknown(&self) -> bool {
        match self.store.job_detail(self.job).await {
            Ok(Some(detail)) => detail
                .attempts
                .iter()
                .any(|a| a.id == self.attempt && a.state == AttemptState::Unknown),
            Ok(None) => false,
            Err(_) => true,
        }
    }

    /// One lookup: asks, records, and applies what it found.
    async fn ask(&self) -> Next {
        let answer = self.lookup().await;
        let status = answer.as_ref().ok().map(|s| s.status);
        let result = verdict(status);
        metrics::counter!(
            "idemgate_reconcile_lookups_total",
            "route" => self.route.clone(),
            "result" => result.as_str()
        )
        .increment(1);
        let lookup = Lookup {
            at: SystemTime::now(),
            status,
            result,
        };
        match &answer {
            Ok(_) => {
                tracing::info!(attempt = %self.attempt, job = %self.job, status, %result, "looked up the attempt's outcome")
            }
            Err(why) => {
                tracing::warn!(attempt = %self.attempt, job = %self.job, error = %why, "could not look up the attempt's outcome; asking again")
            }
        }
        if let Err(e) = self.store.record_lookup(self.attempt, &lookup).await {
            tracing::warn!(attempt = %self.attempt, error = %Chain(&e), "could not record a lookup");
        }
        let resolution = match (result, answer) {
            (LookupResult::SettledSucceeded, Ok(stored)) => Resolution::Succeeded(stored),
            (LookupResult::SettledNoEffect, _) => Resolution::Failed,
            _ => return Next::Again,
        };
        self.settle(resolution).await
    }

    /// The upstream's answer to the lookup, read whole.
    async fn lookup(&self) -> Result<StoredResponse, String> {
        let path = self.reconcile.path_for(&self.job.to_string());
        let mut request = Request::builder()
            .method(Method::GET)
            .uri(path)
            .body(full(bytes::Bytes::new()))
            .map_err(|e| format!("the lookup path is not a request path: {e}"))?;
        if let Ok(v) = HeaderValue::from_str(&self.job.to_string()) {
            request.headers_mut().insert(self.key_header.clone(), v);
        }
        request.extensions_mut().insert(Target(self.target.clone()));
        if let Some(proven) = &self.proven {
            request.extensions_mut().insert(proven.clone());
        }
        let (progress, _) = tokio::sync::watch::channel(0u64);
        let fetch = upstream::fetch(
            self.upstream.clone(),
            request,
            self.max_response_size,
            progress,
        );
        match tokio::time::timeout(self.timeout, fetch).await {
            Ok(Ok(fetched)) => Ok(replay::capture(&fetched)),
            Ok(Err(e)) => Err(Chain(&e).to_string()),
            Err(_) => Err(format!(
                "no answer within {}",
                humantime::format_duration(self.timeout)
            )),
        }
    }

    /// Applies the lookup's finding by the resolution CAS, retrying while
    /// the store is unreachable until the deadline.
    async fn settle(&self, resolution: Resolution) -> Next {
        let mut wait = Duration::from_millis(50);
        loop {
            match self
                .store
                .reconcile_attempt(self.attempt, resolution.clone())
                .await
            {
                Ok(detail) => {
                    tracing::info!(attempt = %self.attempt, job = %self.job, state = %detail.job.state, "attempt reconciled by a lookup");
                    return Next::Stop;
                }
                Err(StoreError::Refused(Refusal::AttemptIs { state, .. })) => {
                    tracing::debug!(attempt = %self.attempt, %state, "attempt settled meanwhile; the lookup's finding is not applied");
                    return Next::Stop;
                }
                Err(e) if e.is_transient() && Instant::now() + wait < self.deadline => {
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
                Err(e) => {
                    tracing::error!(attempt = %self.attempt, error = %Chain(&e), "could not apply the lookup's finding");
                    return Next::Stop;
                }
            }
        }
    }
}
