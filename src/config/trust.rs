//! Whom the gateway trusts, and for what (`docs/design.md` §15): the proxies
//! whose forwarding headers are believed (`trusted_proxies`), the clients
//! that may spend the operator's credentials (`[[clients]]`), where the
//! owner of a key comes from (`[owner]`, per route `[routes.owner]`), and the
//! secret owner digests are salted with (`[owner] salt`).

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use ipnet::IpNet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;

use idemgate_proxy::server::TrustedProxies;
use idemgate_trust::{ClientSettings, Clients, JwtSource, OwnerRule, OwnerSource};

use super::{bad, header_name, ConfigError};

/// `[owner]`, and `[routes.owner]` (where `salt` is refused).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct OwnerFile {
    pub(super) sources: Option<Vec<SourceFile>>,
    allow_anonymous: Option<bool>,
    pub(super) salt: Option<SecretFile>,
}

/// One owner source as written: exactly one of its kinds, with the JWT
/// source's options.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SourceFile {
    header: Option<String>,
    cookie: Option<String>,
    jwt: Option<String>,
    trusted_header: Option<String>,
    client: Option<bool>,
    all: Option<Vec<SourceFile>>,
    // The JWT source's options.
    from: Option<String>,
    keys: Option<PathBuf>,
    secret: Option<SecretFile>,
    algorithms: Option<Vec<String>>,
    audience: Option<String>,
    issuer: Option<String>,
    #[serde(default, with = "humantime_serde")]
    leeway: Option<Duration>,
}

/// A secret read at start-up: from the environment or a file (a mounted
/// Kubernetes Secret), or written in the file itself.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SecretFile {
    pub(super) env: Option<String>,
    pub(super) file: Option<PathBuf>,
    pub(super) value: Option<String>,
}

/// `[[clients]]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ClientFile {
    pub(super) name: String,
    pub(super) key_sha256: SecretFile,
}

impl SecretFile {
    /// Why the secret cannot be had (its variable unset, its file
    /// unreadable), looked up without reading it; `None` when it is there,
    /// or is written in the file, or is written wrongly (which
    /// [`SecretFile::read`] tells).
    pub(super) fn absent(&self, base: &Path) -> Option<String> {
        match (&self.env, &self.file, &self.value) {
            (Some(var), None, None) if std::env::var_os(var).is_none() => {
                Some(format!("environment variable {var} is not set; export it"))
            }
            (None, Some(path), None) => std::fs::File::open(base.join(path)).err().map(|e| {
                format!(
                    "cannot read {}: {e}; put the secret there, or point `file` at it",
                    path.display()
                )
            }),
            _ => None,
        }
    }

    /// The secret's text, trimmed.
    pub(super) fn read(&self, key: &str, base: &Path) -> Result<String, ConfigError> {
        let text = match (&self.env, &self.file, &self.value) {
            (Some(var), None, None) => std::env::var(var).map_err(|_| {
                bad(
                    key,
                    format!("environment variable {var} is not set; export it"),
                )
            })?,
            (None, Some(path), None) => std::fs::read_to_string(base.join(path))
                .map_err(|e| bad(key, format!("cannot read {}: {e}", path.display())))?,
            (None, None, Some(value)) => value.clone(),
            _ => return Err(bad(key, "give exactly one of `env`, `file` or `value`")),
        };
        Ok(text.trim().to_owned())
    }
}

/// `trusted_proxies`: addresses or CIDR ranges.
pub(super) fn trusted_proxies(written: &[String]) -> Result<TrustedProxies, ConfigError> {
    written
        .iter()
        .map(|text| {
            text.parse::<IpNet>()
                .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| {
                    bad(
                        "trusted_proxies",
                        format!("{text:?} is not an address or a CIDR range; write it like \"10.0.0.0/8\" or \"192.0.2.7\""),
                    )
                })
        })
        .collect::<Result<Vec<IpNet>, _>>()
        .map(TrustedProxies::from)
}

impl OwnerFile {
    /// The secrets its sources name (`key.sources[i].secret`, HS256 keys),
    /// by key.
    pub(super) fn secrets<'a>(&'a self, key: &str, found: &mut Vec<(String, &'a SecretFile)>) {
        fn walk<'a>(key: String, s: &'a SourceFile, found: &mut Vec<(String, &'a SecretFile)>) {
            if let Some(secret) = &s.secret {
                found.push((format!("{key}.secret"), secret));
            }
            for (i, part) in s.all.iter().flatten().enumerate() {
                walk(format!("{key}.all[{i}]"), part, found);
            }
        }
        for (i, s) in self.sources.iter().flatten().enumerate() {
            walk(format!("{key}.sources[{i}]"), s, found);
        }
    }
}

