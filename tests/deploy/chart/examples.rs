//! Every values example (and the chart's defaults, the worked sidecar
//! example and the every-integer fixture): lints, renders, passes the
//! Kubernetes schemas and `idemgate check` with its pod's environment, and
//! its pod starts and passes its probes.

use super::*;

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

/// Every values example's pod, started as rendered: the binary answers its
/// probes on the ports they name, reaches the store and Redis it was given
/// (readiness lists them up), and guards the admin API with the token the
/// pod gets. PostgreSQL examples run on a fresh database of their own; the
/// TLS one on the suite's TLS server (postgres_tls.rs), whose CA it is given
/// as the Secret it mounts; Redis on a throwaway server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_values_examples_pod_starts_and_passes_its_probes() {
    let redis = ThrowawayRedis::start().await;
    let tls = crate::support::postgres_tls::server().await;
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
