//! The Helm chart (`helm/idemgate`) as operators install and run it.

mod alerts;
mod dashboard;
mod examples;
mod pods;
mod runbook;
mod secrets_and_notes;
mod sidecar;
mod values;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::chart::{self, Container, Manifest, Pod, Secrets};
use crate::support::pki::TestCa;
use crate::support::redis::free_port;
use crate::support::{send, FakeUpstream, TestDb, ThrowawayRedis};

/// The Kubernetes versions every manifest is validated against: the floor
/// Chart.yaml declares (native sidecars, the preStop sleep action: 1.30),
/// and the newest the validator knows.
fn kubernetes() -> [String; 2] {
    [chart::kubernetes_floor(), "1.37.0".to_owned()]
}

fn example(name: &str) -> PathBuf {
    chart::chart().join("examples").join(name)
}

/// The worked example, app-with-sidecar, with its dependency (this chart)
/// built, in a folder of the test's own.
fn sidecar_app() -> chart::ChartCopy {
    chart::with_dependencies(&example("app-with-sidecar"))
}

/// Every integer key of the config file, as a values file.
fn every_integer() -> PathBuf {
    chart::repo().join("tests/support/fixtures/chart/every-integer.yaml")
}

fn yaml_of(file: &Path) -> serde_yaml_ng::Value {
    serde_yaml_ng::from_str(&std::fs::read_to_string(file).unwrap()).unwrap()
}

/// The SHA-256 (hex) of the production example's client key.
const WEB_APP_KEY_SHA256: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

/// The admin token the examples' `idemgate-admin` Secret holds.
const OPERATORS_TOKEN: &str = "operators-token-0123456789abcdef";

/// The Secrets the examples name that a cluster would hold already:
/// the database URL given, Redis', the admin token, provider keys, the
/// PostgreSQL CA bundle.
fn held(database_url: &str, redis_url: &str, ca_pem: &str) -> Secrets {
    [
        (("idemgate-db", "database-url"), database_url),
        (("idemgate-redis", "redis-url"), redis_url),
        (("idemgate-admin", "admin-token"), OPERATORS_TOKEN),
        (("providers", "provider-a"), "sk-provider-a"),
        (("providers", "provider-b"), "sk-provider-b"),
        (("idemgate-clients", "web-app-sha256"), WEB_APP_KEY_SHA256),
        (("idemgate-db-tls", "ca.pem"), ca_pem),
    ]
    .into_iter()
    .map(|((n, k), v)| ((n.to_owned(), k.to_owned()), v.to_owned()))
    .collect()
}

/// What a values example is rendered from.
enum Values {
    /// The chart's own defaults: `helm install` with nothing set.
    Defaults,
    /// A values file. One in sidecar mode is rendered as the API's chart
    /// would run it: nested under `idemgate:` in the worked example
    /// (app-with-sidecar), since the chart alone renders no pod then.
    File(PathBuf),
    /// The worked example, app-with-sidecar, as it is.
    SidecarApp,
}

struct Case {
    name: String,
    values: Values,
}

/// Every values example users may copy (the `*.fail.yaml` ones aside, which
/// must be refused), the chart's defaults, the worked sidecar example, and
/// the every-integer fixture.
fn cases() -> Vec<Case> {
    let mut cases = vec![
        Case {
            name: "the chart's defaults".into(),
            values: Values::Defaults,
        },
        Case {
            name: "app-with-sidecar".into(),
            values: Values::SidecarApp,
        },
        Case {
            name: "fixtures/chart/every-integer.yaml".into(),
            values: Values::File(every_integer()),
        },
    ];
    for file in chart::examples() {
        let name = file.file_name().unwrap().to_str().unwrap().to_owned();
        if !name.ends_with(".fail.yaml") {
            cases.push(Case {
                name,
                values: Values::File(file),
            });
        }
    }
    cases
}

