//! Rendered pods run as the manifest says: the drain and grace period, the
//! migrate Job, the Deployment's pod on PostgreSQL and Redis (over TLS
//! too), and the single replica on its embedded store.

use super::*;

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
                    ("admin.value", "s3cret-of-the-admin"),
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
        &[("authorization", "Bearer s3cret-of-the-admin")],
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

/// The chart's example with `database.tlsSecret`: the pod, started as
/// rendered, reads the CA from the mount the database URL names (the path
/// the example and docs/design.md §16 give) and serves over TLS only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_tls_mount_holds_the_files_the_url_names() {
    use crate::support::postgres_tls;
    let server = postgres_tls::server().await;
    let db = server.database("postgres").await;
    let upstream = FakeUpstream::echo().await;
    let (http, admin) = ports().await;
    let file = chart::chart().join("examples/deployment-postgres-tls.yaml");
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
                    ("shutdownGraceSeconds", "3"),
                ],
            )
            .unwrap()
        }
    })
    .await
    .unwrap();
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/{db}?sslmode=verify-full\
         &sslrootcert=/etc/idemgate-tls/postgres/ca.pem",
        server.pg.port
    );
    let ca = std::fs::read_to_string(server.file("ca.pem")).unwrap();
    let secrets: Secrets = [
        (("idemgate-db", "database-url"), url),
        (("idemgate-db-tls", "ca.pem"), ca),
    ]
    .into_iter()
    .map(|((n, k), v)| ((n.to_owned(), k.to_owned()), v))
    .collect();
    let spec = &m.one("Deployment")["spec"]["template"]["spec"];
    let container = &spec["containers"][0];
    let mount = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["mountPath"] == "/etc/idemgate-tls/postgres")
        .expect("the Secret is mounted where the docs say");
    assert_eq!(mount["readOnly"], true);
    let pod = exercise(&m, spec, container, &secrets, &upstream).await;
    let (sessions, encrypted) = server.sessions(&db).await;
    assert!(sessions >= 1 && encrypted == sessions, "{}", pod.log());
}
