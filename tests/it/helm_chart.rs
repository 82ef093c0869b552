//! The Helm chart (`helm/idemgate`): every values example lints, renders and
//! passes the Kubernetes schemas of the oldest Kubernetes the chart claims
//! and the newest; the config it renders passes `idemgate check` with the
//! environment its pod would have; values that cannot work are refused at
//! install time; and the pods it renders run: the binary started exactly as
//! the manifest says answers its probes on the ports the manifest names and
//! proxies and replays through them.

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

fn sidecar_app() -> PathBuf {
    let app = example("app-with-sidecar");
    chart::build_dependencies(&app);
    app
}

/// Every integer key of the config file, as a values file.
fn every_integer() -> PathBuf {
    chart::repo().join("tests/it/fixtures/chart/every-integer.yaml")
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
        let (chart, files): (PathBuf, Vec<PathBuf>) = match &self.values {
            Values::Defaults => (chart::chart(), vec![]),
            Values::SidecarApp => (sidecar_app(), vec![]),
            Values::File(file) if app => {
                let mut nested = serde_yaml_ng::Mapping::new();
                nested.insert("idemgate".into(), yaml_of(file));
                let path = dir.path().join("values.yaml");
                std::fs::write(&path, serde_yaml_ng::to_string(&nested).unwrap()).unwrap();
                (sidecar_app(), vec![path])
            }
            Values::File(file) => (chart::chart(), vec![file.clone()]),
        };
        let files: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
        chart::render(&chart, &files, &sets)
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

#[test]
fn every_values_example_lints_renders_and_passes_the_kubernetes_schemas() {
    let mut checked = 0;
    for file in chart::examples() {
        let name = file.file_name().unwrap().to_str().unwrap().to_owned();
        if name.ends_with(".fail.yaml") {
            continue;
        }
        let lint = chart::run_helm(&[
            "lint",
            "--strict",
            chart::chart().to_str().unwrap(),
            "-f",
            file.to_str().unwrap(),
        ]);
        assert!(
            lint.status.success(),
            "helm lint -f {name}:\n{}",
            String::from_utf8_lossy(&lint.stdout)
        );
        let m = chart::render(&chart::chart(), &[&file], &[])
            .unwrap_or_else(|e| panic!("helm template -f {name}: {e}"));
        check_invariants(&name, &m);
        checked += 1;
    }
    assert!(checked >= 4, "only {checked} examples");
    for (name, m) in [
        ("the defaults", chart::render(&chart::chart(), &[], &[])),
        (
            "every-integer.yaml",
            chart::render(&chart::chart(), &[&every_integer()], &[]),
        ),
    ] {
        check_invariants(name, &m.unwrap_or_else(|e| panic!("{name}: {e}")));
    }

    let app = sidecar_app();
    let lint = chart::run_helm(&["lint", "--strict", app.to_str().unwrap()]);
    assert!(
        lint.status.success(),
        "{}",
        String::from_utf8_lossy(&lint.stdout)
    );
    let m = chart::render(&app, &[], &[]).unwrap();
    check_invariants("app-with-sidecar", &m);
    // With its ServiceMonitor: the admin Service reaches the sidecar.
    let m = chart::render(&app, &[], &[("idemgate.serviceMonitor.enabled", "true")]).unwrap();
    check_invariants("app-with-sidecar, monitored", &m);
}

#[test]
fn values_that_cannot_work_are_refused_at_install_naming_the_fix() {
    let mut refused = 0;
    for file in chart::examples() {
        let name = file.file_name().unwrap().to_str().unwrap().to_owned();
        if !name.ends_with(".fail.yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        let expect = text
            .lines()
            .find_map(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{name} has no `# expect:` line"));
        match chart::render(&chart::chart(), &[&file], &[]) {
            Ok(_) => panic!("{name} rendered; it should be refused"),
            Err(said) => assert!(
                said.contains(expect),
                "{name}: expected {expect:?} in {said}"
            ),
        }
        refused += 1;
    }
    assert!(refused >= 4, "only {refused} refusals checked");

    // The defaults are one replica on the embedded store; more replicas,
    // or autoscaling, need PostgreSQL.
    let defaults = chart::render(&chart::chart(), &[], &[]).unwrap();
    assert_eq!(defaults.one("Deployment")["spec"]["replicas"], 1);
    for sets in [
        &[("replicaCount", "2")][..],
        &[("autoscaling.enabled", "true")][..],
    ] {
        match chart::render(&chart::chart(), &[], sets) {
            Ok(_) => panic!("{sets:?} rendered on the embedded store"),
            Err(said) => assert!(said.contains("database.existingSecret"), "{said}"),
        }
    }
    // Sidecar mode: the admin Service for the ServiceMonitor needs the
    // API's pod labels, and the NetworkPolicy belongs to the API's chart.
    let sidecar = example("sidecar.yaml");
    for (sets, expect) in [
        (
            &[("serviceMonitor.enabled", "true")][..],
            "sidecar.podSelector",
        ),
        (
            &[("admin.networkPolicy.enabled", "true")][..],
            "admin.networkPolicy is for mode: deployment",
        ),
    ] {
        match chart::render(&chart::chart(), &[&sidecar], sets) {
            Ok(_) => panic!("{sets:?} rendered in sidecar mode"),
            Err(said) => assert!(said.contains(expect), "{said}"),
        }
    }
}

/// Config values as the chart's schema and the binary judge them: each
/// either accepted by both (rendered, and `idemgate check` passes on the
/// rendered file) or refused by both (the schema at install; the binary on
/// the same value written in TOML by hand).
#[test]
fn the_schema_accepts_the_config_values_the_binary_accepts_and_no_others() {
    // (under `config:` in YAML, the same in TOML, whether both accept it)
    let cases: &[(&str, &str, bool)] = &[
        (
            "upstream_timeout: 1h30m",
            "upstream_timeout = \"1h30m\"",
            true,
        ),
        (
            "upstream_timeout: 1m 30s",
            "upstream_timeout = \"1m 30s\"",
            true,
        ),
        (
            "upstream_timeout: 30 seconds",
            "upstream_timeout = \"30 seconds\"",
            true,
        ),
        (
            "upstream_timeout: 1.5m",
            "upstream_timeout = \"1.5m\"",
            true,
        ),
        (
            "upstream_timeout: 500ms",
            "upstream_timeout = \"500ms\"",
            true,
        ),
        ("upstream_timeout: '30'", "upstream_timeout = \"30\"", false),
        ("upstream_timeout: 30x", "upstream_timeout = \"30x\"", false),
        ("upstream_timeout: 30", "upstream_timeout = 30", false),
        ("max_header_size: 65536", "max_header_size = 65536", true),
        (
            "max_header_size: 64KiB",
            "max_header_size = \"64KiB\"",
            true,
        ),
        (
            "max_header_size: 64 KB",
            "max_header_size = \"64 KB\"",
            true,
        ),
        (
            "max_response_size: 10 MiB",
            "max_response_size = \"10 MiB\"",
            true,
        ),
        (
            "max_response_size: 1.5MiB",
            "max_response_size = \"1.5MiB\"",
            true,
        ),
        ("max_header_size: 64XB", "max_header_size = \"64XB\"", false),
        ("database_pool_size: 32", "database_pool_size = 32", true),
        ("database_pool_size: 1.5", "database_pool_size = 1.5", false),
        // The pool is PostgreSQL's: the binary sizes it only with one.
        (
            "database_pool_size: 0",
            "database_url = \"postgres://idemgate@127.0.0.1:1/idemgate\"\ndatabase_pool_size = 0",
            false,
        ),
        ("max_connections: 0", "max_connections = 0", false),
        ("max_in_flight: 0", "max_in_flight = 0", false),
        ("worker_threads: 0", "worker_threads = 0", false),
        ("mismatch_status: 422", "mismatch_status = 422", true),
        ("mismatch_status: 400", "mismatch_status = 400", false),
        ("access_log: false", "access_log = false", true),
        ("access_log: 'off'", "access_log = \"off\"", false),
        ("upstream_timout: 30s", "upstream_timout = \"30s\"", false),
        (
            "routes: [{name: a, retryable_statuses: [429, 503], max_attempts: 1}]",
            "[[routes]]\nname = \"a\"\nretryable_statuses = [429, 503]\nmax_attempts = 1",
            true,
        ),
        (
            "routes: [{name: a, retryable_statuses: [700]}]",
            "[[routes]]\nname = \"a\"\nretryable_statuses = [700]",
            false,
        ),
        (
            "routes: [{name: a, max_attempts: 0}]",
            "[[routes]]\nname = \"a\"\nmax_attempts = 0",
            false,
        ),
        (
            "routes: [{name: a, in_progress: wait}]",
            "[[routes]]\nname = \"a\"\nin_progress = \"wait\"",
            false,
        ),
        (
            "routes: [{name: a, colour: red}]",
            "[[routes]]\nname = \"a\"\ncolour = \"red\"",
            false,
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (yaml, toml, accepted) in cases {
        let values = dir.path().join("values.yaml");
        std::fs::write(&values, format!("config:\n  {yaml}\n")).unwrap();
        let rendered = chart::render(&chart::chart(), &[&values], &[]);
        // The binary on the same value, written by hand.
        let by_hand = check_toml(dir.path(), toml);
        assert_eq!(
            by_hand.0, *accepted,
            "the binary on {toml:?}: expected accepted = {accepted}:\n{}",
            by_hand.1
        );
        match rendered {
            Ok(m) if *accepted => {
                let (spec, container) = idemgate_pod(&m);
                let c = Container::prepare(&m, &spec, &container, &Secrets::new());
                let (exit, said) = tokio::runtime::Runtime::new().unwrap().block_on(c.check());
                assert!(
                    exit.success(),
                    "config {yaml:?} rendered, then refused:\n{said}"
                );
            }
            Ok(_) => panic!("the schema accepted config {yaml:?}, which the binary refuses"),
            Err(said) if *accepted => {
                panic!("the schema refused config {yaml:?}, which the binary accepts: {said}")
            }
            Err(said) => assert!(said.contains("schema"), "{yaml:?}: {said}"),
        }
    }
    // An upstream's header written on the upstream itself, not under
    // `headers` (the form an example once had): refused by both.
    std::fs::write(
        dir.path().join("values.yaml"),
        "upstreams:\n  - { name: a, url: \"http://a:8000\", \
         authorization: { env: A_KEY, prefix: \"Bearer \" } }\n",
    )
    .unwrap();
    let said = chart::render(&chart::chart(), &[&dir.path().join("values.yaml")], &[])
        .err()
        .expect("the schema refuses an upstream's header outside `headers`");
    assert!(said.contains("authorization"), "{said}");
    let (ok, said) = check_toml_with_upstreams(
        dir.path(),
        "[[upstreams]]\nname = \"a\"\nurl = \"http://a:8000\"\n\
         authorization = { env = \"A_KEY\", prefix = \"Bearer \" }\n",
    );
    assert!(
        !ok,
        "the binary took an upstream's header outside `headers`:\n{said}"
    );
}

/// `idemgate check` on a config file of `toml` beside the embedded store's
/// path and an upstream, with no environment: whether it passed, and what
/// it said.
fn check_toml(dir: &Path, toml: &str) -> (bool, String) {
    check_toml_with_upstreams(
        dir,
        &format!("upstreams = [\"http://127.0.0.1:1\"]\n{toml}\n"),
    )
}

fn check_toml_with_upstreams(dir: &Path, toml: &str) -> (bool, String) {
    let file = dir.join("idemgate.toml");
    let db = dir.join("idemgate.db");
    std::fs::write(
        &file,
        format!("embedded_path = {:?}\n{toml}\n", db.display().to_string()),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .arg("--config")
        .arg(&file)
        .arg("check")
        .env_clear()
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// Helm reads every number in a values file as a float; the chart writes
/// the whole ones back as integers, nested ones too, and every integer key
/// of the binary's config file is in the fixture that proves it.
#[test]
fn whole_numbers_under_config_are_written_as_integers() {
    let fixture = std::fs::read_to_string(every_integer()).unwrap();
    // The integer fields of the config file as the binary declares them.
    let source = std::fs::read_to_string(chart::repo().join("src/config/file.rs")).unwrap();
    let mut fields = 0;
    for line in source.lines() {
        let Some((name, kind)) = line
            .trim()
            .strip_prefix("pub(super) ")
            .and_then(|l| l.split_once(": "))
        else {
            continue;
        };
        let integer = ["usize", "u16", "u32", "u64", "ByteSize"]
            .iter()
            .any(|t| kind.contains(t));
        if integer {
            assert!(
                fixture.contains(&format!("{name}: ")),
                "every-integer.yaml does not set {name} ({kind})"
            );
            fields += 1;
        }
    }
    assert!(
        fields >= 10,
        "only {fields} integer fields found in file.rs"
    );

    let m = chart::render(&chart::chart(), &[&every_integer()], &[]).unwrap();
    let toml = config_of(&m);
    let values = yaml_of(&every_integer());
    let config = values["config"].as_mapping().unwrap();
    for (key, value) in config {
        let key = key.as_str().unwrap();
        if value.is_number() {
            assert!(
                toml[key].is_integer(),
                "config.{key} written as {}",
                toml[key]
            );
        }
    }
    let route = &toml["routes"].as_array().unwrap()[0];
    assert_eq!(route["max_attempts"].as_integer(), Some(2));
    assert_eq!(route["body_limit"].as_integer(), Some(1_048_576));
    assert!(
        route["retryable_statuses"]
            .as_array()
            .unwrap()
            .iter()
            .all(toml::Value::is_integer),
        "{route}"
    );
}

/// `idemgate check` on the config every example renders, with the
/// environment its pod would get (the Secrets it names, the chart's own,
/// the files it mounts): each passes, with an admin token, and the drain
/// the binary will run is the one the pod's grace period was computed from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_values_example_passes_idemgate_check_with_its_pods_environment() {
    let ca = TestCa::new("check CA").pem();
    let mut checked = 0;
    for case in cases() {
        let name = &case.name;
        let m = case.render_off_the_runtime(vec![]).await;
        let (spec, container) = idemgate_pod(&m);
        let database = if mounts_postgres_tls(&container) {
            "postgres://idemgate:pw@db.example.com:5432/idemgate?sslmode=verify-full\
             &sslrootcert=/etc/idemgate-tls/postgres/ca.pem"
        } else {
            "postgres://idemgate:pw@postgres:5432/idemgate"
        };
        let secrets = held(database, "redis://redis:6379/0", &ca);
        let c = Container::prepare(&m, &spec, &container, &secrets);
        let (exit, said) = c.check().await;
        assert!(
            exit.success() && said.contains("configuration ok"),
            "{name}: idemgate check refused what the chart rendered:\n{said}\n{}",
            m.text
        );
        assert!(
            printed(&said, "admin_api").starts_with("on"),
            "{name}: no admin token:\n{said}"
        );
        let grace = printed_seconds(&said, "shutdown_grace");
        let period = spec["terminationGracePeriodSeconds"].as_u64().unwrap();
        if case.in_sidecar_mode() {
            // The API's chart adds its own time on top.
            assert!(period >= pre_stop(&container) + grace + 5, "{name}");
        } else {
            assert_eq!(
                period,
                pre_stop(&container) + grace + 5,
                "{name}: the grace period is not preStop + the drain idemgate runs + 5"
            );
        }
        if !case.sets("shutdownGraceSeconds") {
            assert_eq!(
                grace,
                printed_seconds(&said, "attempt_deadline"),
                "{name}: the drain is not as long as an attempt may run"
            );
        }
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} checked");
}

/// The termination grace follows the config as the binary reads it:
/// attempt_deadline, else 10 x upstream_timeout, else 10 x 30 s, durations
/// in every form the binary takes, unless shutdownGraceSeconds says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_is_as_long_as_an_attempt_may_run_and_the_grace_period_holds_it() {
    let single = "embedded-single.yaml";
    // (values example, --set values, the drain in seconds)
    type Sets<'a> = &'a [(&'a str, &'a str)];
    let cases: &[(&str, Sets, u64)] = &[
        (single, &[], 300),
        ("deployment-postgres.yaml", &[], 1200), // upstream_timeout 120s
        ("deployment-postgres-redis.yaml", &[], 900), // attempt_deadline 15m
        (
            "deployment-postgres-redis.yaml",
            &[("shutdownGraceSeconds", "42")],
            42,
        ),
        (single, &[("config.upstream_timeout", "90s")], 900),
        (single, &[("config.upstream_timeout", "1m 30s")], 900),
        (single, &[("config.upstream_timeout", "500ms")], 5),
        (single, &[("config.upstream_timeout", "100ms")], 1),
        (single, &[("config.attempt_deadline", "2m")], 120),
        (single, &[("config.attempt_deadline", "1h30m")], 5400),
        (single, &[("config.attempt_deadline", "1.5h")], 5400),
        (
            single,
            &[
                ("config.upstream_timeout", "100ms"),
                ("config.attempt_deadline", "1500ms"),
            ],
            2,
        ),
    ];
    let secrets = held(
        "postgres://idemgate@postgres:5432/idemgate",
        "redis://redis:6379/0",
        "",
    );
    for (file, sets, expected) in cases {
        let what = format!("{file} with {sets:?}");
        let path = example(file);
        let m = tokio::task::block_in_place(|| chart::render(&chart::chart(), &[&path], sets))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let (spec, container) = idemgate_pod(&m);
        let (exit, said) = Container::prepare(&m, &spec, &container, &secrets)
            .check()
            .await;
        assert!(exit.success(), "{what}:\n{said}");
        let grace = printed_seconds(&said, "shutdown_grace");
        assert_eq!(grace, *expected, "{what}: shutdown_grace\n{said}");
        assert_eq!(
            spec["terminationGracePeriodSeconds"].as_u64().unwrap(),
            pre_stop(&container) + expected + 5,
            "{what}"
        );
        if !sets.iter().any(|(k, _)| *k == "shutdownGraceSeconds") {
            assert_eq!(
                printed_seconds(&said, "attempt_deadline"),
                *expected,
                "{what}"
            );
        }
    }
    // A duration the binary would not read fails the install, named.
    let said = chart::render(
        &chart::chart(),
        &[],
        &[("config.attempt_deadline", "10 fortnights")],
    )
    .err()
    .expect("an unreadable duration rendered");
    assert!(said.contains("attempt_deadline"), "{said}");
}

/// Every values example's pod, started as rendered: the binary answers its
/// probes on the ports they name, reaches the store and Redis it was given
/// (readiness lists them up), and guards the admin API with the token the
/// pod gets. PostgreSQL examples run on a fresh database of their own; the
/// TLS one on the suite's TLS server (postgres_tls.rs), whose CA it is given
/// as the Secret it mounts; Redis on a throwaway server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_values_examples_pod_starts_and_passes_its_probes() {
    let redis = ThrowawayRedis::start().await;
    let tls = crate::postgres_tls::server().await;
    let ca = std::fs::read_to_string(tls.file("ca.pem")).unwrap();
    let mut started = 0;
    for case in cases() {
        let name = &case.name;
        let (http, admin) = ports().await;
        let db = TestDb::new().await;
        let mut sets = vec![
            ("ports.http".to_owned(), http),
            ("ports.admin".to_owned(), admin),
        ];
        if case.sets("database.value") {
            // Inline (a trial): the chart writes it into its own Secret.
            sets.push(("database.value".to_owned(), db.url.clone()));
        }
        let m = case.render_off_the_runtime(sets).await;
        let (spec, container) = idemgate_pod(&m);
        let database = if mounts_postgres_tls(&container) {
            let on_tls = tls.database("postgres").await;
            format!(
                "postgres://postgres@127.0.0.1:{}/{on_tls}?sslmode=verify-full\
                 &sslrootcert=/etc/idemgate-tls/postgres/ca.pem",
                tls.pg.port
            )
        } else {
            db.url.clone()
        };
        let secrets = held(&database, &redis.url(), &ca);
        let mut pod = Pod::start(&m, &spec, &container, &secrets).await;
        pod.pass("startupProbe").await;
        pod.pass("livenessProbe").await;
        pod.pass("readinessProbe").await;

        // Every dependency the pod was given is reached.
        let readyz = pod.url(&Value::from("admin"), "/readyz");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let last = loop {
            let said = send(http::Method::GET, &readyz, &[], "").await.json();
            let deps = said["dependencies"].as_object().unwrap();
            if deps.values().all(|d| d["status"] == "up") {
                break said;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{name}: dependencies not up: {said}\n{}",
                pod.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let store = &last["dependencies"]["store"];
        assert_eq!(store["status"], "up", "{name}: {last}");
        let expects_redis = pod.env("IDEMGATE_REDIS_URL").is_some();
        assert_eq!(
            last["dependencies"]["redis"].is_object(),
            expects_redis,
            "{name}: {last}"
        );

        // The admin API answers the token the pod was given, and no one else.
        let token = pod
            .env("IDEMGATE_ADMIN_TOKEN")
            .unwrap_or_else(|| panic!("{name}: no admin token"))
            .to_owned();
        let jobs = pod.url(&Value::from("admin"), "/admin/v1/jobs?state=unknown");
        let anonymous = send(http::Method::GET, &jobs, &[], "").await;
        assert_eq!(anonymous.status, 401, "{name}");
        let bearer = format!("Bearer {token}");
        let operator = send(http::Method::GET, &jobs, &[("authorization", &bearer)], "").await;
        assert_eq!(operator.status, 200, "{name}: {:?}", operator.body);

        let exit = pod.terminate(Duration::from_secs(30)).await;
        assert!(exit.success(), "{name}: exit {exit}:\n{}", pod.log());
        started += 1;
    }
    assert!(started >= 10, "only {started} pods started");
}

/// The admin token (docs/design.md §12): made by the chart unless a Secret
/// is named, and given to the container; the admin port closed to all but
/// named namespaces when asked.
#[test]
fn the_chart_makes_an_admin_token_unless_one_is_named() {
    let env_ref = |m: &Manifest, name: &str| -> Value {
        let (_, container) = idemgate_pod(m);
        container["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no {name}"))["valueFrom"]["secretKeyRef"]
            .clone()
    };
    let made = chart::render(&chart::chart(), &[], &[]).unwrap();
    let r = env_ref(&made, "IDEMGATE_ADMIN_TOKEN");
    assert_eq!(r["key"], "admin-token");
    let token = made
        .secret(r["name"].as_str().unwrap(), "admin-token")
        .expect("the chart's Secret holds the token");
    assert!(
        token.len() >= 32 && token.chars().all(|c| c.is_ascii_alphanumeric()),
        "{token:?}"
    );
    for other in ["owner-salt", "replay-key"] {
        assert_ne!(
            made.secret(r["name"].as_str().unwrap(), other),
            Some(token.clone())
        );
    }
    // The Secret is looked up before it is made, so an upgrade keeps it.
    let template = std::fs::read_to_string(chart::chart().join("templates/secret.yaml")).unwrap();
    assert!(template.contains("lookup \"v1\" \"Secret\""));

    let named = chart::render(&chart::chart(), &[], &[("admin.existingSecret", "ops")]).unwrap();
    assert_eq!(env_ref(&named, "IDEMGATE_ADMIN_TOKEN")["name"], "ops");
    assert!(named
        .all("Secret")
        .iter()
        .all(|s| s["stringData"]["admin-token"].is_null()));
    let inline = chart::render(&chart::chart(), &[], &[("admin.value", "trial")]).unwrap();
    let r = env_ref(&inline, "IDEMGATE_ADMIN_TOKEN");
    assert_eq!(
        inline.secret(r["name"].as_str().unwrap(), "admin-token"),
        Some("trial".into())
    );

    // The NetworkPolicy: off by default; in the production example, the
    // proxy port open to all, the admin port to the named namespaces.
    assert!(made.all("NetworkPolicy").is_empty());
    let m = chart::render(
        &chart::chart(),
        &[&example("deployment-postgres-redis.yaml")],
        &[],
    )
    .unwrap();
    let policy = m.one("NetworkPolicy");
    let pod_labels = &m.one("Deployment")["spec"]["template"]["metadata"]["labels"];
    assert!(selects(
        &policy["spec"]["podSelector"]["matchLabels"],
        pod_labels
    ));
    assert_eq!(policy["spec"]["policyTypes"], json!(["Ingress"]));
    let (_, container) = idemgate_pod(&m);
    let port = |name: &str| {
        container["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap()["containerPort"]
            .clone()
    };
    let rules = policy["spec"]["ingress"].as_array().unwrap();
    assert_eq!(rules.len(), 2, "{policy}");
    let proxy = rules
        .iter()
        .find(|r| r["ports"][0]["port"] == port("http"))
        .expect("a rule for the proxy port");
    assert!(proxy["from"].is_null(), "the proxy port is not open to all");
    let admin = rules
        .iter()
        .find(|r| r["ports"][0]["port"] == port("admin"))
        .expect("a rule for the admin port");
    let namespaces: Vec<&Value> = admin["from"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| &f["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"])
        .collect();
    assert_eq!(namespaces, [&json!("monitoring"), &json!("platform-ops")]);
    assert!(rules
        .iter()
        .all(|r| r["ports"].as_array().unwrap().len() == 1));
}

/// The replay key (`docs/design.md` §17): the chart makes one, 32 bytes or
/// more, beside the owner salt, unless a Secret of the operator's is named.
#[test]
fn the_chart_makes_a_replay_key_unless_one_is_named() {
    use base64::Engine;
    let file = example("deployment-postgres-redis.yaml");
    let env_of = |m: &Manifest, name: &str| -> Value {
        let container = &m.one("Deployment")["spec"]["template"]["spec"]["containers"][0];
        container["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no {name}"))["valueFrom"]["secretKeyRef"]
            .clone()
    };
    let made = chart::render(&chart::chart(), &[&file], &[]).unwrap();
    let reference = env_of(&made, "IDEMGATE_REPLAY_KEY");
    assert_eq!(reference["key"], "replay-key");
    let secret = made
        .all("Secret")
        .into_iter()
        .find(|s| s["metadata"]["name"] == reference["name"])
        .expect("the chart's Secret");
    let key = secret["stringData"]["replay-key"].as_str().unwrap();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(key)
        .unwrap();
    assert!(bytes.len() >= 32, "{} bytes", bytes.len());
    assert_ne!(
        secret["stringData"]["owner-salt"], secret["stringData"]["replay-key"],
        "one secret per purpose"
    );

    let named = chart::render(
        &chart::chart(),
        &[&file],
        &[("replayKey.existingSecret", "mine")],
    )
    .unwrap();
    assert_eq!(env_of(&named, "IDEMGATE_REPLAY_KEY")["name"], "mine");
    assert!(named
        .all("Secret")
        .iter()
        .all(|s| s["stringData"]["replay-key"].is_null()));
}

/// The tokens of the first line of `notes` holding `what`.
fn line_with<'a>(notes: &'a str, what: &str) -> Vec<&'a str> {
    notes
        .lines()
        .find(|l| l.contains(what))
        .unwrap_or_else(|| panic!("the notes have no {what:?}:\n{notes}"))
        .split_whitespace()
        .collect()
}

/// The token after `flag` in `tokens`.
fn after<'a>(tokens: &[&'a str], flag: &str) -> &'a str {
    let i = tokens.iter().position(|t| *t == flag).unwrap();
    tokens[i + 1]
}

