//! `idemgate jobs …`: the operator's client of a running gateway's admin
//! API (`docs/design.md` §14), for a terminal or a script where the console
//! is not at hand. It holds no state and reaches no store: every command is
//! one request to `/admin/v1`, with the admin token from the flag, the
//! environment or a file (a mounted Secret).

use std::path::{Path, PathBuf};

use bytes::Bytes;
use clap::{Args, Subcommand};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use serde_json::{json, Value};

/// `idemgate jobs …`: an operator's client of the admin API.
#[derive(Debug, Args)]
pub struct JobsCommand {
    /// The gateway's admin listener.
    #[arg(
        long,
        env = "IDEMGATE_ADMIN_URL",
        default_value = "http://127.0.0.1:9090",
        global = true
    )]
    pub admin_url: String,
    /// The admin token (or `--admin-token-file`).
    #[arg(
        long,
        env = "IDEMGATE_ADMIN_TOKEN",
        hide_env_values = true,
        global = true
    )]
    pub admin_token: Option<String>,
    /// A file holding the admin token (a mounted Secret).
    #[arg(long, env = "IDEMGATE_ADMIN_TOKEN_FILE", global = true)]
    pub admin_token_file: Option<PathBuf>,
    /// A PEM file of the CA certificate(s) an `https://` admin URL's
    /// certificate is checked against, instead of the system's.
    #[arg(long, alias = "ca-file", env = "IDEMGATE_ADMIN_CA_FILE", global = true)]
    pub admin_ca_file: Option<PathBuf>,
    /// What to do.
    #[command(subcommand)]
    pub action: JobsAction,
}

/// What `idemgate jobs` does.
#[derive(Debug, Subcommand)]
pub enum JobsAction {
    /// The jobs waiting for an operator (outcome unknown), newest first.
    List {
        /// Only `unknown` is listed (find others with `show`).
        #[arg(long, default_value = "unknown")]
        state: String,
        /// Jobs per page.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// The page after this cursor (the `next` a listing printed).
        #[arg(long)]
        before: Option<String>,
        /// The admin API's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One job, its attempts and its response, as JSON.
    Show {
        /// The job id (the `Idempotency-Job` header of its answers).
        job: String,
    },
    /// Say what an attempt of unknown outcome did.
    Resolve {
        /// The attempt id (`idemgate jobs show` lists them).
        attempt: String,
        /// It had no effect: the job reopens and the next retry runs again.
        #[arg(
            long,
            conflicts_with = "succeeded",
            required_unless_present = "succeeded"
        )]
        no_effect: bool,
        /// It took effect, with this answer: committed as the job's result.
        #[arg(long, requires = "status")]
        succeeded: bool,
        /// The answer's status.
        #[arg(long)]
        status: Option<u16>,
        /// An answer header, `name: value`; repeat it.
        #[arg(long = "header", value_name = "NAME: VALUE")]
        headers: Vec<String>,
        /// The answer's body, or `@FILE` to read it from a file.
        #[arg(long)]
        body: Option<String>,
    },
    /// Say what every unknown attempt on one upstream, started within a
    /// window, did (after an outage): it had no effect, or abandon them.
    ResolveMany {
        /// The upstream the attempts were sent to (its name).
        #[arg(long)]
        upstream: String,
        /// Started at or after this instant (RFC 3339).
        #[arg(long)]
        since: String,
        /// Started before this instant (RFC 3339); now by default.
        #[arg(long)]
        until: Option<String>,
        /// They had no effect: their jobs reopen.
        #[arg(
            long,
            conflicts_with = "cancelled",
            required_unless_present = "cancelled"
        )]
        no_effect: bool,
        /// Abandon them: their jobs reopen.
        #[arg(long)]
        cancelled: bool,
        /// List what would be resolved; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// Why a command failed, for the terminal.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// No token was given.
    #[error(
        "no admin token: pass --admin-token, set IDEMGATE_ADMIN_TOKEN, or --admin-token-file FILE"
    )]
    NoToken,
    /// A file could not be read.
    #[error("{0}: {1}")]
    File(String, std::io::Error),
    /// What was typed cannot be sent.
    #[error("{0}")]
    Usage(String),
    /// The gateway could not be reached.
    #[error("cannot reach the admin API at {0}: {1}")]
    Unreachable(String, String),
    /// The gateway answered with a problem.
    #[error("{status}: {detail}")]
    Refused {
        /// Its status.
        status: StatusCode,
        /// The problem's detail (or the body).
        detail: String,
    },
}

