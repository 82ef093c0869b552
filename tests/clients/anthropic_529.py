"""An app that asks for a message through idemgate with the official
`anthropic` package and its own retries (the SDK's default, two), one
Idempotency-Key for the call: prints, as JSON, the message's text. Run
twice by tests/gateway/core/real_clients.rs."""

import json
import sys

import anthropic

base_url, key = sys.argv[1], sys.argv[2]
client = anthropic.Anthropic(
    base_url=base_url, api_key="not-a-real-key", max_retries=2, timeout=30
)
message = client.messages.create(
    model="claude-fake",
    max_tokens=64,
    messages=[{"role": "user", "content": "Say hello."}],
    extra_headers={"Idempotency-Key": key},
)
print(json.dumps({"text": message.content[0].text}))
