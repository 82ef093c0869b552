//! TLS to PostgreSQL as libpq spells it in a connection string
//! (docs/design.md §16): `sslmode`, `sslrootcert`, `sslcert` and `sslkey`,
//! in a URL's query (`postgres://…?sslmode=verify-full&sslrootcert=ca.pem`)
//! or as `key=value` words (`host=db sslmode=verify-full`).
//!
//! tokio-postgres reads only `disable`/`prefer`/`require` and refuses the
//! other keys, so they are taken out of the string here, their files read
//! (a bad one stops start-up naming the key), and the rest is left, byte
//! for byte, for tokio-postgres.

use std::path::Path;

use rustls::pki_types::CertificateDer;

use idemgate_store::postgres::{ClientIdentity, PgTls, PgUrl, SslMode};

use super::tls::{client_identity, pem_certificates, system_roots};
use super::{bad, ConfigError};

/// The TLS keys this module reads; any other `ssl…` key libpq knows is
/// refused by name rather than left to a vaguer error.
const OURS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];
/// Read by tokio-postgres itself.
const PASSED: [&str; 1] = ["sslnegotiation"];

/// Reads `url`, given as `key`; relative certificate paths are relative to
/// `base` (the config file's folder), as every other file the config names.
pub fn parse(key: &'static str, url: &str, base: &Path) -> Result<PgUrl, ConfigError> {
    let (rest, params) = split(url).map_err(|e| bad(key, e))?;
    let get = |name: &str| {
        params
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let rootcert = get("sslrootcert");
    let mode = mode(key, get("sslmode"), rootcert == Some("system"))?;
    let (roots, roots_from) = roots(key, mode, rootcert, base)?;
    let identity = identity(key, mode, get("sslcert"), get("sslkey"), base)?;
    let tls = PgTls {
        mode,
        roots,
        roots_from,
        identity,
    };
    Ok(PgUrl {
        key,
        url: rest,
        tls,
    })
}

/// The mode `sslmode` names, or libpq's default; with `sslrootcert=system`
/// (`system`), libpq 16's rule: verify-full, and nothing weaker.
fn mode(key: &str, sslmode: Option<&str>, system: bool) -> Result<SslMode, ConfigError> {
    let given = sslmode
        .map(|m| {
            SslMode::ALL
                .into_iter()
                .find(|mode| mode.as_str() == m)
                .ok_or_else(|| {
                    bad(
                        key,
                        format!(
                            "sslmode={m} is not one of disable, prefer, require, verify-ca, \
                             verify-full; use verify-full with sslrootcert=/path/ca.pem"
                        ),
                    )
                })
        })
        .transpose()?;
    // The system's roots are only worth it with the host name checked: a
    // public CA signs certificates for anyone's host.
    match (given, system) {
        (None, true) => Ok(SslMode::VerifyFull),
        (Some(m), true) if m != SslMode::VerifyFull => Err(bad(
            key,
            format!(
                "sslmode={} may not be used with sslrootcert=system (as in libpq): use \
                 sslmode=verify-full",
                m.as_str()
            ),
        )),
        (m, _) => Ok(m.unwrap_or(SslMode::Prefer)),
    }
}

/// The CA certificates `mode` checks the chain against, and where they
/// came from: `sslrootcert`'s file, or the system's for the verify modes
/// (and `sslrootcert=system`); none when nothing is checked.
fn roots(
    key: &str,
    mode: SslMode,
    rootcert: Option<&str>,
    base: &Path,
) -> Result<(Vec<CertificateDer<'static>>, String), ConfigError> {
    Ok(match (mode, rootcert) {
        (SslMode::Disable, _) => (Vec::new(), String::new()),
        (_, Some(path)) if path != "system" => {
            let path = base.join(path);
            let certs = pem_certificates(key, &path).map_err(|e| in_file(key, "sslrootcert", e))?;
            (certs, format!("sslrootcert {}", path.display()))
        }
        (SslMode::VerifyCa | SslMode::VerifyFull, _) => (
            system_roots(key).map_err(|e| in_file(key, "the system's CA certificates", e))?,
            system_roots_from(),
        ),
        _ => (Vec::new(), String::new()),
    })
}

/// The client certificate `sslcert` and its key `sslkey`: both or neither.
fn identity(
    key: &str,
    mode: SslMode,
    cert: Option<&str>,
    private: Option<&str>,
    base: &Path,
) -> Result<Option<ClientIdentity>, ConfigError> {
    match (cert, private) {
        _ if mode == SslMode::Disable => Ok(None),
        (None, None) => Ok(None),
        (Some(cert), Some(private)) => {
            client_identity(key, &base.join(cert), key, &base.join(private))
                .map(Some)
                .map_err(|e| in_file(key, "sslcert/sslkey", e))
        }
        _ => Err(bad(
            key,
            "sslcert and sslkey go together: give both (the client certificate and its key)",
        )),
    }
}

/// `e`, about the file(s) `name` names, as an error of `key`.
fn in_file(key: &str, name: &str, e: ConfigError) -> ConfigError {
    bad(key, format!("{name}: {}", e.message))
}

/// How the start-up log names the system's roots.
fn system_roots_from() -> String {
    match (
        std::env::var_os("SSL_CERT_FILE"),
        std::env::var_os("SSL_CERT_DIR"),
    ) {
        (None, None) => "the system's CA certificates".to_owned(),
        (file, dir) => {
            let named = [("SSL_CERT_FILE", file), ("SSL_CERT_DIR", dir)]
                .into_iter()
                .filter_map(|(var, v)| v.map(|v| format!("{var}={}", v.to_string_lossy())))
                .collect::<Vec<_>>();
            format!("the CA certificates of {}", named.join(" "))
        }
    }
}

/// `url` without the keys this module reads, and those keys' values.
fn split(url: &str) -> Result<(String, Vec<(String, String)>), String> {
    let is_url = url.starts_with("postgres://") || url.starts_with("postgresql://");
    let (head, words, glue) = if is_url {
        match url.split_once('?') {
            None => return Ok((url.to_owned(), Vec::new())),
            Some((head, query)) => (head, query_words(query)?, "&"),
        }
    } else {
        ("", conninfo_words(url)?, " ")
    };
    let mut kept = Vec::new();
    let mut params = Vec::new();
    for word in words {
        if PASSED.contains(&word.key.as_str()) || !word.key.starts_with("ssl") {
            kept.push(word.raw);
        } else if OURS.contains(&word.key.as_str()) {
            params.push((word.key, word.value));
        } else {
            return Err(format!(
                "{} is not supported; the TLS keys read are sslmode, sslrootcert, sslcert, \
                 sslkey (an unencrypted key) and sslnegotiation",
                word.key
            ));
        }
    }
    let kept = kept.join(glue);
    Ok(match (is_url, kept.is_empty()) {
        (true, true) => (head.to_owned(), params),
        (true, false) => (format!("{head}?{kept}"), params),
        (false, _) => (kept, params),
    })
}

/// One `key=value` of a connection string: the decoded pair, and the text
/// it was written as.
struct Word<'a> {
    key: String,
    value: String,
    raw: &'a str,
}

