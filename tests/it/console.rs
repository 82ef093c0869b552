//! The operator console in a real browser (headless Chromium through
//! chromedriver) against the real binary: sign in with the admin token, find
//! jobs made unknown by an upstream silent past the timeout, resolve one as
//! "had no effect" and another as "succeeded with this response", and check
//! through the HTTP API what the clients' next retries get.

use std::time::Duration;

use http::Method;

use crate::support::browser::Browser;
use crate::support::gateway::ADMIN_TOKEN;
use crate::support::upstream::echo_response;
use crate::support::{post, send, FakeUpstream, Gateway, TestStore};

/// Silent (past the timeout) for a first attempt of a body saying so;
/// answers everything else.
async fn upstream() -> FakeUpstream {
    FakeUpstream::start(|r| async move {
        let silent = r.body.as_ref() == b"silent" && r.header("idempotency-attempt") == Some("1");
        if silent {
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        echo_response(&r)
    })
    .await
}

/// Where the test leaves the job page's screenshots (`job.png` after a
/// resolution and a retry, `unknown.png` waiting for one; the README shows
/// copies from `docs/`).
fn screenshot_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/console/job.png")
}

#[tokio::test]
async fn an_operator_resolves_unknown_jobs_in_the_browser() {
    let store = TestStore::postgres().await;
    let upstream = upstream().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"500ms\"")
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    let no_effect = post(&url, "console-no-effect", "silent").await;
    let succeeded = post(&url, "console-succeeded", "silent").await;
    assert_eq!((no_effect.status, succeeded.status), (504, 504));
    let (no_effect, succeeded) = (no_effect.job().unwrap(), succeeded.job().unwrap());
    let console = format!("{}/console/", gateway.admin_url);

    // Nothing but the sign-in page without the token.
    for path in ["/console/console.js", "/console/console.css"] {
        let reply = send(
            Method::GET,
            &format!("{}{path}", gateway.admin_url),
            &[],
            "",
        )
        .await;
        assert_eq!(reply.status, 401, "{path}");
    }
    let inbox = format!("{}/admin/v1/jobs?state=unknown", gateway.admin_url);
    assert_eq!(send(Method::GET, &inbox, &[], "").await.status, 401);

    let browser = Browser::start().await;
    browser.client.goto(&console).await.unwrap();
    browser.type_into("#token", "not-the-token").await;
    browser.click("#sign-in").await;
    let error = browser.text("#error").await;
    assert!(error.contains("not the admin token"), "{error}");
    assert!(browser
        .client
        .find(fantoccini::Locator::Css("#view"))
        .await
        .is_err());

    // The inbox lists both jobs.
    browser.type_into("#token", ADMIN_TOKEN).await;
    browser.click("#sign-in").await;
    browser
        .wait_for(&format!("#inbox tr[data-job='{no_effect}']"))
        .await;
    browser
        .wait_for(&format!("#inbox tr[data-job='{succeeded}']"))
        .await;

    // "Had no effect": the job reopens and the retry runs attempt 2.
    browser
        .click(&format!("#inbox tr[data-job='{no_effect}'] a"))
        .await;
    let lane = browser.wait_for(".lane[data-number='1']").await;
    assert_eq!(
        lane.attr("data-state").await.unwrap().as_deref(),
        Some("unknown")
    );
    browser.click("#no-effect").await;
    let warning = browser.text("#confirm-text").await;
    assert!(warning.contains("runs attempt 2"), "{warning}");
    browser.click("#confirm-ok").await;
    browser
        .until(".notice.ok", "the resolution", |t| t.contains("Resolved"))
        .await;
    browser
        .until("#job-state", "the job to reopen", |t| t == "open")
        .await;
    let retry = post(&url, "console-no-effect", "silent").await;
    assert_eq!(retry.status, 200, "{:?}", retry.body);
    assert_eq!(retry.json()["attempt"], "2", "the retry made attempt 2");

    // The job page after the retry: two attempts, the winner marked, the
    // stored answer; its screenshot goes with the README.
    browser
        .client
        .goto(&format!("{console}#/jobs/{no_effect}"))
        .await
        .unwrap();
    browser.client.refresh().await.unwrap();
    browser.wait_for(".lane[data-number='2'] .winner").await;
    let failed = browser.wait_for(".lane[data-number='1']").await;
    assert_eq!(
        failed.attr("data-state").await.unwrap().as_deref(),
        Some("failed")
    );
    assert_eq!(browser.text("#response-status").await, "200");
    let png = browser.client.screenshot().await.unwrap();
    std::fs::create_dir_all(screenshot_path().parent().unwrap()).unwrap();
    std::fs::write(screenshot_path(), &png).unwrap();
    assert!(png.starts_with(b"\x89PNG"));

    // "Succeeded with this response": the retry replays what was typed.
    browser
        .client
        .goto(&format!("{console}#/jobs/{succeeded}"))
        .await
        .unwrap();
    browser.client.refresh().await.unwrap();
    browser.wait_for("#resolve").await;
    let png = browser.client.screenshot().await.unwrap();
    std::fs::write(screenshot_path().with_file_name("unknown.png"), &png).unwrap();
    browser.type_into("#resolve-status", "201").await;
    browser
        .type_into("#resolve-body", r#"{"charged": true}"#)
        .await;
    browser.click("#succeeded").await;
    let warning = browser.text("#confirm-text").await;
    assert!(warning.contains("status 201"), "{warning}");
    browser.click("#confirm-ok").await;
    browser
        .until("#job-state", "the job to complete", |t| t == "completed")
        .await;
    let hits = upstream.hits();
    let retry = post(&url, "console-succeeded", "silent").await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.body.as_ref(), br#"{"charged": true}"#);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(upstream.hits(), hits, "the upstream is not called again");

    // Found again by owner and key.
    browser.click("#nav-find").await;
    browser.type_into("#owner", "anonymous").await;
    browser.type_into("#key", "console-succeeded").await;
    browser.click("#find-by-key button").await;
    browser
        .until("#job-key", "the job found by its key", |t| {
            t == "console-succeeded"
        })
        .await;
    assert_eq!(browser.text("#job-id-title").await, succeeded);
    // The upstreams and their probe verdicts (none configured here).
    browser.click("#nav-upstreams").await;
    let row = browser.text("#upstreams tr[data-upstream='primary']").await;
    assert!(row.contains("no contract probes"), "{row}");

    // Both resolved: the inbox is empty.
    browser
        .client
        .goto(&format!("{console}#/inbox"))
        .await
        .unwrap();
    browser.client.refresh().await.unwrap();
    browser.wait_for("#inbox-empty").await;
}

