//! Throwaway Python virtualenvs under cargo's `target/tmp/` (the folder
//! cargo gives integration tests for their own files), made on first use
//! with packages from PyPI, for the tools and clients nobody here wrote.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

/// Tests run in parallel; two making the same virtualenv at once would
/// trample each other: one at a time in this process, and, through a lock
/// on a file beside the virtualenvs, in any other test binary too.
static MAKING: Mutex<()> = Mutex::new(());

/// The `bin/` directory of `target/tmp/<name>`, a virtualenv holding
/// `packages`; `probe` is Python that succeeds only once they are
/// installed.
pub fn venv(name: &str, packages: &[&str], probe: &str) -> PathBuf {
    let _making = MAKING.lock().unwrap_or_else(|e| e.into_inner());
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&root).unwrap();
    let lock = std::fs::File::create(root.join(format!("{name}.lock"))).unwrap();
    lock.lock().expect("lock the virtualenv");
    let venv = root.join(name);
    let bin = venv.join("bin");
    let ready = || {
        Command::new(bin.join("python"))
            .args(["-c", probe])
            .status()
            .is_ok_and(|s| s.success())
    };
    if !ready() {
        let made = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .expect("python3 is needed for these tests");
        assert!(made.success(), "python3 -m venv {}", venv.display());
        let installed = Command::new(bin.join("pip"))
            .args(["install", "--quiet", "--disable-pip-version-check"])
            .args(packages)
            .status()
            .unwrap();
        assert!(installed.success(), "pip install {packages:?}");
        assert!(ready(), "{packages:?} installed, yet `{probe}` fails");
    }
    bin
}

/// Runs a client process (a Python SDK script or README snippet) to its
/// end, 60 s at most, and asserts it succeeded; its standard output.
pub async fn run_client(what: &str, command: &mut tokio::process::Command) -> Vec<u8> {
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        command.kill_on_drop(true).output(),
    )
    .await
    .unwrap_or_else(|_| panic!("the {what} did not finish within 60 s"))
    .unwrap();
    assert!(
        out.status.success(),
        "the {what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}
