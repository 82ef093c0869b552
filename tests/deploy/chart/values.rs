//! Values as the chart takes them: those that cannot work refused at
//! install naming the fix, the schema agreeing with the binary on config
//! values, whole numbers written as integers, the conventions platform
//! engineers expect, and every value described with its default.

use super::*;

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
        (
            "worker_runtime: per_thread",
            "worker_runtime = \"per_thread\"",
            true,
        ),
        (
            "worker_runtime: pooled",
            "worker_runtime = \"pooled\"",
            false,
        ),
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
