//! One reading of a request's line and `Host` (`docs/design.md` §2, "One
//! reading of a request line"): what upstreams could read otherwise than the
//! gateway does is refused before a route is matched, since a route decides
//! which requests need a key and must see what the upstream will see. The
//! path's own spellings are `idemgate_domain::path`'s.

use http::{header, Method, Request};

/// Why a request's line or head could be read two ways: a problem's slug,
/// title and detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Misread {
    pub(crate) slug: &'static str,
    pub(crate) title: &'static str,
    pub(crate) detail: String,
}

/// The methods RFC 9110 §9 (and RFC 5789) define, as they are spelled.
const STANDARD: [Method; 9] = [
    Method::GET,
    Method::HEAD,
    Method::POST,
    Method::PUT,
    Method::DELETE,
    Method::CONNECT,
    Method::OPTIONS,
    Method::TRACE,
    Method::PATCH,
];

/// What of `req`'s line or head upstreams could read otherwise, if any.
/// A request that passes costs a few comparisons and no allocation.
pub(crate) fn misread<B>(req: &Request<B>) -> Option<Misread> {
    method(req.method())
        .or_else(|| target(req.uri()))
        .or_else(|| host(req.headers()))
}

/// A method spelled as a standard one but for case (`post`): methods are
/// case-sensitive (RFC 9110 §9.1), so no route names it, yet some upstreams
/// upper-case it and run it as the standard one.
fn method(method: &Method) -> Option<Misread> {
    let sent = method.as_str();
    let standard = STANDARD
        .iter()
        .find(|s| s.as_str().eq_ignore_ascii_case(sent))?;
    (standard != method).then(|| Misread {
        slug: "invalid-method",
        title: "Method spelled other than as standard",
        detail: format!(
            "the method `{sent}` differs from {standard} only by case; methods are \
             case-sensitive and some upstreams read it as {standard}: send {standard}"
        ),
    })
}

/// A target that is not a path: asterisk-form (`*`) and authority-form
/// (`host:port`) name nothing a route could match, and the gateway is not a
/// tunnel. Origin-form and absolute-form targets have a path.
fn target(uri: &http::Uri) -> Option<Misread> {
    if uri.path().starts_with('/') {
        return None;
    }
    Some(Misread {
        slug: "invalid-request-target",
        title: "Request target that is not a path",
        detail: format!(
            "the request target `{uri}` is not a path: this listener takes a path \
             (`/v1/charges`) or an absolute URL, not `*` or `host:port`"
        ),
    })
}

/// More than one `Host`: upstreams take the first, or the last, so the one
/// the gateway forwards on is not certainly the one they read.
fn host(headers: &http::HeaderMap) -> Option<Misread> {
    let sent = headers.get_all(header::HOST).iter().count();
    (sent > 1).then(|| Misread {
        slug: "invalid-host",
        title: "Host header sent more than once",
        detail: format!(
            "the request carries {sent} Host headers, which upstreams read in different \
             ways; send exactly one"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: &str, target: &str, hosts: &[&str]) -> Request<()> {
        let mut req = Request::builder().method(method).uri(target);
        for host in hosts {
            req = req.header(header::HOST, *host);
        }
        req.body(()).unwrap()
    }

    #[test]
    fn standard_lines_pass() {
        for (method, target) in [
            ("POST", "/v1/charges"),
            ("GET", "http://example.com/v1"),
            ("PATCH", "/"),
            // An extension method that is no standard one's spelling.
            ("PURGE", "/cache"),
            ("purge", "/cache"),
        ] {
            assert_eq!(misread(&request(method, target, &["a"])), None, "{method}");
        }
    }

    #[test]
    fn a_standard_method_in_another_case_is_misread() {
        for method in ["post", "Post", "pOST", "get", "Patch", "delete"] {
            let found = misread(&request(method, "/v1", &["a"])).expect(method);
            assert_eq!(found.slug, "invalid-method");
            assert!(
                found.detail.contains(&method.to_ascii_uppercase()),
                "{found:?}"
            );
        }
    }

    #[test]
    fn targets_that_are_not_paths_and_two_hosts_are_misread() {
        for target in ["*", "example.com:443"] {
            let found = misread(&request("OPTIONS", target, &["a"])).expect(target);
            assert_eq!(found.slug, "invalid-request-target");
        }
        let found = misread(&request("GET", "/", &["a", "b"])).unwrap();
        assert_eq!(found.slug, "invalid-host");
    }
}