/// The `kubectl get secret` the notes print names the Secret and key the
/// container reads its admin token from, in the release's namespace.
fn check_secret_command(notes: &str, m: &Manifest, namespace: &str) {
    let get = line_with(notes, "kubectl get secret");
    assert_eq!(after(&get, "--namespace"), namespace);
    let name = get[get.iter().position(|t| *t == "--namespace").unwrap() + 2];
    let path = after(&get, "-o");
    let key = path
        .strip_prefix("jsonpath='{.data.")
        .and_then(|k| k.strip_suffix("}'"))
        .unwrap_or_else(|| panic!("{path}"));
    let (_, container) = idemgate_pod_or_sidecar(m);
    let reference = container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "IDEMGATE_ADMIN_TOKEN")
        .unwrap()["valueFrom"]["secretKeyRef"]
        .clone();
    assert_eq!(reference, json!({ "name": name, "key": key }), "{notes}");
}

/// In deployment mode, the idemgate pod; in sidecar mode (no pod in the
/// chart alone), the container the worked example renders.
fn idemgate_pod_or_sidecar(m: &Manifest) -> (Value, Value) {
    if m.all("Deployment").is_empty() {
        let app = chart::render(&sidecar_app(), &[], &[]).unwrap();
        return idemgate_pod(&app);
    }
    idemgate_pod(m)
}