/// The owner rule `[owner]` (or a route's) describes; `inherited` fills
/// what it leaves out.
pub(super) fn owner_rule(
    key: &str,
    file: &OwnerFile,
    inherited: &OwnerRule,
    base: &Path,
) -> Result<OwnerRule, ConfigError> {
    let sources = match &file.sources {
        None => inherited.sources.clone(),
        Some(written) if written.is_empty() => {
            return Err(bad(
                format!("{key}.sources"),
                "name at least one source, e.g. sources = [{ header = \"authorization\" }]; to let keyed requests go without an owner, set allow_anonymous = true",
            ))
        }
        Some(written) => {
            let sources = written
                .iter()
                .enumerate()
                .map(|(i, s)| source(&format!("{key}.sources[{i}]"), s, base))
                .collect::<Result<_, _>>()?;
            let sources = side_by_side(&format!("{key}.sources"), sources)?;
            told_apart(&format!("{key}.sources"), &sources)?;
            sources
        }
    };
    Ok(OwnerRule {
        sources,
        allow_anonymous: file.allow_anonymous.unwrap_or(inherited.allow_anonymous),
    })
}

/// Several issuers' tokens on one header (`docs/design.md` §15, "Several
/// issuers"): the `jwt` sources of one list that read the same claim from
/// the same header each know the others' issuers, so that a token one of
/// them made is left to it; each must name its own `issuer`, which is
/// then part of the owner.
fn side_by_side(key: &str, mut sources: Vec<OwnerSource>) -> Result<Vec<OwnerSource>, ConfigError> {
    /// What a `jwt` source reads (its header and claim), and its issuer.
    type Reads = (http::HeaderName, String, Option<String>);
    let read = |s: &OwnerSource| match s {
        OwnerSource::Jwt(jwt) => Some((jwt.from.clone(), jwt.claim.clone(), jwt.issuer().cloned())),
        _ => None,
    };
    let all: Vec<Option<Reads>> = sources.iter().map(read).collect();
    for (i, source) in sources.iter_mut().enumerate() {
        let (Some((from, claim, issuer)), OwnerSource::Jwt(jwt)) = (&all[i], source) else {
            continue;
        };
        // The other sources reading its claim from its header, and their
        // issuers.
        let siblings: Vec<(usize, &Option<String>)> = all
            .iter()
            .enumerate()
            .filter_map(|(j, other)| match other {
                Some((f, c, iss)) if j != i && f == from && c == claim => Some((j, iss)),
                _ => None,
            })
            .collect();
        if siblings.is_empty() {
            continue;
        }
        let distinct =
            issuer.is_some() && siblings.iter().all(|(_, b)| b.is_some() && *b != issuer);
        if !distinct {
            return Err(bad(
                format!("{key}[{i}]"),
                format!("another jwt source reads `{claim}` from `{from}`: give each its own `issuer`, which tells their tokens, and their owners, apart"),
            ));
        }
        // Side by side: a token one of them leaves to another never falls
        // to a source between them, a wider owner (design §15).
        let (first, last) = (siblings[0].0.min(i), siblings[siblings.len() - 1].0.max(i));
        if last - first != siblings.len() {
            return Err(bad(
                format!("{key}[{i}]"),
                format!("the jwt sources that read `{claim}` from `{from}` must stand side by side in the list, with no other source between them"),
            ));
        }
        let mut with = (**jwt).clone();
        with.beside = siblings
            .into_iter()
            .filter_map(|(_, b)| b.clone())
            .collect();
        with.owned_by_issuer = i != first;
        *jwt = Arc::new(with);
    }
    Ok(sources)
}

