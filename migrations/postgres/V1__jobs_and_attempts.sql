-- Jobs: one row per (owner, key). The unique constraint is the only arbiter
-- of "seen before"; the commit is a compare-and-swap on `version`.
CREATE TABLE jobs (
    id                     uuid        PRIMARY KEY,
    owner                  text        NOT NULL,
    key                    text        NOT NULL,
    fingerprint            bytea       NOT NULL,
    route                  text        NOT NULL,
    state                  text        NOT NULL
        CHECK (state IN ('running', 'unknown', 'open', 'completed')),
    version                bigint      NOT NULL,
    attempt_count          integer     NOT NULL,
    completed_by           uuid,
    response_status        smallint,
    response_header_names  text[],
    response_header_values bytea[],
    response_body          bytea,
    created_at             timestamptz NOT NULL DEFAULT now(),
    updated_at             timestamptz NOT NULL DEFAULT now(),
    expires_at             timestamptz NOT NULL,
    CONSTRAINT jobs_owner_key UNIQUE (owner, key),
    -- A job is completed exactly when it names its winner and holds a response.
    CONSTRAINT jobs_completed_has_result CHECK (
        (state = 'completed') = (completed_by IS NOT NULL AND response_status IS NOT NULL)
    )
);

CREATE INDEX jobs_expires_at ON jobs (expires_at);

-- Attempts: every try under a job, never deleted before the job is.
CREATE TABLE attempts (
    id               uuid        PRIMARY KEY,
    job_id           uuid        NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    number           integer     NOT NULL,
    upstream         text        NOT NULL,
    state            text        NOT NULL
        CHECK (state IN ('started', 'succeeded', 'failed', 'unknown',
                         'cancelled', 'superseded', 'rejected')),
    job_version      bigint      NOT NULL,
    instance         uuid        NOT NULL,
    started_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    lease_expires_at timestamptz NOT NULL,
    deadline_at      timestamptz NOT NULL,
    upstream_status  smallint,
    detail           text,
    CONSTRAINT attempts_job_number UNIQUE (job_id, number)
);

-- The sweeper looks only at started attempts whose lease lapsed.
CREATE INDEX attempts_started_lease ON attempts (lease_expires_at) WHERE state = 'started';

-- Every change of a job's state is announced, so held duplicates on every
-- replica wake up; the payload is the job id.
CREATE FUNCTION idemgate_notify_job() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idemgate_jobs', NEW.id::text);
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_state_changed
    AFTER UPDATE OF state ON jobs
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION idemgate_notify_job();
