//! Routes: which requests opt in, and how their jobs are run (upstreams,
//! failover, hedging, contracts, fingerprints).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method};

use super::file::RouteFile;
use super::upstreams::UpstreamSettings;
use super::{at_least_one, bad, header_name, positive, ConfigError};
use crate::domain::contract::Contract;
use crate::domain::fingerprint::BodyRule;

/// Which requests opt in, and how they are treated.
#[derive(Debug, Clone)]
pub struct Route {
    /// Its name, recorded on jobs.
    pub name: String,
    /// Requests whose path is this, or continues it with `/`, match: the
    /// prefix `/v1/chat` takes `/v1/chat` and `/v1/chat/completions`, not
    /// `/v1/chatty`.
    pub path_prefix: String,
    /// Methods that opt in.
    pub methods: Vec<Method>,
    /// Whether a request without a key is refused (400) rather than passed through.
    pub require_key: bool,
    /// Largest request body accepted (413 past it).
    pub body_limit: usize,
    /// Headers that are part of the fingerprint.
    pub significant_headers: Vec<HeaderName>,
    /// Upstream statuses that mean "had no effect, safe to retry".
    pub retryable_statuses: Vec<u16>,
    /// How bodies are fingerprinted.
    pub body: BodyRule,
    /// Where every first attempt goes.
    pub primary: Arc<UpstreamSettings>,
    /// Where failover and hedged attempts may go, in order.
    pub fallbacks: Vec<Arc<UpstreamSettings>>,
    /// Most attempts the gateway makes within one client request (failover).
    pub max_attempts: usize,
    /// Overall time the gateway may spend on one client request's attempts.
    pub failover_deadline: Duration,
    /// Silence after which a second attempt races the first (side-effect-free routes only).
    pub hedge_after: Option<Duration>,
    /// The route's answers have no external side effects, so hedging is allowed.
    pub side_effect_free: bool,
    /// The contract every answer must honour.
    pub contract: Option<Arc<Contract>>,
    /// Content types (lower case, without parameters) whose answers stream
    /// through while they are recorded, instead of being buffered.
    pub stream_types: Vec<String>,
    /// What a duplicate of a running job is answered.
    pub in_progress: InProgress,
}

/// What a duplicate arriving while its job runs is answered
/// (`docs/design.md` §11, "A duplicate of a running job").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InProgress {
    /// Held until the job settles, then answered with its result (or it
    /// joins the job's stream): a retry gets the answer (the default).
    Hold,
    /// `409 …/request-in-progress` with `Retry-After` at once, as the IETF
    /// draft says a server SHOULD.
    Conflict,
}

impl InProgress {
    fn parse(key: &str, value: Option<&str>) -> Result<InProgress, ConfigError> {
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
}

impl Route {
    /// The route used when the file names none: POST and PATCH everywhere,
    /// key optional, every upstream in order.
    pub fn default_route(upstreams: &[Arc<UpstreamSettings>]) -> Option<Route> {
        let (primary, fallbacks) = upstreams.split_first()?;
        Some(Route {
            name: "default".into(),
            path_prefix: "/".into(),
            methods: vec![Method::POST, Method::PATCH],
            require_key: false,
            body_limit: 10 * 1024 * 1024,
            significant_headers: vec![http::header::CONTENT_TYPE],
            retryable_statuses: vec![429, 502, 503],
            body: BodyRule::default(),
            primary: primary.clone(),
            fallbacks: fallbacks.to_vec(),
            max_attempts: upstreams.len(),
            failover_deadline: Duration::from_secs(60),
            hedge_after: None,
            side_effect_free: false,
            contract: None,
            stream_types: vec!["text/event-stream".into()],
            in_progress: InProgress::Hold,
        })
    }

    /// Whether this route matches a path, on whole segments.
    pub fn matches_path(&self, path: &str) -> bool {
        let prefix = self.path_prefix.trim_end_matches('/');
        match path.strip_prefix(prefix) {
            Some(rest) => rest.is_empty() || rest.starts_with('/'),
            None => false,
        }
    }

    /// Whether an answer with these headers streams (its content type is
    /// one of the route's stream types).
    pub fn streams(&self, headers: &http::HeaderMap) -> bool {
        self.streams_type(
            headers
                .get(http::header::CONTENT_TYPE)
                .map(|v| v.as_bytes()),
        )
    }

    /// Whether a stored answer of this route was streamed (its content
    /// type is one of the route's stream types), so a replay streams too.
    pub fn streamed(&self, stored: &crate::domain::response::StoredResponse) -> bool {
        let content_type = stored
            .headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-type"))
            .map(|(_, v)| v.as_ref());
        self.streams_type(content_type)
    }

