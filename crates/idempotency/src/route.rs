//! Routes: which requests opt in, and how their jobs are run (upstreams,
//! failover, hedging, contracts, fingerprints, owners); and the router,
//! which finds the route a request falls under. The configuration reads
//! the file into these (`docs/design.md` §11).

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method};

use idemgate_domain::contract::Contract;
use idemgate_domain::fingerprint::BodyRule;
use idemgate_proxy::upstream::UpstreamSettings;
use idemgate_trust::OwnerRule;

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
    /// Silence allowed before an answer's head, over each upstream's own
    /// (`first_byte_timeout`; see [`Route::silences`]).
    pub first_byte_timeout: Option<Duration>,
    /// Silence allowed between body chunks, over each upstream's own
    /// (`stream_idle_timeout`; see [`Route::silences`]).
    pub stream_idle_timeout: Option<Duration>,
    /// The contract every answer must honour.
    pub contract: Option<Arc<Contract>>,
    /// Content types (lower case, without parameters) whose answers stream
    /// through while they are recorded, instead of being buffered.
    pub stream_types: Vec<String>,
    /// What an error an event stream reports after its head does
    /// (`[routes.stream_errors]`, `docs/design.md` §10).
    pub stream_errors: StreamErrors,
    /// The events that mark a whole answer's end (`stream_end_events`): an
    /// event stream that ends without one as its last event stopped short,
    /// and is cut. Empty: any clean end is whole.
    pub stream_end_events: Vec<String>,
    /// Where the owner of a key comes from (the route's `[routes.owner]`,
    /// else `[owner]`).
    pub owner: Arc<OwnerRule>,
    /// Whether only a client that proved itself with a client key may use
    /// the route (keyed or not): required where an upstream holds the
    /// operator's credentials.
    pub require_client: bool,
    /// What a duplicate of a running job is answered.
    pub in_progress: InProgress,
    /// How an attempt of unknown outcome is looked up on its upstream
    /// (`[routes.reconcile]`); `None`: it waits for its late answer or an
    /// operator.
    pub reconcile: Option<Reconcile>,
    /// What a retry of a job whose outcome is unknown meets.
    pub on_unknown: OnUnknown,
    /// What the route's requests speak: plain HTTP, keyed by the header, or
    /// MCP's JSON-RPC, whose tool calls are keyed (`protocol`,
    /// `docs/design.md` §19).
    pub protocol: Protocol,
    /// Whether a request that prefers it (`Prefer: respond-async`) is
    /// answered `202` with where to poll once its answer would keep it
    /// waiting (`respond_async`, `docs/design.md` §10).
    pub respond_async: bool,
}

/// The silences an attempt allows its upstream before it is `unknown`
/// (`docs/design.md` §11): one before the answer's head, while another
/// upstream may still be tried, and one between body chunks, since a long
/// generation may pause between tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Silences {
    /// Before the answer's head (`first_byte_timeout`).
    pub first_byte: Duration,
    /// Between body chunks once the head has come (`stream_idle_timeout`).
    pub stream_idle: Duration,
}

/// What a route's requests speak (`docs/design.md` §19).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Protocol {
    /// HTTP: a request is keyed by its `Idempotency-Key` header, its
    /// intent is its method, path, significant headers and body.
    #[default]
    Http,
    /// The Model Context Protocol over Streamable HTTP (JSON-RPC 2.0): a
    /// `tools/call` is keyed by `params._meta.idempotencyKey` (else the
    /// header), its intent is the tool and its canonical arguments, and
    /// every answer replayed is addressed to the request that asked.
    Mcp(Mcp),
}

/// An MCP route's own settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mcp {
    /// Only these tools are keyed (`keyed_tools`); `None`: every tool.
    pub keyed_tools: Option<Vec<String>>,
    /// JSON-RPC error codes a server's error answer may carry and still
    /// have had no effect, like a `503` (`retryable_rpc_codes`): nothing is
    /// committed and the next retry calls the tool again. Any other error
    /// answer is committed, like a `4xx`.
    pub retryable_codes: Vec<i64>,
}

impl Mcp {
    /// Whether a call of `tool` is keyed on this route.
    pub fn keys(&self, tool: &str) -> bool {
        self.keyed_tools
            .as_ref()
            .is_none_or(|tools| tools.iter().any(|t| t == tool))
    }
}

/// What an error reported inside an event stream, after its `200` head,
/// does (`docs/design.md` §10, "In-band errors and whole streams").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamErrors {
    /// Whether in-band errors are looked for at all.
    pub enabled: bool,
    /// The error types that had no effect, like a `503`: the attempt
    /// fails, nothing is committed, and the next retry runs again. Any
    /// other type is the answer, committed.
    pub retryable: Vec<String>,
}

impl Default for StreamErrors {
    /// On, with the providers' transient types: Anthropic's
    /// `overloaded_error`, `rate_limit_error` and `api_error`, OpenAI's
    /// `server_error`, `rate_limit_exceeded` and `timeout`.
    fn default() -> Self {
        StreamErrors {
            enabled: true,
            retryable: [
                "overloaded_error",
                "rate_limit_error",
                "api_error",
                "server_error",
                "rate_limit_exceeded",
                "timeout",
            ]
            .map(String::from)
            .to_vec(),
        }
    }
}

impl StreamErrors {
    /// Whether an in-band error of type `kind` had no effect.
    pub fn is_retryable(&self, kind: &str) -> bool {
        self.retryable.iter().any(|r| r == kind)
    }
}