/// NOTES.txt, rendered by `helm install --dry-run` in both modes: the
/// Service, Secret, Deployment, ports and named templates it names are the
/// ones the release holds.
#[test]
fn the_notes_name_what_the_release_holds_in_both_modes() {
    let values_yaml = std::fs::read_to_string(chart::chart().join("values.yaml")).unwrap();
    // The defaults: a trial, and what production needs.
    let (m, notes) = chart::install_notes(&chart::chart(), &[], &[], "shop");
    assert!(notes.contains("This is a trial"), "{notes}");
    for value in [
        "database.existingSecret",
        "replicaCount",
        "redis.existingSecret",
    ] {
        assert!(notes.contains(value), "{value} not in the notes:\n{notes}");
        let leaf = value.rsplit('.').next().unwrap();
        assert!(
            values_yaml.contains(&format!("{leaf}:")),
            "{value} is no value"
        );
    }
    let svc = notes
        .split_whitespace()
        .find(|t| t.starts_with("http://") && t.contains(".shop:"))
        .unwrap_or_else(|| panic!("no Service URL in the notes:\n{notes}"))
        .trim_start_matches("http://");
    let (host, port) = svc.split_once(':').unwrap();
    let (name, namespace) = host.split_once('.').unwrap();
    assert_eq!(namespace, "shop");
    let service = m.named("Service", name);
    assert_eq!(service["spec"]["ports"][0]["port"].to_string(), port);
    check_secret_command(&notes, &m, "shop");
    let forward = line_with(&notes, "kubectl port-forward");
    assert_eq!(after(&forward, "--namespace"), "shop");
    let target = forward[forward.iter().position(|t| *t == "--namespace").unwrap() + 2];
    let deployment = target.strip_prefix("deployment/").expect(target);
    m.named("Deployment", deployment);
    let (local, remote) = forward.last().unwrap().split_once(':').unwrap();
    let (_, container) = idemgate_pod(&m);
    let admin = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "admin")
        .unwrap();
    assert_eq!(remote, admin["containerPort"].to_string());
    assert!(
        notes.contains(&format!("http://localhost:{local}/console/")),
        "{notes}"
    );

    // PostgreSQL and a named admin Secret: no trial; the Secret named.
    let (m, notes) = chart::install_notes(
        &chart::chart(),
        &[&example("deployment-postgres-redis.yaml")],
        &[],
        "shop",
    );
    assert!(!notes.contains("trial"), "{notes}");
    check_secret_command(&notes, &m, "shop");

    // Sidecar mode: the named templates the API's chart must include are
    // the chart's, and the worked example includes them as printed.
    let (m, notes) =
        chart::install_notes(&chart::chart(), &[&example("sidecar.yaml")], &[], "shop");
    let helpers = std::fs::read_to_string(chart::chart().join("templates/_helpers.tpl")).unwrap();
    let app = std::fs::read_to_string(
        chart::chart().join("examples/app-with-sidecar/templates/deployment.yaml"),
    )
    .unwrap();
    let mut included = 0;
    for line in notes.lines().filter(|l| l.contains("include \"")) {
        let expression = line
            .split("{{")
            .nth(1)
            .and_then(|rest| rest.split(" |").next())
            .and_then(|rest| rest.split(" }}").next())
            .unwrap()
            .trim_start_matches('-')
            .trim();
        let template = expression.split('"').nth(1).unwrap();
        assert!(
            helpers.contains(&format!("define \"{template}\"")),
            "the notes name {template}, which the chart does not define"
        );
        assert!(
            app.contains(expression),
            "the worked example does not include {expression:?}"
        );
        included += 1;
    }
    assert!(notes.contains("\"idemgate.sidecar\""), "{notes}");
    assert!(included >= 3, "{notes}");
    let cm = line_with(&notes, "the ConfigMap");
    let cm = cm[cm.iter().position(|t| *t == "ConfigMap").unwrap() + 1];
    m.named("ConfigMap", cm);
    let port = line_with(&notes, "Service at port");
    let port = port[port.iter().position(|t| *t == "port").unwrap() + 1];
    assert_eq!(port, "8080");
    check_secret_command(&notes, &m, "shop");
}

