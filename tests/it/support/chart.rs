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

/// `helm dependency build` for a chart whose dependencies are `file://`
/// charts of this repository (no network). One at a time: it rewrites the
/// chart's `charts/`.
pub fn build_dependencies(chart: &Path) {
    static BUILDING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = BUILDING.lock().unwrap_or_else(|e| e.into_inner());
    let out = run_helm(&["dependency", "build", chart.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "helm dependency build {}: {}",
        chart.display(),
        String::from_utf8_lossy(&out.stderr)
    );
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

impl Manifest {
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

/// One pod's idemgate container, started as the kubelet would: the image's
/// entrypoint (the binary under test) with the container's args and only
/// its env, each volume mount a directory of its own (a ConfigMap's files,
/// or a Secret's the test holds, written into it) and the mount paths
/// mapped onto those directories.
pub struct Pod {
    pub container: Value,
    child: tokio::process::Child,
    dir: tempfile::TempDir,
}

/// The `Secret` objects the pod refers to: (name, key) to value.
pub type Secrets = HashMap<(String, String), String>;

impl Pod {
    pub async fn start(
        manifest: &Manifest,
        pod: &Value,
        container: &Value,
        secrets: &Secrets,
    ) -> Pod {
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

        let mut cmd = tokio::process::Command::new(entrypoint(container));
        for arg in container["args"].as_array().into_iter().flatten() {
            cmd.arg(remap(arg.as_str().unwrap()));
        }
        cmd.env_clear();
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
                // A Secret the chart rendered (values given inline), or
                // one the cluster is expected to hold already.
                let rendered = manifest
                    .all("Secret")
                    .into_iter()
                    .find(|s| s["metadata"]["name"] == id.0.as_str())
                    .and_then(|s| s["stringData"][&id.1].as_str());
                match rendered {
                    Some(v) => v.to_owned(),
                    None => secrets.get(&id).cloned().unwrap_or_else(|| {
                        panic!("{name} reads Secret {id:?}, which the test does not hold")
                    }),
                }
            };
            // A path under a mount (a URL naming a mounted file) is remapped too.
            cmd.env(name, remap(&value));
        }
        let log = std::fs::File::create(dir.path().join("container.log")).unwrap();
        cmd.stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true);
        let child = cmd.spawn().expect("the binary starts");
        Pod {
            container: container.clone(),
            child,
            dir,
        }
    }

    /// What the container wrote.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("container.log")).unwrap_or_default()
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