/// How an attempt of unknown outcome is settled by its upstream
/// (`docs/design.md` §5, "Unknown attempts are looked up").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reconcile {
    /// `[routes.reconcile] path = …`: the upstream answers what became of a
    /// job at a path of its own, asked with `GET` on the attempt's upstream.
    Lookup {
        /// The lookup path, `{job}` standing for the job id the gateway
        /// forwarded as the idempotency key.
        path: String,
    },
    /// `reconcile = "resend"`: the upstream honours the forwarded
    /// idempotency key itself (the operator's promise, for at least
    /// `attempt_deadline`), so the attempt's request is sent again, byte for
    /// byte, and its answer settles the attempt.
    Resend,
}

impl Reconcile {
    /// The `GET` path that looks up `job`, on a route that looks up.
    pub fn lookup_path(&self, job: &str) -> Option<String> {
        match self {
            Reconcile::Lookup { path } => Some(idemgate_domain::reconcile::lookup_path(path, job)),
            Reconcile::Resend => None,
        }
    }
}

/// What a retry of a job whose outcome is unknown meets (`on_unknown`,
/// `docs/design.md` §5, "Side-effect-free routes may move on").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnUnknown {
    /// `409` until evidence settles the unknown attempt (the default).
    Block,
    /// A new attempt at once, beside the unknown one; the first answer wins.
    /// Only on a `side_effect_free` route: the cost is a second call,
    /// never a second effect.
    NewAttempt,
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

impl Route {
    /// The route used when the file names none: POST and PATCH everywhere,
    /// key optional, every upstream in order.
    pub fn default_route(
        upstreams: &[Arc<UpstreamSettings>],
        owner: Arc<OwnerRule>,
    ) -> Option<Route> {
        let (primary, fallbacks) = upstreams.split_first()?;
        Some(Route {
            name: "default".into(),
            path_prefix: "/".into(),
            methods: vec![Method::POST, Method::PATCH],
            require_key: false,
            body_limit: 10 * 1024 * 1024,
            significant_headers: vec![http::header::CONTENT_TYPE],
            retryable_statuses: vec![429, 502, 503, 529],
            body: BodyRule::default(),
            primary: primary.clone(),
            fallbacks: fallbacks.to_vec(),
            max_attempts: upstreams.len(),
            failover_deadline: Duration::from_secs(60),
            hedge_after: None,
            side_effect_free: false,
            first_byte_timeout: None,
            stream_idle_timeout: None,
            contract: None,
            stream_types: vec!["text/event-stream".into()],
            stream_errors: StreamErrors::default(),
            stream_end_events: Vec::new(),
            owner,
            require_client: false,
            in_progress: InProgress::Hold,
            reconcile: None,
            on_unknown: OnUnknown::Block,
            protocol: Protocol::Http,
            respond_async: true,
        })
    }

    /// Whether this route matches a (normalised) path, on whole segments,
    /// ASCII case aside: Express and ASP.NET route `/V1/Charges` to the
    /// handler of `/v1/charges`, so it must meet that route's rules too
    /// (`docs/design.md` §11). The path keeps its case everywhere else.
    pub fn matches_path(&self, path: &str) -> bool {
        let prefix = self.path_prefix.trim_end_matches('/').as_bytes();
        match path.as_bytes().split_at_checked(prefix.len()) {
            Some((head, rest)) => {
                head.eq_ignore_ascii_case(prefix) && matches!(rest, [] | [b'/', ..])
            }
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
    pub fn streamed(&self, stored: &idemgate_domain::response::StoredResponse) -> bool {
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

    /// The silences an attempt of this route on `upstream` allows: the
    /// route's keys, else the upstream's (which default to its `timeout`).
    pub fn silences(&self, upstream: &UpstreamSettings) -> Silences {
        Silences {
            first_byte: self
                .first_byte_timeout
                .unwrap_or(upstream.first_byte_timeout),
            stream_idle: self
                .stream_idle_timeout
                .unwrap_or(upstream.stream_idle_timeout),
        }
    }

    /// Every upstream the route may use, the primary first.
    pub fn upstreams(&self) -> impl Iterator<Item = &Arc<UpstreamSettings>> {
        std::iter::once(&self.primary).chain(&self.fallbacks)
    }
}

/// The route a request falls under, if any: the first of `routes` (most
/// specific prefix first) whose methods and path prefix match. An MCP
/// route takes every method on its path: its transport's `GET` and
/// `DELETE` pass through to its own upstream.
pub fn find<'a>(routes: &'a [Arc<Route>], method: &Method, path: &str) -> Option<&'a Arc<Route>> {
    routes.iter().find(|r| {
        let mcp = matches!(r.protocol, Protocol::Mcp(_));
        (mcp || r.methods.contains(method)) && r.matches_path(path)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing;

    #[test]
    fn an_mcp_route_takes_every_method_on_its_path_and_an_http_route_its_own() {
        let mcp = testing::route(&["http://a:1", "http://b:1"], |r| {
            r.path_prefix = "/mcp".into();
            r.protocol = Protocol::Mcp(Mcp::default());
        });
        let http = testing::route(&["http://a:1"], |r| r.path_prefix = "/v1".into());
        let routes = [mcp.clone(), http];
        for method in [Method::GET, Method::DELETE, Method::POST] {
            let found = find(&routes, &method, "/mcp").map(|r| r.path_prefix.as_str());
            assert_eq!(found, Some("/mcp"), "{method}");
        }
        assert!(find(&routes, &Method::GET, "/v1/x").is_none());
        assert!(find(&routes, &Method::POST, "/v1/x").is_some());
    }
}
