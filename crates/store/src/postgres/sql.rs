//! The columns the statements read, in the order the row readers
//! (`rows.rs`) expect them, and the begin statement.

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
     a.resolved_by, a.resolved_at";
pub(super) const ATTEMPT_WIDTH: usize = 17;
/// A job's head, the database's clock, and each attempt's head: one row per attempt.
pub(super) const SNAPSHOT_COLUMNS: &str =
    "j.id, j.state, j.version, j.attempt_count, j.completed_by, now(), \
     a.id, a.number, a.state, a.job_version, a.lease_expires_at";

/// [`Backend::begin`](crate::Backend::begin)'s statement: one round trip for a new key and for a
/// duplicate alike. The job of `(owner, key)` ($2, $3) is read, and
/// inserted ($1, $4-$6, $12) with its first attempt ($7-$11, $13) only when
/// there is none. The insert's `ON CONFLICT DO NOTHING` stays the only
/// arbiter of creation; for a duplicate it inserts nothing, so its commit
/// writes nothing either. See [`answer`](super::rows::answer) for what its row says.
pub(super) fn begin_statement() -> String {
    format!(
        "WITH existing AS ( \
           SELECT j.*, j.expires_at <= now() AS expired FROM jobs j \
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
         SELECT {JOB_COLUMNS}, {ATTEMPT_COLUMNS}, false FROM j, a \
         UNION ALL \
         SELECT {JOB_COLUMNS}, NULL::uuid, NULL::uuid, NULL::integer, NULL::text, NULL::text, \
                NULL::bigint, NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, \
                NULL::smallint, NULL::text, NULL::integer, NULL::timestamptz, NULL::smallint, \
                NULL::text, NULL::text, NULL::timestamptz, j.expired \
         FROM existing j"
    )
}
