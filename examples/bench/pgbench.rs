//! The new-key rows' ceiling, from pgbench.

use tokio::process::Command;

use crate::args::Args;

/// The ceiling for new keys: pgbench running the statements a new key
/// minimally needs (insert the job, insert attempt 1, the CAS commit: three
/// autocommit transactions), prepared, on a copy of the schema without the
/// notification trigger.
pub async fn pgbench_ceiling(args: &Args, db: &str) -> f64 {
    let (client, conn) = tokio_postgres::connect(db, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(
            "DROP TABLE IF EXISTS ceiling_attempts, ceiling_jobs; \
             CREATE TABLE ceiling_jobs (LIKE jobs INCLUDING ALL); \
             CREATE TABLE ceiling_attempts (LIKE attempts INCLUDING ALL);",
        )
        .await
        .unwrap();
    let script = std::env::temp_dir().join(format!("idemgate-ceiling-{}.sql", std::process::id()));
    std::fs::write(
        &script,
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
    .unwrap();
    let out = Command::new("pgbench")
        .args(["-n", "-M", "prepared", "-j", "2"])
        .arg(format!("-c{}", args.connections))
        .arg(format!("-T{}", args.seconds))
        .arg("-f")
        .arg(&script)
        .arg(db)
        .output()
        .await
        .expect("pgbench is not installed");
    let _ = std::fs::remove_file(&script);
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
}
