//! The columns the statements read, in the order the row readers
//! (`rows.rs`) expect them, the begin statements, and the sweep's and the
//! purge's, which skip what another transaction holds. Each statement's text
//! is built once, not per call: a begin's is about 2 KiB, formatted, then
//! hashed by `prepare_cached` to find its prepared statement.

use std::sync::LazyLock;

/// A body over [`INLINE_ANSWER`](idemgate_domain::job::INLINE_ANSWER)
/// (262144 bytes) is left unread, only its length read
/// (`docs/design.md` §18); `octet_length` reads a stored value's size
/// without fetching it.
pub(super) const JOB_COLUMNS: &str =
    "j.id, j.owner, j.key, j.fingerprint, j.route, j.state, j.version, \
     j.attempt_count, j.completed_by, j.response_status, j.response_header_names, \
     j.response_header_values, \
     CASE WHEN octet_length(j.response_body) <= 262144 THEN j.response_body END, \
     j.created_at, j.expires_at, octet_length(j.response_body)";
pub(super) const JOB_WIDTH: usize = 16;
pub(super) const ATTEMPT_COLUMNS: &str =
    "a.id, a.job_id, a.number, a.upstream, a.state, a.job_version, \
     a.started_at, a.finished_at, a.lease_expires_at, a.upstream_status, a.detail, \
     a.lookups, a.last_lookup_at, a.last_lookup_status, a.last_lookup_result, \
     a.resolved_by, a.resolved_at, a.deadline_at";
pub(super) const ATTEMPT_WIDTH: usize = 18;
/// A job's head, the database's clock, and each attempt's head: one row per attempt.
pub(super) const SNAPSHOT_COLUMNS: &str =
    "j.id, j.state, j.version, j.attempt_count, j.completed_by, now(), \
     a.id, a.number, a.state, a.job_version, a.lease_expires_at";

/// Whether the job `j` is past its expiry and forgotten: none of its
/// attempts may still answer, and it has not changed for
/// [`SETTLED_GRACE`](crate::SETTLED_GRACE). An attempt still `started`
/// is at its upstream (or its lease lapsed and the sweep will make it
/// `unknown`), and one `unknown` may still answer until its deadline:
/// forgetting such a job would lose that answer's commit, and let a new job
/// of the key run the call a second time beside it. The grace keeps a job
/// answered (or claimed) a moment ago for the duplicates held on it, and
/// closes a race the attempts' test alone leaves open: a claim that
/// commits while a purge or a begin waits on the job's lock is read by the
/// subquery in the delete's old snapshot, but its `updated_at` is the
/// row's own, which the delete checks again on the row it locked
/// (`docs/design.md` §11, "not forgotten"). `AND` stops at a job not yet
/// expired, so a live job pays no read of its attempts.
pub(super) const FORGOTTEN: &str = "(j.expires_at <= now() \
     AND j.updated_at <= now() - interval '5 seconds' \
     AND NOT EXISTS ( \
     SELECT 1 FROM attempts a WHERE a.job_id = j.id \
     AND (a.state = 'started' OR (a.state = 'unknown' AND a.deadline_at > now()))))";

/// What both begin statements return: the job made with its attempt, and
/// the job found ([`rows_found`]).
fn rows_made_or_found() -> String {
    format!(
        "SELECT {JOB_COLUMNS}, {ATTEMPT_COLUMNS}, false FROM j JOIN a ON a.job_id = j.id \
         UNION ALL {}",
        rows_found()
    )
}

/// The rows of the jobs found (the CTE `existing`): with whether each
/// expired, its attempt columns empty.
fn rows_found() -> String {
    format!(
        "SELECT {JOB_COLUMNS}, NULL::uuid, NULL::uuid, NULL::integer, NULL::text, NULL::text, \
                NULL::bigint, NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, \
                NULL::smallint, NULL::text, NULL::integer, NULL::timestamptz, NULL::smallint, \
                NULL::text, NULL::text, NULL::timestamptz, NULL::timestamptz, j.expired \
         FROM existing j"
    )
}

