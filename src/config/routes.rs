//! `[[routes]]`: read into the idempotency layer's [`Route`]s, each value
//! checked, its defaults filled in, its mistakes named by key.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method};

use super::bounds::within_deadline;
use super::file::{ReconcileFile, RouteFile, StreamErrorsFile};
use super::trust::{owner_rule, OwnerFile};
use super::{at_least_one, bad, header_name, positive, ConfigError};
use idemgate_domain::contract::Contract;
use idemgate_domain::fingerprint::BodyRule;
use idemgate_domain::sse;
use idemgate_idempotency::route::{
    InProgress, Mcp, OnUnknown, Protocol, Reconcile, Route, StreamErrors,
};
use idemgate_proxy::upstream::UpstreamSettings;
use idemgate_trust::{Clients, OwnerRule};

/// The route's `reconcile`: `"resend"`, or a table with the lookup path.
fn reconcile(key: &str, value: toml::Value) -> Result<Reconcile, ConfigError> {
    let either = "write `reconcile = \"resend\"` (the upstream honours the idempotency \
                  key) or a `[routes.reconcile]` table with `path = \"/…/{job}\"` (it \
                  answers lookups)";
    match value {
        toml::Value::String(s) if s == "resend" => Ok(Reconcile::Resend),
        toml::Value::Table(table) => {
            let file: ReconcileFile = toml::Value::Table(table).try_into().map_err(|e| {
                let said = super::file::unknown_key(e.message());
                let said = said.as_deref().unwrap_or(e.message());
                bad(key, format!("{said}; {either}"))
            })?;
            lookup(&format!("{key}.path"), file)
        }
        other => Err(bad(
            key,
            format!("{other} is not a way to reconcile; {either}"),
        )),
    }
}

fn lookup(key: &str, file: ReconcileFile) -> Result<Reconcile, ConfigError> {
    let placeholder = idemgate_domain::reconcile::JOB_PLACEHOLDER;
    let example = "path = \"/v1/charges/lookup/{job}\"";
    let Some(path) = file.path else {
        return Err(bad(
            key,
            format!("give the lookup path, with {placeholder} for the job id: {example}"),
        ));
    };
    if !path.starts_with('/') {
        return Err(bad(
            key,
            format!("{path:?} must start with `/` (a path on the upstream, like {example})"),
        ));
    }
    if !path.contains(placeholder) {
        return Err(bad(
            key,
            format!(
                "{path:?} does not say where the job goes: put {placeholder} where the \
                 upstream expects the idempotency key the gateway forwarded, like {example}"
            ),
        ));
    }
    let sample =
        idemgate_domain::reconcile::lookup_path(&path, "00000000-0000-0000-0000-000000000000");
    if sample.parse::<http::uri::PathAndQuery>().is_err() {
        return Err(bad(
            key,
            format!("{path:?} is not a valid request path; percent-encode what it holds beside {placeholder}"),
        ));
    }
    Ok(Reconcile::Lookup { path })
}

fn on_unknown(
    key: &str,
    value: Option<&str>,
    side_effect_free: bool,
) -> Result<OnUnknown, ConfigError> {
    match value {
        None | Some("block") => Ok(OnUnknown::Block),
        Some("new_attempt") if side_effect_free => Ok(OnUnknown::NewAttempt),
        Some("new_attempt") => Err(bad(
            key,
            "\"new_attempt\" calls the upstream again while the first call may have taken \
             effect; allow it only on a route declared `side_effect_free = true`, or \
             remove it to keep retries blocked until the outcome is known",
        )),
        Some(other) => Err(bad(
            key,
            format!(
                "{other:?} is neither \"block\" (a retry is answered 409 until the \
                 outcome is known) nor \"new_attempt\" (a retry starts a new attempt; \
                 side-effect-free routes only)"
            ),
        )),
    }
}

fn in_progress(key: &str, value: Option<&str>) -> Result<InProgress, ConfigError> {
    match value {
        None | Some("hold") => Ok(InProgress::Hold),
        Some("conflict") => Ok(InProgress::Conflict),
        Some(other) => Err(bad(
            key,
            format!(
                "{other:?} is neither \"hold\" (a duplicate of a running job waits for \
                 its answer) nor \"conflict\" (it is answered 409 at once)"
            ),
        )),
    }
}

