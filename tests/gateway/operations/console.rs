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
/// resolution and a retry, `unknown.png` waiting for one) and the inbox's
/// (`bulk.png`, a bulk resolution previewed); the README shows copies from
/// `docs/`.
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

/// The unknown jobs of `gateway` on `route`, made by `keys` sent to a
/// silent upstream.
async fn unknown_jobs(gateway: &Gateway, route: &str, keys: &[&str]) -> Vec<String> {
    let mut ids = Vec::new();
    for key in keys {
        let reply = post(&gateway.path(route), key, "silent").await;
        assert_eq!(reply.status, 504, "{key}");
        ids.push(reply.job().unwrap());
    }
    ids
}

/// The states of jobs `ids` and of their first attempts, read through the
/// admin API.
async fn states(gateway: &Gateway, ids: &[String]) -> Vec<(String, String)> {
    let mut states = Vec::new();
    for id in ids {
        let job = gateway.job(id).await;
        let attempt = job["attempts"][0]["state"].as_str().unwrap().to_owned();
        states.push((job["state"].as_str().unwrap().to_owned(), attempt));
    }
    states
}

fn all(ids: &[String], job: &str, attempt: &str) -> Vec<(String, String)> {
    vec![(job.to_owned(), attempt.to_owned()); ids.len()]
}

#[tokio::test]
async fn an_operator_resolves_one_upstreams_unknown_attempts_at_once() {
    let store = TestStore::postgres().await;
    let (a, b) = (upstream().await, upstream().await);
    let gateway = Gateway::builder(&store, "http://unused")
        .unset("upstreams")
        .set("upstream_timeout", "\"300ms\"")
        .tables(&format!(
            "[[upstreams]]\nname = \"a\"\nurl = {:?}\n[[upstreams]]\nname = \"b\"\nurl = {:?}\n",
            a.url(),
            b.url()
        ))
        .tables(
            "[[routes]]\npath_prefix = \"/v1/a\"\nupstreams = [\"a\"]\n\
             [[routes]]\npath_prefix = \"/v1/b\"\nupstreams = [\"b\"]\n",
        )
        .start()
        .await;
    let since = std::time::SystemTime::now() - Duration::from_secs(1);
    let since = humantime::format_rfc3339_seconds(since).to_string();
    let on_a = unknown_jobs(
        &gateway,
        "/v1/a/charges",
        &["bulk-a1", "bulk-a2", "bulk-a3"],
    )
    .await;
    let on_b = unknown_jobs(&gateway, "/v1/b/charges", &["bulk-b1", "bulk-b2"]).await;
    assert_eq!(gateway.job(&on_a[0]).await["attempts"][0]["upstream"], "a");
    assert_eq!(gateway.job(&on_b[0]).await["attempts"][0]["upstream"], "b");

    let browser = Browser::start().await;
    browser
        .client
        .goto(&format!("{}/console/", gateway.admin_url))
        .await
        .unwrap();
    browser.type_into("#token", ADMIN_TOKEN).await;
    browser.click("#sign-in").await;
    browser
        .wait_for(&format!("#inbox tr[data-job='{}']", on_b[1]))
        .await;
    browser.click("#bulk summary").await;
    // The upstreams come from the API, as a select.
    browser.wait_for("#bulk-upstream option[value='b']").await;
    browser
        .wait_for("#bulk-upstream option[value='a']")
        .await
        .click()
        .await
        .unwrap();
    let resolve = browser.wait_for("#bulk-resolve").await;
    assert!(
        !resolve.is_enabled().await.unwrap(),
        "nothing previewed yet"
    );

    // The API's refusal is shown, not swallowed.
    browser.type_into("#bulk-since", "yesterday").await;
    browser.click("#bulk-preview-button").await;
    browser
        .until("#bulk-message .notice.error", "the API's refusal", |t| {
            t.contains("since:") && t.contains("RFC 3339")
        })
        .await;

    // A preview of "cancelled", then the resolution changed: not offered
    // until previewed again.
    browser.type_into("#bulk-since", &since).await;
    browser
        .wait_for("#bulk-outcome")
        .await
        .select_by_value("cancelled")
        .await
        .unwrap();
    browser.click("#bulk-preview-button").await;
    browser
        .until("#bulk-resolve", "a preview", |t| t == "Resolve 3 attempts")
        .await;
    assert!(resolve.is_enabled().await.unwrap());
    browser
        .wait_for("#bulk-outcome")
        .await
        .select_by_value("failed")
        .await
        .unwrap();
    assert!(!resolve.is_enabled().await.unwrap(), "inputs not previewed");

    browser.click("#bulk-preview-button").await;
    browser
        .until("#bulk-count", "the preview's count", |t| {
            t.starts_with("3 attempts would change")
        })
        .await;
    let count = browser.wait_for("#bulk-count").await;
    assert_eq!(
        count.attr("data-count").await.unwrap().as_deref(),
        Some("3")
    );
    let mut listed = Vec::new();
    for row in browser
        .client
        .find_all(fantoccini::Locator::Css("#bulk-matched tbody tr"))
        .await
        .unwrap()
    {
        listed.push(row.attr("data-job").await.unwrap().unwrap());
    }
    listed.sort();
    let mut expected = on_a.clone();
    expected.sort();
    assert_eq!(listed, expected, "the jobs of upstream a, and only them");
    assert!(resolve.is_enabled().await.unwrap());
    assert_eq!(
        states(&gateway, &on_a).await,
        all(&on_a, "unknown", "unknown"),
        "a preview changes nothing"
    );
    let png = browser.client.screenshot().await.unwrap();
    std::fs::create_dir_all(screenshot_path().parent().unwrap()).unwrap();
    std::fs::write(screenshot_path().with_file_name("bulk.png"), &png).unwrap();

    // One more goes unknown on a after the preview: the resolution keeps to
    // the window previewed, and leaves it.
    let late = unknown_jobs(&gateway, "/v1/a/charges", &["bulk-a-late"]).await;
    browser.click("#bulk-resolve").await;
    let warning = browser.text("#confirm-text").await;
    assert!(
        warning.contains("3 unknown attempts sent to a") && warning.contains("runs a new attempt"),
        "{warning}"
    );
    browser.click("#confirm-ok").await;
    let done = browser.wait_for("#bulk-done").await;
    assert_eq!(
        done.attr("data-resolved").await.unwrap().as_deref(),
        Some("3")
    );
    // The inbox, refreshed: b's jobs and the late one wait; a's are gone.
    browser
        .wait_for(&format!("#inbox tr[data-job='{}']", late[0]))
        .await;
    for id in &on_a {
        let row = format!("#inbox tr[data-job='{id}']");
        assert!(browser
            .client
            .find(fantoccini::Locator::Css(&row))
            .await
            .is_err());
    }
    assert_eq!(states(&gateway, &on_a).await, all(&on_a, "open", "failed"));
    assert_eq!(
        states(&gateway, &on_b).await,
        all(&on_b, "unknown", "unknown"),
        "another upstream's attempts are left alone"
    );
    assert_eq!(
        states(&gateway, &late).await,
        all(&late, "unknown", "unknown"),
        "started after the preview"
    );
}

