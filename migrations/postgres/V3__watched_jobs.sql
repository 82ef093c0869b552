-- Wake-ups only for jobs someone waits on. A NOTIFY takes a lock on the
-- notification queue at commit, which serialises every committing
-- transaction; most jobs never have a held duplicate. A duplicate that is
-- about to wait marks its job `watched` first (then reads it again), so a
-- change of a watched job's state is announced, and nothing else is: either
-- the mark lands before the change (whose row then carries it, so the
-- trigger fires), or after it (and the waiter's read sees the change).
ALTER TABLE jobs ADD COLUMN watched boolean NOT NULL DEFAULT false;

DROP TRIGGER jobs_state_changed ON jobs;

CREATE TRIGGER jobs_state_changed
    AFTER UPDATE OF state ON jobs
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state AND NEW.watched)
    EXECUTE FUNCTION idemgate_notify_job();