/// The read a batch of begins makes first while most begins find their job
/// (`batch/begin.rs`, "read first"): each request's job by owner ($1) and
/// key ($2), in the rows [`begin_statement`] returns for a job it found,
/// and nothing written, so the database sets up no insert for a replay. A
/// request with no row here goes on to the begin statement, which stays the
/// only arbiter of creation.
pub(super) fn read_found_statement() -> &'static str {
    static TEXT: LazyLock<String> = LazyLock::new(|| {
        format!(
            "WITH existing AS ( \
           SELECT j.*, {FORGOTTEN} AS expired FROM jobs j \
           JOIN unnest($1::text[], $2::text[]) AS i(owner, key) \
             ON j.owner = i.owner AND j.key = i.key \
         ) {}",
            rows_found()
        )
    });
    &TEXT
}

/// [`Backend::begin`](crate::Backend::begin)'s statement, for a batch of
/// new requests at once (`batch/begin.rs`): one round trip and one commit for all
/// of them, a new key and a duplicate alike. The parameters are arrays, one
/// element per request, sorted by `(owner, key)` so that two batches
/// inserting the same keys take their index locks in the same order and
/// never deadlock: job ids ($1), owners ($2), keys ($3), fingerprints
/// ($4), routes ($5), key lifetimes in ms ($6), attempt ids ($7),
/// upstreams ($8), instances ($9), leases ($10) and deadlines ($11) in ms;
/// $12 and $13 are the new job's and attempt's states.
///
/// Each request's job of `(owner, key)` is read, and inserted with its
/// first attempt only when there is none. The insert's `ON CONFLICT DO
/// NOTHING` stays the only arbiter of creation; for a duplicate it inserts
/// nothing. One row per job read or made, carrying its owner and key, by
/// which the batcher maps rows back to requests (never by position); a
/// request with no row lost an insert race to another writer and is asked
/// again alone. See [`answer`](super::rows::answer) for what a row says.
pub(super) fn begin_statement() -> &'static str {
    static TEXT: LazyLock<String> = LazyLock::new(|| {
        format!(
        "WITH input AS ( \
           SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::text[], \
                                $6::bigint[], $7::uuid[], $8::text[], $9::uuid[], $10::bigint[], \
                                $11::bigint[]) \
             AS i(job_id, owner, key, fingerprint, route, ttl, attempt_id, upstream, instance, \
                  lease, deadline) \
         ), existing AS ( \
           SELECT j.*, {FORGOTTEN} AS expired FROM jobs j \
           JOIN input i ON j.owner = i.owner AND j.key = i.key \
         ), j AS ( \
           INSERT INTO jobs (id, owner, key, fingerprint, route, state, version, attempt_count, expires_at) \
           SELECT i.job_id, i.owner, i.key, i.fingerprint, i.route, $12, 1, 1, \
                  now() + i.ttl * interval '1 millisecond' \
           FROM input i \
           WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.owner = i.owner AND e.key = i.key) \
           ORDER BY i.owner, i.key \
           ON CONFLICT (owner, key) DO NOTHING \
           RETURNING * \
         ), a AS ( \
           INSERT INTO attempts (id, job_id, number, upstream, state, job_version, instance, \
                                 lease_expires_at, deadline_at) \
           SELECT i.attempt_id, j.id, 1, i.upstream, $13, j.version, i.instance, \
                  now() + i.lease * interval '1 millisecond', \
                  now() + i.deadline * interval '1 millisecond' \
           FROM j JOIN input i ON i.job_id = j.id \
           RETURNING * \
         ) \
         {}",
        rows_made_or_found()
    )
    });
    &TEXT
}

/// The begin statement for one request: [`begin_statement`]'s, with
/// scalar parameters in the same order. A batch of one is sent with it
/// (`batch/begin.rs`): PostgreSQL runs it in a fraction of the time the
/// array form takes for one row, which at a low load is most batches.
pub(super) fn begin_one_statement() -> &'static str {
    static TEXT: LazyLock<String> = LazyLock::new(|| {
        format!(
        "WITH existing AS ( \
           SELECT j.*, {FORGOTTEN} AS expired FROM jobs j \
           WHERE j.owner = $2 AND j.key = $3 \
         ), j AS ( \
           INSERT INTO jobs (id, owner, key, fingerprint, route, state, version, attempt_count, expires_at) \
           SELECT $1, $2, $3, $4, $5, $12, 1, 1, now() + $6::bigint * interval '1 millisecond' \
           WHERE NOT EXISTS (SELECT 1 FROM existing) \
           ON CONFLICT (owner, key) DO NOTHING \
           RETURNING * \
         ), a AS ( \
           INSERT INTO attempts (id, job_id, number, upstream, state, job_version, instance, \
                                 lease_expires_at, deadline_at) \
           SELECT $7, j.id, 1, $8, $13, j.version, $9, \
                  now() + $10::bigint * interval '1 millisecond', \
                  now() + $11::bigint * interval '1 millisecond' \
           FROM j \
           RETURNING * \
         ) \
         {}",
        rows_made_or_found()
    )
    });
    &TEXT
}