    fn streams_type(&self, content_type: Option<&[u8]>) -> bool {
        let Some(value) = content_type.and_then(|v| std::str::from_utf8(v).ok()) else {
            return false;
        };
        let essence = value.split(';').next().unwrap_or("").trim();
        self.stream_types
            .iter()
            .any(|t| t.eq_ignore_ascii_case(essence))
    }

    /// Every upstream the route may use, the primary first.
    pub fn upstreams(&self) -> impl Iterator<Item = &Arc<UpstreamSettings>> {
        std::iter::once(&self.primary).chain(&self.fallbacks)
    }
}

/// The route a request falls under, if any: the first of `routes` (most
/// specific prefix first) whose methods and path prefix match.
pub fn find<'a>(routes: &'a [Arc<Route>], method: &Method, path: &str) -> Option<&'a Arc<Route>> {
    routes
        .iter()
        .find(|r| r.methods.contains(method) && r.matches_path(path))
}

/// The routes of the file, most specific prefix first; the default route
/// when the file has none.
pub(super) fn parse_all(
    files: Vec<RouteFile>,
    upstreams: &[Arc<UpstreamSettings>],
    contracts: &BTreeMap<String, Arc<Contract>>,
) -> Result<Vec<Arc<Route>>, ConfigError> {
    let mut routes = if files.is_empty() {
        Route::default_route(upstreams).into_iter().collect()
    } else {
        files
            .into_iter()
            .enumerate()
            .map(|(i, r)| parse(i, r, upstreams, contracts))
            .collect::<Result<Vec<_>, _>>()?
    };
    // Longest prefix first, so the most specific route wins.
    routes.sort_by_key(|r| std::cmp::Reverse(r.path_prefix.trim_end_matches('/').len()));
    Ok(routes.into_iter().map(Arc::new).collect())
}

fn parse(
    i: usize,
    r: RouteFile,
    upstreams: &[Arc<UpstreamSettings>],
    contracts: &BTreeMap<String, Arc<Contract>>,
) -> Result<Route, ConfigError> {
    let key = |field: &str| format!("routes[{i}].{field}");
    let Some(default) = Route::default_route(upstreams) else {
        return Err(bad("upstreams", "no upstream configured"));
    };
    let path_prefix = r.path_prefix.unwrap_or_else(|| "/".into());
    if !path_prefix.starts_with('/') {
        let why = format!("{path_prefix:?} must start with `/`");
        return Err(bad(key("path_prefix"), why));
    }
    let methods = match r.methods {
        None => default.methods,
        Some(ms) => methods(&key("methods"), &ms)?,
    };
    let significant_headers = match r.significant_headers {
        None => default.significant_headers,
        Some(hs) => header_names(&key("significant_headers"), &hs)?,
    };
    let retryable_statuses = statuses(
        &key("retryable_statuses"),
        r.retryable_statuses.unwrap_or(default.retryable_statuses),
    )?;
    let ignore = pointers(&key("ignore_fields"), r.ignore_fields.unwrap_or_default())?;
    let body_limit = r
        .body_limit
        .map_or(default.body_limit, |b| b.as_u64() as usize);
    if body_limit == 0 {
        return Err(bad(key("body_limit"), "must be greater than zero"));
    }
    let (primary, fallbacks) = match &r.upstreams {
        None => (default.primary, default.fallbacks),
        Some(names) => by_name(&key("upstreams"), names, upstreams)?,
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
        .map(|name| contract(&key("contract"), name, contracts, !fallbacks.is_empty()))
        .transpose()?;
    Ok(Route {
        name: r.name.unwrap_or_else(|| format!("route-{i}")),
        path_prefix,
        methods,
        require_key: r.require_key.unwrap_or(false),
        body_limit,
        significant_headers,
        retryable_statuses,
        body: BodyRule {
            canonical_json: r.canonical_json.unwrap_or(false),
            ignore,
        },
        primary,
        fallbacks,
        max_attempts,
        failover_deadline: positive(
            &key("failover_deadline"),
            r.failover_deadline.unwrap_or(default.failover_deadline),
        )?,
        hedge_after,
        side_effect_free,
        contract,
        stream_types: r.stream_types.map_or(default.stream_types, |types| {
            types
                .iter()
                .map(|t| t.trim().to_ascii_lowercase())
                .collect()
        }),
        in_progress: InProgress::parse(&key("in_progress"), r.in_progress.as_deref())?,
    })
}

fn header_names(key: &str, names: &[String]) -> Result<Vec<HeaderName>, ConfigError> {
    names.iter().map(|h| header_name(key, h)).collect()
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
