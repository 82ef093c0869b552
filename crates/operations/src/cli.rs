//! `idemgate jobs …`: the operator's client of a running gateway's admin
//! API (`docs/design.md` §14), for a terminal or a script where the console
//! is not at hand. It holds no state and reaches no store: every command is
//! one request to `/admin/v1`, with the admin token from the flag, the
//! environment or a file (a mounted Secret).

use std::path::{Path, PathBuf};

use bytes::Bytes;
use clap::{Args, Subcommand};
use http::{HeaderValue, Method, Request, StatusCode};
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
    /// Your name, recorded with what you resolve (the token is shared);
    /// `$USER` by default.
    #[arg(long, env = "IDEMGATE_OPERATOR", global = true)]
    pub operator: Option<String>,
    /// What to do.
    #[command(subcommand)]
    pub action: JobsAction,
}

/// What `idemgate jobs` does.
#[derive(Debug, Subcommand)]
pub enum JobsAction {
    /// The jobs waiting for an operator (outcome unknown), newest first,
    /// with the attempt to resolve.
    List {
        /// Only `unknown` is listed (find others with `show` or `find`).
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
    /// The job of an owner and a key, as JSON.
    Find {
        /// Whose key: the stored form `hmac:<hex>` (as `show` prints it),
        /// `anonymous`, or the raw value of the owner's source (the
        /// `Authorization` header's value, by default).
        #[arg(long, default_value = "anonymous")]
        owner: String,
        /// The `Idempotency-Key`.
        #[arg(long)]
        key: String,
    },
    /// Say what an attempt of unknown outcome did: `--succeeded` or
    /// `--no-effect`, one of them always (nothing is assumed).
    Resolve {
        /// The attempt id, or the job id (its attempt of unknown outcome
        /// is resolved).
        id: String,
        /// It did nothing upstream: the job reopens, and the client's next
        /// retry runs a new attempt against the upstream (a charge is made
        /// again).
        #[arg(long, conflicts_with = "succeeded")]
        no_effect: bool,
        /// It took effect, with this answer: committed as the job's result,
        /// which every retry gets replayed (the upstream is not called
        /// again). Needs `--status`.
        #[arg(long)]
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
    /// window, did (after an outage): `--no-effect` or `--cancelled`, one
    /// of them always.
    ResolveMany {
        /// The upstream the attempts were sent to (its name, as
        /// configured; another is refused).
        #[arg(long)]
        upstream: String,
        /// Started at or after this instant (RFC 3339).
        #[arg(long)]
        since: String,
        /// Started before this instant (RFC 3339); now by default.
        #[arg(long)]
        until: Option<String>,
        /// They did nothing upstream: their jobs reopen, and each client's
        /// next retry runs a new attempt (charging again).
        #[arg(long, conflicts_with = "cancelled")]
        no_effect: bool,
        /// Abandon them, whatever they did: their jobs reopen, and each
        /// client's next retry runs a new attempt.
        #[arg(long)]
        cancelled: bool,
        /// List what would be resolved; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// What `resolve` says when no outcome is given: both, and what each does
/// to the client's next retry, so that the message leads to neither.
pub const NO_OUTCOME: &str = "say what the attempt did; nothing is assumed:\n  \
     --succeeded --status N [--header 'name: value'] [--body TEXT|@FILE]\n      \
     it took effect: this answer becomes the job's result, and the client's next retry gets it \
     replayed; the upstream is not called again\n  \
     --no-effect\n      \
     it did nothing upstream: the job reopens, and the client's next retry runs a new attempt \
     against the upstream (a payment is charged again)\n\
     check the upstream first (`idemgate jobs show JOB` lists what is known)";

/// What `resolve-many` says when no outcome is given.
pub const NO_BULK_OUTCOME: &str = "say what the attempts did; nothing is assumed:\n  \
     --no-effect\n      \
     they did nothing upstream: their jobs reopen, and each client's next retry runs a new \
     attempt against the upstream (a payment is charged again)\n  \
     --cancelled\n      \
     abandon them, whatever they did: their jobs reopen the same way\n\
     an attempt that took effect is resolved on its own: idemgate jobs resolve ID --succeeded …";

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
                path.push_str(&format!("&before={}", encode(&before)));
            }
            let page = admin.call(Method::GET, &path, None).await?;
            Ok(if json { pretty(&page) } else { table(&page) })
        }
        JobsAction::Show { job } => {
            let path = format!("/admin/v1/jobs/{}", encode(&job));
            Ok(pretty(&admin.call(Method::GET, &path, None).await?))
        }
        JobsAction::Find { owner, key } => {
            let path = format!(
                "/admin/v1/jobs?owner={}&key={}",
                encode(&owner),
                encode(&key)
            );
            Ok(pretty(&admin.call(Method::GET, &path, None).await?))
        }
        JobsAction::ResolveMany {
            upstream,
            since,
            until,
            no_effect,
            cancelled,
            dry_run,
        } => {
            let outcome = match (no_effect, cancelled) {
                (true, _) => "failed",
                (_, true) => "cancelled",
                _ => return Err(CliError::Usage(NO_BULK_OUTCOME.into())),
            };
            let request = json!({"upstream": upstream, "since": since, "until": until, "outcome": outcome, "dry_run": dry_run});
            let done = admin
                .call(Method::POST, "/admin/v1/attempts/resolve", Some(request))
                .await?;
            Ok(bulk_report(&done))
        }
        JobsAction::Resolve {
            id,
            no_effect,
            succeeded,
            status,
            headers,
            body,
        } => {
            let resolution = match (succeeded, no_effect) {
                (true, _) => {
                    let status = status.ok_or(CliError::Usage(
                        "--succeeded needs --status: the status the upstream answered with".into(),
                    ))?;
                    json!({"outcome": "succeeded", "response": answer(status, &headers, body)?})
                }
                (_, true) => json!({"outcome": "failed"}),
                _ => return Err(CliError::Usage(NO_OUTCOME.into())),
            };
            resolve(&admin, &id, resolution).await
        }
    }
}

