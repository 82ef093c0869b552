//! The admin listener: job inspection and out-of-band resolution (behind a
//! bearer token, or the console's session), the operator console under
//! `/console/`, plus `/healthz`, `/readyz` and `/metrics` (open, for probes
//! and scrapers).
//!
//! | method | path | |
//! |---|---|---|
//! | GET | `/admin/v1/jobs/{id}` | a job and its attempts |
//! | GET | `/admin/v1/jobs?owner=…&key=…` | the same, by owner (its stored form `hmac:<hex>` or `anonymous`, or the raw value of `[owner]`'s first source) and key |
//! | GET | `/admin/v1/jobs?state=unknown&limit=…&before=…` | unknown jobs, newest first, paged (`next` is the following page's `before`), each with its unknown attempts |
//! | GET | `/admin/v1/upstreams` | upstreams and whether they pass their contracts' probes |
//! | POST | `/admin/v1/attempts/resolve` | `{"upstream", "since", "until", "outcome": "failed" \| "cancelled", "dry_run"}`: every unknown attempt on one upstream started in the window (the answer echoes the window read) |
//! | POST | `/admin/v1/attempts/{id}/resolve` | `{"outcome": "failed" \| "cancelled"}` or `{"outcome": "succeeded", "response": {…}}` |
//!
//! A resolution is recorded as the operator's (`resolved_by`: who, as
//! `auth.rs` knew them, and when), never as an upstream status.
//!
//! Here: the router, path to handler. Beside it: `auth.rs` decides who may
//! call `/admin/v1/*`; `jobs.rs` answers the job API (`resolution.rs` reads
//! the resolution body); `health.rs` the open endpoints; `views.rs` writes
//! the JSON; and every failure is an `AdminError` (`error.rs`), rendered as
//! problem+json by the proxy's renderer.

use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use metrics_exporter_prometheus::PrometheusHandle;

use crate::console::{self, Console};
use idemgate_domain::BoxError;
use idemgate_proxy::http::{collect_limited, Body, ClientAddr};
use idemgate_proxy::upstream::UpstreamSettings;
use idemgate_store::Store;
use idemgate_trust::Trust;
use idemgate_upkeep::health::Dependencies;
use idemgate_upkeep::probe::ProbeBoard;
use idemgate_upkeep::supervise::Supervisor;

mod auth;
mod bulk;
mod error;
mod health;
mod jobs;
mod resolution;
mod views;

pub use auth::OPERATOR_HEADER;
use error::AdminError;

/// What the admin listener needs.
pub struct Admin {
    /// The store.
    pub store: Arc<dyn Store>,
    /// The bearer token; `None` turns the job endpoints off.
    pub token: Option<String>,
    /// The console, with its sessions.
    pub console: Console,
    /// Rendered on `/metrics`.
    pub metrics: PrometheusHandle,
    /// The upstreams, listed on `/admin/v1/upstreams`.
    pub upstreams: Vec<Arc<UpstreamSettings>>,
    /// Their contracts' probe verdicts.
    pub probes: Arc<ProbeBoard>,
    /// The background tasks, whose health `/readyz` reports.
    pub tasks: Supervisor,
    /// The store's and Redis' health, which `/readyz` reports (and does
    /// not fail on).
    pub dependencies: Arc<Dependencies>,
    /// How an owner written in a query is read.
    pub trust: Arc<Trust>,
    /// Which routes look unknown attempts up, and until when: what the job
    /// page says of an attempt's next lookup.
    pub reconciling: Reconciling,
}

/// How unknown attempts are looked up on their upstream (`docs/design.md`
/// §5), as far as the job API tells of it.
#[derive(Debug, Clone, Default)]
pub struct Reconciling {
    /// The routes with `reconcile`, by name, and how they ask (`lookup`,
    /// `resend`).
    pub routes: std::collections::BTreeMap<String, &'static str>,
    /// `attempt_deadline`: an attempt is asked about this long after it
    /// started, no longer.
    pub deadline: std::time::Duration,
}

impl Admin {
    /// Answers one admin request.
    pub async fn handle<B>(self: Arc<Self>, req: Request<B>) -> Result<Response<Body>, Infallible>
    where
        B: http_body::Body<Data = Bytes> + Send,
        B::Error: Into<BoxError>,
    {
        Ok(self
            .route(req)
            .await
            .unwrap_or_else(AdminError::into_response))
    }

    /// Path to handler; `/admin/v1/*` only once `auth` lets it through.
    async fn route<B>(&self, req: Request<B>) -> Result<Response<Body>, AdminError>
    where
        B: http_body::Body<Data = Bytes> + Send,
        B::Error: Into<BoxError>,
    {
        let path = req.uri().path().to_owned();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        match (req.method(), segments.as_slice()) {
            (&Method::GET, ["healthz"]) => Ok(health::healthz()),
            (&Method::GET, ["readyz"]) => Ok(self.readiness().await),
            (&Method::GET, ["metrics"]) => Ok(self.metrics()),
            (_, ["console", rest @ ..]) => self.console(req, rest).await,
            (_, ["admin", "v1", rest @ ..]) => {
                let caller = self.authorize(&req)?;
                self.api(req, rest, caller).await
            }
            _ => Err(AdminError::NoSuchEndpoint),
        }
    }