/// Chart conventions: name overrides, security contexts (and the OpenShift
/// example without fixed IDs), ServiceAccount annotations, extra volumes,
/// priority class, pod labels and annotations, probes merged over the
/// chart's, and the README's values table generated from the schema.
#[test]
fn the_chart_takes_the_values_platform_engineers_expect() {
    // Names.
    let m = chart::render(&chart::chart(), &[], &[("fullnameOverride", "gw")]).unwrap();
    for kind in [
        "Deployment",
        "Service",
        "ConfigMap",
        "Secret",
        "ServiceAccount",
    ] {
        m.named(kind, "gw");
    }
    let m = chart::render(&chart::chart(), &[], &[("nameOverride", "proxy")]).unwrap();
    let d = m.named("Deployment", "rel-proxy");
    assert_eq!(
        d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"],
        "proxy"
    );
    check_invariants("nameOverride", &m);

    // OpenShift: no fixed UID, GID or fsGroup anywhere, runAsNonRoot kept.
    let m = chart::render(&chart::chart(), &[&example("openshift.yaml")], &[]).unwrap();
    let mut contexts = 0;
    for d in m.all("Deployment").into_iter().chain(m.all("Job")) {
        let spec = &d["spec"]["template"]["spec"];
        for context in std::iter::once(&spec["securityContext"]).chain(
            spec["containers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| &c["securityContext"]),
        ) {
            for fixed in ["runAsUser", "runAsGroup", "fsGroup"] {
                assert!(context[fixed].is_null(), "{fixed} in {context}");
            }
            assert_eq!(context["runAsNonRoot"], true, "{context}");
            contexts += 1;
        }
    }
    assert!(contexts >= 2);
    // One default dropped with null on the command line: that key goes,
    // the rest of the context stays.
    let m = chart::render(
        &chart::chart(),
        &[],
        &[("securityContext.runAsUser", "null")],
    )
    .unwrap();
    let (_, container) = idemgate_pod(&m);
    let context = &container["securityContext"];
    assert!(context["runAsUser"].is_null(), "{context}");
    assert_eq!(context["runAsGroup"], 65532, "{context}");
    // The pod's context fixes no UID; nulling one there (a habit from other
    // charts) renders all the same.
    let m = chart::render(
        &chart::chart(),
        &[],
        &[("podSecurityContext.runAsUser", "null")],
    )
    .unwrap();
    assert!(idemgate_pod(&m).0["securityContext"]["runAsUser"].is_null());
    // The defaults as they were: a fixed non-root UID on the container.
    let m = chart::render(&chart::chart(), &[], &[]).unwrap();
    let (spec, container) = idemgate_pod(&m);
    assert_eq!(container["securityContext"]["runAsUser"], 65532);
    assert_eq!(spec["securityContext"]["fsGroup"], 65532);

    // The rest, in one render.
    let dir = tempfile::tempdir().unwrap();
    let values = dir.path().join("values.yaml");
    std::fs::write(
        &values,
        r#"
serviceAccount:
  annotations: { eks.amazonaws.com/role-arn: "arn:aws:iam::1:role/idemgate" }
extraVolumes:
  - { name: provider-ca, configMap: { name: provider-ca } }
extraVolumeMounts:
  - { name: provider-ca, mountPath: /etc/provider-ca, readOnly: true }
priorityClassName: gateway-critical
podAnnotations: { example.com/team: payments }
podLabels: { example.com/tier: edge }
startupProbe: { failureThreshold: 120 }
readinessProbe: { periodSeconds: 7 }
"#,
    )
    .unwrap();
    let m = chart::render(&chart::chart(), &[&values], &[]).unwrap();
    assert_eq!(
        m.one("ServiceAccount")["metadata"]["annotations"]["eks.amazonaws.com/role-arn"],
        "arn:aws:iam::1:role/idemgate"
    );
    let template = &m.one("Deployment")["spec"]["template"];
    assert_eq!(
        template["metadata"]["annotations"]["example.com/team"],
        "payments"
    );
    assert_eq!(template["metadata"]["labels"]["example.com/tier"], "edge");
    let (spec, container) = idemgate_pod(&m);
    assert_eq!(spec["priorityClassName"], "gateway-critical");
    assert!(spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|v| v["name"] == "provider-ca"));
    assert!(container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|v| v["mountPath"] == "/etc/provider-ca"));
    assert_eq!(
        container["startupProbe"],
        json!({ "httpGet": { "path": "/healthz", "port": "admin" }, "periodSeconds": 1, "failureThreshold": 120 })
    );
    assert_eq!(
        container["readinessProbe"],
        json!({ "httpGet": { "path": "/readyz", "port": "admin" }, "periodSeconds": 7, "failureThreshold": 2 })
    );
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    check_invariants("conventions", &m);
    // In sidecar mode the extra volume reaches the API's pod through
    // idemgate.volumes.
    let m = chart::render(
        &sidecar_app(),
        &[],
        &[
            ("idemgate.extraVolumes[0].name", "provider-ca"),
            ("idemgate.extraVolumes[0].configMap.name", "provider-ca"),
        ],
    )
    .unwrap();
    assert!(idemgate_pod(&m).0["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|v| v["name"] == "provider-ca"));

    // The README's values table is what the script writes from the schema.
    let out = std::process::Command::new("python3")
        .arg(chart::repo().join("scripts/chart-readme.py"))
        .arg("--check")
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every value values.yaml sets is described in values.schema.json with
/// that default, so the README generated from the schema lists every value
/// with its true default.
#[test]
fn the_schema_describes_every_value_with_its_default() {
    let values: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(chart::chart().join("values.yaml")).unwrap(),
    )
    .unwrap();
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(chart::chart().join("values.schema.json")).unwrap(),
    )
    .unwrap();
    fn walk(path: &str, value: &Value, schema: &Value, root: &Value, leaves: &mut usize) {
        let mut node = schema.clone();
        if let Some(r) = node["$ref"].as_str() {
            let name = r.rsplit('/').next().unwrap();
            let mut merged = root["definitions"][name].clone();
            for (k, v) in node.as_object().unwrap() {
                merged[k] = v.clone();
            }
            node = merged;
        }
        assert!(
            node["description"].is_string(),
            "{path} has no description in the schema"
        );
        match (value.as_object(), node["properties"].as_object()) {
            (Some(table), Some(properties)) if node.get("default").is_none() => {
                for (key, inner) in table {
                    let described = properties
                        .get(key)
                        .unwrap_or_else(|| panic!("{path}.{key} is not in the schema"));
                    walk(&format!("{path}.{key}"), inner, described, root, leaves);
                }
            }
            _ => {
                assert_eq!(&node["default"], value, "{path}: the schema's default");
                *leaves += 1;
            }
        }
    }
    let mut leaves = 0;
    for (key, value) in values.as_object().unwrap() {
        let described = schema["properties"]
            .get(key)
            .unwrap_or_else(|| panic!("{key} is not in the schema"));
        walk(key, value, described, &schema, &mut leaves);
    }
    assert!(leaves >= 50, "only {leaves} values");
}