/// Runs one `idemgate jobs` command; what it prints on success.
pub async fn run(command: JobsCommand) -> Result<String, CliError> {
    let admin = Admin::new(&command)?;
    match command.action {
        JobsAction::List {
            state,
            limit,
            before,
            json,
        } => {
            let mut path = format!("/admin/v1/jobs?state={state}&limit={limit}");
            if let Some(before) = before {
                path.push_str(&format!("&before={before}"));
            }
            let page = admin.call(Method::GET, &path, None).await?;
            Ok(if json { pretty(&page) } else { table(&page) })
        }
        JobsAction::Show { job } => {
            let job = admin
                .call(Method::GET, &format!("/admin/v1/jobs/{job}"), None)
                .await?;
            Ok(pretty(&job))
        }
        JobsAction::ResolveMany {
            upstream,
            since,
            until,
            no_effect: _,
            cancelled,
            dry_run,
        } => {
            let outcome = if cancelled { "cancelled" } else { "failed" };
            let request = json!({"upstream": upstream, "since": since, "until": until, "outcome": outcome, "dry_run": dry_run});
            let done = admin
                .call(Method::POST, "/admin/v1/attempts/resolve", Some(request))
                .await?;
            Ok(bulk_report(&done))
        }
        JobsAction::Resolve {
            attempt,
            no_effect: _,
            succeeded,
            status,
            headers,
            body,
        } => {
            let resolution = if succeeded {
                let status = status.ok_or(CliError::Usage("--succeeded needs --status".into()))?;
                json!({"outcome": "succeeded", "response": answer(status, &headers, body)?})
            } else {
                json!({"outcome": "failed"})
            };
            let path = format!("/admin/v1/attempts/{attempt}/resolve");
            let job = admin.call(Method::POST, &path, Some(resolution)).await?;
            Ok(format!(
                "job {} is now {}\n",
                job["id"].as_str().unwrap_or_default(),
                job["state"].as_str().unwrap_or_default()
            ))
        }
    }
}

/// The answer a succeeded attempt gave, as the admin API takes it.
fn answer(status: u16, headers: &[String], body: Option<String>) -> Result<Value, CliError> {
    let headers = headers
        .iter()
        .map(|h| {
            let (name, value) = h.split_once(':').ok_or_else(|| {
                CliError::Usage(format!("--header {h:?}: write it as `name: value`"))
            })?;
            Ok(json!([name.trim(), value.trim()]))
        })
        .collect::<Result<Vec<Value>, CliError>>()?;
    let body = match body {
        Some(text) => match text.strip_prefix('@') {
            Some(path) => {
                std::fs::read_to_string(path).map_err(|e| CliError::File(path.into(), e))?
            }
            None => text,
        },
        None => String::new(),
    };
    Ok(json!({"status": status, "headers": headers, "body": body}))
}

/// What a bulk resolution matched, did and skipped.
fn bulk_report(done: &Value) -> String {
    let dry = done["dry_run"].as_bool().unwrap_or(false);
    let mut out = String::new();
    for m in done["matched"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "{}  attempt {}  job {}  started {}\n",
            if dry { "would resolve" } else { "matched" },
            m["attempt"].as_str().unwrap_or_default(),
            m["job"].as_str().unwrap_or_default(),
            m["started_at"].as_str().unwrap_or_default()
        ));
    }
    for s in done["skipped"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "skipped  attempt {}: {}\n",
            s["attempt"].as_str().unwrap_or_default(),
            s["why"].as_str().unwrap_or_default()
        ));
    }
    let count = |key: &str| done[key].as_array().map_or(0, Vec::len);
    out.push_str(&format!(
        "{} matched, {} resolved, {} skipped{}\n",
        count("matched"),
        count("resolved"),
        count("skipped"),
        if dry {
            " (dry run: nothing changed)"
        } else {
            ""
        }
    ));
    out
}