#[tokio::test]
async fn the_session_cookie_alone_authorizes_nothing() {
    let store = TestStore::postgres().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let login = send(
        Method::POST,
        &format!("{}/console/login", gateway.admin_url),
        &[("content-type", "application/x-www-form-urlencoded")],
        format!("token={ADMIN_TOKEN}"),
    )
    .await;
    assert_eq!(login.status, 303);
    let cookie = login
        .header("set-cookie")
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    assert!(!cookie.contains(ADMIN_TOKEN), "the cookie is not the token");
    let inbox = format!("{}/admin/v1/jobs?state=unknown", gateway.admin_url);
    // A page on another site can make the browser send the cookie, but not
    // the console's header: refused.
    let forged = send(Method::GET, &inbox, &[("cookie", &cookie)], "").await;
    assert_eq!(forged.status, 401);
    let console = send(
        Method::GET,
        &inbox,
        &[("cookie", &cookie), ("x-idemgate-console", "1")],
        "",
    )
    .await;
    assert_eq!(console.status, 200);
    assert_eq!(console.json()["jobs"], serde_json::json!([]));
    let script = send(
        Method::GET,
        &format!("{}/console/console.js", gateway.admin_url),
        &[("cookie", &cookie)],
        "",
    )
    .await;
    assert_eq!(script.status, 200);
    assert_eq!(
        script.header("content-type"),
        Some("text/javascript; charset=utf-8")
    );
}

#[tokio::test]
async fn the_inbox_pages_through_unknown_jobs_newest_first() {
    let store = TestStore::postgres().await;
    let upstream = upstream().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"300ms\"")
        .start()
        .await;
    let url = gateway.path("/v1/charges");
    let mut made = Vec::new();
    for i in 0..5 {
        made.push(
            post(&url, &format!("inbox-{i}"), "silent")
                .await
                .job()
                .unwrap(),
        );
    }
    post(&url, "inbox-fine", "{}").await;
    let mut seen = Vec::new();
    let mut path = "/admin/v1/jobs?state=unknown&limit=2".to_owned();
    // Three pages of two hold the five; a cursor that never ran out would
    // page forever, so more pages than jobs is a failure, not a hang.
    for pages in 1.. {
        assert!(
            pages <= made.len(),
            "page {pages} for {} jobs: the cursor never ran out (seen {seen:?})",
            made.len()
        );
        let page = gateway.admin(Method::GET, &path, "").await.json();
        for job in page["jobs"].as_array().unwrap() {
            assert_eq!(job["state"], "unknown");
            seen.push(job["id"].as_str().unwrap().to_owned());
        }
        match page["next"].as_str() {
            Some(next) => path = format!("/admin/v1/jobs?state=unknown&limit=2&before={next}"),
            None => break,
        }
    }
    made.reverse();
    assert_eq!(seen, made, "every unknown job once, newest first");
    let wrong = gateway
        .admin(Method::GET, "/admin/v1/jobs?state=running", "")
        .await;
    assert_eq!(wrong.status, 400);
    assert_eq!(wrong.problem(), "invalid-admin-request");
}