/// What every route is parsed against.
pub(super) struct Context<'a> {
    pub(super) upstreams: &'a [Arc<UpstreamSettings>],
    pub(super) contracts: &'a BTreeMap<String, Arc<Contract>>,
    /// `[owner]`, which a route's own `[routes.owner]` overrides.
    pub(super) owner: &'a Arc<OwnerRule>,
    pub(super) clients: &'a Clients,
    pub(super) base_dir: &'a Path,
    /// When an attempt is abandoned: no silence of the route's may outlast it.
    pub(super) attempt_deadline: Duration,
}

/// The routes of the file, most specific prefix first; the default route
/// when the file has none.
pub(super) fn parse_all(
    files: Vec<RouteFile>,
    cx: &Context<'_>,
) -> Result<Vec<Arc<Route>>, ConfigError> {
    let mut routes = if files.is_empty() {
        let default = Route::default_route(cx.upstreams, cx.owner.clone());
        default
            .into_iter()
            .map(|r| guarded(r, "the default route"))
            .collect::<Result<_, _>>()?
    } else {
        files
            .into_iter()
            .enumerate()
            .map(|(i, r)| parse(i, r, cx).and_then(|r| guarded(r, &format!("routes[{i}]"))))
            .collect::<Result<Vec<_>, _>>()?
    };
    // Longest prefix first, so the most specific route wins.
    routes.sort_by_key(|r| std::cmp::Reverse(r.path_prefix.trim_end_matches('/').len()));
    Ok(routes.into_iter().map(Arc::new).collect())
}

/// Route `i` of the file, read step by step: what it matches, how it fails
/// over, what it waits for, who may use it, and what meets a duplicate.
/// The steps check their keys in the order they have always been checked,
/// so a route with two mistakes is told of the same one first.
fn parse(i: usize, r: RouteFile, cx: &Context<'_>) -> Result<Route, ConfigError> {
    let key = |field: &str| format!("routes[{i}].{field}");
    let Some(default) = Route::default_route(cx.upstreams, cx.owner.clone()) else {
        return Err(bad("upstreams", "no upstream configured"));
    };
    let matching = matching(&key, &r, &default)?;
    let failover = failover(&key, &r, &default, cx)?;
    let waits = waits(&key, &r, &default, cx.attempt_deadline)?;
    let owner = route_owner(&key("owner"), r.owner.as_ref(), cx)?;
    let require_client = require_client(&key("require_client"), r.require_client, cx)?;
    let unsettled = unsettled(&key, &r, failover.side_effect_free)?;
    let protocol = protocol(&key, &r)?;
    // A lookup answers in the upstream's own shape, not as a JSON-RPC
    // response to the tool call: committed, its `id` readdressed, it would
    // reach the agent as neither (docs/design.md §19).
    if let (Protocol::Mcp(_), Some(Reconcile::Lookup { .. })) = (&protocol, &unsettled.reconcile) {
        return Err(bad(
            key("reconcile"),
            "an MCP route cannot look a tool call up: a lookup's answer is not the tool's \
             JSON-RPC response; remove [routes.reconcile], or write reconcile = \"resend\" if the \
             MCP server deduplicates tool calls by the forwarded key",
        ));
    }
    Ok(Route {
        name: r.name.unwrap_or_else(|| format!("route-{i}")),
        path_prefix: matching.path_prefix,
        methods: matching.methods,
        require_key: r.require_key.unwrap_or(false),
        body_limit: matching.body_limit,
        significant_headers: matching.significant_headers,
        retryable_statuses: matching.retryable_statuses,
        body: matching.body,
        primary: failover.primary,
        fallbacks: failover.fallbacks,
        max_attempts: failover.max_attempts,
        failover_deadline: failover.failover_deadline,
        hedge_after: failover.hedge_after,
        side_effect_free: failover.side_effect_free,
        first_byte_timeout: waits.first_byte_timeout,
        stream_idle_timeout: waits.stream_idle_timeout,
        contract: failover.contract,
        stream_types: waits.stream_types,
        stream_errors: waits.stream_errors,
        stream_end_events: waits.stream_end_events,
        owner,
        require_client,
        in_progress: unsettled.in_progress,
        reconcile: unsettled.reconcile,
        on_unknown: unsettled.on_unknown,
        respond_async: r.respond_async.unwrap_or(true),
        protocol,
    })
}

