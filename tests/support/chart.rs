//! The Helm chart as an operator meets it: `helm` (fetched once by
//! `scripts/fetch-helm.sh`), rendered manifests read as JSON, the Kubernetes
//! schema validator, and a rendered pod's idemgate container started the
//! way the kubelet would start it, on loopback.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;

use super::python;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `helm/idemgate`.
pub fn chart() -> PathBuf {
    repo().join("helm/idemgate")
}

/// The values examples shipped with the chart: `*.yaml` render, while
/// `*.fail.yaml` must be refused.
pub fn examples() -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(chart().join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    found.sort();
    found
}

pub fn helm() -> &'static Path {
    static HELM: OnceLock<PathBuf> = OnceLock::new();
    HELM.get_or_init(|| {
        let out = Command::new(repo().join("scripts/fetch-helm.sh"))
            .stderr(Stdio::inherit())
            .output()
            .expect("scripts/fetch-helm.sh");
        assert!(out.status.success(), "scripts/fetch-helm.sh failed");
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
}

pub fn run_helm(args: &[&str]) -> Output {
    Command::new(helm()).args(args).output().expect("helm runs")
}

/// A chart of this repository's `helm/` with its `file://` dependencies
/// built, in a folder of the test's own: all of `helm/` copied (so that
/// `file://` paths resolve as in the repository; the dependencies' build
/// output, `charts/` and `Chart.lock`, left out), then `helm dependency
/// build` run on the copy, with helm's cache, config and data homes in that
/// folder too. Nothing is written into the repository, and no test reads
/// what another writes.
pub struct ChartCopy {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl std::ops::Deref for ChartCopy {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for ChartCopy {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

/// [`ChartCopy`] of `chart` (a folder under the repository's `helm/`).
pub fn with_dependencies(chart: &Path) -> ChartCopy {
    let helm_dir = repo().join("helm");
    let inside = chart
        .strip_prefix(&helm_dir)
        .unwrap_or_else(|_| panic!("{} is not under {}", chart.display(), helm_dir.display()));
    let dir = tempfile::tempdir().unwrap();
    copy_chart_sources(&helm_dir, &dir.path().join("helm"));
    let path = dir.path().join("helm").join(inside);
    let homes = dir.path().join("helm-homes");
    let out = Command::new(helm())
        .args(["dependency", "build"])
        .arg(&path)
        .env("HELM_CACHE_HOME", homes.join("cache"))
        .env("HELM_CONFIG_HOME", homes.join("config"))
        .env("HELM_DATA_HOME", homes.join("data"))
        .output()
        .expect("helm runs");
    assert!(
        out.status.success(),
        "helm dependency build {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    ChartCopy { path, _dir: dir }
}

/// Copies the charts under `from` into `to`, without what `helm dependency
/// build` makes (`charts/`, `Chart.lock`, its `tmpcharts-*`).
fn copy_chart_sources(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        let name = name.to_str().unwrap();
        if name == "charts" || name == "Chart.lock" || name.starts_with("tmpcharts") {
            continue;
        }
        let target = to.join(name);
        if entry.file_type().unwrap().is_dir() {
            copy_chart_sources(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// The `kubernetes-validate` command (PyPI), in a throwaway virtualenv.
pub fn kubernetes_validate() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        python::venv(
            "test-venv-k8s",
            &["kubernetes-validate"],
            "import kubernetes_validate",
        )
        .join("kubernetes-validate")
    })
}

/// Everything `helm template` wrote, and each document as JSON.
pub struct Manifest {
    pub text: String,
    pub docs: Vec<Value>,
}

/// `helm template` of `chart` with these values files and `--set`s: the
/// manifest, or helm's complaint.
pub fn render(chart: &Path, values: &[&Path], sets: &[(&str, &str)]) -> Result<Manifest, String> {
    let mut cmd = Command::new(helm());
    cmd.args(["template", "rel", chart.to_str().unwrap()]);
    for file in values {
        cmd.arg("-f").arg(file);
    }
    for (key, value) in sets {
        cmd.arg("--set").arg(format!("{key}={value}"));
    }
    let out = cmd.output().expect("helm runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let text = String::from_utf8(out.stdout).unwrap();
    let docs = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| {
            <Value as serde::Deserialize>::deserialize(doc)
                .unwrap_or_else(|e| panic!("helm wrote YAML that does not parse ({e}):\n{text}"))
        })
        .filter(|doc| !doc.is_null())
        .collect();
    Ok(Manifest { text, docs })
}

/// `helm install --dry-run=client` (no cluster) of `chart` into
/// `namespace`: the manifest (hooks included) and the notes helm prints.
pub fn install_notes(
    chart: &Path,
    values: &[&Path],
    sets: &[(&str, &str)],
    namespace: &str,
) -> (Manifest, String) {
    let mut cmd = Command::new(helm());
    cmd.args(["install", "rel"]).arg(chart).args([
        "--dry-run=client",
        "--output",
        "json",
        "--namespace",
        namespace,
    ]);
    for file in values {
        cmd.arg("-f").arg(file);
    }
    for (key, value) in sets {
        cmd.arg("--set").arg(format!("{key}={value}"));
    }
    let out = cmd.output().expect("helm runs");
    assert!(
        out.status.success(),
        "helm install --dry-run=client: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let release: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut text = release["manifest"].as_str().unwrap().to_owned();
    for hook in release["hooks"].as_array().into_iter().flatten() {
        text.push_str("\n---\n");
        text.push_str(hook["manifest"].as_str().unwrap());
    }
    let docs = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| <Value as serde::Deserialize>::deserialize(doc).unwrap())
        .filter(|doc| !doc.is_null())
        .collect();
    let notes = release["info"]["notes"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    (Manifest { text, docs }, notes)
}

/// The oldest Kubernetes the chart says it supports: the floor of
/// Chart.yaml's `kubeVersion` (">=1.30.0-0"), as "1.30.0".
pub fn kubernetes_floor() -> String {
    let text = std::fs::read_to_string(chart().join("Chart.yaml")).unwrap();
    let yaml: Value = serde_yaml_ng::from_str(&text).unwrap();
    let range = yaml["kubeVersion"]
        .as_str()
        .expect("Chart.yaml has a kubeVersion");
    let floor = range
        .strip_prefix(">=")
        .unwrap_or_else(|| panic!("kubeVersion {range:?} is not a floor (>=x.y.z-0)"));
    floor.trim().trim_end_matches("-0").to_owned()
}

impl Manifest {
    /// A key of a Secret the manifest holds (stringData, or base64 data).
    pub fn secret(&self, name: &str, key: &str) -> Option<String> {
        use base64::Engine;
        let secret = self
            .all("Secret")
            .into_iter()
            .find(|s| s["metadata"]["name"] == name)?;
        if let Some(v) = secret["stringData"][key].as_str() {
            return Some(v.to_owned());
        }
        let data = secret["data"][key].as_str()?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data)
            .unwrap();
        Some(String::from_utf8(bytes).unwrap())
    }

    pub fn all(&self, kind: &str) -> Vec<&Value> {
        self.docs.iter().filter(|d| d["kind"] == kind).collect()
    }

    pub fn one(&self, kind: &str) -> &Value {
        let found = self.all(kind);
        assert_eq!(found.len(), 1, "expected one {kind}, found {}", found.len());
        found[0]
    }

    pub fn named(&self, kind: &str, name: &str) -> &Value {
        self.docs
            .iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} named {name} in the manifest"))
    }

    /// Every container of every pod template (Deployments and Jobs), init
    /// containers included.
    pub fn containers(&self) -> Vec<&Value> {
        self.docs
            .iter()
            .filter_map(|d| d["spec"]["template"]["spec"].as_object())
            .flat_map(|spec| {
                ["initContainers", "containers"]
                    .into_iter()
                    .filter_map(|k| spec.get(k).and_then(Value::as_array))
                    .flatten()
            })
            .collect()
    }

    /// `kubernetes-validate --strict` against Kubernetes `version`: every
    /// kind it knows must pass; those it does not are returned.
    pub fn validate(&self, version: &str) -> Vec<String> {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("manifest.yaml");
        std::fs::write(&file, &self.text).unwrap();
        let out = Command::new(kubernetes_validate())
            .args(["--strict", "--quiet", "-k", version])
            .arg(&file)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "the manifest fails the Kubernetes {version} schemas:\n{said}\n{}",
            self.text
        );
        said.lines()
            .filter_map(|l| l.split("Couldn't find schema for kind ").nth(1))
            .map(|rest| rest.split(' ').next().unwrap().to_owned())
            .collect()
    }
}

/// One container of a rendered pod, laid out as the kubelet would lay it
/// out: each volume mount a directory of its own (a ConfigMap's files, or a
/// Secret's the test holds, written into it), the mount paths in its args
/// and env mapped onto those directories, and only its env, each variable
/// read from its `value` or from the Secret it names. The program is the
/// image's entrypoint: the binary under test.
pub struct Container {
    pub spec: Value,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    dir: tempfile::TempDir,
}

/// The `Secret` objects the pod refers to: (name, key) to value.
pub type Secrets = HashMap<(String, String), String>;

impl Container {
    pub fn prepare(
        manifest: &Manifest,
        pod: &Value,
        container: &Value,
        secrets: &Secrets,
    ) -> Container {
        let dir = tempfile::tempdir().unwrap();
        let mounts: Vec<(String, PathBuf)> = container["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| {
                let path = m["mountPath"].as_str().unwrap().to_owned();
                (path.clone(), dir.path().join(path.trim_start_matches('/')))
            })
            .collect();
        // In one pass, the longest mount path first where several match
        // (`/etc/idemgate` and `/etc/idemgate-tls/postgres`).
        let remap = |s: &str| {
            let mut out = String::with_capacity(s.len());
            let mut rest = s;
            while !rest.is_empty() {
                let longest = mounts
                    .iter()
                    .filter(|(path, _)| rest.starts_with(path.as_str()))
                    .max_by_key(|(path, _)| path.len());
                match longest {
                    Some((path, host)) => {
                        out.push_str(host.to_str().unwrap());
                        rest = &rest[path.len()..];
                    }
                    None => {
                        let c = rest.chars().next().unwrap();
                        out.push(c);
                        rest = &rest[c.len_utf8()..];
                    }
                }
            }
            out
        };
        for m in container["volumeMounts"].as_array().into_iter().flatten() {
            let name = m["name"].as_str().unwrap();
            let host = dir
                .path()
                .join(m["mountPath"].as_str().unwrap().trim_start_matches('/'));
            std::fs::create_dir_all(&host).unwrap();
            let volume = pod["volumes"]
                .as_array()
                .and_then(|v| v.iter().find(|v| v["name"] == name))
                .unwrap_or_else(|| panic!("volume {name} is mounted but not in the pod"));
            if let Some(cm) = volume["configMap"]["name"].as_str() {
                let data = manifest.named("ConfigMap", cm)["data"].as_object().unwrap();
                for (file, body) in data {
                    std::fs::write(host.join(file), remap(body.as_str().unwrap())).unwrap();
                }
            } else if let Some(secret) = volume["secret"]["secretName"].as_str() {
                // A Secret the cluster holds: each key the test gave it, a file.
                for ((of, key), value) in secrets {
                    if of == secret {
                        std::fs::write(host.join(key), value).unwrap();
                    }
                }
            } else {
                assert!(
                    volume.get("emptyDir").is_some(),
                    "volume {name}: only configMap, secret and emptyDir volumes are expected"
                );
            }
        }

        let args = container["args"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|arg| remap(arg.as_str().unwrap()))
            .collect();
        let mut env = Vec::new();
        for var in container["env"].as_array().into_iter().flatten() {
            let name = var["name"].as_str().unwrap();
            let value = if let Some(v) = var["value"].as_str() {
                v.to_owned()
            } else {
                let r = &var["valueFrom"]["secretKeyRef"];
                let id = (
                    r["name"].as_str().unwrap().to_owned(),
                    r["key"].as_str().unwrap().to_owned(),
                );
                // A Secret the chart rendered (values given inline, or
                // made by the chart), or one the cluster is expected to
                // hold already.
                match manifest.secret(&id.0, &id.1) {
                    Some(v) => v,
                    None => secrets.get(&id).cloned().unwrap_or_else(|| {
                        panic!("{name} reads Secret {id:?}, which the test does not hold")
                    }),
                }
            };
            // A path under a mount (a URL naming a mounted file) is remapped too.
            env.push((name.to_owned(), remap(&value)));
        }
        Container {
            spec: container.clone(),
            program: entrypoint(container),
            args,
            env,
            dir,
        }
    }

    /// The program with `args` (the container's own, or others), only the
    /// container's environment, and the container's log file as its output.
    fn command(&self, args: &[String]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.program);
        cmd.args(args).env_clear().envs(self.env.iter().cloned());
        let log = std::fs::File::create(self.dir.path().join("container.log")).unwrap();
        cmd.stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true);
        cmd
    }

    /// The value of an environment variable as the container gets it.
    pub fn env(&self, name: &str) -> Option<&str> {
        self.env
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// What the container wrote.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("container.log")).unwrap_or_default()
    }

    /// `idemgate check` with everything the container would serve with (its
    /// config file, its environment, its mounted files): its args with
    /// `serve` replaced by `check`. The exit status, and what it printed.
    pub async fn check(&self) -> (std::process::ExitStatus, String) {
        let args: Vec<String> = self
            .args
            .iter()
            .map(|a| {
                if a == "serve" {
                    "check".into()
                } else {
                    a.clone()
                }
            })
            .collect();
        assert!(
            args.iter().any(|a| a == "check"),
            "the container does not serve: {:?}",
            self.args
        );
        let exit = tokio::time::timeout(Duration::from_secs(30), self.command(&args).status())
            .await
            .expect("`idemgate check` did not finish within 30 s")
            .unwrap();
        (exit, self.log())
    }

    /// Runs the container to its end, as a Job's: the exit status.
    pub async fn run_to_end(&self, within: Duration) -> std::process::ExitStatus {
        tokio::time::timeout(within, self.command(&self.args).status())
            .await
            .unwrap_or_else(|_| panic!("still running after {within:?}:\n{}", self.log()))
            .unwrap()
    }
}

