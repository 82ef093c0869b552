//! One route as `idemgate check` prints it: whole, every setting it runs
//! with (its own or inherited), one topic a line, in the file's words.

use std::fmt::{self, Formatter};

use idemgate_idempotency::route::{InProgress, OnUnknown, Protocol, Reconcile, Route};
use idemgate_trust::{OwnerRule, OwnerSource};

use super::human;

/// `route.NAME = METHODS PREFIX -> PRIMARY`, then its settings, indented.
pub(super) fn write(f: &mut Formatter<'_>, route: &Route) -> fmt::Result {
    let methods: Vec<&str> = route.methods.iter().map(http::Method::as_str).collect();
    writeln!(
        f,
        "route.{} = {} {} -> {}",
        route.name,
        methods.join(","),
        route.path_prefix,
        route.primary.name()
    )?;
    writeln!(f, "  failover: {}", failover(route))?;
    writeln!(f, "  silences: {}", silences(route))?;
    writeln!(f, "  requests: {}", requests(route))?;
    writeln!(f, "  streams: {}", streams(route))?;
    writeln!(f, "  trust: {}", trust(route))?;
    writeln!(f, "  unknown outcomes: {}", unknown(route))?;
    writeln!(f, "  protocol: {}", protocol(&route.protocol))
}

/// Where attempts go, how many, for how long; hedging; the contract a
/// fallback must be proven on.
fn failover(route: &Route) -> String {
    let fallbacks: Vec<&str> = route.fallbacks.iter().map(|u| u.name()).collect();
    let hedge = match route.hedge_after {
        Some(after) => human(after).to_string(),
        None => "off".to_owned(),
    };
    let contract = match &route.contract {
        Some(c) => format!("{} ({} probes)", c.name, c.probes.len()),
        None => "none (any fallback may be tried)".to_owned(),
    };
    format!(
        "fallbacks [{}], max_attempts {}, failover_deadline {}, hedge_after {hedge}, side_effect_free {}, contract {contract}",
        fallbacks.join(", "),
        route.max_attempts,
        human(route.failover_deadline),
        route.side_effect_free,
    )
}

/// The silences each of the route's upstreams is allowed on it
/// ([`Route::silences`]): the route's keys, else the upstream's.
fn silences(route: &Route) -> String {
    let whose = |own: bool| if own { "the route's" } else { "the upstream's" };
    let each: Vec<String> = route
        .upstreams()
        .map(|upstream| {
            let s = route.silences(upstream);
            format!(
                "{}: first_byte_timeout {} ({}), stream_idle_timeout {} ({})",
                upstream.name(),
                human(s.first_byte),
                whose(route.first_byte_timeout.is_some()),
                human(s.stream_idle),
                whose(route.stream_idle_timeout.is_some()),
            )
        })
        .collect();
    each.join("; ")
}

/// What the route takes and fingerprints, and what it may retry.
fn requests(route: &Route) -> String {
    let headers: Vec<&str> = route
        .significant_headers
        .iter()
        .map(http::HeaderName::as_str)
        .collect();
    format!(
        "require_key {}, body_limit {}, significant_headers [{}], retryable_statuses {:?}, canonical_json {}, ignore_fields {:?}",
        route.require_key,
        bytesize::ByteSize(route.body_limit as u64).to_string_as(true),
        headers.join(", "),
        route.retryable_statuses,
        route.body.canonical_json,
        route.body.ignore,
    )
}

/// What streams through, and what of a finished stream is read.
fn streams(route: &Route) -> String {
    let errors = &route.stream_errors;
    let errors = if errors.enabled {
        format!("on, retryable {:?}", errors.retryable)
    } else {
        "off".to_owned()
    };
    format!(
        "stream_types {:?}, stream_end_events {:?}, stream_errors {errors}",
        route.stream_types, route.stream_end_events
    )
}

/// Who owns a key, and who may use the route.
fn trust(route: &Route) -> String {
    format!(
        "owner {}, allow_anonymous {}, require_client {}",
        owner(&route.owner),
        route.owner.allow_anonymous,
        route.require_client
    )
}

/// Where owners come from, in the words of `[owner] sources`.
pub(super) fn owner(rule: &OwnerRule) -> String {
    let sources: Vec<String> = rule.sources.iter().map(source).collect();
    format!("from [{}]", sources.join(", "))
}

/// A source in the words of `[owner] sources`.
fn source(source: &OwnerSource) -> String {
    match source {
        OwnerSource::Header(name) => format!("header {name}"),
        OwnerSource::Cookie(name) => format!("cookie {name}"),
        OwnerSource::Jwt(jwt) => format!("jwt {} from {}", jwt.claim, jwt.from),
        OwnerSource::TrustedHeader(name) => format!("trusted_header {name}"),
        OwnerSource::Client => "client".to_owned(),
        OwnerSource::All(all) => {
            let parts: Vec<String> = all.iter().map(self::source).collect();
            format!("all of ({})", parts.join(" and "))
        }
    }
}

/// What becomes of an attempt whose outcome is unknown, and of the
/// requests that meet its job.
fn unknown(route: &Route) -> String {
    let reconcile = match &route.reconcile {
        Some(Reconcile::Lookup { path }) => format!("lookup GET {path}"),
        Some(Reconcile::Resend) => "resend".to_owned(),
        None => "none (it waits for its late answer or an operator)".to_owned(),
    };
    let on_unknown = match route.on_unknown {
        OnUnknown::Block => "block",
        OnUnknown::NewAttempt => "new_attempt",
    };
    let in_progress = match route.in_progress {
        InProgress::Hold => "hold",
        InProgress::Conflict => "conflict",
    };
    format!(
        "reconcile {reconcile}, on_unknown {on_unknown}, in_progress {in_progress}, respond_async {}",
        route.respond_async
    )
}

fn protocol(protocol: &Protocol) -> String {
    match protocol {
        Protocol::Http => "http (keyed by the Idempotency-Key header)".to_owned(),
        Protocol::Mcp(mcp) => {
            let tools = match &mcp.keyed_tools {
                Some(tools) => format!("{tools:?}"),
                None => "all".to_owned(),
            };
            format!(
                "mcp (keyed_tools {tools}, retryable_rpc_codes {:?})",
                mcp.retryable_codes
            )
        }
    }
}
