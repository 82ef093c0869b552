-- Who resolved an attempt by hand, and when (docs/design.md §14): an
-- operator's answer is the operator's, never the upstream's.
ALTER TABLE attempts
    ADD COLUMN IF NOT EXISTS resolved_by TEXT,
    ADD COLUMN IF NOT EXISTS resolved_at TIMESTAMPTZ;

-- Attempts resolved before who was recorded: an operator not named, at the
-- time the attempt finished; the status they typed (the job's response) was
-- stored as the upstream's, which the upstream never answered.
UPDATE attempts
   SET resolved_by = 'an operator (not recorded)',
       resolved_at = finished_at,
       upstream_status = NULL
 WHERE detail = 'resolved by an operator' AND resolved_by IS NULL;
