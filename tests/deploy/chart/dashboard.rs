//! The Grafana dashboard shipped in the chart: it parses, and every query
//! names a metric a live gateway exports (read from its `/metrics` after a
//! little traffic), so no panel can silently show "no data" after a rename.

use std::collections::BTreeSet;

use http::Method;
use serde_json::Value;

use crate::support::promql::names;
use crate::support::{eventually, post, send, FakeUpstream, Gateway, TestStore, ThrowawayRedis};

fn dashboard() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("helm/idemgate/dashboards/idemgate.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).expect("the dashboard is JSON")
}

/// The sample names in a Prometheus exposition.
fn exported(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn every_dashboard_query_names_a_metric_the_gateway_exports() {
    let dashboard = dashboard();
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut wanted = BTreeSet::new();
    for panel in panels {
        assert!(panel["title"].as_str().is_some_and(|t| !t.is_empty()));
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{}: no query", panel["title"]);
        for target in targets {
            let expr = target["expr"].as_str().expect("expr");
            let found = names(expr);
            assert!(!found.is_empty(), "{expr}: names no idemgate metric");
            wanted.extend(found);
        }
    }
    // What the issue asks the dashboard to show.
    for must in [
        "idemgate_requests_total",
        "idemgate_replays_total",
        "idemgate_held_requests",
        "idemgate_jobs_unknown",
        "idemgate_commits_superseded_total",
        "idemgate_failovers_total",
        "idemgate_hedges_total",
        "idemgate_store_seconds_bucket",
        "idemgate_store_errors_total",
        "idemgate_fastpath_seconds_bucket",
        "idemgate_fastpath_errors_total",
        "idemgate_memory_budget_in_use_bytes",
        "idemgate_memory_budget_refusals_total",
    ] {
        assert!(wanted.contains(must), "the dashboard does not show {must}");
    }

    let store = TestStore::postgres().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("redis_url", &format!("{:?}", redis.url()))
        .set("sweep_interval", "\"100ms\"")
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    post(&url, "dash", "{}").await;
    post(&url, "dash", "{}").await;
    post(&url, "dash", "another body").await;
    send(Method::POST, &url, &[], "{}").await;
    let metrics = format!("{}/metrics", gateway.admin_url);
    eventually(
        std::time::Duration::from_secs(10),
        "every dashboard metric exported",
        || async {
            let text = send(Method::GET, &metrics, &[], "").await;
            let have = exported(&String::from_utf8_lossy(&text.body));
            wanted.iter().all(|w| have.contains(w))
        },
    )
    .await; // Each request counted once, by how it was answered.
    for (outcome, status) in [
        ("executed", "2xx"),
        ("replayed", "2xx"),
        ("problem", "4xx"),
        ("passed_through", "2xx"),
    ] {
        let series =
            format!("idemgate_requests_total{{outcome=\"{outcome}\",status=\"{status}\"}}");
        assert_eq!(gateway.metric(&series).await, 1.0, "{series}");
    }
}

#[test]
fn names_are_read_from_promql() {
    assert_eq!(
        names("histogram_quantile(0.99, sum by (le) (rate(idemgate_store_seconds_bucket[5m]))) + idemgate_x"),
        ["idemgate_store_seconds_bucket", "idemgate_x"]
    );
}
