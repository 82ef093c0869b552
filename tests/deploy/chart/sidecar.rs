//! The worked example (app-with-sidecar): idemgate as a native sidecar
//! behind the app's Service, run as rendered; and the `helm install`
//! commands the docs give, rendered as written.

use super::*;
use crate::support::docs;

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

/// The `helm install` commands `docs/kubernetes.md`, the chart's README and
/// the examples' comments give users to copy: each renders as written (from
/// the repository's root) and holds the invariants.
#[test]
fn the_install_commands_the_docs_give_render_as_written() {
    let repo = chart::repo();
    let mut commands = Vec::new();
    let chart_readme = std::fs::read_to_string(repo.join("helm/idemgate/README.md")).unwrap();
    let blocks = chart_readme
        .split("```sh\n")
        .skip(1)
        .map(|block| {
            (
                "helm/idemgate/README.md",
                block[..block.find("```").unwrap()].to_owned(),
            )
        })
        .chain([("docs/kubernetes.md", docs::block("kubernetes-helm-install"))]);
    for (doc, block) in blocks {
        let joined = block.replace("\\\n", " ");
        for line in joined.lines() {
            if line.trim_start().starts_with("helm install") {
                commands.push((doc.to_owned(), line.trim().to_owned()));
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
        let built;
        let chart_dir: &Path =
            if chart_dir.join("Chart.yaml").exists() && chart_dir.ends_with("app-with-sidecar") {
                built = chart::with_dependencies(&chart_dir);
                &built
            } else {
                &chart_dir
            };
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
        let m = chart::render(chart_dir, &files, &sets)
            .unwrap_or_else(|e| panic!("{doc}: `{command}` does not render: {e}"));
        check_invariants(&command, &m);
    }
}

/// `docs/kubernetes.md`'s sidecar excerpt says what the worked example
/// (`examples/app-with-sidecar`, installed by the tests above) does: the
/// same dependency, values and template calls.
#[test]
fn the_sidecar_excerpt_is_what_the_worked_example_does() {
    let repo = chart::repo();
    let example = repo.join("helm/idemgate/examples/app-with-sidecar");
    let excerpt = docs::block("kubernetes-sidecar-excerpt");
    let part = |from: &str, to: &str| -> String {
        let start = excerpt
            .find(from)
            .unwrap_or_else(|| panic!("{from} in {excerpt}"));
        let rest = &excerpt[start..];
        rest[..rest.find(to).unwrap_or(rest.len())].to_owned()
    };
    let yaml = |text: &str| -> serde_yaml_ng::Value { serde_yaml_ng::from_str(text).unwrap() };
    let read = |path: &Path| std::fs::read_to_string(path).unwrap();

    let chart = yaml(&part("# your chart's Chart.yaml", "# your values.yaml"));
    let theirs = yaml(&read(&example.join("Chart.yaml")));
    let ours = yaml(&read(&repo.join("helm/idemgate/Chart.yaml")));
    let dependency = &chart["dependencies"][0];
    assert_eq!(dependency["name"], theirs["dependencies"][0]["name"]);
    assert_eq!(
        dependency["version"], ours["version"],
        "the chart's version"
    );

    let values = yaml(&part("# your values.yaml", "# your Deployment's pod spec"));
    let theirs = yaml(&read(&example.join("values.yaml")));
    for key in ["mode", "upstreams", "database"] {
        assert_eq!(values["idemgate"][key], theirs["idemgate"][key], "{key}");
    }

    let template = read(&example.join("templates/deployment.yaml"));
    let calls: Vec<&str> = excerpt
        .lines()
        .filter(|l| l.contains("include \"idemgate."))
        .collect();
    assert_eq!(calls.len(), 3, "{excerpt}");
    for call in calls {
        let what = call
            .trim()
            .trim_start_matches("- ")
            .trim_start_matches("{{-");
        let what = &what[..what.find("| nindent").unwrap_or(what.len())];
        assert!(template.contains(what.trim()), "the example does {what}");
    }
}