impl Case {
    /// Whether the values set this path (dotted) themselves.
    fn sets(&self, path: &str) -> bool {
        let Values::File(file) = &self.values else {
            return false;
        };
        let mut node = yaml_of(file);
        for part in path.split('.') {
            match node.get(part) {
                Some(next) => node = next.clone(),
                None => return false,
            }
        }
        !node.is_null()
    }

    fn in_sidecar_mode(&self) -> bool {
        match &self.values {
            Values::Defaults => false,
            Values::SidecarApp => true,
            Values::File(file) => yaml_of(file)["mode"] == "sidecar",
        }
    }

    /// `helm template` of the case with `sets` (paths of the idemgate
    /// chart's values, prefixed for the worked example).
    fn render(&self, sets: &[(String, String)]) -> Manifest {
        let app = self.in_sidecar_mode();
        let sets: Vec<(String, String)> = sets
            .iter()
            .map(|(k, v)| {
                let key = if app {
                    format!("idemgate.{k}")
                } else {
                    k.clone()
                };
                (key, v.clone())
            })
            .collect();
        let sets: Vec<(&str, &str)> = sets.iter().map(|(k, v)| (&**k, &**v)).collect();
        let dir = tempfile::tempdir().unwrap();
        let (repo_chart, app_chart);
        let (chart, files): (&Path, Vec<PathBuf>) = match &self.values {
            Values::Defaults => {
                repo_chart = chart::chart();
                (&repo_chart, vec![])
            }
            Values::SidecarApp => {
                app_chart = sidecar_app();
                (&app_chart, vec![])
            }
            Values::File(file) if app => {
                let mut nested = serde_yaml_ng::Mapping::new();
                nested.insert("idemgate".into(), yaml_of(file));
                let path = dir.path().join("values.yaml");
                std::fs::write(&path, serde_yaml_ng::to_string(&nested).unwrap()).unwrap();
                app_chart = sidecar_app();
                (&app_chart, vec![path])
            }
            Values::File(file) => {
                repo_chart = chart::chart();
                (&repo_chart, vec![file.clone()])
            }
        };
        let files: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
        chart::render(chart, &files, &sets)
            .unwrap_or_else(|e| panic!("helm template {}: {e}", self.name))
    }

    async fn render_off_the_runtime(&self, sets: Vec<(String, String)>) -> Manifest {
        // helm takes a while; the runtime's threads serve the pods meanwhile.
        tokio::task::block_in_place(|| self.render(&sets))
    }
}

/// The pod that runs idemgate (the chart's Deployment, or the API's with
/// the sidecar) and its idemgate container.
fn idemgate_pod(m: &Manifest) -> (Value, Value) {
    for d in m.all("Deployment") {
        let spec = &d["spec"]["template"]["spec"];
        let found = spec["initContainers"]
            .as_array()
            .into_iter()
            .chain(spec["containers"].as_array())
            .flatten()
            .find(|c| c["name"] == "idemgate");
        if let Some(c) = found {
            return (spec.clone(), c.clone());
        }
    }
    panic!("no pod runs idemgate")
}

fn mounts_postgres_tls(container: &Value) -> bool {
    container["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|m| m["mountPath"] == "/etc/idemgate-tls/postgres")
}

/// The value `idemgate check` printed for `key` (`key = value`).
fn printed<'a>(said: &'a str, key: &str) -> &'a str {
    let prefix = format!("{key} = ");
    said.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("`idemgate check` printed no {key}:\n{said}"))
}

/// A duration `idemgate check` printed, in whole seconds rounded up.
fn printed_seconds(said: &str, key: &str) -> u64 {
    let d = humantime::parse_duration(printed(said, key)).unwrap();
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

fn pre_stop(container: &Value) -> u64 {
    container["lifecycle"]["preStop"]["sleep"]["seconds"]
        .as_u64()
        .unwrap()
}

/// Whether a label selector (a map of labels) selects `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .is_some_and(|s| !s.is_empty() && s.iter().all(|(k, v)| &labels[k] == v))
}