/// A route's key, `routes[i].FIELD`, from its field.
type Key<'a> = &'a dyn Fn(&str) -> String;

/// Which requests the route takes, what of them its fingerprint reads, and
/// which of the upstream's statuses may be retried.
struct Matching {
    path_prefix: String,
    methods: Vec<Method>,
    significant_headers: Vec<HeaderName>,
    retryable_statuses: Vec<u16>,
    body: BodyRule,
    body_limit: usize,
}

fn matching(key: Key<'_>, r: &RouteFile, default: &Route) -> Result<Matching, ConfigError> {
    let path_prefix = prefix(&key("path_prefix"), r.path_prefix.clone())?;
    let methods = match &r.methods {
        None => default.methods.clone(),
        Some(ms) => methods(&key("methods"), ms)?,
    };
    let significant_headers = match &r.significant_headers {
        None => default.significant_headers.clone(),
        Some(hs) => significant(&key("significant_headers"), hs)?,
    };
    let retryable_statuses = statuses(
        &key("retryable_statuses"),
        r.retryable_statuses
            .clone()
            .unwrap_or_else(|| default.retryable_statuses.clone()),
    )?;
    let ignore = pointers(
        &key("ignore_fields"),
        r.ignore_fields.clone().unwrap_or_default(),
    )?;
    let body_limit = r
        .body_limit
        .map_or(default.body_limit, |b| b.as_u64() as usize);
    if body_limit == 0 {
        return Err(bad(key("body_limit"), "must be greater than zero"));
    }
    Ok(Matching {
        path_prefix,
        methods,
        significant_headers,
        retryable_statuses,
        body: BodyRule {
            canonical_json: r.canonical_json.unwrap_or(false),
            ignore,
        },
        body_limit,
    })
}

/// Where the route's attempts go, how many, for how long, whether a second
/// one may race the first, and the contract a fallback must be proven on.
struct Failover {
    primary: Arc<UpstreamSettings>,
    fallbacks: Vec<Arc<UpstreamSettings>>,
    max_attempts: usize,
    failover_deadline: Duration,
    hedge_after: Option<Duration>,
    side_effect_free: bool,
    contract: Option<Arc<Contract>>,
}

fn failover(
    key: Key<'_>,
    r: &RouteFile,
    default: &Route,
    cx: &Context<'_>,
) -> Result<Failover, ConfigError> {
    let (primary, fallbacks) = match &r.upstreams {
        None => (default.primary.clone(), default.fallbacks.clone()),
        Some(names) => by_name(&key("upstreams"), names, cx.upstreams)?,
    };
    let max_attempts = at_least_one(
        &key("max_attempts"),
        r.max_attempts.unwrap_or(1 + fallbacks.len()),
    )?;
    let side_effect_free = r.side_effect_free.unwrap_or(false);
    let hedge_after = hedging(&key("hedge_after"), r.hedge_after, side_effect_free)?;
    let contract = r
        .contract
        .as_ref()
        .map(|name| contract(&key("contract"), name, cx.contracts, !fallbacks.is_empty()))
        .transpose()?;
    let failover_deadline = positive(
        &key("failover_deadline"),
        r.failover_deadline.unwrap_or(default.failover_deadline),
    )?;
    Ok(Failover {
        primary,
        fallbacks,
        max_attempts,
        failover_deadline,
        hedge_after,
        side_effect_free,
        contract,
    })
}

/// The silences the route allows over its upstreams' own, the answers that
/// stream through as they come, and what such a stream must say to be
/// committed whole.
struct Waits {
    first_byte_timeout: Option<Duration>,
    stream_idle_timeout: Option<Duration>,
    stream_types: Vec<String>,
    stream_errors: StreamErrors,
    stream_end_events: Vec<String>,
}

