//! The console's session through the real binary: a random id per sign-in,
//! kept by the process that issued it and ended by signing out; its cookie's
//! attributes in both modes (plain, and `Secure` with the `__Host-` name);
//! and that cookie never forwarded upstream by the proxy (`docs/design.md`,
//! §14).

use std::time::Duration;

use http::Method;

use crate::support::browser::Browser;
use crate::support::gateway::ADMIN_TOKEN;
use crate::support::{send, FakeUpstream, Gateway, Reply, TestStore};

const CONSOLE: (&str, &str) = ("x-idemgate-console", "1");

/// Signs in through the console's form.
async fn sign_in(gateway: &Gateway) -> Reply {
    let login = send(
        Method::POST,
        &format!("{}/console/login", gateway.admin_url),
        &[("content-type", "application/x-www-form-urlencoded")],
        format!("token={ADMIN_TOKEN}"),
    )
    .await;
    assert_eq!(login.status, 303, "{:?}", login.body);
    login
}

/// The `name=id` pair a browser sends back after `reply`.
fn cookie_of(reply: &Reply) -> String {
    let set = reply.header("set-cookie").expect("a Set-Cookie");
    set.split(';').next().unwrap().to_owned()
}

/// What the admin API's inbox and the console's script answer `cookie`,
/// sent as the console page sends it.
async fn with_cookie(gateway: &Gateway, cookie: &str) -> (u16, u16) {
    let inbox = format!("{}/admin/v1/jobs?state=unknown", gateway.admin_url);
    let api = send(Method::GET, &inbox, &[("cookie", cookie), CONSOLE], "").await;
    let script = format!("{}/console/console.js", gateway.admin_url);
    let script = send(Method::GET, &script, &[("cookie", cookie)], "").await;
    (api.status, script.status)
}

async fn sign_out(gateway: &Gateway, cookie: &str) -> Reply {
    let out = send(
        Method::POST,
        &format!("{}/console/logout", gateway.admin_url),
        &[("cookie", cookie)],
        "",
    )
    .await;
    assert_eq!(out.status, 303);
    out
}

#[tokio::test]
async fn a_console_session_is_random_per_process_and_ends_at_sign_out() {
    let store = TestStore::postgres().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let first = sign_in(&gateway).await;
    assert_eq!(
        first
            .header("set-cookie")
            .unwrap()
            .split_once(';')
            .unwrap()
            .1,
        " Path=/; HttpOnly; SameSite=Strict; Max-Age=28800",
        "plain HTTP: not Secure, no prefix"
    );
    let (cookie, again) = (cookie_of(&first), cookie_of(&sign_in(&gateway).await));
    assert!(cookie.starts_with("idemgate_console="), "{cookie}");
    assert_ne!(
        cookie, again,
        "each sign-in its own id, not the token's digest"
    );
    assert_eq!(with_cookie(&gateway, &cookie).await, (200, 200));
    assert_eq!(with_cookie(&gateway, &again).await, (200, 200));

    // Another replica on the same store knows nothing of these sessions.
    let replica = Gateway::start(&store, &upstream.url()).await;
    assert_eq!(with_cookie(&replica, &cookie).await, (401, 401));

    // Signed out, the old cookie replayed is refused everywhere; the other
    // session goes on.
    let out = sign_out(&gateway, &cookie).await;
    assert_eq!(
        out.header("set-cookie"),
        Some("idemgate_console=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0")
    );
    assert_eq!(with_cookie(&gateway, &cookie).await, (401, 401));
    let page = send(
        Method::GET,
        &format!("{}/console/", gateway.admin_url),
        &[("cookie", &cookie)],
        "",
    )
    .await;
    let page = String::from_utf8_lossy(&page.body);
    assert!(page.contains("Sign in with the gateway's admin token"));
    assert_eq!(with_cookie(&gateway, &again).await, (200, 200));
}

#[tokio::test]
async fn a_secure_cookie_under_the_host_prefix_when_configured() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::builder(&store, &upstream.url())
        .set("console_secure_cookie", "true")
        .start()
        .await;
    let login = sign_in(&gateway).await;
    assert_eq!(
        login
            .header("set-cookie")
            .unwrap()
            .split_once(';')
            .unwrap()
            .1,
        " Path=/; HttpOnly; SameSite=Strict; Max-Age=28800; Secure"
    );
    let cookie = cookie_of(&login);
    let id = cookie
        .strip_prefix("__Host-idemgate_console=")
        .unwrap_or_else(|| panic!("the __Host- name: {cookie}"));
    assert_eq!(with_cookie(&gateway, &cookie).await, (200, 200));
    // The id under the unprefixed name is not this console's cookie.
    let unprefixed = format!("idemgate_console={id}");
    assert_eq!(with_cookie(&gateway, &unprefixed).await, (401, 401));

    let out = sign_out(&gateway, &cookie).await;
    assert_eq!(
        out.header("set-cookie"),
        Some("__Host-idemgate_console=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0; Secure")
    );
    assert_eq!(with_cookie(&gateway, &cookie).await, (401, 401));

    // A value that is not a boolean stops start-up, naming the key.
    let refused = Gateway::builder(&store, &upstream.url())
        .set("console_secure_cookie", "\"yes\"")
        .start_and_fail()
        .await;
    assert!(refused.contains("console_secure_cookie"), "{refused}");
}