/// The upstreams page says which upstreams failover may use, and why not:
/// a provider answering the probe's golden value wrong is not eligible,
/// with what differed and its last verdicts; the one answering right is.
#[tokio::test]
async fn the_upstreams_page_shows_eligibility_and_the_last_verdicts() {
    use crate::support::chat::{Drift, Provider, Timing};
    let store = TestStore::embedded();
    let a = Provider::start("a", Drift::None, Timing::Now).await;
    let b = Provider::start("b", Drift::WrongAnswer, Timing::Now).await;
    let gateway = crate::upstreams::failover::chat_gateway(&store, &a.url(), &b.url(), "")
        .tables(
            "[[contracts.chat-json.probes]]\nname = \"golden\"\npath = \"/v1/chat/completions\"\n\
             body = \"probe-capital.json\"\nexpect = { \"/answer\" = { matches = \"^Paris\" } }\n",
        )
        .start()
        .await;
    let browser = Browser::start().await;
    browser
        .client
        .goto(&format!("{}/console/#/upstreams", gateway.admin_url))
        .await
        .unwrap();
    browser.type_into("#token", ADMIN_TOKEN).await;
    browser.click("#sign-in").await;
    browser.click("#nav-upstreams").await;
    // Verdicts come every probe_interval; the page shows them once reloaded.
    let reloaded = || async {
        browser.client.refresh().await.unwrap();
        browser.wait_for("#upstreams tr[data-upstream='b']").await;
    };
    let mut rows = (String::new(), String::new());
    for _ in 0..50 {
        reloaded().await;
        rows = (
            browser.text("#upstreams tr[data-upstream='a']").await,
            browser.text("#upstreams tr[data-upstream='b']").await,
        );
        if rows.0.contains("eligible") && rows.1.contains("last verdicts") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (row_a, row_b) = rows;
    assert!(
        row_a.contains("eligible") && !row_a.contains("not eligible"),
        "{row_a}"
    );
    assert!(row_b.contains("not eligible"), "{row_b}");
    assert!(
        row_b.contains("golden") && row_b.contains("Lyon"),
        "{row_b}"
    );
    assert!(
        row_b.contains("last verdicts") && row_b.contains("fail"),
        "{row_b}"
    );
}