/// A listing as a table, and how to get the next page.
fn table(page: &Value) -> String {
    let mut out = format!(
        "{:<36}  {:<9}  {:<16}  {:>8}  {:<24}  KEY\n",
        "JOB", "STATE", "ROUTE", "ATTEMPTS", "CREATED"
    );
    for job in page["jobs"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "{:<36}  {:<9}  {:<16}  {:>8}  {:<24}  {}\n",
            job["id"].as_str().unwrap_or_default(),
            job["state"].as_str().unwrap_or_default(),
            job["route"].as_str().unwrap_or_default(),
            job["attempt_count"],
            job["created_at"].as_str().unwrap_or_default(),
            job["key"].as_str().unwrap_or_default(),
        ));
    }
    if let Some(next) = page["next"].as_str() {
        out.push_str(&format!("more: --before {next}\n"));
    }
    out
}

fn pretty(value: &Value) -> String {
    format!(
        "{}\n",
        serde_json::to_string_pretty(value).unwrap_or_default()
    )
}

/// The admin API of one gateway.
struct Admin {
    base: String,
    token: String,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
}

impl Admin {
    fn new(command: &JobsCommand) -> Result<Admin, CliError> {
        let token = match (&command.admin_token, &command.admin_token_file) {
            (Some(token), _) if !token.is_empty() => token.clone(),
            (_, Some(file)) => std::fs::read_to_string(file)
                .map_err(|e| CliError::File(file.display().to_string(), e))?
                .trim()
                .to_owned(),
            _ => return Err(CliError::NoToken),
        };
        Ok(Admin {
            base: command.admin_url.trim_end_matches('/').to_owned(),
            token,
            client: client(command.admin_ca_file.as_deref())?,
        })
    }

    /// One request; the answer's JSON, or the problem it reported.
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, CliError> {
        let url = format!("{}{path}", self.base);
        let request = Request::builder()
            .method(method)
            .uri(&url)
            .header("authorization", format!("Bearer {}", self.token))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(
                body.map(|b| b.to_string()).unwrap_or_default(),
            )))
            .map_err(|e| CliError::Usage(format!("{url}: {e}")))?;
        let client = &self.client;
        // With every cause: "client error (Connect)" alone does not say a
        // certificate was refused.
        let unreachable = |e: &dyn std::error::Error| {
            let mut why = e.to_string();
            let mut cause = e.source();
            while let Some(e) = cause {
                why.push_str(&format!(": {e}"));
                cause = e.source();
            }
            CliError::Unreachable(self.base.clone(), why)
        };
        let response = client.request(request).await.map_err(|e| unreachable(&e))?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| unreachable(&e))?
            .to_bytes();
        let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if status.is_success() {
            return Ok(value);
        }
        let detail = value["detail"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
        Err(CliError::Refused { status, detail })
    }
}

/// A client for `http://` and `https://` admin URLs: an `https://` one's
/// certificate is checked against `ca_file`'s certificates where given (a
/// private CA in front of the admin listener, `docs/design.md` §14), the
/// system's CA certificates otherwise.
fn client(
    ca_file: Option<&Path>,
) -> Result<Client<HttpsConnector<HttpConnector>, Full<Bytes>>, CliError> {
    let mut roots = rustls::RootCertStore::empty();
    let certs = match ca_file {
        Some(path) => ca_certificates(path)?,
        None => rustls_native_certs::load_native_certs().certs,
    };
    roots.add_parsable_certificates(certs);
    let tls = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| CliError::Usage(format!("TLS cannot be set up: {e}")))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .build();
    Ok(Client::builder(TokioExecutor::new()).build(connector))
}

/// The certificates of the PEM file `path` (at least one).
fn ca_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, CliError> {
    let unusable = |why: String| {
        CliError::Usage(format!(
            "--admin-ca-file {}: {why}; name a PEM file holding the CA certificate(s) of the admin URL",
            path.display()
        ))
    };
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| unusable(e.to_string()))?;
    if certs.is_empty() {
        return Err(unusable("it holds no certificate".to_owned()));
    }
    Ok(certs)
}
