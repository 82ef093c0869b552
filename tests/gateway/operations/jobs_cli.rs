//! `idemgate jobs`: an operator lists the jobs waiting on them, reads one,
//! and resolves its attempt from a terminal, against a running gateway.

use std::time::Duration;

use serde_json::Value;

use crate::support::gateway::ADMIN_TOKEN;
use crate::support::{post, FakeUpstream, Gate, Gateway, TestStore};

/// Runs `idemgate jobs ARGS` against `gateway`'s admin API with `token`.
async fn jobs(gateway: &Gateway, token: Option<&str>, args: &[&str]) -> std::process::Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemgate"));
    command
        .arg("jobs")
        .args(args)
        .env("IDEMGATE_ADMIN_URL", &gateway.admin_url)
        .env_remove("IDEMGATE_ADMIN_TOKEN")
        .env_remove("IDEMGATE_ADMIN_TOKEN_FILE")
        .kill_on_drop(true);
    if let Some(token) = token {
        command.env("IDEMGATE_ADMIN_TOKEN", token);
    }
    tokio::time::timeout(Duration::from_secs(20), command.output())
        .await
        .expect("idemgate jobs finished")
        .unwrap()
}

fn stdout(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn an_operator_lists_shows_and_resolves_unknown_jobs_from_the_terminal() {
    let store = TestStore::embedded();
    let gate = Gate::new();
    // The first two calls never answer in time: two unknown jobs.
    let upstream = FakeUpstream::gated_echo(&gate, |r| r.hit <= 2).await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"60s\"")
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    let mut ids = Vec::new();
    for key in ["cli-took-effect", "cli-no-effect"] {
        let reply = post(&url, key, "{}").await;
        assert_eq!(reply.status, 504);
        ids.push(reply.job().unwrap());
    }

    let listed = stdout(&jobs(&gateway, Some(ADMIN_TOKEN), &["list"]).await);
    for id in &ids {
        let line = listed.lines().find(|l| l.starts_with(id.as_str()));
        assert!(
            line.is_some_and(|l| l.contains("unknown")),
            "{id} not listed:\n{listed}"
        );
    }

    let attempt_of = |shown: String| {
        let job: Value = serde_json::from_str(&shown).unwrap();
        assert_eq!(job["state"], "unknown", "{job}");
        job["attempts"][0]["id"].as_str().unwrap().to_owned()
    };
    let took = attempt_of(stdout(
        &jobs(&gateway, Some(ADMIN_TOKEN), &["show", &ids[0]]).await,
    ));
    let none = attempt_of(stdout(
        &jobs(&gateway, Some(ADMIN_TOKEN), &["show", &ids[1]]).await,
    ));

    // It took effect: the operator gives its answer, from a file.
    let dir = tempfile::tempdir().unwrap();
    let body = dir.path().join("answer.json");
    std::fs::write(&body, r#"{"charged": 42}"#).unwrap();
    let at_body = format!("@{}", body.display());
    let args = [
        "resolve",
        &took,
        "--succeeded",
        "--status",
        "201",
        "--header",
        "content-type: application/json",
        "--body",
        &at_body,
    ];
    let resolved = stdout(&jobs(&gateway, Some(ADMIN_TOKEN), &args).await);
    assert!(
        resolved.contains(&format!("job {} is now completed", ids[0])),
        "{resolved}"
    );
    let replay = post(&url, "cli-took-effect", "{}").await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(&replay.body[..], br#"{"charged": 42}"#);

    // It had no effect: the job reopens and the retry runs again.
    let reopened = stdout(
        &jobs(
            &gateway,
            Some(ADMIN_TOKEN),
            &["resolve", &none, "--no-effect"],
        )
        .await,
    );
    assert!(reopened.contains("is now open"), "{reopened}");
    let retried = post(&url, "cli-no-effect", "{}").await;
    assert_eq!(retried.status, 200);
    assert_eq!(
        upstream.hits(),
        3,
        "one new call, for the job that had no effect"
    );
    gate.open(2);
}

#[tokio::test]
async fn without_the_right_token_nothing_is_done_and_the_terminal_says_why() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;

    let missing = jobs(&gateway, None, &["list"]).await;
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("IDEMGATE_ADMIN_TOKEN"));

    let wrong = jobs(&gateway, Some("not-the-token"), &["list"]).await;
    assert_eq!(wrong.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&wrong.stderr).contains("401"),
        "{}",
        String::from_utf8_lossy(&wrong.stderr)
    );

    // A resolution that says nothing is refused before anything is sent
    // (who_decided.rs reads the whole message).
    let neither = jobs(&gateway, Some(ADMIN_TOKEN), &["resolve", "x"]).await;
    assert_eq!(neither.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&neither.stderr).contains("nothing is assumed"));
}