#[tokio::test]
async fn the_console_cookie_never_reaches_the_upstream() {
    let store = TestStore::postgres().await;
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let live = cookie_of(&sign_in(&gateway).await);
    let url = gateway.path("/v1/charges");
    // (the Cookie headers sent, those the upstream must receive)
    let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
        (vec![format!("a=1; {live}; b=2")], vec!["a=1; b=2"]),
        (vec![format!("{live}")], vec![]),
        (
            vec!["__Host-idemgate_console=s; theme=dark".into()],
            vec!["theme=dark"],
        ),
        (
            // Lines a client split its cookies across go on as one.
            vec!["a=1".into(), format!("{live}"), "b=\"x y\";c=3".into()],
            vec!["a=1; b=\"x y\";c=3"],
        ),
        (
            vec!["a=1;b=2 ;  idemgate_consoles=3".into()],
            vec!["a=1;b=2 ;  idemgate_consoles=3"],
        ),
    ];
    for (i, (sent, expected)) in cases.iter().enumerate() {
        let cookies = sent.iter().map(|c| ("cookie", c.as_str()));
        // Passed through (a GET opts in to nothing), then keyed.
        let key = format!("cookie-{i}");
        let keyed = [
            ("idempotency-key", key.as_str()),
            ("content-type", "application/json"),
        ];
        for headers in [
            cookies.clone().collect::<Vec<_>>(),
            cookies.chain(keyed).collect(),
        ] {
            let keyed = headers.len() > sent.len();
            let method = if keyed { Method::POST } else { Method::GET };
            let reply = send(method, &url, &headers, "{}").await;
            assert_eq!(reply.status, 200, "{sent:?}");
            assert_eq!(reply.job().is_some(), keyed, "{sent:?}");
            let arrived = upstream.arrival().await;
            let forwarded: Vec<&str> = arrived
                .headers
                .get_all("cookie")
                .iter()
                .map(|v| v.to_str().unwrap())
                .collect();
            assert_eq!(forwarded, *expected, "sent {sent:?}, keyed: {keyed}");
        }
    }
    // The session itself is untouched: the gateway only kept it to itself.
    assert_eq!(with_cookie(&gateway, &live).await, (200, 200));
}

#[tokio::test]
async fn the_console_works_in_a_browser_under_either_cookie_name() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let browser = Browser::start().await;
    for (secure, name) in [
        (false, "idemgate_console"),
        (true, "__Host-idemgate_console"),
    ] {
        let gateway = Gateway::builder(&store, &upstream.url())
            .set("console_secure_cookie", &secure.to_string())
            .start()
            .await;
        // (a browser counts 127.0.0.1 as a secure origin, so it keeps a
        // Secure cookie from the plain-HTTP test listener)
        let console = format!("{}/console/", gateway.admin_url);
        browser.client.goto(&console).await.unwrap();
        browser.type_into("#token", ADMIN_TOKEN).await;
        browser.click("#sign-in").await;
        browser.wait_for("#inbox-empty").await;
        let cookies = browser.client.get_all_cookies().await.unwrap();
        let names: Vec<&str> = cookies.iter().map(|c| c.name()).collect();
        assert_eq!(names, [name], "secure: {secure}");
        assert_eq!(cookies[0].secure(), Some(secure));
        assert_eq!(cookies[0].http_only(), Some(true));

        browser.click("#sign-out").await;
        browser.wait_for("#token").await;
        assert!(browser.client.get_all_cookies().await.unwrap().is_empty());
        browser
            .client
            .goto(&format!("{console}#/inbox"))
            .await
            .unwrap();
        browser.wait_for("#token").await;
    }
}

/// A sign-in form with `token`, sent from the local address `from`.
async fn sign_in_from(gateway: &Gateway, from: &str, token: &str) -> Reply {
    let request = http::Request::post(format!("{}/console/login", gateway.admin_url))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(http_body_util::Full::new(format!("token={token}").into()))
        .unwrap();
    admin_from(from, request).await
}