fn waits(
    key: Key<'_>,
    r: &RouteFile,
    default: &Route,
    attempt_deadline: Duration,
) -> Result<Waits, ConfigError> {
    let silence = |field: &str, d: Duration| {
        let key = key(field);
        within_deadline(&key, positive(&key, d)?, attempt_deadline)
    };
    Ok(Waits {
        first_byte_timeout: r
            .first_byte_timeout
            .map(|d| silence("first_byte_timeout", d))
            .transpose()?,
        stream_idle_timeout: r
            .stream_idle_timeout
            .map(|d| silence("stream_idle_timeout", d))
            .transpose()?,
        stream_types: r.stream_types.as_ref().map_or_else(
            || default.stream_types.clone(),
            |types| {
                types
                    .iter()
                    .map(|t| t.trim().to_ascii_lowercase())
                    .collect()
            },
        ),
        stream_errors: stream_errors(&key("stream_errors"), r.stream_errors.as_ref())?,
        stream_end_events: end_events(&key("stream_end_events"), r.stream_end_events.clone())?,
    })
}

/// `[routes.stream_errors]` over the defaults (on, the providers'
/// transient types retryable).
fn stream_errors(key: &str, file: Option<&StreamErrorsFile>) -> Result<StreamErrors, ConfigError> {
    let default = StreamErrors::default();
    let Some(file) = file else {
        return Ok(default);
    };
    let retryable = file.retryable.clone().unwrap_or(default.retryable);
    if let Some(blank) = retryable.iter().find(|t| t.trim().is_empty()) {
        return Err(bad(
            format!("{key}.retryable"),
            format!("{blank:?} names no error type; list types like \"overloaded_error\""),
        ));
    }
    Ok(StreamErrors {
        enabled: file.enabled.unwrap_or(default.enabled),
        retryable,
    })
}

/// `stream_end_events`: each an event's name or its whole data.
fn end_events(key: &str, written: Option<Vec<String>>) -> Result<Vec<String>, ConfigError> {
    let ends = written.unwrap_or_default();
    match ends
        .iter()
        .find(|e| e.trim().is_empty() || e.contains(['\r', '\n']))
    {
        Some(bad_end) => Err(bad(
            key,
            format!(
                "{bad_end:?} cannot be an event's name or data; write the names or data that \
                 end a whole answer, like [\"[DONE]\", \"message_stop\", \"response.completed\"]"
            ),
        )),
        None => Ok(ends),
    }
}

/// What meets a duplicate of a job that is not settled: one still running,
/// or one whose attempt's outcome is unknown.
struct Unsettled {
    in_progress: InProgress,
    reconcile: Option<Reconcile>,
    on_unknown: OnUnknown,
}

fn unsettled(
    key: Key<'_>,
    r: &RouteFile,
    side_effect_free: bool,
) -> Result<Unsettled, ConfigError> {
    Ok(Unsettled {
        in_progress: in_progress(&key("in_progress"), r.in_progress.as_deref())?,
        reconcile: r
            .reconcile
            .clone()
            .map(|v| reconcile(&key("reconcile"), v))
            .transpose()?,
        on_unknown: on_unknown(
            &key("on_unknown"),
            r.on_unknown.as_deref(),
            side_effect_free,
        )?,
    })
}

/// The route's `[routes.owner]` over `[owner]`.
fn route_owner(
    key: &str,
    file: Option<&OwnerFile>,
    cx: &Context<'_>,
) -> Result<Arc<OwnerRule>, ConfigError> {
    let Some(file) = file else {
        return Ok(cx.owner.clone());
    };
    if file.salt.is_some() {
        return Err(bad(
            format!("{key}.salt"),
            "the salt is the deployment's: set it under [owner], not per route",
        ));
    }
    Ok(Arc::new(owner_rule(key, file, cx.owner, cx.base_dir)?))
}

fn require_client(key: &str, written: Option<bool>, cx: &Context<'_>) -> Result<bool, ConfigError> {
    if written == Some(true) && cx.clients.clients.is_empty() {
        return Err(bad(
            key,
            "no client can prove itself: declare [[clients]] (a name and the SHA-256 of its key)",
        ));
    }
    Ok(written.unwrap_or(false))
}

