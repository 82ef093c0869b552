-- MCP tool calls at their server (docs/design.md §19, "An agent's cancel"):
-- each replica marks the keyed calls its attempts have at their server, by
-- session and JSON-RPC id, so that an agent's cancel of one, or the end of
-- its session, reaching another replica is held back there too. A hint, not
-- a record: unlogged (a crash of the database empties it, and cancels then
-- pass as they did before), each mark good until its attempt's deadline at
-- the latest, taken off when the attempt ends, swept once past it.
CREATE UNLOGGED TABLE IF NOT EXISTS mcp_calls_at_server (
    attempt_id UUID PRIMARY KEY,
    session BYTEA NOT NULL,
    rpc_id TEXT NOT NULL,
    good_until TIMESTAMPTZ NOT NULL
);
CREATE INDEX IF NOT EXISTS mcp_calls_at_server_session
    ON mcp_calls_at_server (session, rpc_id);
