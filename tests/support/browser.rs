//! A real browser for the console's tests: headless Chromium driven through
//! chromedriver (WebDriver), both from the Debian packages `scripts/test.sh`
//! installs. One chromedriver per browser, on a free port, in a process
//! group of its own: it and the browser it started are killed with it.

use std::process::Stdio;
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use tokio::process::{Child, Command};

use super::process::ProcessGroup;
use super::redis::free_port;

pub struct Browser {
    pub client: Client,
    // Dropped in this order: the group (chromedriver, Chromium and its
    // renderers) killed, then the driver's handle reaped.
    _group: ProcessGroup,
    _driver: Child,
}

impl Browser {
    pub async fn start() -> Browser {
        let port = free_port().await;
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .expect("chromedriver is not installed; scripts/test.sh installs chromium-driver");
        let group = ProcessGroup::of(&driver);
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                    "--disable-gpu", "--window-size=1280,1100", "--lang=en-GB",
                ],
            }),
        );
        let url = format!("http://127.0.0.1:{port}");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let client = loop {
            let attempt = ClientBuilder::new(HttpConnector::new())
                .capabilities(capabilities.clone())
                .connect(&url)
                .await;
            match attempt {
                Ok(client) => break client,
                Err(e) if tokio::time::Instant::now() > deadline => {
                    panic!("chromedriver did not start a browser: {e}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        Browser {
            client,
            _group: group,
            _driver: driver,
        }
    }

    /// The element `css` selects, once it is there (10 s at most).
    pub async fn wait_for(&self, css: &str) -> fantoccini::elements::Element {
        self.client
            .wait()
            .at_most(Duration::from_secs(10))
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no {css} on the page: {e}"))
    }

    /// The text of the element `css` selects, once it is there.
    pub async fn text(&self, css: &str) -> String {
        self.wait_for(css).await.text().await.unwrap()
    }

    pub async fn click(&self, css: &str) {
        self.wait_for(css).await.click().await.unwrap();
    }

    pub async fn type_into(&self, css: &str, text: &str) {
        let field = self.wait_for(css).await;
        field.clear().await.unwrap();
        field.send_keys(text).await.unwrap();
    }

    /// Waits until `check` holds of the element `css` selects (10 s at most).
    pub async fn until(&self, css: &str, what: &str, check: impl Fn(&str) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(element) = self.client.find(Locator::Css(css)).await {
                if let Ok(text) = element.text().await {
                    if check(&text) {
                        return;
                    }
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what} ({css})"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
