-- Attempts of unknown outcome still within their deadline are asked about
-- on their upstream by the reconcile scan (docs/design.md §5).
CREATE INDEX IF NOT EXISTS attempts_unknown_started ON attempts (started_at)
    WHERE state = 'unknown';
