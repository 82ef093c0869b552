use std::path::Path;

use idemgate_store::postgres::{Check, SslMode};

use super::parse;

/// A CA certificate and a client certificate with its key, written to `dir`
/// as ca.pem, client.pem, client.key, and other.key (a key of no certificate).
fn files(dir: &Path) {
    let ca = rcgen::generate_simple_self_signed(vec!["ca".to_owned()]).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.cert.pem()).unwrap();
    let client = rcgen::generate_simple_self_signed(vec!["idemgate".to_owned()]).unwrap();
    std::fs::write(dir.join("client.pem"), client.cert.pem()).unwrap();
    std::fs::write(dir.join("client.key"), client.key_pair.serialize_pem()).unwrap();
    let other = rcgen::KeyPair::generate().unwrap();
    std::fs::write(dir.join("other.key"), other.serialize_pem()).unwrap();
}

fn error(url: &str, base: &Path) -> String {
    let e = parse("database_url", url, base).unwrap_err();
    assert_eq!(e.key, "database_url");
    e.message
}

#[test]
fn the_tls_keys_are_taken_out_and_the_rest_kept_as_written() {
    let dir = tempfile::tempdir().unwrap();
    files(dir.path());
    let url = "postgres://u:p%40ss@db:5432/app?application_name=a%20b&sslmode=verify-full\
               &sslrootcert=ca.pem&target_session_attrs=read-write&sslnegotiation=postgres";
    let parsed = parse("database_url", url, dir.path()).unwrap();
    assert_eq!(
        parsed.url,
        "postgres://u:p%40ss@db:5432/app?application_name=a%20b\
         &target_session_attrs=read-write&sslnegotiation=postgres"
    );
    assert_eq!(parsed.tls.mode, SslMode::VerifyFull);
    assert_eq!(parsed.tls.check(), Check::ChainAndHost);
    assert_eq!(parsed.tls.roots.len(), 1);
    assert!(parsed.url.parse::<tokio_postgres::Config>().is_ok());

    // Only TLS keys: the `?` goes too.
    let only = parse(
        "database_url",
        "postgres://db/app?sslmode=require",
        dir.path(),
    )
    .unwrap();
    assert_eq!(only.url, "postgres://db/app");
    assert_eq!(only.tls.mode, SslMode::Require);
}

#[test]
fn key_value_strings_with_quoted_paths() {
    let dir = tempfile::tempdir().unwrap();
    let spaced = dir.path().join("with space");
    std::fs::create_dir(&spaced).unwrap();
    files(&spaced);
    let text = format!(
        "host=db  user=app sslmode = verify-ca sslrootcert='{}/ca.pem' \
         sslcert='{0}/client.pem' sslkey='{0}/client.key' password='it\\'s'",
        spaced.display()
    );
    let parsed = parse("database_direct_url", &text, Path::new("")).unwrap();
    assert_eq!(parsed.url, "host=db user=app password='it\\'s'");
    assert_eq!(parsed.key, "database_direct_url");
    assert_eq!(parsed.tls.check(), Check::Chain);
    assert!(parsed.tls.identity.is_some());
    let config: tokio_postgres::Config = parsed.url.parse().unwrap();
    assert_eq!(config.get_password(), Some(&b"it's"[..]));
}

#[test]
fn libpq_defaults_and_rules() {
    let dir = tempfile::tempdir().unwrap();
    files(dir.path());
    let base = dir.path();
    let plain = parse("database_url", "postgres://db/app", base).unwrap();
    assert_eq!(plain.tls.mode, SslMode::Prefer, "libpq's default");
    assert_eq!(plain.tls.check(), Check::Nothing);
    // A root file given to require (or prefer) checks the chain, as libpq does.
    let rooted = parse(
        "database_url",
        "postgres://db/a?sslmode=require&sslrootcert=ca.pem",
        base,
    );
    assert_eq!(rooted.unwrap().tls.check(), Check::Chain);
    let rooted = parse("database_url", "postgres://db/a?sslrootcert=ca.pem", base);
    assert_eq!(rooted.unwrap().tls.check(), Check::Chain);
    // Disable reads no file at all.
    let off = parse(
        "database_url",
        "postgres://db/a?sslmode=disable&sslrootcert=nope.pem",
        base,
    );
    assert_eq!(off.unwrap().tls.check(), Check::Nothing);
    // libpq 16: sslrootcert=system means verify-full, and nothing weaker.
    let system = parse("database_url", "postgres://db/a?sslrootcert=system", base);
    assert_eq!(system.unwrap().tls.mode, SslMode::VerifyFull);
    let weak = error("postgres://db/a?sslrootcert=system&sslmode=require", base);
    assert!(weak.contains("verify-full"), "{weak}");
}

#[test]
fn bad_settings_name_the_key_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    files(dir.path());
    let base = dir.path();
    let mode = error("postgres://db/a?sslmode=verify", base);
    assert!(mode.contains("sslmode=verify is not one of"), "{mode}");
    let missing = error(
        "postgres://db/a?sslmode=verify-full&sslrootcert=none.pem",
        base,
    );
    assert!(missing.starts_with("sslrootcert: cannot read"), "{missing}");
    assert!(missing.contains("none.pem"), "{missing}");
    let lone = error("postgres://db/a?sslcert=client.pem", base);
    assert!(lone.contains("sslcert and sslkey go together"), "{lone}");
    let other = error("postgres://db/a?sslcert=client.pem&sslkey=other.key", base);
    assert!(
        other.contains("is not the key of the certificate"),
        "{other}"
    );
    let crl = error("postgres://db/a?sslcrl=revoked.pem", base);
    assert!(crl.starts_with("sslcrl is not supported"), "{crl}");
    let open = error("host=db sslrootcert='ca.pem", base);
    assert!(open.contains("not closed"), "{open}");
    let escape = error("postgres://db/a?sslrootcert=%zz", base);
    assert!(escape.contains("%-escape"), "{escape}");
}

#[test]
fn the_start_up_line_says_what_is_proved() {
    let dir = tempfile::tempdir().unwrap();
    files(dir.path());
    let describe = |url: &str| {
        parse("database_url", url, dir.path())
            .unwrap()
            .tls
            .describe()
    };
    assert!(describe("postgres://db/a?sslmode=require").contains("NOT verified"));
    assert!(describe("postgres://db/a").contains("if the server offers TLS"));
    let full = describe("postgres://db/a?sslmode=verify-full&sslrootcert=ca.pem");
    assert!(
        full.contains("host name matched") && full.contains("ca.pem"),
        "{full}"
    );
    let ca = describe("postgres://db/a?sslmode=verify-ca&sslrootcert=ca.pem");
    assert!(ca.contains("not the host name"), "{ca}");
    assert!(describe("postgres://db/a?sslmode=disable").contains("plaintext"));
}
