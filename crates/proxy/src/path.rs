//! Request lines read one way, and paths normalised, before anything reads
//! them (`docs/design.md` §2): a method, target or `Host` upstreams could
//! read otherwise is refused (`crate::line`); then the
//! request's URI is rewritten to the normal form of its path, its query
//! kept byte for byte, so routing, the fingerprint and the upstream all see
//! the one path; a path upstreams could read two ways is answered
//! `400 …/ambiguous-path` and goes no further, and a target longer than
//! [`MAX_TARGET`] once normal `414 …/uri-too-long`. A path already normal (the
//! common case) costs one scan of its bytes and no allocation.

use std::borrow::Cow;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode, Uri};
use pin_project_lite::pin_project;
use tower::{Layer, Service};

use crate::http::Body;
use crate::problem::problem_response;
use idemgate_domain::path::normalize;

/// The longest path and query, in normal form, the gateway forwards. A
/// normal path spells each byte a path may not hold raw as `%XX`, three
/// times its length, so a target that fit the request line may not fit a
/// URI (`http`'s 65,534 bytes) once normalised, or once an upstream's base
/// path is put before it: refused here, `414`, rather than sent elsewhere
/// or failing as the gateway's own fault. nginx refuses a request line over
/// 8 KiB by default.
pub const MAX_TARGET: usize = 16 * 1024;

/// Normalises every request's path before the inner service sees it.
#[derive(Debug, Clone, Copy, Default)]
pub struct NormalizePathLayer;

impl<S> Layer<S> for NormalizePathLayer {
    type Service = NormalizePath<S>;

    fn layer(&self, inner: S) -> Self::Service {
        NormalizePath { inner }
    }
}

/// The service built by [`NormalizePathLayer`].
#[derive(Debug, Clone)]
pub struct NormalizePath<S> {
    inner: S,
}

impl<S, B> Service<Request<B>> for NormalizePath<S>
where
    S: Service<Request<B>, Response = Response<Body>, Error = Infallible>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        // The method, the target's form and `Host` are read one way first:
        // the path is the route's only once the rest of the line is certain.
        if let Some(misread) = crate::line::misread(&req) {
            return ResponseFuture::answer(
                StatusCode::BAD_REQUEST,
                misread.slug,
                misread.title,
                &misread.detail,
            );
        }
        let rewritten = match normalize(req.uri().path()) {
            Ok(Cow::Borrowed(_)) => None,
            Ok(Cow::Owned(path)) => Some(path),
            Err(why) => {
                return ResponseFuture::answer(
                    StatusCode::BAD_REQUEST,
                    "ambiguous-path",
                    "Path that upstreams could read two ways",
                    &why.to_string(),
                )
            }
        };
        let path_len = rewritten
            .as_ref()
            .map_or(req.uri().path().len(), String::len);
        let target_len = path_len + req.uri().query().map_or(0, |q| q.len() + 1);
        if target_len > MAX_TARGET {
            return ResponseFuture::answer(
                StatusCode::URI_TOO_LONG,
                "uri-too-long",
                "Request target too long",
                &format!(
                    "the path and query are {target_len} bytes in their normal form \
                     (each byte a path may not hold raw is spelled %XX); at most {MAX_TARGET} are \
                     forwarded"
                ),
            );
        }
        if let Some(path) = rewritten {
            match with_path(std::mem::take(req.uri_mut()), path) {
                Ok(uri) => *req.uri_mut() = uri,
                Err(e) => {
                    return ResponseFuture::answer(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "internal-error",
                        "Internal gateway error",
                        &e,
                    )
                }
            }
        }
        ResponseFuture {
            kind: Kind::Inner {
                answer: self.inner.call(req),
            },
        }
    }
}

/// `uri` with its path replaced by `path`, its query (and scheme and
/// authority, for an absolute-form target) as they were.
fn with_path(uri: Uri, path: String) -> Result<Uri, String> {
    let mut parts = uri.into_parts();
    let query = parts.path_and_query.as_ref().and_then(PathAndQuery::query);
    let path_and_query = match query {
        Some(query) => format!("{path}?{query}"),
        None => path,
    };
    // A normal path holds only characters a path may hold, and the query
    // was parsed before: neither can fail unless the normaliser is wrong.
    parts.path_and_query = Some(
        PathAndQuery::from_maybe_shared(Bytes::from(path_and_query))
            .map_err(|e| format!("a normalised path did not parse: {e}"))?,
    );
    Uri::from_parts(parts).map_err(|e| format!("a normalised URI did not parse: {e}"))
}

