-- The operator's inbox: jobs whose outcome is unknown, newest first. Few
-- jobs are ever unknown, so the partial index stays small.
CREATE INDEX IF NOT EXISTS jobs_unknown_newest ON jobs (created_at DESC, id DESC)
    WHERE state = 'unknown';