/// Each source of one list names its owners apart from the others': an
/// owner is its source's label and the values it read (`OwnerSource::label`),
/// and a `:` or `+` in a claim name or an issuer can spell one source's
/// label as another's (`jwt:authorization:sub:a:b` is the claim `sub` of
/// the issuer `a:b` beside another, or the claim `sub:a:b`), which would
/// give two callers one owner and each the other's answers.
fn told_apart(key: &str, sources: &[OwnerSource]) -> Result<(), ConfigError> {
    let labels: Vec<String> = sources.iter().map(OwnerSource::label).collect();
    for (i, label) in labels.iter().enumerate() {
        if let Some(j) = labels[..i].iter().position(|earlier| earlier == label) {
            return Err(bad(
                format!("{key}[{i}]"),
                format!("it names its owners as `{key}[{j}]` does (`{label}`), so their callers would share keys and answers: drop one of them, or read a claim (or name an issuer) without `:` or `+` in it"),
            ));
        }
    }
    Ok(())
}

/// The default: the `Authorization` header (or `owner_header`), no
/// anonymous owners.
pub(super) fn default_owner_rule(owner_header: HeaderName) -> OwnerRule {
    OwnerRule {
        sources: vec![OwnerSource::Header(owner_header)],
        allow_anonymous: false,
    }
}

fn source(key: &str, s: &SourceFile, base: &Path) -> Result<OwnerSource, ConfigError> {
    let kinds = [
        s.header.is_some(),
        s.cookie.is_some(),
        s.jwt.is_some(),
        s.trusted_header.is_some(),
        s.client.is_some(),
        s.all.is_some(),
    ];
    if kinds.iter().filter(|k| **k).count() != 1 {
        return Err(bad(
            key,
            "give exactly one of `header`, `cookie`, `jwt`, `trusted_header`, `client = true` or `all`",
        ));
    }
    if s.jwt.is_none()
        && (s.from.is_some()
            || s.keys.is_some()
            || s.secret.is_some()
            || s.algorithms.is_some()
            || s.audience.is_some()
            || s.issuer.is_some()
            || s.leeway.is_some())
    {
        return Err(bad(
            key,
            "`from`, `keys`, `secret`, `algorithms`, `audience`, `issuer` and `leeway` belong to a `jwt` source",
        ));
    }
    Ok(match s {
        SourceFile {
            header: Some(h), ..
        } => OwnerSource::Header(header_name(key, h)?),
        SourceFile {
            cookie: Some(c), ..
        } if !c.is_empty() => OwnerSource::Cookie(c.clone()),
        SourceFile {
            cookie: Some(_), ..
        } => return Err(bad(key, "name the cookie")),
        SourceFile {
            jwt: Some(claim), ..
        } => OwnerSource::Jwt(Arc::new(jwt(key, claim, s, base)?)),
        SourceFile {
            trusted_header: Some(h),
            ..
        } => OwnerSource::TrustedHeader(header_name(key, h)?),
        SourceFile {
            client: Some(true), ..
        } => OwnerSource::Client,
        SourceFile {
            client: Some(false),
            ..
        } => return Err(bad(key, "write `client = true`, or leave the source out")),
        SourceFile { all: Some(all), .. } if all.len() >= 2 => OwnerSource::All(
            all.iter()
                .enumerate()
                .map(|(i, s)| source(&format!("{key}.all[{i}]"), s, base))
                .collect::<Result<_, _>>()?,
        ),
        _ => return Err(bad(key, "`all` combines two sources or more")),
    })
}