pin_project! {
    /// The answer to one request: `400` at once, or the inner service's.
    /// Named rather than boxed, so the common case allocates nothing.
    pub struct ResponseFuture<F> {
        #[pin]
        kind: Kind<F>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F> {
        /// Refused before the inner service saw it.
        Refused { response: Option<Response<Body>> },
        /// The inner service's answer.
        Inner {
            #[pin]
            answer: F,
        },
    }
}

impl<F> ResponseFuture<F> {
    /// A problem answer made here: the path never reaches the inner service.
    fn answer(status: StatusCode, slug: &str, title: &str, detail: &str) -> Self {
        ResponseFuture {
            kind: Kind::Refused {
                response: Some(problem_response(status, slug, title, detail, None)),
            },
        }
    }
}

impl<F> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<Body>, Infallible>>,
{
    type Output = Result<Response<Body>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Refused { response } => Poll::Ready(Ok(response
                .take()
                .expect("a ResponseFuture is not polled after it completed"))),
            KindProj::Inner { answer } => answer.poll(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tower::{service_fn, ServiceExt};

    use super::*;

    /// The answer to a request for `uri`, and the URI the inner service was
    /// given (`None`: it was not called).
    async fn through(uri: &str) -> (Response<Body>, Option<Uri>) {
        let seen = Arc::new(Mutex::new(None));
        let inner = {
            let seen = seen.clone();
            service_fn(move |req: Request<()>| {
                *seen.lock().unwrap() = Some(req.uri().clone());
                std::future::ready(Ok(Response::new(crate::http::full("ok"))))
            })
        };
        let req = Request::builder().uri(uri).body(()).unwrap();
        let answer = NormalizePathLayer.layer(inner).oneshot(req).await.unwrap();
        let seen = seen.lock().unwrap().take();
        (answer, seen)
    }

    #[tokio::test]
    async fn the_inner_service_sees_the_normal_path_and_the_query_as_sent() {
        for (uri, expected) in [
            (
                "/v1//x/../charges?a=%2f&b=..&c=%63",
                "/v1/charges?a=%2f&b=..&c=%63",
            ),
            (
                "http://example.com//v1/%63harges?a=%2f&b=..&c=%63",
                "http://example.com/v1/charges?a=%2f&b=..&c=%63",
            ),
            (
                "/v1/charges?a=%2f&b=..&c=%63",
                "/v1/charges?a=%2f&b=..&c=%63",
            ),
            ("/v1/./charges", "/v1/charges"),
        ] {
            let (answer, seen) = through(uri).await;
            assert_eq!(answer.status(), 200, "{uri}");
            assert_eq!(seen.map(|u| u.to_string()).as_deref(), Some(expected));
        }
    }

    /// A target that grows past [`MAX_TARGET`] as its path is normalised
    /// (every `{` spelled `%7B`) is refused `414`, never sent; one just
    /// within it goes through. Before, one past `http`'s 65,534 bytes was
    /// answered `500`, and one just under went to an upstream with a base
    /// path as `/`.
    #[tokio::test]
    async fn a_target_too_long_once_normal_is_refused_uri_too_long() {
        let fits = format!("/{}?q=1", "a".repeat(MAX_TARGET - 5));
        let (answer, seen) = through(&fits).await;
        assert_eq!((answer.status(), seen.is_some()), (StatusCode::OK, true));
        for long in [
            format!("/{}", "{".repeat(MAX_TARGET / 3 + 1)),
            format!("/{}", "{".repeat(22_000)),
            format!("/{}?q=1", "a".repeat(MAX_TARGET - 4)),
        ] {
            let (refused, seen) = through(&long).await;
            assert_eq!(seen, None, "{} bytes", long.len());
            assert_eq!(refused.status(), StatusCode::URI_TOO_LONG);
            assert_eq!(
                refused.headers()[http::header::CONTENT_TYPE],
                "application/problem+json"
            );
        }
    }

    #[tokio::test]
    async fn an_ambiguous_path_is_refused_and_never_reaches_the_inner_service() {
        let (refused, seen) = through("/v1/charges%2Fx?a=1").await;
        assert_eq!(seen, None);
        assert_eq!(refused.status(), http::StatusCode::BAD_REQUEST);
        assert_eq!(
            refused.headers()[http::header::CONTENT_TYPE],
            "application/problem+json"
        );
        let body = http_body_util::BodyExt::collect(refused.into_body())
            .await
            .unwrap()
            .to_bytes();
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            problem["type"],
            "https://idemgate.dev/problems/ambiguous-path"
        );
        assert!(problem["detail"].as_str().unwrap().contains("%2F"));
    }
}