/// The migration Job's pod is the gateway's (image, pull secrets,
/// ServiceAccount, security context, scheduling, the store's environment
/// and files, extraEnv, extraVolumes) without the labels Services, the
/// PodDisruptionBudget or the NetworkPolicy select; and, started as
/// rendered, it migrates a fresh database and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_migrate_job_runs_as_the_gateway_but_takes_no_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let values = dir.path().join("values.yaml");
    std::fs::write(
        &values,
        r#"
imagePullSecrets: [{ name: registry }]
serviceAccount: { name: idemgate-runner }
priorityClassName: gateway-critical
nodeSelector: { pool: gateways }
tolerations: [{ key: dedicated, value: gateways, effect: NoSchedule }]
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms: [{ matchExpressions: [{ key: zone, operator: In, values: [a, b] }] }]
podLabels: { example.com/tier: edge }
extraVolumes:
  - { name: provider-ca, configMap: { name: provider-ca } }
extraVolumeMounts:
  - { name: provider-ca, mountPath: /etc/provider-ca, readOnly: true }
"#,
    )
    .unwrap();
    let production = example("deployment-postgres-redis.yaml");
    let m = tokio::task::block_in_place(|| {
        chart::render(&chart::chart(), &[&production, &values], &[]).unwrap()
    });
    check_invariants("the migrate Job", &m);
    let job = m.one("Job");
    assert_eq!(
        job["metadata"]["annotations"]["helm.sh/hook"],
        "post-install,pre-upgrade"
    );
    let deployment = m.one("Deployment");
    let pod = &deployment["spec"]["template"]["spec"];
    let (_, container) = idemgate_pod(&m);
    let container = &container;
    let job_pod = &job["spec"]["template"]["spec"];
    for field in [
        "imagePullSecrets",
        "serviceAccountName",
        "priorityClassName",
        "nodeSelector",
        "tolerations",
        "affinity",
        "securityContext",
    ] {
        assert!(!pod[field].is_null(), "the Deployment has no {field}");
        assert_eq!(job_pod[field], pod[field], "the Job's {field}");
    }
    assert_eq!(job_pod["serviceAccountName"], "idemgate-runner");
    let migrate = &job_pod["containers"][0];
    for field in ["image", "imagePullPolicy", "securityContext", "resources"] {
        assert_eq!(
            migrate[field], container[field],
            "the Job's container's {field}"
        );
    }
    // The store's environment and extraEnv, as the gateway has them; not
    // the secrets it serves with (a pre-upgrade hook runs before the
    // chart's Secret gets a key this version adds).
    let env = |c: &Value| -> Vec<Value> { c["env"].as_array().unwrap().clone() };
    for var in env(container) {
        let name = var["name"].as_str().unwrap();
        let serving = [
            "IDEMGATE_OWNER_SALT",
            "IDEMGATE_REPLAY_KEY",
            "IDEMGATE_ADMIN_TOKEN",
            "IDEMGATE_REDIS_URL",
        ];
        assert_eq!(
            env(migrate).contains(&var),
            !serving.contains(&name),
            "{name} in the Job's env"
        );
    }
    assert!(migrate["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|v| v["mountPath"] == "/etc/provider-ca"));
    assert!(job_pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|v| v["name"] == "provider-ca"));
    let labels = &job["spec"]["template"]["metadata"]["labels"];
    assert_eq!(labels["example.com/tier"], "edge");
    let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
    let selected: Vec<String> = selectors(&m)
        .into_iter()
        .filter(|(_, s)| selects(s, pod_labels))
        .map(|(what, _)| what)
        .collect();
    assert!(selected.len() >= 4, "{selected:?}");

    // Started as rendered, against a fresh database: migrated, exit 0.
    let db = TestDb::new().await;
    let m = tokio::task::block_in_place(|| {
        chart::render(&chart::chart(), &[&production], &[]).unwrap()
    });
    let job_pod = m.one("Job")["spec"]["template"]["spec"].clone();
    let migrate = job_pod["containers"][0].clone();
    assert!(migrate["command"].is_null(), "the image's entrypoint runs");
    let secrets = held(&db.url, "redis://unused:6379", "");
    let run = Container::prepare(&m, &job_pod, &migrate, &secrets);
    let exit = run.run_to_end(Duration::from_secs(60)).await;
    assert!(exit.success(), "migrate: {exit}\n{}", run.log());
    let applied: i64 = db
        .connect()
        .await
        .query_one("SELECT count(*) FROM refinery_schema_history", &[])
        .await
        .unwrap()
        .get(0);
    let migrations = std::fs::read_dir(chart::repo().join("migrations/postgres"))
        .unwrap()
        .count();
    assert_eq!(applied as usize, migrations, "{}", run.log());
}

