"""An MCP server with the official `mcp` package (2.x), over Streamable
HTTP: one tool, `charge`, that counts its runs in a file. Run by
tests/gateway/agents/mcp.rs: mcp_server.py PORT RUNS_FILE."""

import sys

from mcp.server.mcpserver import MCPServer

port, runs_file = int(sys.argv[1]), sys.argv[2]
server = MCPServer("payments")


@server.tool()
def charge(amount: int, to: str) -> str:
    """Charges `amount` to account `to`: a side effect that must happen once."""
    with open(runs_file, "a", encoding="utf-8") as runs:
        runs.write(f"{amount} {to}\n")
    with open(runs_file, encoding="utf-8") as runs:
        run = len(runs.readlines())
    return f"charged {amount} to {to} (run {run})"


server.run(transport="streamable-http", host="127.0.0.1", port=port)
