//! Issue 38, in a real browser: the console says who decided. The inbox
//! shows key, upstream, age and an owner cut short (whole on hover); every
//! time is UTC (local on hover); the bulk preview lists keys; the job page
//! says where lookups stand; an attempt an operator resolved is drawn and
//! told as the operator's (who, when), not as a long failed call nor as an
//! upstream's answer.

use std::time::Duration;

use fantoccini::Locator;
use http::Method;

use crate::support::browser::Browser;
use crate::support::gateway::ADMIN_TOKEN;
use crate::support::upstream::echo_response;
use crate::support::{send, FakeUpstream, Gateway, TestStore};

/// Silent past the timeout for every first attempt: each job goes unknown.
async fn silent_upstream() -> FakeUpstream {
    FakeUpstream::start(|r| async move {
        if r.header("idempotency-attempt") == Some("1") {
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        echo_response(&r)
    })
    .await
}

/// An unknown job of the owner `Bearer sk-console-owner` with `key`.
async fn unknown_job(gateway: &Gateway, key: &str) -> String {
    let reply = send(
        Method::POST,
        &gateway.path("/v1/charges"),
        &[
            ("idempotency-key", key),
            ("authorization", "Bearer sk-console-owner"),
            ("content-type", "application/json"),
        ],
        "{}",
    )
    .await;
    assert_eq!(reply.status, 504);
    reply.job().unwrap()
}

/// Every `<time>` on the page reads as UTC to the second and tells the
/// local time on hover.
async fn every_time_is_utc(browser: &Browser, page: &str) {
    let times = browser.client.find_all(Locator::Css("time")).await.unwrap();
    assert!(!times.is_empty(), "no time on the {page}");
    for time in times {
        let text = time.text().await.unwrap();
        let utc = text.len() == 23
            && text.ends_with(" UTC")
            && humantime::parse_rfc3339(&format!("{}Z", text[..19].replace(' ', "T"))).is_ok();
        assert!(utc, "{page}: {text:?} is not UTC to the second");
        let title = time.attr("title").await.unwrap().unwrap_or_default();
        assert!(title.ends_with("(your time)"), "{page}: {title:?}");
    }
}

#[tokio::test]
async fn the_console_says_who_decided_and_shows_keys_upstreams_and_one_time_format() {
    let store = TestStore::embedded();
    let upstream = silent_upstream().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("upstream_timeout", "\"500ms\"")
        .start()
        .await;
    let by_console = unknown_job(&gateway, "decided-in-console").await;
    let by_token = unknown_job(&gateway, "decided-by-token").await;
    let owner = gateway.job(&by_console).await["owner"]
        .as_str()
        .unwrap()
        .to_owned();
    let console = format!("{}/console/", gateway.admin_url);

    let browser = Browser::start().await;
    browser.client.goto(&console).await.unwrap();
    browser.type_into("#token", ADMIN_TOKEN).await;
    browser.type_into("#operator", "carol").await;
    browser.click("#sign-in").await;

    // The inbox: key, upstream, age, and an owner that does not take the row.
    let row = format!("#inbox tr[data-job='{by_console}']");
    browser.wait_for(&row).await;
    assert_eq!(
        browser.text(&format!("{row} td.key")).await,
        "decided-in-console"
    );
    assert_eq!(browser.text(&format!("{row} td.upstream")).await, "primary");
    let age = browser.text(&format!("{row} .age")).await;
    assert!(age.ends_with(" s") || age.ends_with(" min"), "{age}");
    let cut = browser.wait_for(&format!("{row} td.owner .cut")).await;
    let shown = cut.text().await.unwrap();
    assert!(
        shown.ends_with('…') && shown.chars().count() <= 15,
        "{shown}"
    );
    assert!(owner.starts_with(shown.trim_end_matches('…')));
    assert_eq!(
        cut.attr("title").await.unwrap().as_deref(),
        Some(owner.as_str())
    );
    every_time_is_utc(&browser, "inbox").await;

    // The bulk preview lists the keys it would resolve.
    browser.click("#bulk summary").await;
    browser
        .until("#bulk-upstream", "the upstreams to load", |t| {
            t.contains("primary")
        })
        .await;
    browser.click("#bulk-preview-button").await;
    for (job, key) in [
        (&by_console, "decided-in-console"),
        (&by_token, "decided-by-token"),
    ] {
        let cell = format!("#bulk-matched tr[data-job='{job}'] td.key");
        assert_eq!(browser.text(&cell).await, key);
    }
    every_time_is_utc(&browser, "bulk preview").await;

    // The job page: no lookup on this route, and it says so.
    browser.click(&format!("{row} a")).await;
    let lookups = browser.text("#lookups-1").await;
    assert!(
        lookups.contains("0 lookups")
            && lookups.contains("stopped: route")
            && lookups.contains("does not look attempts up"),
        "{lookups}"
    );
    // Resolved here: carol, signed in to the console, decided, and it shows.
    browser.click("#no-effect").await;
    browser.click("#confirm-ok").await;
    browser
        .until("#job-state", "the job to reopen", |t| t == "open")
        .await;
    let decided = browser.text("#decided-1").await;
    assert!(
        decided.starts_with("resolved by carol (console session) at ")
            && decided.ends_with(": it had no effect"),
        "{decided}"
    );
    let lane = browser.wait_for(".lane[data-number='1']").await;
    assert_eq!(
        lane.attr("data-decided").await.unwrap().as_deref(),
        Some("operator")
    );
    assert_eq!(
        lane.attr("data-state").await.unwrap().as_deref(),
        Some("failed")
    );
    let bar = browser.wait_for(".lane[data-number='1'] .bar").await;
    assert_eq!(
        bar.attr("class").await.unwrap().as_deref(),
        Some("bar operator"),
        "not drawn as a failed call"
    );
    every_time_is_utc(&browser, "job page").await;

    // Resolved through the API by a named operator with a typed answer:
    // shown as theirs, never as "upstream answered".
    let attempt = gateway.job(&by_token).await["attempts"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let reply = send(
        Method::POST,
        &format!("{}/admin/v1/attempts/{attempt}/resolve", gateway.admin_url),
        &[
            ("authorization", &format!("Bearer {ADMIN_TOKEN}")),
            ("x-idemgate-operator", "bob"),
        ],
        r#"{"outcome": "succeeded", "response": {"status": 200, "body": "ok"}}"#,
    )
    .await;
    assert_eq!(reply.status, 200);
    browser
        .client
        .goto(&format!("{console}#/jobs/{by_token}"))
        .await
        .unwrap();
    browser.client.refresh().await.unwrap();
    let decided = browser.text("#decided-1").await;
    assert!(
        decided.starts_with("resolved by bob (admin token) at ")
            && decided.contains("it took effect"),
        "{decided}"
    );
    let lane = browser.text(".lane[data-number='1']").await;
    assert!(!lane.contains("upstream answered"), "{lane}");
    assert_eq!(browser.text("#response-status").await, "200");
    let typed = browser.text("#response-typed").await;
    assert!(
        typed.starts_with("Typed by bob (admin token) at "),
        "{typed}"
    );
}
