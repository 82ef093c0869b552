-- The embedded store's schema: the same shape and guarantees as PostgreSQL's
-- (migrations/postgres), in SQLite types. Times are milliseconds since the
-- Unix epoch; ids are UUID text; headers are length-prefixed name/value pairs.
CREATE TABLE jobs (
    id               TEXT    PRIMARY KEY,
    owner            TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL,
    route            TEXT    NOT NULL,
    state            TEXT    NOT NULL
        CHECK (state IN ('running', 'unknown', 'open', 'completed')),
    version          INTEGER NOT NULL,
    attempt_count    INTEGER NOT NULL,
    completed_by     TEXT,
    response_status  INTEGER,
    response_headers BLOB,
    response_body    BLOB,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    expires_at       INTEGER NOT NULL,
    -- The only arbiter of "seen before".
    CONSTRAINT jobs_owner_key UNIQUE (owner, key),
    CONSTRAINT jobs_completed_has_result CHECK (
        (state = 'completed') = (completed_by IS NOT NULL AND response_status IS NOT NULL)
    )
);

CREATE INDEX jobs_expires_at ON jobs (expires_at);

CREATE TABLE attempts (
    id               TEXT    PRIMARY KEY,
    job_id           TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    number           INTEGER NOT NULL,
    upstream         TEXT    NOT NULL,
    state            TEXT    NOT NULL
        CHECK (state IN ('started', 'succeeded', 'failed', 'unknown',
                         'cancelled', 'superseded', 'rejected')),
    job_version      INTEGER NOT NULL,
    instance         TEXT    NOT NULL,
    started_at       INTEGER NOT NULL,
    finished_at      INTEGER,
    lease_expires_at INTEGER NOT NULL,
    deadline_at      INTEGER NOT NULL,
    upstream_status  INTEGER,
    detail           TEXT,
    CONSTRAINT attempts_job_number UNIQUE (job_id, number)
);

CREATE INDEX attempts_job ON attempts (job_id);
CREATE INDEX attempts_started_lease ON attempts (lease_expires_at) WHERE state = 'started';
