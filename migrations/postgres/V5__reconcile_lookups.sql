-- Lookups made to reconcile an attempt of unknown outcome by asking its
-- upstream (docs/design.md §5): how many, and the last one (when, the
-- upstream's status if it answered, and what it meant).
ALTER TABLE attempts
    ADD COLUMN IF NOT EXISTS lookups            INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS last_lookup_at     TIMESTAMPTZ,
    ADD COLUMN IF NOT EXISTS last_lookup_status SMALLINT,
    ADD COLUMN IF NOT EXISTS last_lookup_result TEXT
        CHECK (last_lookup_result IN ('settled_succeeded', 'settled_no_effect',
                                      'still_unknown', 'error'));
