//! The TOML file, as written: every field optional, unknown keys refused.
//! Defaults and validation live with the settings they make.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::contracts::ContractFile;
use super::trust::{ClientFile, OwnerFile, SecretFile};
use super::{bad, ConfigError};

/// The TOML file. See `config/idemgate.example.toml` for every key.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub(super) listen: Option<SocketAddr>,
    pub(super) admin_listen: Option<SocketAddr>,
    pub(super) admin_token: Option<String>,
    pub(super) console_secure_cookie: Option<bool>,
    pub(super) access_log: Option<bool>,
    pub(super) upstreams: Option<Vec<UpstreamFile>>,
    pub(super) database_url: Option<String>,
    pub(super) database_direct_url: Option<String>,
    pub(super) database_pool_size: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    pub(super) database_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) database_lock_timeout: Option<Duration>,
    pub(super) embedded_path: Option<PathBuf>,
    pub(super) redis_url: Option<String>,
    #[serde(default, with = "humantime_serde")]
    pub(super) redis_timeout: Option<Duration>,
    pub(super) redis_inline_max: Option<bytesize::ByteSize>,
    pub(super) redis_key_prefix: Option<String>,
    pub(super) redis_ca_file: Option<PathBuf>,
    pub(super) redis_client_cert: Option<PathBuf>,
    pub(super) redis_client_key: Option<PathBuf>,
    pub(super) replay_key: Option<SecretFile>,
    #[serde(default)]
    pub(super) replay_previous_keys: Vec<SecretFile>,
    #[serde(default, with = "humantime_serde")]
    pub(super) upstream_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) attempt_deadline: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) hold_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) key_ttl: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) lease_ttl: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) sweep_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) retry_after: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) shutdown_grace: Option<Duration>,
    pub(super) max_connections: Option<usize>,
    pub(super) max_in_flight: Option<usize>,
    pub(super) worker_threads: Option<usize>,
    pub(super) worker_runtime: Option<String>,
    #[serde(default, with = "humantime_serde")]
    pub(super) header_read_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) keepalive_timeout: Option<Duration>,
    pub(super) max_header_size: Option<bytesize::ByteSize>,
    #[serde(default, with = "humantime_serde")]
    pub(super) body_read_timeout: Option<Duration>,
    pub(super) body_min_rate: Option<bytesize::ByteSize>,
    #[serde(default, with = "humantime_serde")]
    pub(super) http2_keepalive_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) http2_keepalive_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) http2_idle_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) send_timeout: Option<Duration>,
    pub(super) memory_budget: Option<bytesize::ByteSize>,
    pub(super) memory_budget_owner_share: Option<f64>,
    pub(super) owner_header: Option<String>,
    pub(super) forward_key_header: Option<String>,
    pub(super) forward_attempt_header: Option<String>,
    pub(super) mismatch_status: Option<u16>,
    pub(super) max_response_size: Option<bytesize::ByteSize>,
    pub(super) replay_cache_size: Option<bytesize::ByteSize>,
    pub(super) respond_async_path: Option<String>,
    #[serde(default, with = "humantime_serde")]
    pub(super) probe_interval: Option<Duration>,
    #[serde(default)]
    pub(super) routes: Vec<RouteFile>,
    #[serde(default)]
    pub(super) contracts: BTreeMap<String, ContractFile>,
    pub(super) encryption: Option<EncryptionFile>,
    pub(super) trusted_proxies: Option<Vec<String>>,
    pub(super) owner: Option<OwnerFile>,
    #[serde(default)]
    pub(super) clients: Vec<ClientFile>,
    pub(super) client_key_header: Option<String>,
    /// The folder contract and certificate files are read from (the config
    /// file's own).
    #[serde(skip)]
    pub(super) base_dir: PathBuf,
}

/// An upstream: a bare URL, or a table with its own settings.
#[derive(Debug, Clone)]
pub(super) enum UpstreamFile {
    Url(String),
    Table(UpstreamTable),
}

