//! Method overrides (`docs/design.md` §2, "One reading of a request
//! line"): Rails, Express, ASP.NET and Laravel run the method a header or
//! a `_method` query parameter names in place of the line's, so the route
//! that method takes must be the one the gateway applied. What a request's
//! overrides name is read here, whole; whether that steps around a route,
//! and what the fingerprint then names, is decided here too.

use std::borrow::Cow;
use std::sync::Arc;

use http::{HeaderName, Method, Request};

use crate::route::{self, Protocol, Route};
use idemgate_proxy::http::{spelling, Body};

/// The headers Rails, Express, ASP.NET and others take a request's
/// method from in place of its line's.
const METHOD_OVERRIDES: [HeaderName; 3] = [
    HeaderName::from_static("x-http-method-override"),
    HeaderName::from_static("x-http-method"),
    HeaderName::from_static("x-method-override"),
];

/// What a request's method-overrides name besides its line's method.
enum Overrides {
    /// Nothing else.
    None,
    /// These methods, as upstreams read them (upper-cased).
    Methods(Vec<Method>),
    /// A value no upstream reads as one method (`DELETE,POST`: Express
    /// takes the first).
    Unreadable(String),
}

/// Every method `req` names in a method-override header (every line of
/// each, in any spelling, `_` for `-`, each item of a list) or in a
/// `_method` query parameter (Express's, Laravel's), other than its line's.
/// A request with none costs three lookups and a look at its names and
/// query.
fn overrides(method: &Method, headers: &http::HeaderMap, uri: &http::Uri) -> Overrides {
    let query = uri.query().unwrap_or("");
    let possible = METHOD_OVERRIDES
        .iter()
        .any(|name| headers.contains_key(name))
        || headers.keys().any(|name| name.as_str().contains('_'))
        || query.contains('%')
        || query
            .as_bytes()
            .windows(6)
            .any(|w| w.eq_ignore_ascii_case(b"method"));
    if !possible {
        return Overrides::None;
    }
    let sent = headers
        .iter()
        .filter(|(name, _)| spelling::is_spelling_of(name, &METHOD_OVERRIDES))
        .map(|(_, value)| value.as_bytes().to_vec());
    let mut methods = Vec::new();
    for value in sent.chain(query_method(query)) {
        // An empty item names nothing, as Express, ASP.NET and Symfony
        // read it.
        let items = value
            .split(|b| *b == b',')
            .filter(|i| !i.trim_ascii().is_empty());
        for item in items {
            let upper = item.trim_ascii().to_ascii_uppercase();
            let Ok(named) = Method::from_bytes(&upper) else {
                return Overrides::Unreadable(String::from_utf8_lossy(&value).into_owned());
            };
            if named != *method && !methods.contains(&named) {
                methods.push(named);
            }
        }
    }
    match methods.is_empty() {
        true => Overrides::None,
        false => Overrides::Methods(methods),
    }
}

/// The values of a query's `_method` parameters, percent-decoded, the
/// name read as PHP reads it for Laravel and Symfony (leading spaces
/// dropped, `.` and ` ` as `_`: `?.method=` is `_method`).
fn query_method(query: &str) -> impl Iterator<Item = Vec<u8>> + '_ {
    query.split('&').filter_map(|pair| {
        let (name, value) = pair.split_once('=')?;
        let name = spelling::percent_decoded(name.as_bytes());
        let name: Vec<u8> = (name.trim_ascii_start().iter())
            .map(|b| if matches!(b, b'.' | b' ') { b'_' } else { *b })
            .collect();
        name.eq_ignore_ascii_case(b"_method")
            .then(|| spelling::percent_decoded(value.as_bytes()))
    })
}

/// The methods `req`'s overrides name beside its line's (none, nearly
/// always), or, refused, what one names that would step around a route's
/// rules: its upstream runs the named method, so the route that method
/// takes (`found` for the line's) must be the one the line took. A safe
/// method (`GET`, `HEAD`, …) that no route takes, named on a line a route
/// takes, runs nothing; an MCP route reads the method itself (a `DELETE`
/// ends a session), so any other is refused there; a value that names no
/// one method is refused on a path any route takes.
pub(crate) fn read(
    routes: &[Arc<Route>],
    found: Option<&Arc<Route>>,
    req: &Request<Body>,
) -> Result<Vec<Method>, String> {
    let path = req.uri().path();
    let methods = match overrides(req.method(), req.headers(), req.uri()) {
        Overrides::None => return Ok(Vec::new()),
        Overrides::Unreadable(value) => {
            let routed = routes.iter().any(|route| route.matches_path(path));
            return if routed { Err(value) } else { Ok(Vec::new()) };
        }
        Overrides::Methods(methods) => methods,
    };
    let mcp = found.is_some_and(|route| matches!(route.protocol, Protocol::Mcp(_)));
    let steps_around = |named: &Method| {
        let other = route::find(routes, named, path);
        let same = match (found, other) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (a, b) => a.is_none() && b.is_none(),
        };
        // A safe method runs nothing, where no other route takes it.
        let safe = named.is_safe() && found.is_some() && other.is_none();
        mcp || !(same || safe)
    };
    match methods.iter().find(|named| steps_around(named)) {
        Some(named) => Err(named.to_string()),
        None => Ok(methods),
    }
}

/// The method a keyed request's fingerprint names: its line's, and any an
/// override names beside it on the same route (`also`, from [`read`]), so
/// a `POST` that its upstream runs as a `PATCH` is not the `POST` it
/// spells.
pub(crate) fn fingerprinted<'m>(method: &'m Method, also: &[Method]) -> Cow<'m, str> {
    if also.is_empty() {
        return method.as_str().into();
    }
    let named: Vec<&str> = also.iter().map(Method::as_str).collect();
    format!("{method} {}", named.join(" ")).into()
}
