//! The Helm chart (`helm/idemgate`): every values example lints, renders and
//! passes the Kubernetes schemas; values that cannot work are refused at
//! install time; and the pods it renders run: the binary started exactly as
//! the manifest says answers its probes on the ports the manifest names and
//! proxies and replays through them.

use std::time::Duration;

use serde_json::Value;

use crate::support::chart::{self, Manifest, Pod, Secrets};
use crate::support::redis::free_port;
use crate::support::{send, FakeUpstream, TestDb, ThrowawayRedis};

/// The oldest Kubernetes the chart supports (native sidecars, the preStop
/// sleep action) and the newest the validator knows.
const KUBERNETES: &[&str] = &["1.30.0", "1.37.0"];

fn example(name: &str) -> std::path::PathBuf {
    chart::chart().join("examples").join(name)
}

fn sidecar_app() -> std::path::PathBuf {
    let app = example("app-with-sidecar");
    chart::build_dependencies(&app);
    app
}

/// What every rendered manifest must hold, whatever the values.
fn check_invariants(what: &str, m: &Manifest) {
    for kind in KUBERNETES {
        let unknown = m.validate(kind);
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
        assert_eq!(
            s["capabilities"]["drop"],
            serde_json::json!(["ALL"]),
            "{what}: {name}"
        );
        if c["name"] != "idemgate" {
            continue;
        }
        // Secrets by reference only, never inlined into env or the config.
        for var in c["env"].as_array().into_iter().flatten() {
            let n = var["name"].as_str().unwrap();
            if n.ends_with("_URL") && n != "OTEL_EXPORTER_OTLP_ENDPOINT"
                || n.ends_with("TOKEN")
                || n.ends_with("KEY")
            {
                assert!(
                    var["valueFrom"]["secretKeyRef"].is_object(),
                    "{what}: {n} is not read from a Secret"
                );
            }
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
    // The Service clients reach never carries the admin port.
    for svc in m.all("Service") {
        if svc["metadata"]["labels"]["app.kubernetes.io/component"] == "admin" {
            continue;
        }
        for port in svc["spec"]["ports"].as_array().unwrap() {
            assert_eq!(
                port["targetPort"], "http",
                "{what}: {} exposes {port}",
                svc["metadata"]["name"]
            );
        }
    }
    // The pod outlives its drain: preStop, then shutdown_grace, inside the
    // termination grace period.
    for d in m.all("Deployment") {
        let spec = &d["spec"]["template"]["spec"];
        let idemgate = spec["initContainers"]
            .as_array()
            .into_iter()
            .chain(spec["containers"].as_array())
            .flatten()
            .find(|c| c["name"] == "idemgate")
            .expect("an idemgate container");
        let pre_stop = idemgate["lifecycle"]["preStop"]["sleep"]["seconds"]
            .as_u64()
            .unwrap();
        let toml = config_of(m);
        let grace = humantime::parse_duration(toml["shutdown_grace"].as_str().unwrap())
            .unwrap()
            .as_secs();
        let period = spec["terminationGracePeriodSeconds"].as_u64().unwrap();
        assert!(
            period > pre_stop + grace,
            "{what}: terminationGracePeriodSeconds {period} <= preStop {pre_stop} + shutdown_grace {grace}"
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

    let app = sidecar_app();
    let lint = chart::run_helm(&["lint", "--strict", app.to_str().unwrap()]);
    assert!(
        lint.status.success(),
        "{}",
        String::from_utf8_lossy(&lint.stdout)
    );
    let m = chart::render(&app, &[], &[]).unwrap();
    check_invariants("app-with-sidecar", &m);
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

    // The defaults (two replicas) need PostgreSQL; one replica on the
    // embedded store renders, autoscaling it does not.
    match chart::render(&chart::chart(), &[], &[]) {
        Ok(_) => panic!("the defaults rendered on the embedded store with two replicas"),
        Err(said) => assert!(said.contains("database.existingSecret"), "{said}"),
    }
    chart::render(&chart::chart(), &[], &[("replicaCount", "1")]).unwrap();
    let scaled = chart::render(
        &chart::chart(),
        &[],
        &[("replicaCount", "1"), ("autoscaling.enabled", "true")],
    );
    assert!(scaled.is_err(), "autoscaling the embedded store rendered");
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

#[test]
fn the_worked_example_runs_idemgate_as_a_native_sidecar_behind_the_apps_service() {
    let m = chart::render(&sidecar_app(), &[], &[]).unwrap();
    let pod = &m.one("Deployment")["spec"]["template"]["spec"];
    let init = pod["initContainers"].as_array().unwrap();
    let sidecar = init.iter().find(|c| c["name"] == "idemgate").unwrap();
    assert_eq!(sidecar["restartPolicy"], "Always", "not a native sidecar");
    let app = pod["containers"].as_array().unwrap();
    assert!(app.iter().all(|c| c["name"] != "idemgate"));

    // The app's Service reaches the sidecar's named port.
    let svc = m.one("Service");
    let target = &svc["spec"]["ports"][0]["targetPort"];
    let ports = sidecar["ports"].as_array().unwrap();
    assert!(
        ports.iter().any(|p| &p["name"] == target),
        "Service targets {target}, not idemgate"
    );
    assert!(
        app.iter().all(|c| c["ports"].is_null()),
        "the app's own port is reachable"
    );

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
