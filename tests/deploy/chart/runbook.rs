//! `docs/runbook.md`'s port-forward names what the chart makes: a
//! Deployment of that name whose pods listen on the admin port it forwards.

use super::*;
use crate::support::docs;

#[test]
fn the_runbooks_port_forward_names_a_deployment_with_the_admin_port() {
    let command = docs::block("runbook-port-forward");
    let words: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(&words[..2], ["kubectl", "port-forward"], "{command}");
    // `helm template` names its release `rel`.
    let target = words[2].replace("<release>", "rel");
    let (kind, name) = target.split_once('/').unwrap();
    assert_eq!(kind, "deployment", "{command}");
    let port: u64 = words[3].parse().unwrap();
    let m = chart::render(&chart::chart(), &[], &[]).unwrap();
    let deployment = m.named("Deployment", name);
    let admin: Vec<u64> = deployment["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|c| c["ports"].as_array().cloned().unwrap_or_default())
        .filter(|p| p["name"] == "admin")
        .filter_map(|p| p["containerPort"].as_u64())
        .collect();
    assert_eq!(admin, [port], "{name}'s admin port is the one forwarded");
}