/// Every label selector of the manifest that picks pods: Services',
/// PodDisruptionBudgets', NetworkPolicies', Deployments'.
fn selectors(m: &Manifest) -> Vec<(String, Value)> {
    let mut found = Vec::new();
    for d in &m.docs {
        let selector = match d["kind"].as_str() {
            Some("Service") => d["spec"]["selector"].clone(),
            Some("PodDisruptionBudget" | "Deployment") => {
                d["spec"]["selector"]["matchLabels"].clone()
            }
            Some("NetworkPolicy") => d["spec"]["podSelector"]["matchLabels"].clone(),
            _ => continue,
        };
        let what = format!("{} {}", d["kind"], d["metadata"]["name"]);
        found.push((what, selector));
    }
    found
}

/// What every rendered manifest must hold, whatever the values.
fn check_invariants(what: &str, m: &Manifest) {
    for version in kubernetes() {
        let unknown = m.validate(&version);
        assert!(
            unknown.iter().all(|k| k == "ServiceMonitor"),
            "{what}: kinds without a schema: {unknown:?}"
        );
    }
    for c in m.containers() {
        let s = &c["securityContext"];
        let name = &c["name"];
        assert_eq!(s["runAsNonRoot"], true, "{what}: {name} may run as root");
        assert_eq!(
            s["readOnlyRootFilesystem"], true,
            "{what}: {name} root fs writable"
        );
        assert_eq!(
            s["allowPrivilegeEscalation"], false,
            "{what}: {name} may escalate"
        );
        assert_eq!(s["capabilities"]["drop"], json!(["ALL"]), "{what}: {name}");
        if c["name"] != "idemgate" && c["name"] != "migrate" {
            continue;
        }
        // Secrets by reference only, never inlined into env or the config.
        for var in c["env"].as_array().into_iter().flatten() {
            let n = var["name"].as_str().unwrap();
            if n.ends_with("_URL") && n != "OTEL_EXPORTER_OTLP_ENDPOINT"
                || n.ends_with("TOKEN")
                || n.ends_with("KEY")
                || n.ends_with("SALT")
            {
                assert!(
                    var["valueFrom"]["secretKeyRef"].is_object(),
                    "{what}: {n} is not read from a Secret"
                );
            }
        }
        if c["name"] != "idemgate" {
            continue;
        }
        for probe in ["livenessProbe", "readinessProbe", "startupProbe"] {
            assert_eq!(
                c[probe]["httpGet"]["port"], "admin",
                "{what}: {probe} is not on the admin port"
            );
        }
    }
    for cm in m.all("ConfigMap") {
        if let Some(toml) = cm["data"]["idemgate.toml"].as_str() {
            for secret in ["database_url", "redis_url", "admin_token"] {
                assert!(
                    !toml.contains(secret),
                    "{what}: {secret} inlined in the ConfigMap"
                );
            }
        }
    }
    // Each Service reaches idemgate's own port: the clients' the proxy
    // port (never the admin port), the admin Service the admin port. A
    // named target must name a port of a regular container: a Service
    // resolves a named port of a native sidecar (an init container) only
    // from Kubernetes 1.32, above the chart's floor.
    for svc in m.all("Service") {
        let name = &svc["metadata"]["name"];
        let wanted = if svc["metadata"]["labels"]["app.kubernetes.io/component"] == "admin" {
            "admin"
        } else {
            "http"
        };
        let mut reached = 0;
        for d in m.all("Deployment") {
            let template = &d["spec"]["template"];
            if !selects(&svc["spec"]["selector"], &template["metadata"]["labels"]) {
                continue;
            }
            let spec = &template["spec"];
            let (idemgate, native_sidecar) = match spec["containers"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["name"] == "idemgate"))
            {
                Some(c) => (c, false),
                None => (
                    spec["initContainers"]
                        .as_array()
                        .and_then(|cs| cs.iter().find(|c| c["name"] == "idemgate"))
                        .unwrap_or_else(|| {
                            panic!("{what}: Service {name} selects pods without idemgate")
                        }),
                    true,
                ),
            };
            let port = idemgate["ports"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["name"] == wanted)
                .unwrap();
            for p in svc["spec"]["ports"].as_array().unwrap() {
                match &p["targetPort"] {
                    Value::String(target) => {
                        assert!(
                            !native_sidecar,
                            "{what}: Service {name} targets the named port {target} of a \
                             native sidecar, which resolves only from Kubernetes 1.32"
                        );
                        assert_eq!(target, wanted, "{what}: Service {name} exposes {p}");
                    }
                    target => assert_eq!(
                        target, &port["containerPort"],
                        "{what}: Service {name} does not reach idemgate's {wanted} port"
                    ),
                }
            }
            reached += 1;
        }
        assert!(reached > 0, "{what}: Service {name} selects no pod");
    }
    // A Job's pods (the migration) get no traffic and count for no budget:
    // nothing that selects pods selects them.
    for job in m.all("Job") {
        let labels = &job["spec"]["template"]["metadata"]["labels"];
        for (selector_of, selector) in selectors(m) {
            assert!(
                !selects(&selector, labels),
                "{what}: {selector_of} selects the pods of Job {}",
                job["metadata"]["name"]
            );
        }
    }
    // The pod outlives its drain: preStop, then shutdown_grace, inside the
    // termination grace period.
    for d in m.all("Deployment") {
        let spec = &d["spec"]["template"]["spec"];
        let Some(idemgate) = spec["initContainers"]
            .as_array()
            .into_iter()
            .chain(spec["containers"].as_array())
            .flatten()
            .find(|c| c["name"] == "idemgate")
        else {
            continue;
        };
        let toml = config_of(m);
        let grace = humantime::parse_duration(toml["shutdown_grace"].as_str().unwrap())
            .unwrap()
            .as_secs();
        let period = spec["terminationGracePeriodSeconds"].as_u64().unwrap();
        assert!(
            period > pre_stop(idemgate) + grace,
            "{what}: terminationGracePeriodSeconds {period} <= preStop {} + shutdown_grace {grace}",
            pre_stop(idemgate)
        );
    }
}