    /// Who calls `/admin/v1/*` (see `auth.rs`). A bearer token is a try at
    /// the admin token, throttled per client address as a sign-in is
    /// (before it is compared: the right token too), so the API is no
    /// faster a way to guess it than the console's form (`docs/design.md`
    /// §14). A request with no `Authorization` (the console's page, on its
    /// session) guesses nothing and is not counted.
    fn authorize<B>(&self, req: &Request<B>) -> Result<String, AdminError> {
        let headers = req.headers();
        let tries = match headers.contains_key(http::header::AUTHORIZATION) {
            true => Some(
                self.console
                    .try_token(client_ip(req))
                    .map_err(AdminError::SignInThrottled)?,
            ),
            false => None,
        };
        let caller = auth::authorize(self.token.as_deref(), &self.console, headers);
        // A right token ends its try and clears nothing: automation polling
        // with it from an address an attacker shares must not reset the
        // attacker's count.
        if let (Err(AdminError::Unauthorized), Some(try_)) = (&caller, tries) {
            try_.failed();
        }
        caller
    }

    /// `/admin/v1/*`, authorized: `caller` is who called (see `auth.rs`).
    async fn api<B>(
        &self,
        req: Request<B>,
        rest: &[&str],
        caller: String,
    ) -> Result<Response<Body>, AdminError>
    where
        B: http_body::Body<Data = Bytes> + Send,
        B::Error: Into<BoxError>,
    {
        match (req.method(), rest) {
            (&Method::GET, ["jobs", id]) => self.job(id).await,
            (&Method::GET, ["jobs"]) => self.jobs(req.uri().query().unwrap_or("")).await,
            (&Method::GET, ["upstreams"]) => {
                let upstreams = views::upstreams(&self.upstreams, &self.probes.snapshot());
                Ok(views::json_response(StatusCode::OK, &upstreams))
            }
            (&Method::POST, ["attempts", "resolve"]) => {
                self.resolve_many(req.into_body(), &caller).await
            }
            (&Method::POST, ["attempts", id, "resolve"]) => {
                self.resolve(id, req.into_body(), &caller).await
            }
            _ => Err(AdminError::NoSuchEndpoint),
        }
    }

    /// The console's pages, sign-in and sign-out (see [`console`]).
    async fn console<B>(&self, req: Request<B>, rest: &[&str]) -> Result<Response<Body>, AdminError>
    where
        B: http_body::Body<Data = Bytes> + Send,
        B::Error: Into<BoxError>,
    {
        let Some(token) = &self.token else {
            return Ok(console::disabled());
        };
        let signed_in = self.console.signed_in(req.headers());
        Ok(match (req.method(), rest) {
            (&Method::GET, []) => console::asset("", signed_in),
            (&Method::GET, [file]) => console::asset(file, signed_in),
            (&Method::POST, ["login"]) => {
                // Throttled before the token is compared, the try counted
                // pending while its body is read (docs/design.md §14).
                let try_ = self
                    .console
                    .try_token(client_ip(&req))
                    .map_err(AdminError::SignInThrottled)?;
                // The admin listener reads bodies without a clock of its
                // own: a form that never comes must not keep its try
                // pending, and the address locked out, for as long as its
                // connection lives.
                let form =
                    tokio::time::timeout(SIGN_IN_BODY, collect_limited(req.into_body(), 4096))
                        .await
                        .map_err(|_| {
                            AdminError::bad_request("the sign-in form did not arrive within 10 s")
                        })?
                        .map_err(|e| AdminError::bad_request(e.to_string()))?;
                self.console.sign_in(try_, &form, token)
            }
            (&Method::POST, ["logout"]) => self.console.sign_out(req.headers()),
            _ => console::not_found(),
        })
    }
}

/// How long a sign-in's form may take to arrive.
const SIGN_IN_BODY: std::time::Duration = std::time::Duration::from_secs(10);

/// The address a console sign-in is counted against: the peer's, or where
/// the peer is a trusted proxy, the client it forwarded for (the last
/// address of `X-Forwarded-For`, the one it appended), so that one
/// balancer's clients are not one address (`docs/design.md` §14, §15).
fn client_ip<B>(req: &Request<B>) -> IpAddr {
    let Some(peer) = req.extensions().get::<ClientAddr>() else {
        return IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED);
    };
    let forwarded = || {
        let last = req
            .headers()
            .get_all("x-forwarded-for")
            .iter()
            .next_back()?;
        let hop = last.to_str().ok()?.rsplit(',').next()?.trim();
        hop.parse::<IpAddr>().ok()
    };
    match peer.trusted.then(forwarded).flatten() {
        Some(client) => client,
        None => peer.addr.ip(),
    }
}