/// The parameters of a URL's query (`a=1&b=2`), percent-decoded.
fn query_words(query: &str) -> Result<Vec<Word<'_>>, String> {
    query
        .split('&')
        .filter(|piece| !piece.is_empty())
        .map(|piece| {
            let (key, value) = piece.split_once('=').unwrap_or((piece, ""));
            Ok(Word {
                key: percent_decoded(key)?,
                value: percent_decoded(value)?,
                raw: piece,
            })
        })
        .collect()
}

fn percent_decoded(text: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("`{text}` holds a bad %-escape"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("`{text}` is not UTF-8 once decoded"))
}

/// The words of a libpq `key=value` string: spaces around `=` allowed,
/// values bare or single-quoted, `\` escaping the next character.
fn conninfo_words(text: &str) -> Result<Vec<Word<'_>>, String> {
    let bytes = text.as_bytes();
    let mut words = Vec::new();
    let mut i = 0;
    let skip_spaces = |mut i: usize| {
        while i < bytes.len() && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    loop {
        i = skip_spaces(i);
        if i == bytes.len() {
            return Ok(words);
        }
        let start = i;
        while i < bytes.len() && bytes[i] != b'=' && !bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = text[start..i].to_owned();
        i = skip_spaces(i);
        if bytes.get(i) != Some(&b'=') {
            return Err(format!("`{key}` has no `=value`"));
        }
        i = skip_spaces(i + 1);
        let quoted = bytes.get(i) == Some(&b'\'');
        if quoted {
            i += 1;
        }
        let mut value = Vec::new();
        loop {
            match bytes.get(i) {
                None if quoted => return Err(format!("the value of `{key}` is not closed")),
                None => break,
                Some(b'\'') if quoted => {
                    i += 1;
                    break;
                }
                Some(c) if !quoted && c.is_ascii_whitespace() => break,
                Some(b'\\') if i + 1 < bytes.len() => {
                    value.push(bytes[i + 1]);
                    i += 2;
                }
                Some(&c) => {
                    value.push(c);
                    i += 1;
                }
            }
        }
        let value = String::from_utf8(value).map_err(|_| format!("`{key}` is not UTF-8"))?;
        words.push(Word {
            key,
            value,
            raw: &text[start..i],
        });
    }
}

#[cfg(test)]
mod tests;