/// Resolves the attempt `id` names: an attempt's id, or a job's (its one
/// attempt of unknown outcome). Says what was resolved and what the next
/// retry meets.
async fn resolve(admin: &Admin, id: &str, resolution: Value) -> Result<String, CliError> {
    let (attempt, of_job) = attempt_of(admin, id).await?;
    let path = format!("/admin/v1/attempts/{}/resolve", encode(&attempt));
    let job = match admin.call(Method::POST, &path, Some(resolution)).await {
        Err(CliError::Refused { status, .. }) if status == StatusCode::NOT_FOUND && !of_job => {
            return Err(CliError::Usage(format!(
                "no job or attempt has id {id} (`idemgate jobs list` shows the jobs waiting, with their attempts)"
            )))
        }
        done => done?,
    };
    let state = job["state"].as_str().unwrap_or_default();
    let settled = job["attempts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|a| a["id"] == attempt.as_str());
    let by = settled
        .and_then(|a| a["resolved_by"]["operator"].as_str())
        .unwrap_or("an operator");
    let next = match state {
        "completed" => "every retry with its key gets its result replayed",
        "open" => "the client's next retry runs a new attempt against the upstream",
        _ => "another attempt is still in flight or unknown",
    };
    Ok(format!(
        "attempt {attempt} resolved by {by}\njob {} is now {state}: {next}\n",
        job["id"].as_str().unwrap_or_default(),
    ))
}

/// The attempt `id` names, and whether it was a job's id: a job's id
/// stands for its one attempt of unknown outcome; an id no job has is
/// taken for an attempt's.
async fn attempt_of(admin: &Admin, id: &str) -> Result<(String, bool), CliError> {
    let path = format!("/admin/v1/jobs/{}", encode(id));
    let job = match admin.call(Method::GET, &path, None).await {
        Ok(job) => job,
        Err(CliError::Refused { status, .. }) if status == StatusCode::NOT_FOUND => {
            return Ok((id.to_owned(), false))
        }
        Err(e) => return Err(e),
    };
    let attempts = job["attempts"].as_array().cloned().unwrap_or_default();
    let unknown: Vec<&Value> = attempts
        .iter()
        .filter(|a| a["state"] == "unknown")
        .collect();
    let describe = |a: &Value| {
        format!(
            "#{} {} {}",
            a["number"],
            a["id"].as_str().unwrap_or_default(),
            a["state"].as_str().unwrap_or_default()
        )
    };
    match unknown.as_slice() {
        [one] => Ok((one["id"].as_str().unwrap_or_default().to_owned(), true)),
        [] => Err(CliError::Usage(format!(
            "job {id} is {} and has no attempt of unknown outcome: nothing to resolve (its attempts: {})",
            job["state"].as_str().unwrap_or_default(),
            attempts.iter().map(describe).collect::<Vec<_>>().join(", ")
        ))),
        many => Err(CliError::Usage(format!(
            "job {id} has {} attempts of unknown outcome; resolve each by its attempt id: {}",
            many.len(),
            many.iter().map(|a| describe(a)).collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// `text` as one query or path component.
fn encode(text: &str) -> String {
    form_urlencoded::byte_serialize(text.as_bytes()).collect()
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
    if done["truncated"].as_bool().unwrap_or(false) {
        out.push_str(
            "stopped early: more unknown jobs than one call reads (the newest are read first), \
             so older attempts in the window may be missing; resolve newer ones first, then run \
             again (docs/operations.md)\n",
        );
    }
    // The window as the gateway read it: `until` was "now" unless given,
    // so a run without it after a dry run would take in attempts that went
    // unknown since (docs/operations.md).
    let (since, until) = (
        done["since"].as_str().unwrap_or_default(),
        done["until"].as_str().unwrap_or_default(),
    );
    out.push_str(&format!("window: since {since} until {until}\n"));
    if dry {
        out.push_str(&format!(
            "to resolve exactly these, run it again without --dry-run and with --until {until}\n"
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

/// A listing as a table, with the attempt to resolve and its upstream,
/// and how to get the next page.
fn table(page: &Value) -> String {
    let mut out = format!(
        "{:<36}  {:<7}  {:<36}  {:<12}  {:<16}  {:<24}  KEY\n",
        "JOB", "STATE", "UNKNOWN ATTEMPT", "UPSTREAM", "ROUTE", "CREATED (UTC)"
    );
    for job in page["jobs"].as_array().into_iter().flatten() {
        let unknown = job["unknown_attempts"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let field = |key: &str| {
            let values: Vec<&str> = unknown.iter().filter_map(|a| a[key].as_str()).collect();
            if values.is_empty() {
                "-".to_owned()
            } else {
                values.join(",")
            }
        };
        out.push_str(&format!(
            "{:<36}  {:<7}  {:<36}  {:<12}  {:<16}  {:<24}  {}\n",
            job["id"].as_str().unwrap_or_default(),
            job["state"].as_str().unwrap_or_default(),
            field("id"),
            field("upstream"),
            job["route"].as_str().unwrap_or_default(),
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
    /// Who runs the command, sent with every request (see `--operator`).
    operator: Option<String>,
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
        let operator = command
            .operator
            .clone()
            .or_else(|| std::env::var("USER").ok())
            .filter(|name| !name.trim().is_empty());
        Ok(Admin {
            base: command.admin_url.trim_end_matches('/').to_owned(),
            token,
            operator,
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
        let mut request = Request::builder()
            .method(method)
            .uri(&url)
            .header("authorization", format!("Bearer {}", self.token))
            .header("content-type", "application/json");
        if let Some(name) = &self.operator {
            let name = HeaderValue::from_bytes(name.trim().as_bytes())
                .map_err(|_| CliError::Usage(format!("--operator {name:?}: not a name")))?;
            request = request.header(crate::admin::OPERATOR_HEADER, name);
        }
        let request = request
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A bulk answer that stopped at its cap says so before its counts,
    /// so "0 matched" is not read as an empty window; a whole one does not.
    #[test]
    fn a_truncated_bulk_answer_is_said_to_have_stopped_early() {
        let answer = |truncated| json!({"dry_run": true, "matched": [], "resolved": [], "skipped": [], "truncated": truncated});
        let said = bulk_report(&answer(true));
        assert!(said.contains("stopped early"), "{said}");
        assert!(said.ends_with("0 matched, 0 resolved, 0 skipped (dry run: nothing changed)\n"));
        assert!(!bulk_report(&answer(false)).contains("stopped early"));
    }
}
