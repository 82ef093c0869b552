//! The ceilings the database rows are measured against, from pgbench: the
//! statements a new key needs, one by one (with durable commits, and with
//! `synchronous_commit = off` beside them), and the read a replay needs.

use tokio::process::Command;

use crate::args::Args;

/// One round's ceilings, in transactions per second.
#[derive(Clone, Copy, Default)]
pub struct Ceilings {
    /// A new key's statements, durable commits: what new keys are held to.
    pub new_key: f64,
    /// The same with `synchronous_commit = off`: when commits are cheap.
    pub new_key_cheap_commits: f64,
    /// A replay's read: one finished job's row, its answer with it.
    pub replay_read: f64,
}

/// Each ceiling's median over `rounds`.
pub fn median(rounds: &[Ceilings]) -> Ceilings {
    let of = |f: fn(&Ceilings) -> f64| {
        let mut v: Vec<f64> = rounds.iter().map(f).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    Ceilings {
        new_key: of(|c| c.new_key),
        new_key_cheap_commits: of(|c| c.new_key_cheap_commits),
        replay_read: of(|c| c.replay_read),
    }
}

/// One round of the three ceilings, on `db` (its replay keys primed).
pub async fn ceilings(args: &Args, db: &str) -> Ceilings {
    let new_key = new_key_script(db).await;
    let read = replay_read_script(db).await;
    let ceilings = Ceilings {
        new_key: pgbench(args, db, &new_key, None).await,
        new_key_cheap_commits: pgbench(args, db, &new_key, Some("-c synchronous_commit=off")).await,
        replay_read: pgbench(args, db, &read, None).await,
    };
    let _ = std::fs::remove_file(&new_key);
    let _ = std::fs::remove_file(&read);
    ceilings
}

/// The statements a new key minimally needs (insert the job, insert
/// attempt 1, the CAS commit: three autocommit transactions), on a copy of
/// the schema without the notification trigger.
async fn new_key_script(db: &str) -> std::path::PathBuf {
    let client = connect(db).await;
    client
        .batch_execute(
            "DROP TABLE IF EXISTS ceiling_attempts, ceiling_jobs; \
             CREATE TABLE ceiling_jobs (LIKE jobs INCLUDING ALL); \
             CREATE TABLE ceiling_attempts (LIKE attempts INCLUDING ALL);",
        )
        .await
        .unwrap();
    script(
        "new-key",
        "\\set n random(1, 4000000000000)\n\
         INSERT INTO ceiling_jobs (id, owner, key, fingerprint, route, state, version, attempt_count, expires_at) \
           VALUES (md5(:client_id || '-' || :n)::uuid, 'anonymous', 'c' || :client_id || '-' || :n, '\\x00', 'default', 'running', 1, 1, now() + interval '1 day') \
           ON CONFLICT (owner, key) DO NOTHING;\n\
         INSERT INTO ceiling_attempts (id, job_id, number, upstream, state, job_version, instance, lease_expires_at, deadline_at) \
           VALUES (md5('a' || :client_id || '-' || :n)::uuid, md5(:client_id || '-' || :n)::uuid, 1, 'primary', 'started', 1, md5('i')::uuid, now() + interval '30 seconds', now() + interval '5 minutes');\n\
         UPDATE ceiling_jobs SET state = 'completed', completed_by = md5('a' || :client_id || '-' || :n)::uuid, \
           response_status = 200, response_body = '\\x7b7d', version = version + 1 \
           WHERE id = md5(:client_id || '-' || :n)::uuid AND version = 1 AND completed_by IS NULL;\n",
    )
}

/// A replay's read: one of the 200 primed jobs by its owner and key, with
/// its answer (head and body), as the replay rows ask for them.
async fn replay_read_script(db: &str) -> std::path::PathBuf {
    let client = connect(db).await;
    let owner: String = client
        .query_one("SELECT owner FROM jobs WHERE key = 'replay-0' LIMIT 1", &[])
        .await
        .expect("the replay keys are primed before the ceilings")
        .get(0);
    // The owner is the gateway's hex digest: safe to write as a literal.
    assert!(owner.chars().all(|c| c.is_ascii_alphanumeric() || c == ':'));
    script(
        "replay-read",
        &format!(
            "\\set k random(0, 199)\n\
             SELECT id, state, version, completed_by, response_status, response_header_names, \
               response_header_values, response_body, expires_at \
             FROM jobs WHERE owner = '{owner}' AND key = 'replay-' || :k;\n"
        ),
    )
}

async fn connect(db: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(db, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
}

fn script(name: &str, text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("idemgate-{name}-{}.sql", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path
}

/// pgbench running `script` prepared at the run's concurrency, with
/// `options` for its sessions; its transactions per second.
async fn pgbench(args: &Args, db: &str, script: &std::path::Path, options: Option<&str>) -> f64 {
    let mut command = Command::new("pgbench");
    if let Some(options) = options {
        command.env("PGOPTIONS", options);
    }
    let out = command
        .args(["-n", "-M", "prepared", "-j", "2"])
        .arg(format!("-c{}", args.connections))
        .arg(format!("-T{}", args.seconds))
        .arg("-f")
        .arg(script)
        .arg(db)
        .output()
        .await
        .expect("pgbench is not installed");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
}
