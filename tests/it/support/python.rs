//! Throwaway Python virtualenvs under `target/`, made on first use with
//! packages from PyPI, for the tools and clients nobody here wrote.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

/// Tests run in parallel; two making the same virtualenv at once would
/// trample each other.
static MAKING: Mutex<()> = Mutex::new(());

/// The `bin/` directory of `target/<name>`, a virtualenv holding `packages`;
/// `probe` is Python that succeeds only once they are installed.
pub fn venv(name: &str, packages: &[&str], probe: &str) -> PathBuf {
    let _making = MAKING.lock().unwrap_or_else(|e| e.into_inner());
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target")
        .join(name);
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
