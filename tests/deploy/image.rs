//! The container image: built here without a container engine
//! (`scripts/oci-image.py`, the Dockerfile's final stage written as an OCI
//! image layout), checked blob by blob and config key by key, and run:
//! its root filesystem unpacked and the gateway started in it as its
//! non-root user. And the release workflow that pushes the real one names
//! the image and tag the chart installs by default.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use http::Method;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::support::chart::repo;
use crate::support::send;

/// A blob of the layout, its digest checked against its bytes.
fn blob(layout: &Path, digest: &str) -> Vec<u8> {
    let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
    let bytes = std::fs::read(layout.join("blobs/sha256").join(hex)).unwrap();
    assert_eq!(hex::encode(Sha256::digest(&bytes)), hex, "blob {digest}");
    bytes
}

fn json_blob(layout: &Path, descriptor: &Value) -> Value {
    let bytes = blob(layout, descriptor["digest"].as_str().unwrap());
    assert_eq!(descriptor["size"].as_u64(), Some(bytes.len() as u64));
    serde_json::from_slice(&bytes).unwrap()
}

fn cargo_version() -> String {
    let cargo: toml::Table = std::fs::read_to_string(repo().join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    // Every crate of the workspace takes its version from there.
    cargo["workspace"]["package"]["version"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Builds the image from the binary under test; the layout's directory.
fn build(dir: &Path) -> PathBuf {
    let layout = dir.join("oci");
    let out = std::process::Command::new("python3")
        .arg(repo().join("scripts/oci-image.py"))
        .arg("--binary")
        .arg(env!("CARGO_BIN_EXE_idemgate"))
        .arg("--out")
        .arg(&layout)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    layout
}

#[tokio::test]
async fn the_image_is_a_valid_oci_layout_whose_config_is_the_dockerfiles_and_it_runs() {
    let dir = tempfile::tempdir().unwrap();
    let layout = build(dir.path());
    let index: Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let entry = &index["manifests"][0];
    let version = cargo_version();
    assert_eq!(
        entry["annotations"]["org.opencontainers.image.ref.name"],
        version.as_str()
    );
    let manifest = json_blob(&layout, entry);
    let config = json_blob(&layout, &manifest["config"]);
    let c = &config["config"];
    assert_eq!(
        c["Entrypoint"],
        serde_json::json!(["/usr/local/bin/idemgate"])
    );
    assert_eq!(
        c["Cmd"],
        serde_json::json!(["serve", "--config", "/etc/idemgate/idemgate.toml"])
    );
    assert_eq!(c["User"], "65532:65532", "numeric, for runAsNonRoot");
    let ports: Vec<&String> = c["ExposedPorts"].as_object().unwrap().keys().collect();
    assert_eq!(ports, ["8080/tcp", "9090/tcp"]);
    let labels = &c["Labels"];
    assert_eq!(labels["org.opencontainers.image.version"], version.as_str());
    assert_eq!(labels["org.opencontainers.image.licenses"], "Apache-2.0");
    assert_eq!(
        labels["org.opencontainers.image.source"],
        "https://github.com/idemgate/idemgate"
    );

    // The one layer: its gzip holds the tar whose digest the config names.
    let layer = &manifest["layers"][0];
    let gz = blob(&layout, layer["digest"].as_str().unwrap());
    let mut tar = Vec::new();
    std::io::Read::read_to_end(&mut flate_decoder(&gz), &mut tar).unwrap();
    assert_eq!(
        format!("sha256:{}", hex::encode(Sha256::digest(&tar))),
        config["rootfs"]["diff_ids"][0].as_str().unwrap()
    );
    run_in_rootfs(dir.path(), &layout, layer).await;
}

/// gzip, through the system's `gzip` (no decompression crate for one test).
fn flate_decoder(gz: &[u8]) -> std::io::Cursor<Vec<u8>> {
    let mut child = std::process::Command::new("gzip")
        .arg("-dc")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let input = gz.to_vec();
    let writer = std::thread::spawn(move || std::io::Write::write_all(&mut stdin, &input));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(out.status.success());
    std::io::Cursor::new(out.stdout)
}

/// Unpacks the layer and serves from it, chrooted, as the image's user:
/// the binary, its libraries and its loader are all in the image.
async fn run_in_rootfs(dir: &Path, layout: &Path, layer: &Value) {
    let rootfs = dir.join("rootfs");
    std::fs::create_dir_all(&rootfs).unwrap();
    let hex = layer["digest"]
        .as_str()
        .unwrap()
        .trim_start_matches("sha256:");
    let unpacked = std::process::Command::new("tar")
        .arg("-xzf")
        .arg(layout.join("blobs/sha256").join(hex))
        .arg("-C")
        .arg(&rootfs)
        .status()
        .unwrap();
    assert!(unpacked.success());
    std::fs::write(
        rootfs.join("etc/idemgate/idemgate.toml"),
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         upstreams = [\"http://127.0.0.1:1\"]\nembedded_path = \"/tmp/idemgate.db\"\n",
    )
    .unwrap();
    let mut child = tokio::process::Command::new("chroot")
        .args(["--userspec=65532:65532"])
        .arg(&rootfs)
        .args([
            "/usr/local/bin/idemgate",
            "serve",
            "--config",
            "/etc/idemgate/idemgate.toml",
        ])
        // The image's own environment only (chroot found on the host's PATH).
        .env_clear()
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("chroot");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the image's gateway did not report its address within 30 s")
        .unwrap()
        .expect("the image's gateway exited before listening");
    let admin = line.rsplit(' ').next().unwrap().trim_end_matches(')');
    let health = send(Method::GET, &format!("{admin}/healthz"), &[], "").await;
    assert_eq!(health.status, 200);
    let _ = child.start_kill();
    // It wrote its store where the image lets its user write.
    assert!(rootfs.join("tmp/idemgate.db").exists());
}

#[test]
fn the_release_workflow_pushes_the_image_and_chart_the_chart_installs_by_default() {
    let text = std::fs::read_to_string(repo().join(".github/workflows/release.yml")).unwrap();
    let workflow: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
    let tags = &workflow["on"]["push"]["tags"];
    assert_eq!(tags[0].as_str(), Some("v*"), "released on version tags");
    let steps = workflow["jobs"]["image"]["steps"].as_sequence().unwrap();
    let build = steps
        .iter()
        .find(|s| {
            s["uses"]
                .as_str()
                .is_some_and(|u| u.starts_with("docker/build-push-action"))
        })
        .expect("a build-push step");
    assert_eq!(build["with"]["file"].as_str(), Some("Dockerfile"));
    assert_eq!(
        build["with"]["platforms"].as_str(),
        Some("linux/amd64,linux/arm64")
    );
    assert_eq!(build["with"]["push"].as_bool(), Some(true));

    let chart_dir = repo().join("helm/idemgate");
    let values: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(chart_dir.join("values.yaml")).unwrap())
            .unwrap();
    let chart: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(chart_dir.join("Chart.yaml")).unwrap())
            .unwrap();
    assert_eq!(
        workflow["env"]["IMAGE"], values["image"]["repository"],
        "the chart pulls what the release pushes"
    );
    assert_eq!(
        values["image"]["tag"].as_str(),
        Some(""),
        "the tag defaults to appVersion"
    );
    assert_eq!(
        chart["appVersion"].as_str(),
        Some(cargo_version().as_str()),
        "a tag v<crate version> pushes the image tagged <appVersion>"
    );
    let chart_job = workflow["jobs"]["chart"]["steps"].as_sequence().unwrap();
    assert!(chart_job.iter().any(|s| s["run"]
        .as_str()
        .is_some_and(|r| r.contains("helm push") && r.contains("$CHARTS"))));
    assert!(workflow["env"]["CHARTS"]
        .as_str()
        .is_some_and(|c| c.starts_with("oci://")));
}