/// The jobs `jobs` (a query of job ids from `jobs j`, with its own order
/// and limit; `also` adds locking clauses after the job's) names that this
/// transaction can lock, with every one of their attempts
/// (the CTE `unheld`): a job another transaction holds is skipped, not
/// waited for, and so is a job one of whose attempts is held (an
/// operator's `UPDATE attempts` left open, say). Waiting on either, a sweep
/// would time out and roll back, every tick, for as long as the holder held
/// it (`docs/design.md` §13, "A lock waited for").
fn unheld(jobs: &str, also: &str) -> String {
    format!(
        "WITH locked AS MATERIALIZED ({jobs} FOR UPDATE OF j SKIP LOCKED{also}), \
         free AS MATERIALIZED ( \
           SELECT id FROM attempts WHERE job_id IN (SELECT id FROM locked) \
           ORDER BY id FOR NO KEY UPDATE SKIP LOCKED \
         ), unheld AS ( \
           SELECT l.id FROM locked l WHERE NOT EXISTS ( \
             SELECT 1 FROM attempts a WHERE a.job_id = l.id \
             AND a.id NOT IN (SELECT id FROM free)) \
         ) "
    )
}

/// The sweep of lapsed leases' first statement: the jobs of up to $1
/// started attempts ($2) whose lease lapsed, oldest first, those held
/// skipped ([`unheld`]). The limit counts only rows this statement could
/// lock: a job another transaction holds, or a lapsed attempt it holds,
/// is skipped below the limit (`LIMIT … FOR UPDATE … SKIP LOCKED` locks
/// before it limits), so rows held longer than a tick never use up the
/// sweep's batch and starve the free ones behind them (`docs/design.md`
/// §13, "A lock waited for"). Nothing here waits on a lock, so the order
/// the rows are locked in cannot deadlock; the job is locked first (the
/// clauses' order), so that a row skipped for its held job leaves its
/// attempt unlocked for the job's holder, which may be about to settle it.
/// A job with two lapsed attempts (a hedge) is named once, though each
/// counts against the limit.
pub(super) fn lapsed_jobs_statement() -> &'static str {
    static TEXT: LazyLock<String> = LazyLock::new(|| {
        format!(
            "{}SELECT DISTINCT id FROM unheld",
            unheld(
                "SELECT j.id FROM attempts a JOIN jobs j ON j.id = a.job_id \
                 WHERE a.state = $2 AND a.lease_expires_at < now() \
                 ORDER BY a.lease_expires_at LIMIT $1",
                " FOR NO KEY UPDATE OF a SKIP LOCKED",
            )
        )
    });
    &TEXT
}

/// The purge: up to $1 jobs past their expiry, oldest first, deleted with
/// their attempts, those held skipped ([`unheld`]). A job another
/// transaction holds is skipped below the limit, as in
/// [`lapsed_jobs_statement`]; a job only one of whose attempts is held
/// still counts, and is left for a later purge.
pub(super) fn purge_statement() -> &'static str {
    static TEXT: LazyLock<String> = LazyLock::new(|| {
        format!(
            "{}DELETE FROM jobs WHERE id IN (SELECT id FROM unheld)",
            unheld(
                &format!(
                    "SELECT j.id FROM jobs j WHERE {FORGOTTEN} ORDER BY j.expires_at LIMIT $1"
                ),
                "",
            )
        )
    });
    &TEXT
}

#[cfg(test)]
mod tests {
    #[test]
    fn forgotten_keeps_a_job_for_the_settled_grace() {
        let grace = format!("interval '{} seconds'", crate::SETTLED_GRACE.as_secs());
        assert!(super::FORGOTTEN.contains(&grace));
    }
}