/// A route whose upstreams hold the operator's credentials serves only
/// proven clients (`docs/design.md` §15). Every injected header counts as
/// one unless marked `credential = false`.
fn guarded(route: Route, name: &str) -> Result<Route, ConfigError> {
    let Some((holder, header)) = route
        .upstreams()
        .find_map(|u| u.credentials.first().map(|h| (u, h)))
    else {
        return Ok(route);
    };
    if route.require_client {
        return Ok(route);
    }
    let key = if name.starts_with("routes[") {
        format!("{name}.require_client")
    } else {
        "routes".to_owned()
    };
    Err(bad(
        key,
        format!(
            "{name} sends requests to upstream {:?}, which is given a credential of yours \
             ([upstreams.headers] {header}); only proven clients may spend it: set \
             require_client = true on the route and declare [[clients]] with their key \
             digests, or, if {header} proves nothing, mark it `credential = false`",
            holder.name()
        ),
    ))
}

/// The route's path prefix, which must be in normal form: request paths
/// are normalised before they are matched (`docs/design.md` §2), so a
/// prefix in any other spelling would never match.
fn prefix(key: &str, path_prefix: Option<String>) -> Result<String, ConfigError> {
    let path_prefix = path_prefix.unwrap_or_else(|| "/".into());
    if !path_prefix.starts_with('/') {
        return Err(bad(key, format!("{path_prefix:?} must start with `/`")));
    }
    match idemgate_domain::path::normalize(&path_prefix) {
        Ok(Cow::Borrowed(_)) => Ok(path_prefix),
        Ok(Cow::Owned(normal)) => Err(bad(
            key,
            format!(
                "{path_prefix:?} would never match: request paths are normalised before routing; \
                 write {normal:?}"
            ),
        )),
        Err(why) => Err(bad(
            key,
            format!("{path_prefix:?} would never match, since requests with it are refused: {why}"),
        )),
    }
}

fn header_names(key: &str, names: &[String]) -> Result<Vec<HeaderName>, ConfigError> {
    names.iter().map(|h| header_name(key, h)).collect()
}

/// The headers a route fingerprints: never a resume point, which differs
/// between the first try and a resume of the same request
/// (`docs/design.md` §10, "Resume").
fn significant(key: &str, names: &[String]) -> Result<Vec<HeaderName>, ConfigError> {
    let names = header_names(key, names)?;
    let resume = [sse::LAST_EVENT_ID, sse::EVENTS_RECEIVED];
    match names.iter().find(|n| resume.contains(&n.as_str())) {
        Some(name) => Err(bad(
            key,
            format!("{name} says where a retry resumes a stream, not what it asks; remove it"),
        )),
        None => Ok(names),
    }
}

fn statuses(key: &str, statuses: Vec<u16>) -> Result<Vec<u16>, ConfigError> {
    match statuses.iter().find(|s| !(100..=599).contains(*s)) {
        Some(s) => Err(bad(key, format!("{s} is not an HTTP status"))),
        None => Ok(statuses),
    }
}

fn pointers(key: &str, pointers: Vec<String>) -> Result<Vec<String>, ConfigError> {
    match pointers.iter().find(|p| !p.starts_with('/')) {
        Some(p) => Err(bad(
            key,
            format!("{p:?} is not a JSON pointer; write it like \"/metadata/sent_at\""),
        )),
        None => Ok(pointers),
    }
}

fn methods(key: &str, ms: &[String]) -> Result<Vec<Method>, ConfigError> {
    if ms.is_empty() {
        return Err(bad(key, "list at least one method, e.g. [\"POST\"]"));
    }
    ms.iter()
        .map(|m| {
            let upper = m.to_ascii_uppercase();
            match upper.as_str() {
                "GET" | "HEAD" | "OPTIONS" | "CONNECT" | "TRACE" => Err(bad(
                    key,
                    format!("{m} cannot opt in: only request methods with effects (POST, PUT, PATCH, DELETE) can"),
                )),
                _ => Method::from_bytes(upper.as_bytes())
                    .map_err(|_| bad(key, format!("{m:?} is not an HTTP method"))),
            }
        })
        .collect()
}

