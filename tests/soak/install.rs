//! The README's "Install the binary", run as written. `cargo install`
//! resolves the package's features without the tests' dev-dependencies, so
//! it compiles the binary (and a few dependencies) once more: a minute of
//! both cores that would slow the integration tests' timing-sensitive ones,
//! so it runs here, alone.

use std::time::Duration;

use tokio::process::Command;

use crate::support::docs;

/// The README's install, as written but into a folder of the test's own
/// and with this build's profile (`--debug`, so it reuses what `cargo test`
/// built instead of making a release build): `idemgate` lands on `PATH`
/// and runs.
#[tokio::test]
async fn the_binary_installs_as_written() {
    let _alone = crate::ALONE.lock().await;
    let block = docs::block("install-binary");
    let root = tempfile::tempdir().unwrap();
    let install = "cargo install --locked --path .";
    assert!(block.starts_with(install), "{block}");
    let script = block.replacen(
        install,
        &format!(
            "{install} --debug --offline --quiet --root {}",
            root.path().display()
        ),
        1,
    );
    // This test binary is target/debug/deps/soak-…: the build's target.
    let target = std::env::current_exe()
        .unwrap()
        .ancestors()
        .nth(3)
        .unwrap()
        .to_owned();
    let path = format!(
        "{}:{}",
        root.path().join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = tokio::time::timeout(
        Duration::from_secs(900),
        Command::new("bash")
            .args(["-euo", "pipefail", "-c", &script])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("PATH", path)
            .env("CARGO_TARGET_DIR", &target)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the install did not end within 900 s")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(root.path().join("bin/idemgate").exists());
    assert_eq!(
        stdout.trim(),
        format!("idemgate {}", env!("CARGO_PKG_VERSION")),
        "the installed binary runs"
    );
}