/// A JWT source: its keys (a PEM public key or a JWK set in `keys`, or a
/// shared `secret` for HS256) and how tokens are validated.
fn jwt(key: &str, claim: &str, s: &SourceFile, base: &Path) -> Result<JwtSource, ConfigError> {
    let algorithms = s
        .algorithms
        .clone()
        .unwrap_or_else(|| vec!["RS256".to_owned()])
        .iter()
        .map(|a| {
            Algorithm::from_str(a).map_err(|_| {
                bad(
                    format!("{key}.algorithms"),
                    format!("{a:?} is not a JWT algorithm; use HS256, RS256 or ES256"),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let Some(first) = algorithms.first().copied() else {
        return Err(bad(
            format!("{key}.algorithms"),
            "name at least one algorithm",
        ));
    };
    let keys = match (&s.keys, &s.secret) {
        (Some(path), None) => public_keys(&format!("{key}.keys"), &base.join(path))?,
        (None, Some(secret)) => {
            let text = secret.read(&format!("{key}.secret"), base)?;
            if text.len() < 32 {
                return Err(bad(format!("{key}.secret"), "an HS256 secret needs at least 32 bytes"));
            }
            vec![(None, DecodingKey::from_secret(text.as_bytes()))]
        }
        _ => return Err(bad(key, "give the verification keys: `keys = \"file.pem\"` (a PEM public key or a JWK set) or `secret = { env = \"…\" }` for HS256")),
    };
    let mut validation = Validation::new(first);
    validation.algorithms = algorithms;
    validation.validate_nbf = true;
    validation.leeway = leeway(&format!("{key}.leeway"), s.leeway)?;
    // A configured audience or issuer must be in the token, not merely
    // match when present (docs/design.md §15).
    let mut required = vec!["exp"];
    match &s.audience {
        Some(aud) => {
            validation.set_audience(&[aud]);
            required.push("aud");
        }
        None => validation.validate_aud = false,
    }
    if let Some(iss) = &s.issuer {
        validation.set_issuer(&[iss]);
        required.push("iss");
    }
    validation.set_required_spec_claims(&required);
    Ok(JwtSource {
        claim: claim.to_owned(),
        from: header_name(
            &format!("{key}.from"),
            s.from.as_deref().unwrap_or("authorization"),
        )?,
        keys,
        validation,
        beside: Vec::new(),
        owned_by_issuer: false,
    })
}

/// The longest leeway: past it, `exp` no longer bounds a stolen token's
/// use by much.
const MAX_LEEWAY: Duration = Duration::from_secs(300);

/// How far clocks may disagree when `exp` and `nbf` are checked: 60 s
/// unless written, whole seconds, five minutes at most.
fn leeway(key: &str, written: Option<Duration>) -> Result<u64, ConfigError> {
    let leeway = written.unwrap_or(Duration::from_secs(60));
    if leeway.subsec_nanos() != 0 || leeway > MAX_LEEWAY {
        return Err(bad(
            key,
            "write whole seconds, five minutes at most, e.g. leeway = \"60s\" (the default); it is how far the issuer's clock may be from the gateway's",
        ));
    }
    Ok(leeway.as_secs())
}

/// The public keys in `path`: a JWK set (JSON), or one PEM key (RSA or EC).
fn public_keys(key: &str, path: &Path) -> Result<Vec<(Option<String>, DecodingKey)>, ConfigError> {
    let bytes = std::fs::read(path)
        .map_err(|e| bad(key, format!("cannot read {}: {e}", path.display())))?;
    if let Ok(set) = serde_json::from_slice::<jsonwebtoken::jwk::JwkSet>(&bytes) {
        return set
            .keys
            .iter()
            .map(|jwk| {
                DecodingKey::from_jwk(jwk)
                    .map(|k| (jwk.common.key_id.clone(), k))
                    .map_err(|e| {
                        bad(
                            key,
                            format!("a key of {} is not usable: {e}", path.display()),
                        )
                    })
            })
            .collect();
    }
    DecodingKey::from_rsa_pem(&bytes)
        .or_else(|_| DecodingKey::from_ec_pem(&bytes))
        .map(|k| vec![(None, k)])
        .map_err(|_| {
            bad(
                key,
                format!(
                    "{} is neither a JWK set nor a PEM public key (RSA or EC)",
                    path.display()
                ),
            )
        })
}

/// `[[clients]]`, presented in `client_key_header`.
pub(super) fn clients(
    written: &[ClientFile],
    header: Option<&str>,
    base: &Path,
) -> Result<Clients, ConfigError> {
    let mut clients: Vec<ClientSettings> = Vec::with_capacity(written.len());
    for (i, c) in written.iter().enumerate() {
        let key = format!("clients[{i}]");
        if c.name.is_empty() || clients.iter().any(|o| o.name == c.name) {
            return Err(bad(
                format!("{key}.name"),
                "give every client a unique, non-empty name",
            ));
        }
        let hex_digest = c.key_sha256.read(&format!("{key}.key_sha256"), base)?;
        let key_sha256 = hex::decode(&hex_digest)
            .ok()
            .and_then(|d| <[u8; 32]>::try_from(d).ok())
            .ok_or_else(|| {
                bad(
                    format!("{key}.key_sha256"),
                    "not a SHA-256 in hex; make one with `printf %s \"$CLIENT_KEY\" | sha256sum`",
                )
            })?;
        clients.push(ClientSettings {
            name: c.name.clone(),
            key_sha256,
        });
    }
    Ok(Clients {
        header: header_name("client_key_header", header.unwrap_or("authorization"))?,
        clients,
    })
}
