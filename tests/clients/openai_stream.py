"""Two concurrent streamed chat completions with one Idempotency-Key, through
idemgate, with the official `openai` package: prints the token sequences each
call saw, as JSON. Run by tests/gateway/core/real_clients.rs."""

import json
import sys
import threading

from openai import OpenAI

base_url, key = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key="not-a-real-key", max_retries=0, timeout=30)
results = {}


def call(name):
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "Count to five."}],
        stream=True,
        extra_headers={"Idempotency-Key": key},
    )
    tokens = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                tokens.append(choice.delta.content)
    results[name] = tokens


threads = [threading.Thread(target=call, args=(name,)) for name in ("first", "second")]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(results))