/// By hand rather than `#[serde(untagged)]`, which answers any mistake in
/// a table with "did not match any variant": this keeps the table's own
/// error (the key, what was expected).
impl<'de> Deserialize<'de> for UpstreamFile {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = UpstreamFile;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a URL, or a table with `url` and the upstream's settings")
            }

            fn visit_str<E: serde::de::Error>(self, url: &str) -> Result<UpstreamFile, E> {
                Ok(UpstreamFile::Url(url.to_owned()))
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<UpstreamFile, A::Error> {
                UpstreamTable::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(UpstreamFile::Table)
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct UpstreamTable {
    pub(super) name: Option<String>,
    pub(super) url: String,
    #[serde(default, with = "humantime_serde")]
    pub(super) timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) connect_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) idle_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) first_byte_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) stream_idle_timeout: Option<Duration>,
    pub(super) ca_file: Option<PathBuf>,
    #[serde(default)]
    pub(super) headers: BTreeMap<String, HeaderSource>,
}

/// A header an upstream gets on every request: a fixed value, or one read
/// from an environment variable at start-up (a provider's API key, which
/// clients then never hold), with an optional prefix such as `Bearer `.
/// Every such header is a credential of the operator's unless it is marked
/// `credential = false` (`docs/design.md` §15).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct HeaderSource {
    pub(super) value: Option<String>,
    pub(super) env: Option<String>,
    #[serde(default)]
    pub(super) prefix: String,
    pub(super) credential: Option<bool>,
}

/// `[encryption]`: keys that seal stored responses.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EncryptionFile {
    pub(super) active: String,
    pub(super) keys: Vec<KeyFile>,
}

/// One key: its id, and where its 32 bytes (base64) are read from.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct KeyFile {
    pub(super) id: String,
    pub(super) env: Option<String>,
    pub(super) file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RouteFile {
    pub(super) name: Option<String>,
    pub(super) path_prefix: Option<String>,
    pub(super) methods: Option<Vec<String>>,
    pub(super) require_key: Option<bool>,
    pub(super) body_limit: Option<bytesize::ByteSize>,
    pub(super) significant_headers: Option<Vec<String>>,
    pub(super) retryable_statuses: Option<Vec<u16>>,
    pub(super) canonical_json: Option<bool>,
    pub(super) ignore_fields: Option<Vec<String>>,
    pub(super) upstreams: Option<Vec<String>>,
    pub(super) max_attempts: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    pub(super) failover_deadline: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) hedge_after: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) first_byte_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub(super) stream_idle_timeout: Option<Duration>,
    pub(super) side_effect_free: Option<bool>,
    pub(super) contract: Option<String>,
    pub(super) stream_types: Option<Vec<String>>,
    pub(super) stream_errors: Option<StreamErrorsFile>,
    pub(super) stream_end_events: Option<Vec<String>>,
    pub(super) owner: Option<OwnerFile>,
    pub(super) require_client: Option<bool>,
    pub(super) in_progress: Option<String>,
    /// `reconcile = "resend"`, or a `[routes.reconcile]` table: read as a
    /// value so that each spelling gets its own error.
    pub(super) reconcile: Option<toml::Value>,
    pub(super) on_unknown: Option<String>,
    pub(super) respond_async: Option<bool>,
    pub(super) protocol: Option<String>,
    pub(super) keyed_tools: Option<Vec<String>>,
    pub(super) retryable_rpc_codes: Option<Vec<i64>>,
}

/// `[routes.stream_errors]`: what an error an event stream reports after
/// its head does (`docs/design.md` §10).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct StreamErrorsFile {
    pub(super) enabled: Option<bool>,
    pub(super) retryable: Option<Vec<String>>,
}

/// `[routes.reconcile]`: where the route's upstream answers what became of
/// a job (`docs/design.md` §5).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReconcileFile {
    pub(super) path: Option<String>,
}

impl FileConfig {
    /// The file at `path`, parsed, remembering its folder; no file is an
    /// empty one.
    pub fn read(path: Option<&Path>) -> Result<FileConfig, ConfigError> {
        let Some(path) = path else {
            return Ok(FileConfig::default());
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad("--config", format!("cannot read {}: {e}", path.display())))?;
        let mut file = Self::parse(&text)?;
        file.base_dir = path.parent().map(Path::to_owned).unwrap_or_default();
        Ok(file)
    }

    /// Reads the files it names (contracts, certificates) relative to `dir`.
    pub fn relative_to(mut self, dir: impl Into<PathBuf>) -> Self {
        self.base_dir = dir.into();
        self
    }

