-- Lookups made to reconcile an attempt of unknown outcome by asking its
-- upstream (docs/design.md §5): how many, and the last one (when, in
-- milliseconds since the epoch; the upstream's status if it answered; and
-- what it meant).
ALTER TABLE attempts ADD COLUMN lookups INTEGER NOT NULL DEFAULT 0;
ALTER TABLE attempts ADD COLUMN last_lookup_at INTEGER;
ALTER TABLE attempts ADD COLUMN last_lookup_status INTEGER;
ALTER TABLE attempts ADD COLUMN last_lookup_result TEXT
    CHECK (last_lookup_result IN ('settled_succeeded', 'settled_no_effect',
                                  'still_unknown', 'error'));