/// One pod's idemgate container, started as the kubelet would
/// ([`Container::prepare`]), running.
pub struct Pod {
    pub container: Value,
    child: tokio::process::Child,
    prepared: Container,
}

impl Pod {
    pub async fn start(
        manifest: &Manifest,
        pod: &Value,
        container: &Value,
        secrets: &Secrets,
    ) -> Pod {
        let prepared = Container::prepare(manifest, pod, container, secrets);
        let child = prepared
            .command(&prepared.args)
            .spawn()
            .expect("the binary starts");
        Pod {
            container: container.clone(),
            child,
            prepared,
        }
    }

    /// The value of an environment variable as the container got it.
    pub fn env(&self, name: &str) -> Option<&str> {
        self.prepared.env(name)
    }

    /// What the container wrote.
    pub fn log(&self) -> String {
        self.prepared.log()
    }

    /// The container port a probe or Service names (by name or number).
    pub fn port(&self, port: &Value) -> u16 {
        if let Some(n) = port.as_u64() {
            return n as u16;
        }
        let name = port.as_str().unwrap();
        self.container["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no container port named {name}"))["containerPort"]
            .as_u64()
            .unwrap() as u16
    }

    pub fn url(&self, port: &Value, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port(port))
    }

    /// Runs the container's `probe` (`startupProbe`, …) the way the kubelet
    /// does, within the budget the probe itself gives (period × failure
    /// threshold); panics, with the container's log, if it never passes.
    pub async fn pass(&mut self, probe: &str) {
        let p = &self.container[probe]["httpGet"];
        assert!(p.is_object(), "{probe} is not an httpGet probe");
        let url = self.url(&p["port"], p["path"].as_str().unwrap());
        let period = self.container[probe]["periodSeconds"]
            .as_u64()
            .unwrap_or(10);
        let failures = self.container[probe]["failureThreshold"]
            .as_u64()
            .unwrap_or(3);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(period * failures);
        loop {
            if let Ok(status) = get_status(&url).await {
                if (200..400).contains(&status) {
                    return;
                }
            }
            if let Ok(Some(exit)) = self.child.try_wait() {
                panic!(
                    "the container exited ({exit}) before {probe} passed:\n{}",
                    self.log()
                );
            }
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "{probe} ({url}) did not pass within its budget:\n{}",
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGTERM, as the kubelet sends after preStop; the exit status.
    pub async fn terminate(&mut self, within: Duration) -> std::process::ExitStatus {
        let pid = self.child.id().unwrap().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(sent.success());
        tokio::time::timeout(within, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("not stopped {within:?} after SIGTERM:\n{}", self.log()))
            .unwrap()
    }
}

async fn get_status(url: &str) -> Result<u16, ()> {
    let req = http::Request::get(url)
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    match tokio::time::timeout(Duration::from_secs(2), super::client().request(req)).await {
        Ok(Ok(r)) => Ok(r.status().as_u16()),
        _ => Err(()),
    }
}

/// The program the container runs: its `command`, or else the image's
/// ENTRYPOINT from the Dockerfile. Either must be the idemgate binary,
/// which is then the one under test.
fn entrypoint(container: &Value) -> PathBuf {
    let program = match container["command"].as_array() {
        Some(command) => command[0].as_str().unwrap().to_owned(),
        None => {
            let dockerfile = std::fs::read_to_string(repo().join("Dockerfile")).unwrap();
            let line = dockerfile
                .lines()
                .rfind(|l| l.starts_with("ENTRYPOINT"))
                .expect("the Dockerfile has an ENTRYPOINT");
            let exec: Vec<String> =
                serde_json::from_str(line.trim_start_matches("ENTRYPOINT").trim()).unwrap();
            exec[0].clone()
        }
    };
    assert!(
        program.ends_with("/idemgate"),
        "the container runs {program}, not the idemgate binary"
    );
    PathBuf::from(env!("CARGO_BIN_EXE_idemgate"))
}