    /// Parses TOML text; unknown keys are errors that name the key.
    pub fn parse(text: &str) -> Result<FileConfig, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let mut message = e.message().to_owned();
            // A bad value is named by the line its span points at; an
            // unknown or missing key is named in the message (whose
            // backquotes otherwise quote the value).
            let quoted =
                message.starts_with("unknown field") || message.starts_with("missing field");
            let key = e
                .span()
                .and_then(|span| key_at(text, span.start))
                .or_else(|| {
                    quoted
                        .then(|| message.split('`').nth(1).map(str::to_owned))
                        .flatten()
                })
                .unwrap_or_else(|| "config file".to_owned());
            if let Some(said) = unknown_key(&message) {
                message = said;
            }
            if message.contains("invalid type: floating point") && message.contains("expected u") {
                // Helm and some templating tools write 32 as 32.0.
                message.push_str("; write it as a whole number (32, not 32.0)");
            }
            bad(
                key,
                format!("{message} (see config/idemgate.example.toml for every key)"),
            )
        })
    }
}

/// The key written on the line holding byte `at`, if that line is `key = …`.
fn key_at(text: &str, at: usize) -> Option<String> {
    // A span may point inside a multi-byte character: step back to a boundary.
    let at = (0..=at.min(text.len()))
        .rev()
        .find(|&i| text.is_char_boundary(i))?;
    let start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let line = text[start..].lines().next()?;
    let (key, _) = line.split_once('=')?;
    let key = key.trim();
    (!key.is_empty() && !key.starts_with('[')).then(|| key.to_owned())
}

/// serde's "unknown field `x`, expected one of `a`, `b`, …" (the whole
/// table's keys, some fifty at the top level) as a person wants it: the
/// key nearest to the one written, when one is near; the table's keys only
/// when they are few.
pub(super) fn unknown_key(message: &str) -> Option<String> {
    let (written, rest) = message.strip_prefix("unknown field `")?.split_once('`')?;
    // ", expected one of `a`, `b`": every other piece between backquotes.
    let expected: Vec<&str> = rest.split('`').skip(1).step_by(2).collect();
    Some(match nearest(written, &expected) {
        Some(key) => format!("unknown key `{written}`; did you mean `{key}`?"),
        None if expected.is_empty() => format!("unknown key `{written}`: this table takes none"),
        None if expected.len() <= 8 => format!(
            "unknown key `{written}`; this table takes `{}`",
            expected.join("`, `")
        ),
        None => format!("unknown key `{written}`, and none of this table's keys is near it"),
    })
}

/// The key of `keys` fewest edits away from `written` (case, `-` for `_`
/// and transposed letters forgiven or cheap), if it is near enough to be
/// the one meant: at most a third of its letters changed.
fn nearest<'a>(written: &str, keys: &[&'a str]) -> Option<&'a str> {
    let written = written.to_ascii_lowercase().replace('-', "_");
    keys.iter()
        .map(|key| (strsim::damerau_levenshtein(&written, key), *key))
        .filter(|(edits, key)| *edits <= (key.len().max(written.len()) / 3).max(1))
        .min_by_key(|(edits, _)| *edits)
        .map(|(_, key)| key)
}

#[cfg(test)]
mod tests {
    use super::{unknown_key, FileConfig};

    #[test]
    fn a_misspelled_key_is_named_with_the_nearest_and_a_far_one_with_none() {
        let said = |text: &str| FileConfig::parse(text).unwrap_err().message;
        let near = said("upstream_timout = \"1s\"");
        assert!(near.contains("did you mean `upstream_timeout`?"), "{near}");
        assert!(!near.contains("admin_listen"), "not every key: {near}");
        let case = said("First-Byte-Timeout = \"1s\"\n");
        assert!(case.contains("unknown key"), "{case}");
        let far = said("frobnicate = 1");
        assert!(
            !far.contains("did you mean") && !far.contains("admin_listen"),
            "{far}"
        );
        let route = said("[[routes]]\nfirst_byte_timout = \"2s\"");
        assert!(
            route.contains("did you mean `first_byte_timeout`?"),
            "{route}"
        );
    }

    #[test]
    fn a_small_table_lists_its_keys_when_none_is_near() {
        let said = unknown_key("unknown field `zzz`, expected `enabled` or `retryable`").unwrap();
        assert_eq!(
            said,
            "unknown key `zzz`; this table takes `enabled`, `retryable`"
        );
        let said = unknown_key("unknown field `pth`, expected `path`").unwrap();
        assert_eq!(said, "unknown key `pth`; did you mean `path`?");
        assert_eq!(unknown_key("invalid type: string"), None);
    }
}
