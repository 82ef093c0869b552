"""An app that streams a Responses API call with a remote MCP tool through
idemgate with the official `openai` package, one Idempotency-Key for the
call: prints, as JSON, the types of the events the SDK yielded. Run twice
by tests/gateway/core/real_clients.rs."""

import json
import sys

import openai

base_url, key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key="not-a-real-key", max_retries=0, timeout=30)
stream = client.responses.create(
    model="gpt-fake",
    input="Charge the order.",
    tools=[{"type": "mcp", "server_label": "shop", "server_url": "https://shop.example/mcp",
            "require_approval": "never"}],
    stream=True,
    extra_headers={"Idempotency-Key": key},
)
print(json.dumps({"types": [event.type for event in stream]}))
