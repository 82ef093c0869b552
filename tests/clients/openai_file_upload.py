"""An app that uploads a file through idemgate with the official `openai`
package and its own retries (the SDK's default, two), one
Idempotency-Key for the upload: prints, as JSON, the file's id. The SDK
encodes the multipart body again for every try, under a new random
boundary. Run twice by tests/gateway/core/real_clients.rs."""

import io
import json
import sys

from openai import OpenAI

base_url, key = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key="alice", max_retries=2, timeout=30)
uploaded = client.files.create(
    file=("train.jsonl", io.BytesIO(b'{"prompt": "hi"}\n')),
    purpose="fine-tune",
    extra_headers={"Idempotency-Key": key},
)
print(json.dumps({"id": uploaded.id}))
