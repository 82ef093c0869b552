//! Routes and the layer's configuration as the defaults make them, for the
//! crate's own tests: the settings file is read above this crate, so its
//! tests build what they need here, with the defaults `docs/design.md` §11
//! documents.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, StatusCode};

use crate::route::Route;
use crate::{execute, hold, Config};
use idemgate_proxy::upstream::{UpstreamId, UpstreamSettings, DEFAULT_IDLE_TIMEOUT};
use idemgate_trust::{OwnerRule, OwnerSource};

/// The default `upstream_timeout`.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);

/// Upstreams at `urls`, named as a plain list names them (`primary`,
/// `fallback-1`, …), with the default timeouts.
pub(crate) fn upstreams(urls: &[&str]) -> Vec<Arc<UpstreamSettings>> {
    urls.iter()
        .enumerate()
        .map(|(i, url)| {
            let name = match i {
                0 => "primary".to_owned(),
                i => format!("fallback-{i}"),
            };
            Arc::new(UpstreamSettings {
                id: UpstreamId::new(i, &name),
                base: url.parse().expect("a test upstream's URL"),
                timeout: UPSTREAM_TIMEOUT,
                first_byte_timeout: UPSTREAM_TIMEOUT,
                stream_idle_timeout: UPSTREAM_TIMEOUT,
                connect_timeout: Duration::from_secs(10),
                idle_timeout: DEFAULT_IDLE_TIMEOUT,
                headers: Vec::new(),
                credentials: Vec::new(),
                withheld: None,
                extra_roots: Vec::new(),
            })
        })
        .collect()
}

/// The route `[[routes]] path_prefix = "/"` makes over `urls`, its
/// owners anonymous (these tests send no credentials), changed by `with`.
pub(crate) fn route(urls: &[&str], with: impl FnOnce(&mut Route)) -> Arc<Route> {
    let owner = Arc::new(OwnerRule {
        sources: vec![OwnerSource::Header(http::header::AUTHORIZATION)],
        allow_anonymous: true,
    });
    let mut route = Route::default_route(&upstreams(urls), owner).expect("an upstream");
    route.name = "route-0".into();
    with(&mut route);
    Arc::new(route)
}

/// A side-effect-free route over two upstreams that hedges after 500 ms.
pub(crate) fn hedged() -> Arc<Route> {
    route(&["http://a:1", "http://b:1"], |r| {
        r.side_effect_free = true;
        r.hedge_after = Some(Duration::from_millis(500));
    })
}

/// The layer's configuration with the defaults, over `routes`.
pub(crate) fn config(routes: Vec<Arc<Route>>) -> Config {
    Config {
        routes,
        mismatch_status: StatusCode::CONFLICT,
        key_ttl: Duration::from_secs(24 * 3600),
        retry_after: Duration::from_secs(1),
        hold: hold::Config {
            timeout: UPSTREAM_TIMEOUT + Duration::from_secs(5),
            retry_after: Duration::from_secs(1),
        },
        attempt: execute::Config {
            deadline: UPSTREAM_TIMEOUT * 10,
            lease_ttl: Duration::from_secs(30),
            max_response_size: 10 << 20,
            forward_key_header: HeaderName::from_static("idempotency-key"),
            forward_attempt_header: HeaderName::from_static("idempotency-attempt"),
        },
        stream_stall: UPSTREAM_TIMEOUT + Duration::from_secs(30),
        replay_cache_size: 64 << 20,
        respond_async_path: "/.well-known/idemgate/jobs".into(),
    }
}

/// The size of the future (or any value) `make` returns; `make` is never
/// called. The held-size tests bound what a held duplicate waits in.
pub(crate) fn size_of_output<F>(_: &impl Fn() -> F) -> usize {
    std::mem::size_of::<F>()
}
