"""An app that streams a message through idemgate with the official
`anthropic` package, and retries with the same Idempotency-Key when the
stream fails: prints, as JSON, the error the first try raised and the text
each later try got. Run by tests/gateway/streams/inband.rs."""

import json
import sys

import anthropic

base_url, key = sys.argv[1], sys.argv[2]
client = anthropic.Anthropic(
    base_url=base_url, api_key="not-a-real-key", max_retries=0, timeout=30
)


def ask():
    text = []
    with client.messages.stream(
        model="claude-fake",
        max_tokens=64,
        messages=[{"role": "user", "content": "Say hello."}],
        extra_headers={"Idempotency-Key": key},
    ) as stream:
        for piece in stream.text_stream:
            text.append(piece)
    return "".join(text)


results = {"errors": [], "texts": []}
for _ in range(3):
    try:
        results["texts"].append(ask())
    except anthropic.APIError as e:
        results["errors"].append(f"{type(e).__name__}: {e}")
print(json.dumps(results))
