-- Attempts of unknown outcome still within their deadline are asked about
-- on their upstream by every replica's reconcile scan (docs/design.md §5):
-- few attempts are ever unknown, so the partial index stays small.
CREATE INDEX IF NOT EXISTS attempts_unknown_started ON attempts (started_at)
    WHERE state = 'unknown';
