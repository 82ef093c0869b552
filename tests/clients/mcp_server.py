"""An MCP server with the official `mcp` package (2.x), over Streamable
HTTP: a tool, `charge`, that counts its runs in a file. Run by
tests/gateway/agents/mcp.rs: mcp_server.py PORT RUNS_FILE [polling].

With `polling`, the server keeps its events in memory (resumability, as
the 2025-11-25 transport has it) and has a second tool, `long_charge`,
that closes its call's event stream before it runs (`close_sse_stream`):
its response goes to whoever reconnects with `Last-Event-ID`."""

import sys
import uuid

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.streamable_http import EventMessage, EventStore

port, runs_file = int(sys.argv[1]), sys.argv[2]
polling = sys.argv[3:] == ["polling"]
server = MCPServer("payments")


def run(amount: int, to: str) -> str:
    with open(runs_file, "a", encoding="utf-8") as runs:
        runs.write(f"{amount} {to}\n")
    with open(runs_file, encoding="utf-8") as runs:
        count = len(runs.readlines())
    return f"charged {amount} to {to} (run {count})"


@server.tool()
def charge(amount: int, to: str) -> str:
    """Charges `amount` to account `to`: a side effect that must happen once."""
    return run(amount, to)


class Events(EventStore):
    """Every event, in memory, for a client that reconnects."""

    def __init__(self):
        self.events = []

    async def store_event(self, stream_id, message):
        event_id = uuid.uuid4().hex
        self.events.append((event_id, stream_id, message))
        return event_id

    async def replay_events_after(self, last_event_id, send_callback):
        at = next((i for i, e in enumerate(self.events) if e[0] == last_event_id), None)
        if at is None:
            return None
        stream_id = self.events[at][1]
        for event_id, stream, message in self.events[at + 1 :]:
            if stream == stream_id and message is not None:
                await send_callback(EventMessage(message, event_id))
        return stream_id


if polling:

    @server.tool()
    async def long_charge(amount: int, to: str, ctx: Context) -> str:
        """As `charge`, answered after its stream was closed."""
        await ctx.close_sse_stream()
        await anyio.sleep(0.3)
        return run(amount, to)

    server.run(
        transport="streamable-http",
        host="127.0.0.1",
        port=port,
        event_store=Events(),
        retry_interval=100,
    )
else:
    server.run(transport="streamable-http", host="127.0.0.1", port=port)
