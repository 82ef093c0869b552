//! The chart's alerts: each PrometheusRule alert queries series the gateway
//! exports (`telemetry::catalogue`, which a unit test holds to what the
//! code records), carries a severity, a summary and a description, and
//! links a section of `docs/runbook.md` that exists; and every runbook
//! section belongs to an alert.

use std::collections::BTreeSet;

use idemgate_telemetry::catalogue::SERIES;

use crate::support::chart::{chart, render, repo};
use crate::support::promql::names;

#[test]
fn every_alert_queries_exported_series_and_links_its_runbook_section() {
    let off = render(&chart(), &[], &[]).unwrap();
    assert!(
        off.docs.iter().all(|d| d["kind"] != "PrometheusRule"),
        "off by default"
    );
    let on = render(&chart(), &[], &[("prometheusRule.enabled", "true")]).unwrap();
    let rule = on
        .docs
        .iter()
        .find(|d| d["kind"] == "PrometheusRule")
        .expect("a PrometheusRule");
    let runbook = std::fs::read_to_string(repo().join("docs/runbook.md")).unwrap();
    let sections: BTreeSet<&str> = runbook
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .collect();
    let exported: BTreeSet<&str> = SERIES.iter().map(|(name, _, _)| *name).collect();
    let base = "https://github.com/idemgate/idemgate/blob/main/docs/runbook.md";
    let mut alerts = BTreeSet::new();
    for r in rule["spec"]["groups"][0]["rules"].as_array().unwrap() {
        let alert = r["alert"].as_str().unwrap();
        alerts.insert(alert);
        let expr = r["expr"].as_str().unwrap();
        let queried = names(expr);
        assert!(!queried.is_empty(), "{alert}: {expr}");
        for name in queried {
            assert!(
                exported.contains(name.as_str()),
                "{alert} queries {name}, which is not exported"
            );
        }
        assert!(
            ["critical", "warning", "info"].contains(&r["labels"]["severity"].as_str().unwrap()),
            "{alert}"
        );
        for field in ["summary", "description"] {
            assert!(
                r["annotations"][field]
                    .as_str()
                    .is_some_and(|t| t.len() > 10),
                "{alert}: {field}"
            );
        }
        assert_eq!(
            r["annotations"]["runbook_url"].as_str().unwrap(),
            format!("{base}#{}", alert.to_lowercase()),
            "{alert}"
        );
        assert!(
            sections.contains(alert),
            "docs/runbook.md has no ## {alert}"
        );
    }
    // What the issue asks the alerts to cover.
    for must in [
        "IdemgateUnknownJobsWaiting",
        "IdemgateStoreDown",
        "IdemgateRedisDown",
        "IdemgateUpstreamProbesFailing",
        "IdemgateShedding",
        "IdemgateCommitRaces",
    ] {
        assert!(alerts.contains(must), "no {must}");
    }
    let runbook_only: Vec<&&str> = sections.difference(&alerts).collect();
    assert!(
        runbook_only.is_empty(),
        "runbook sections without an alert: {runbook_only:?}"
    );
    // A template's `{{ $value }}` reaches Prometheus as written.
    assert!(
        on.text.contains("{{ $value }}"),
        "the alert templates were eaten by helm"
    );
}
