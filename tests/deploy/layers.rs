//! The layers the workspace's crates are (`docs/design.md`, "Where things
//! are"), checked on what cargo resolves: an arrow that points up does not
//! compile, and these hold what the compiler alone would let slip.

use std::collections::BTreeSet;
use std::process::Command;

use crate::support::chart::repo;

/// Every package `crate` depends on, directly or not (normal dependencies:
/// what it is built with, not what its tests use).
fn tree(krate: &str) -> BTreeSet<String> {
    let out = Command::new(env!("CARGO"))
        .current_dir(repo())
        .args([
            "tree",
            "--locked",
            "--offline",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .args(["-p", krate, "--format", "{p}"])
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo tree -p {krate}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_domain_stands_on_no_runtime_server_database_or_redis() {
    let tree = tree("idemgate-domain");
    assert!(tree.contains("serde_json"), "the tree was read: {tree:?}");
    for runtime in ["tokio", "hyper", "tokio-postgres", "redis", "rusqlite"] {
        assert!(
            !tree.contains(runtime),
            "idemgate-domain depends on {runtime}: {tree:?}"
        );
    }
}

#[test]
fn the_proxy_knows_nothing_of_jobs_and_no_layer_reads_the_configuration() {
    let proxy = tree("idemgate-proxy");
    for above in ["idemgate-store", "idemgate-idempotency", "idemgate-trust"] {
        assert!(!proxy.contains(above), "idemgate-proxy depends on {above}");
    }
    // The configuration is the binary's crate: no layer may depend on it.
    for layer in [
        "idemgate-domain",
        "idemgate-telemetry",
        "idemgate-store",
        "idemgate-proxy",
        "idemgate-trust",
        "idemgate-upkeep",
        "idemgate-idempotency",
        "idemgate-operations",
    ] {
        let tree = tree(layer);
        assert!(tree.contains(layer), "{layer}'s tree was read");
        assert!(
            !tree.contains("idemgate"),
            "{layer} depends on the binary's crate (the configuration)"
        );
    }
}
