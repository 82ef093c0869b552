//! What the release holds and tells: the admin token and replay key made
//! unless named, and NOTES.txt naming what the release holds.

use super::*;

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
    let trial = "a-trial-token-of-ours";
    let inline = chart::render(&chart::chart(), &[], &[("admin.value", trial)]).unwrap();
    let r = env_ref(&inline, "IDEMGATE_ADMIN_TOKEN");
    assert_eq!(
        inline.secret(r["name"].as_str().unwrap(), "admin-token"),
        Some(trial.into())
    );
    // A token the binary would refuse at start-up is refused at install.
    let short = chart::render(&chart::chart(), &[], &[("admin.value", "trial")]);
    assert!(short.is_err_and(|said| said.contains("schema")));
    let empty = chart::render(&chart::chart(), &[], &[("admin.value", "")]).unwrap();
    let r = env_ref(&empty, "IDEMGATE_ADMIN_TOKEN");
    let own = empty.secret(r["name"].as_str().unwrap(), "admin-token");
    assert!(
        own.is_some_and(|t| t.len() >= 32),
        "empty is unset: the chart makes one"
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