#[test]
fn the_worked_example_runs_idemgate_as_a_native_sidecar_behind_the_apps_service() {
    let m = chart::render(
        &sidecar_app(),
        &[],
        &[("idemgate.serviceMonitor.enabled", "true")],
    )
    .unwrap();
    let deployment = m.one("Deployment");
    let pod = &deployment["spec"]["template"]["spec"];
    let init = pod["initContainers"].as_array().unwrap();
    let sidecar = init.iter().find(|c| c["name"] == "idemgate").unwrap();
    assert_eq!(sidecar["restartPolicy"], "Always", "not a native sidecar");
    let app = pod["containers"].as_array().unwrap();
    assert!(app.iter().all(|c| c["name"] != "idemgate"));

    // The app's Service reaches the sidecar's proxy port, by number (a
    // named port of a native sidecar resolves only from Kubernetes 1.32,
    // above the chart's floor), and the admin Service its admin port.
    let port = |name: &str| {
        sidecar["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap()["containerPort"]
            .clone()
    };
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    let clients = m.named("Service", "rel-api");
    assert!(selects(&clients["spec"]["selector"], labels));
    assert_eq!(clients["spec"]["ports"][0]["targetPort"], port("http"));
    assert!(
        app.iter().all(|c| c["ports"].is_null()),
        "the app's own port is reachable"
    );
    let admin = m.named("Service", "rel-idemgate-admin");
    assert!(selects(&admin["spec"]["selector"], labels), "{admin}");
    assert_eq!(admin["spec"]["ports"][0]["targetPort"], port("admin"));
    // The ServiceMonitor scrapes that Service.
    let monitor = m.one("ServiceMonitor");
    assert!(selects(
        &monitor["spec"]["selector"]["matchLabels"],
        &admin["metadata"]["labels"]
    ));
    assert_eq!(monitor["spec"]["endpoints"][0]["port"], "admin");

    // The sidecar's config comes from the ConfigMap the subchart installs,
    // and forwards to the app inside the pod.
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "idemgate-config")
        .unwrap();
    let cm = m.named("ConfigMap", volume["configMap"]["name"].as_str().unwrap());
    let toml: toml::Table = cm["data"]["idemgate.toml"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(toml["upstreams"][0].as_str(), Some("http://127.0.0.1:8000"));
    assert_eq!(
        m.all("Deployment").len(),
        1,
        "sidecar mode deploys idemgate by itself"
    );
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rendered_deployment_pod_runs_on_postgresql_and_redis_as_the_manifest_says() {
    let db = TestDb::new().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let (http, admin) = ports().await;
    let file = example("deployment-postgres.yaml");
    let m = tokio::task::spawn_blocking({
        let upstream = upstream.url();
        move || {
            chart::render(
                &chart::chart(),
                &[&file],
                &[
                    ("upstreams[0]", &upstream),
                    ("ports.http", &http),
                    ("ports.admin", &admin),
                    ("redis.existingSecret", "idemgate-redis"),
                    // Inline: the chart writes the Secret itself.
                    ("admin.value", "s3cret"),
                    ("shutdownGraceSeconds", "3"),
                ],
            )
            .unwrap()
        }
    })
    .await
    .unwrap();
    let secrets: Secrets = [
        (("idemgate-db", "database-url"), db.url.clone()),
        (("idemgate-redis", "redis-url"), redis.url()),
    ]
    .into_iter()
    .map(|((n, k), v)| ((n.to_owned(), k.to_owned()), v))
    .collect();
    let deployment = m.one("Deployment");
    let spec = &deployment["spec"]["template"]["spec"];
    let container = &spec["containers"][0];
    let mut pod = exercise(&m, spec, container, &secrets, &upstream).await;

    // The admin token from the Secret guards the job API.
    let job = send(
        http::Method::POST,
        &pod.url(&Value::from("http"), "/v1/jobs"),
        &[
            ("idempotency-key", "chart-1"),
            ("content-type", "application/json"),
            ("authorization", "Bearer alice"),
        ],
        r#"{"n":1}"#,
    )
    .await
    .job()
    .unwrap();
    let path = format!("/admin/v1/jobs/{job}");
    let admin_url = pod.url(&Value::from("admin"), &path);
    let anonymous = send(http::Method::GET, &admin_url, &[], "").await;
    assert_eq!(anonymous.status, 401);
    let authorised = send(
        http::Method::GET,
        &admin_url,
        &[("authorization", "Bearer s3cret")],
        "",
    )
    .await;
    assert_eq!(authorised.status, 200, "{:?}", authorised.body);
    assert_eq!(authorised.json()["state"], "completed");

    let grace = spec["terminationGracePeriodSeconds"].as_u64().unwrap();
    let exit = pod.terminate(Duration::from_secs(grace)).await;
    assert!(exit.success(), "exit {exit}:\n{}", pod.log());
    // It logged JSON, as IDEMGATE_LOG_FORMAT in the manifest asks.
    let first_line = pod.log().lines().next().unwrap_or_default().to_owned();
    assert!(
        serde_json::from_str::<Value>(&first_line).is_ok(),
        "not JSON logs: {first_line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rendered_single_replica_pod_runs_on_its_embedded_store_in_the_empty_dir() {
    let upstream = FakeUpstream::echo().await;
    let (http, admin) = ports().await;
    let file = example("embedded-single.yaml");
    let m = tokio::task::spawn_blocking({
        let upstream = upstream.url();
        move || {
            chart::render(
                &chart::chart(),
                &[&file],
                &[
                    ("upstreams[0]", &upstream),
                    ("ports.http", &http),
                    ("ports.admin", &admin),
                ],
            )
            .unwrap()
        }
    })
    .await
    .unwrap();
    let spec = &m.one("Deployment")["spec"]["template"]["spec"];
    let mut pod = exercise(&m, spec, &spec["containers"][0], &Secrets::new(), &upstream).await;
    let exit = pod.terminate(Duration::from_secs(20)).await;
    assert!(exit.success(), "exit {exit}:\n{}", pod.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worked_examples_sidecar_runs_in_front_of_the_app_as_rendered() {
    let db = TestDb::new().await;
    let redis = ThrowawayRedis::start().await;
    let upstream = FakeUpstream::echo().await;
    let (http, admin) = ports().await;
    let m = tokio::task::spawn_blocking({
        let upstream = upstream.url();
        move || {
            chart::render(
                &sidecar_app(),
                &[],
                &[
                    ("idemgate.upstreams[0]", &upstream),
                    ("idemgate.ports.http", &http),
                    ("idemgate.ports.admin", &admin),
                ],
            )
            .unwrap()
        }
    })
    .await
    .unwrap();
    let secrets: Secrets = [
        (("idemgate-db", "database-url"), db.url.clone()),
        (("idemgate-redis", "redis-url"), redis.url()),
    ]
    .into_iter()
    .map(|((n, k), v)| ((n.to_owned(), k.to_owned()), v))
    .collect();
    let spec = &m.one("Deployment")["spec"]["template"]["spec"];
    let sidecar = spec["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "idemgate")
        .unwrap();
    let mut pod = exercise(&m, spec, sidecar, &secrets, &upstream).await;
    let exit = pod.terminate(Duration::from_secs(20)).await;
    assert!(exit.success(), "exit {exit}:\n{}", pod.log());
}

/// The `helm install` commands the READMEs and the examples' comments give
/// users to copy: each renders as written (from the repository's root) and
/// holds the invariants.
#[test]
fn the_install_commands_the_docs_give_render_as_written() {
    let repo = chart::repo();
    let mut commands = Vec::new();
    for doc in ["README.md", "helm/idemgate/README.md"] {
        let text = std::fs::read_to_string(repo.join(doc)).unwrap();
        for block in text.split("```sh\n").skip(1) {
            let block = &block[..block.find("```").unwrap()];
            let joined = block.replace("\\\n", " ");
            for line in joined.lines() {
                if line.trim_start().starts_with("helm install") {
                    commands.push((doc.to_owned(), line.trim().to_owned()));
                }
            }
        }
    }
    for entry in std::fs::read_dir(repo.join("helm/idemgate/examples")).unwrap() {
        let path = entry.unwrap().path();
        let file = if path.is_dir() {
            path.join("Chart.yaml")
        } else {
            path
        };
        let text = std::fs::read_to_string(&file).unwrap();
        for line in text.lines() {
            if let Some(command) = line
                .trim_start_matches('#')
                .trim()
                .strip_prefix("helm install")
            {
                commands.push((file.display().to_string(), format!("helm install{command}")));
            }
        }
    }
    assert!(commands.len() >= 6, "{commands:?}");
    for (doc, command) in commands {
        let words: Vec<String> = command
            .split_whitespace()
            .map(|w| w.trim_matches('\'').trim_matches('"').to_owned())
            .collect();
        // helm install NAME CHART, then --set k=v and -f FILE.
        let chart_dir = repo.join(&words[3]);
        if chart_dir.join("Chart.yaml").exists() && chart_dir.ends_with("app-with-sidecar") {
            chart::build_dependencies(&chart_dir);
        }
        let (mut sets, mut files) = (Vec::new(), Vec::new());
        let mut rest = words[4..].iter();
        while let Some(flag) = rest.next() {
            let value = rest.next().unwrap_or_else(|| panic!("{doc}: {command}"));
            match flag.as_str() {
                "--set" => sets.push(value.split_once('=').unwrap()),
                "-f" => files.push(repo.join(value)),
                other => panic!("{doc}: {other} in {command}"),
            }
        }
        let files: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
        let m = chart::render(&chart_dir, &files, &sets)
            .unwrap_or_else(|e| panic!("{doc}: `{command}` does not render: {e}"));
        check_invariants(&command, &m);
    }
}