type RouteUpstreams = (Arc<UpstreamSettings>, Vec<Arc<UpstreamSettings>>);

fn by_name(
    key: &str,
    names: &[String],
    upstreams: &[Arc<UpstreamSettings>],
) -> Result<RouteUpstreams, ConfigError> {
    let chosen = names
        .iter()
        .map(|n| {
            upstreams
                .iter()
                .find(|u| u.name() == n)
                .cloned()
                .ok_or_else(|| {
                    let known: Vec<&str> = upstreams.iter().map(|u| u.name()).collect();
                    bad(
                        key,
                        format!("no upstream is named {n:?}; known: {}", known.join(", ")),
                    )
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut chosen = chosen.into_iter();
    let primary = chosen
        .next()
        .ok_or_else(|| bad(key, "list at least one upstream name"))?;
    Ok((primary, chosen.collect()))
}

fn hedging(
    key: &str,
    hedge_after: Option<Duration>,
    side_effect_free: bool,
) -> Result<Option<Duration>, ConfigError> {
    let Some(after) = hedge_after else {
        return Ok(None);
    };
    if !side_effect_free {
        return Err(bad(
            key,
            "hedging sends the same request twice at once; allow it only on a route declared \
             `side_effect_free = true`",
        ));
    }
    positive(key, after).map(Some)
}

/// The route's contract. One without probes on a route with fallbacks is
/// refused: no fallback could ever be proven, so failover would be silently
/// off.
fn contract(
    key: &str,
    name: &str,
    contracts: &BTreeMap<String, Arc<Contract>>,
    has_fallbacks: bool,
) -> Result<Arc<Contract>, ConfigError> {
    let contract = contracts.get(name).cloned().ok_or_else(|| {
        bad(
            key,
            format!("no [contracts.{name}] section defines this contract"),
        )
    })?;
    if has_fallbacks && contract.probes.is_empty() {
        return Err(bad(
            key,
            format!(
                "contract {name:?} has no probes, so no fallback upstream could ever be proven \
                 and this route would never fail over; add [[contracts.{name}.probes]] or list \
                 only one upstream on the route"
            ),
        ));
    }
    Ok(contract)
}

/// `protocol`: `"http"` (the default) or `"mcp"`, with the MCP route's own
/// keys, which only an MCP route may set.
fn protocol(key: Key<'_>, r: &RouteFile) -> Result<Protocol, ConfigError> {
    match r.protocol.as_deref() {
        None | Some("http") => {
            let mcp_only = [
                ("keyed_tools", r.keyed_tools.is_some()),
                ("retryable_rpc_codes", r.retryable_rpc_codes.is_some()),
            ];
            match mcp_only.iter().find(|(_, set)| *set) {
                Some((name, _)) => Err(bad(
                    key(name),
                    "only a route with protocol = \"mcp\" keys tool calls; set it, or remove this key",
                )),
                None => Ok(Protocol::Http),
            }
        }
        Some("mcp") => {
            // A tool call's intent is its tool and arguments, canonical
            // (docs/design.md §19): these would be read by no one.
            let http_only = [
                ("significant_headers", r.significant_headers.is_some()),
                ("ignore_fields", r.ignore_fields.is_some()),
                ("canonical_json", r.canonical_json.is_some()),
            ];
            if let Some((name, _)) = http_only.iter().find(|(_, set)| *set) {
                return Err(bad(
                    key(name),
                    "a tool call's fingerprint is its tool's name and its arguments as canonical JSON, whatever this says: remove this key from the route with protocol = \"mcp\"",
                ));
            }
            Ok(Protocol::Mcp(Mcp {
                keyed_tools: r.keyed_tools.clone(),
                retryable_codes: r.retryable_rpc_codes.clone().unwrap_or_default(),
            }))
        }
        Some(other) => Err(bad(
            key("protocol"),
            format!("{other:?} is neither \"http\" nor \"mcp\" (JSON-RPC tool calls over Streamable HTTP)"),
        )),
    }
}
