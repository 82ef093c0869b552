-- MCP tool calls at their server (docs/design.md §19, "An agent's cancel"):
-- each replica marks the keyed calls its attempts have at their server, so
-- that an agent's cancel of one, or the end of its session, reaching another
-- replica is held back there too. Marks are found by digests (SHA-256) of
-- the route and the session, and of those and the call's JSON-RPC id: fixed
-- in size whatever a client sends, and no session id stored. A hint, not a
-- record: unlogged (a crash of the database, or a failover to a standby,
-- empties it, and cancels then pass as they did before), each mark good
-- until its attempt's deadline at the latest, taken off when the attempt
-- ends, and deleted by the sweep once past it.
CREATE UNLOGGED TABLE IF NOT EXISTS mcp_calls_at_server (
    attempt_id UUID PRIMARY KEY,
    instance UUID NOT NULL,
    session_key BYTEA NOT NULL,
    call_key BYTEA NOT NULL,
    good_until TIMESTAMPTZ NOT NULL
);
CREATE INDEX IF NOT EXISTS mcp_calls_at_server_keys
    ON mcp_calls_at_server (session_key, call_key);
CREATE INDEX IF NOT EXISTS mcp_calls_at_server_good_until
    ON mcp_calls_at_server (good_until);
