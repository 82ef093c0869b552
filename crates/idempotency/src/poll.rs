//! Polling a job answered `202` (`Prefer: respond-async`, `docs/design.md`
//! §10, "Answered later"): `GET {respond_async_path}/{job}` on the proxy
//! listener, by the job's own owner (read as the job's route reads owners),
//! answers `202` while the job runs (or joins its stream live, for a client
//! that accepts `text/event-stream`), its committed answer once it has one,
//! `409` while its outcome is unknown or when nothing runs for it any more.
//! Another owner, a caller that cannot prove who it is, or a job that does
//! not exist (or expired), gets `404`: the same answer, so a job id proves
//! nothing to a stranger. Nothing is proxied.

use std::sync::Arc;
use std::time::SystemTime;

use http::{header, Method, Request, Response};
use uuid::Uuid;

use crate::error::{ClientError, GatewayError};
use crate::replay::{self, Framing};
use crate::respond_async::accepted;
use crate::route::{Protocol, Route};
use crate::shared::Shared;
use idemgate_domain::id::JobId;
use idemgate_domain::job::{Job, JobState};
use idemgate_domain::key::Owner;
use idemgate_proxy::budget::until_sent;
use idemgate_proxy::http::{Body, Outcome};
use idemgate_store::fastpath::Tag;

/// The job a request polls, if it is a poll: a `GET` (or `HEAD`) on
/// `{prefix}/{job}`; `Some(None)` for a poll whose job id does not parse.
pub(crate) fn polled(prefix: &str, method: &Method, path: &str) -> Option<Option<JobId>> {
    if method != Method::GET && method != Method::HEAD {
        return None;
    }
    let id = path.strip_prefix(prefix)?.strip_prefix('/')?;
    Some(Uuid::parse_str(id).ok().map(JobId))
}

/// The answer to a poll of `job`.
pub(crate) async fn answer(
    shared: Arc<Shared>,
    job: Option<JobId>,
    req: Request<Body>,
) -> Response<Body> {
    let answer = match job {
        Some(job) => poll(&shared, job, req).await,
        None => Err(ClientError::NoSuchJob.into()),
    };
    let mut response = answer.unwrap_or_else(GatewayError::into_response);
    let found = match response.status().as_u16() {
        202 => "running",
        404 => "not_found",
        409 => "unsettled",
        401 => "unproven",
        _ => "answered",
    };
    metrics::counter!("idemgate_polls_total", "found" => found).increment(1);
    if response.extensions().get::<Outcome>().is_none() {
        response.extensions_mut().insert(Outcome::Replayed);
    }
    response
}

async fn poll(
    shared: &Shared,
    id: JobId,
    req: Request<Body>,
) -> Result<Response<Body>, GatewayError> {
    let (mut parts, _) = req.into_parts();
    let found = shared.store.job(id).await?;
    let Some((job, route)) = found.and_then(|job| owned(shared, job)) else {
        return Err(ClientError::NoSuchJob.into());
    };
    // Not the job's owner, or not able to say who it is: the same answer
    // as no job at all.
    if !is_owner(shared, &route, &job, &mut parts) {
        return Err(ClientError::NoSuchJob.into());
    }
    let config = &shared.config;
    match job.state {
        JobState::Completed => committed(shared, &job, &route).await,
        JobState::Running => {
            let streams = parts
                .headers
                .get_all(header::ACCEPT)
                .iter()
                .any(|v| v.to_str().is_ok_and(|v| v.contains("text/event-stream")));
            let tag = Tag::of(&job.owner, &job.key);
            if streams {
                if let Some(joined) = shared.live.join(&tag, &job).await {
                    return Ok(in_no_session(&route, joined));
                }
            }
            Ok(accepted(
                id,
                &config.respond_async_path,
                config.retry_after,
                false,
            ))
        }
        JobState::Unknown => Err(ClientError::OutcomeUnknown {
            retry_after: config.retry_after,
        }
        .into()),
        JobState::Open => Err(ClientError::NothingRunning.into()),
    }
}

/// Whether the poll comes from `job`'s owner, as the route that made it
/// tells owners: with its client proven first where the route serves only
/// proven clients, and put where an owner source of `client` reads it
/// (`docs/design.md` §15).
fn is_owner(shared: &Shared, route: &Route, job: &Job, parts: &mut http::request::Parts) -> bool {
    // Anyone is `anonymous`: such a job is never polled (never accepted
    // with a `202` either), or its id alone would hand out its answer.
    if job.owner == Owner::anonymous() {
        return false;
    }
    if route.require_client {
        match shared.trust.prove_client(&parts.headers) {
            Ok(client) => drop(parts.extensions.insert(client)),
            Err(_) => return false,
        }
    }
    shared
        .trust
        .owner(&route.owner, parts)
        .is_ok_and(|owner| owner == job.owner)
}

/// The job, while it has not expired ([`Job::is_expired`]), and the
/// route it was made on (a job of a route the configuration no longer has
/// cannot be polled).
fn owned(shared: &Shared, job: Job) -> Option<(Job, Arc<Route>)> {
    if job.is_expired(SystemTime::now()) {
        return None;
    }
    let route = shared.config.routes.iter().find(|r| r.name == job.route)?;
    Some((job, route.clone()))
}

/// A completed job's answer, held against the memory budget until it is
/// sent; one left in the store is read only once the budget has room for
/// it (`docs/design.md` §18).
async fn committed(
    shared: &Shared,
    job: &Job,
    route: &Route,
) -> Result<Response<Body>, GatewayError> {
    let no_response =
        || GatewayError::internal(format!("completed job {} has no response", job.id));
    let size = job
        .response
        .as_ref()
        .map_or(job.response_in_store, |r| Some(r.body.len()));
    let over = || GatewayError::OverBudget {
        retry_after: shared.config.retry_after,
    };
    let charge = shared
        .budget
        .admit(size.ok_or_else(no_response)?)
        .ok_or_else(over)?;
    let stored = match &job.response {
        Some(stored) => stored.clone(),
        None => shared
            .store
            .response(job.id)
            .await?
            .ok_or_else(no_response)?,
    };
    let framing = Framing::of(route, &stored);
    let answer = in_no_session(route, replay::response(&stored, job.id, true, framing));
    Ok(answer.map(|body| until_sent(body, charge)))
}

/// An MCP call's answer as a poll gets it: the session of the call that
/// made it, and the questions its server asked there, are not the poll's,
/// which is in none (`docs/design.md` §19, "The answer").
fn in_no_session(route: &Route, answer: Response<Body>) -> Response<Body> {
    match route.protocol {
        Protocol::Mcp(_) => crate::mcp::in_no_session(answer),
        _ => answer,
    }
}
