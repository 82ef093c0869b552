-- Announcements name the gateway instance that made the change
-- (`<job id> <instance>`), read from the `idemgate.instance` setting each
-- gateway puts on its connections. A replica ignores its own announcements:
-- it has already woken its own waiters. A change made by any other client
-- (an operator's psql session) carries no instance and wakes everyone.
CREATE OR REPLACE FUNCTION idemgate_notify_job() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(
        'idemgate_jobs',
        NEW.id::text || ' ' || coalesce(current_setting('idemgate.instance', true), '')
    );
    RETURN NULL;
END
$$;