#[tokio::test]
async fn after_an_outage_every_unknown_attempt_of_one_upstream_is_resolved_at_once() {
    let store = TestStore::embedded();
    let gate = Gate::new();
    let upstream = FakeUpstream::gated_echo(&gate, |r| r.hit <= 4).await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"300ms\"")
        .set("attempt_deadline", "\"60s\"")
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    let before = humantime::format_rfc3339(std::time::SystemTime::now()).to_string();
    let mut ids = Vec::new();
    for key in ["outage-1", "outage-2", "outage-3"] {
        let reply = post(&url, key, "{}").await;
        assert_eq!(reply.status, 504);
        ids.push(reply.job().unwrap());
    }
    let token = Some(ADMIN_TOKEN);
    let many = |extra: &[&str]| {
        let mut args = vec!["resolve-many", "--upstream", "primary", "--since", &before];
        args.extend_from_slice(extra);
        args.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let run = |args: Vec<String>| {
        let gateway = &gateway;
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            stdout(&jobs(gateway, token, &args).await)
        }
    };

    let dry = run(many(&["--no-effect", "--dry-run"])).await;
    assert_eq!(
        dry.lines()
            .filter(|l| l.starts_with("would resolve"))
            .count(),
        3,
        "{dry}"
    );
    assert!(
        dry.contains("3 matched, 0 resolved, 0 skipped (dry run"),
        "{dry}"
    );
    for id in &ids {
        assert_eq!(
            gateway.job(id).await["state"],
            "unknown",
            "a dry run changes nothing"
        );
    }
    let earlier = run(many(&["--until", &before, "--no-effect"])).await;
    assert!(earlier.contains("0 matched"), "an empty window: {earlier}");

    // The dry run says the window it read, and how to resolve exactly what
    // it showed: an attempt that goes unknown after it is not swept in.
    let until = dry
        .lines()
        .find_map(|l| l.split_once("with --until "))
        .map(|(_, until)| until.trim().to_owned())
        .unwrap_or_else(|| panic!("no --until to repeat: {dry}"));
    let later = post(&url, "outage-4", "{}").await;
    assert_eq!(later.status, 504);
    let done = run(many(&["--until", &until, "--no-effect"])).await;
    assert!(done.contains("3 matched, 3 resolved, 0 skipped"), "{done}");
    assert!(done.contains(&format!("until {until}")), "{done}");
    for id in &ids {
        assert_eq!(gateway.job(id).await["state"], "open");
    }
    let unseen = later.job().unwrap();
    assert_eq!(
        gateway.job(&unseen).await["state"],
        "unknown",
        "the attempt that went unknown after the dry run is left"
    );
    assert_eq!(
        post(&url, "outage-2", "{}").await.status,
        200,
        "the retry runs again"
    );
    assert_eq!(upstream.hits(), 5);
    gate.open(4);
}

/// A TLS front of `admin` (a balancer terminating TLS before the admin
/// listener) with a certificate for 127.0.0.1 issued by `ca`: its
/// `https://` URL.
async fn tls_front(admin: &str, ca: &crate::support::pki::TestCa) -> String {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let issued = ca.issue("admin", &["127.0.0.1"]);
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).unwrap()],
        PrivateKeyDer::from_pem_slice(issued.key_pem.as_bytes()).unwrap(),
    )
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    let admin = admin.trim_start_matches("http://").to_owned();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (acceptor, admin) = (acceptor.clone(), admin.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(stream).await else {
                    return;
                };
                let mut plain = tokio::net::TcpStream::connect(admin).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    url
}

/// `idemgate jobs` reaches an `https://` admin URL, its certificate
/// checked against `--ca-file` (or `IDEMGATE_ADMIN_CA_FILE`); a
/// certificate of another CA is refused, and the terminal says so.
#[tokio::test]
async fn an_https_admin_url_is_reached_with_its_ca() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let job = post(&gateway.path("/v1/charges"), "over-tls", "{}")
        .await
        .job()
        .unwrap();
    let ca = crate::support::pki::TestCa::new("admin CA");
    let url = tls_front(&gateway.admin_url, &ca).await;
    let dir = tempfile::tempdir().unwrap();
    let (ours, theirs) = (dir.path().join("ca.pem"), dir.path().join("other.pem"));
    std::fs::write(&ours, ca.pem()).unwrap();
    std::fs::write(&theirs, crate::support::pki::TestCa::new("other CA").pem()).unwrap();
    let run = |args: Vec<String>, env: Option<&std::path::Path>| {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemgate"));
        command
            .arg("jobs")
            .args(args)
            .env("IDEMGATE_ADMIN_URL", &url)
            .env("IDEMGATE_ADMIN_TOKEN", ADMIN_TOKEN)
            .env_remove("IDEMGATE_ADMIN_CA_FILE")
            .kill_on_drop(true);
        if let Some(ca) = env {
            command.env("IDEMGATE_ADMIN_CA_FILE", ca);
        }
        async move {
            tokio::time::timeout(Duration::from_secs(20), command.output())
                .await
                .expect("idemgate jobs finished")
                .unwrap()
        }
    };
    let flag = vec![
        "show".to_owned(),
        job.clone(),
        "--ca-file".to_owned(),
        ours.display().to_string(),
    ];
    let shown: Value = serde_json::from_str(&stdout(&run(flag, None).await)).unwrap();
    assert_eq!(shown["id"], job.as_str());
    let listed = stdout(&run(vec!["list".to_owned()], Some(&ours)).await);
    assert!(listed.starts_with("JOB"), "{listed}");

    let refused = run(vec!["list".to_owned()], Some(&theirs)).await;
    assert_eq!(refused.status.code(), Some(1));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("certificate"), "{said}");
}