/// `GET /admin/v1/jobs?state=unknown` from address `from`, with `token` as
/// its bearer token.
async fn api_from(gateway: &Gateway, from: &str, token: &str) -> Reply {
    let request = http::Request::get(format!("{}/admin/v1/jobs?state=unknown", gateway.admin_url))
        .header("authorization", format!("Bearer {token}"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    admin_from(from, request).await
}

/// `request` sent to the admin listener from address `from`.
async fn admin_from(
    from: &str,
    request: http::Request<http_body_util::Full<bytes::Bytes>>,
) -> Reply {
    use http_body_util::{BodyExt, Full};
    let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
    connector.set_local_address(Some(from.parse().unwrap()));
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build::<_, Full<bytes::Bytes>>(connector);
    let response = client.request(request).await.unwrap();
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

/// Past five failed sign-ins within a minute, an address is answered 429
/// with `Retry-After` — the right token included, which opens no session
/// — while another address signs in as before (`docs/design.md` §14).
#[tokio::test]
async fn failed_sign_ins_are_throttled_per_client_address() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    for i in 0..5 {
        let wrong = sign_in_from(&gateway, "127.0.0.1", &format!("guess-{i}")).await;
        assert_eq!(wrong.status, 401, "guess {i}");
    }
    for token in ["guess-5", ADMIN_TOKEN] {
        let throttled = sign_in_from(&gateway, "127.0.0.1", token).await;
        assert_eq!(throttled.status, 429);
        assert_eq!(throttled.problem(), "sign-in-throttled");
        assert_eq!(
            throttled.header("content-type"),
            Some("application/problem+json")
        );
        let wait: u64 = throttled.header("retry-after").unwrap().parse().unwrap();
        assert!((1..=60).contains(&wait), "{wait}");
        assert!(throttled.header("set-cookie").is_none(), "no session");
    }
    let elsewhere = sign_in_from(&gateway, "127.0.0.2", ADMIN_TOKEN).await;
    assert_eq!(elsewhere.status, 303, "another address is not throttled");
    assert!(elsewhere.header("set-cookie").is_some());
}

/// A bearer token on `/admin/v1/*` is a try at the admin token like a
/// sign-in: five wrong ones from an address within a minute, and its next
/// try (the right token included, on the API or the form) is answered 429;
/// a request with no token (a console page on its session) is not a try;
/// another address is its own. Before, the API answered every guess `401`
/// at the listener's speed, and the right one `200`.
#[tokio::test]
async fn failed_bearer_tokens_are_throttled_like_sign_ins() {
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    for i in 0..5 {
        let wrong = api_from(&gateway, "127.0.0.1", &format!("guess-{i}")).await;
        assert_eq!(wrong.status, 401, "guess {i}");
    }
    let throttled = api_from(&gateway, "127.0.0.1", ADMIN_TOKEN).await;
    assert_eq!(throttled.status, 429);
    assert_eq!(throttled.problem(), "sign-in-throttled");
    let wait: u64 = throttled.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&wait), "{wait}");
    let form = sign_in_from(&gateway, "127.0.0.1", ADMIN_TOKEN).await;
    assert_eq!(form.status, 429, "one window for the form and the API");
    let untokened = http::Request::get(format!("{}/admin/v1/jobs", gateway.admin_url))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    assert_eq!(admin_from("127.0.0.1", untokened).await.status, 401);
    assert_eq!(
        api_from(&gateway, "127.0.0.2", ADMIN_TOKEN).await.status,
        200
    );
}

/// Sign-ins sent at once, their bodies held back, count against the
/// window while their tokens wait to be compared: of twenty, five are
/// taken (answered once their bodies come: `401`) and fifteen are answered
/// `429` at once. Before, all twenty passed the check and were compared:
/// twenty guesses in a window of five.
#[tokio::test]
async fn concurrent_sign_ins_count_against_the_window() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let store = TestStore::embedded();
    let upstream = FakeUpstream::echo().await;
    let gateway = Gateway::start(&store, &upstream.url()).await;
    let authority = gateway.admin_url.trim_start_matches("http://");
    let body = "token=guess";
    let mut connections = Vec::new();
    for _ in 0..20 {
        let mut stream = tokio::net::TcpStream::connect(authority).await.unwrap();
        let head = format!(
            "POST /console/login HTTP/1.1\r\nhost: x\r\n\
             content-type: application/x-www-form-urlencoded\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        connections.push(stream);
    }
    // What each answers before its body is sent, within 3 s.
    let early = |mut stream: tokio::net::TcpStream| async move {
        let mut buf = [0u8; 12];
        let read = tokio::time::timeout(Duration::from_secs(3), stream.read_exact(&mut buf)).await;
        (
            stream,
            read.is_ok()
                .then(|| String::from_utf8_lossy(&buf).into_owned()),
        )
    };
    let answered = futures_util::future::join_all(connections.into_iter().map(early)).await;
    let throttled = answered
        .iter()
        .filter(|(_, a)| a.as_deref() == Some("HTTP/1.1 429"))
        .count();
    assert_eq!(
        throttled,
        15,
        "{:?}",
        answered.iter().map(|(_, a)| a).collect::<Vec<_>>()
    );
    let mut compared = 0;
    for (mut stream, early) in answered {
        if early.is_some() {
            continue;
        }
        stream.write_all(body.as_bytes()).await.unwrap();
        let mut buf = [0u8; 12];
        stream.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"HTTP/1.1 401");
        compared += 1;
    }
    assert_eq!(compared, 5);
}