fn config_of(m: &Manifest) -> toml::Table {
    let cm = m
        .all("ConfigMap")
        .into_iter()
        .find(|cm| cm["data"]["idemgate.toml"].is_string())
        .expect("a ConfigMap with idemgate.toml");
    cm["data"]["idemgate.toml"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// Ports for the rendered pod: free ones, so the test owns them.
pub(crate) async fn ports() -> (String, String) {
    (free_port().await.to_string(), free_port().await.to_string())
}

/// Runs `pod` as rendered and checks it is what the chart promises: probes
/// pass on the ports they name, a keyed request through the `http` port is
/// proxied once and replayed, and SIGTERM drains within shutdown_grace.
pub(crate) async fn exercise(
    m: &Manifest,
    spec: &Value,
    container: &Value,
    secrets: &Secrets,
    upstream: &FakeUpstream,
) -> Pod {
    let mut pod = Pod::start(m, spec, container, secrets).await;
    pod.pass("startupProbe").await;
    pod.pass("livenessProbe").await;
    pod.pass("readinessProbe").await;

    let url = pod.url(&Value::from("http"), "/v1/jobs");
    // As a client of the API would: its credential names the key's owner.
    let as_alice = || async {
        let headers = [
            ("idempotency-key", "chart-1"),
            ("content-type", "application/json"),
            ("authorization", "Bearer alice"),
        ];
        send(http::Method::POST, &url, &headers, r#"{"n":1}"#).await
    };
    let first = as_alice().await;
    assert_eq!(first.status, 200, "{:?}\n{}", first.body, pod.log());
    let again = as_alice().await;
    assert_eq!(again.status, 200);
    assert_eq!(
        again.body, first.body,
        "the duplicate is not the same answer"
    );
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(upstream.hits(), 1, "the duplicate reached the upstream");

    // Metrics are on the admin port named in the manifest.
    let metrics = send(
        http::Method::GET,
        &pod.url(&Value::from("admin"), "/metrics"),
        &[],
        "",
    )
    .await;
    assert!(String::from_utf8_lossy(&metrics.body).contains("idemgate_replays_total"));
    pod
}
