//! Agents' tool calls: MCP's `tools/call` over Streamable HTTP, run once per key.

mod mcp;
mod mcp_input;
mod mcp_resend;
