"""Chat completion answers as the OpenAI API sends them, built from the types
the official `openai` package ships (every field it knows, nulls included),
printed as a JSON object {case: answer}. Run by tests/deploy/chat_example.rs to
check config/chat's contract against real answers, not answers we imagined."""

import json

from openai.types.chat import ChatCompletion

ANSWER = '{"answer": "Paris"}'


def completion(message, finish_reason="stop"):
    return ChatCompletion.model_validate(
        {
            "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
            "object": "chat.completion",
            "created": 1741570283,
            "model": "gpt-4o-2024-08-06",
            "service_tier": "default",
            "system_fingerprint": "fp_fc9f1d7035",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": finish_reason,
                    "logprobs": None,
                    "message": {"role": "assistant", "refusal": None, "annotations": [], **message},
                }
            ],
            "usage": {
                "prompt_tokens": 1117,
                "completion_tokens": 46,
                "total_tokens": 1163,
                "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                "completion_tokens_details": {
                    "reasoning_tokens": 0,
                    "audio_tokens": 0,
                    "accepted_prediction_tokens": 0,
                    "rejected_prediction_tokens": 0,
                },
            },
        }
    ).model_dump(mode="json")


cases = {
    "json-mode": completion({"content": ANSWER}),
    "tool-calls": completion(
        {
            "content": None,
            "tool_calls": [
                {
                    "id": "call_62136354",
                    "type": "function",
                    "function": {"name": "get_capital", "arguments": '{"country": "France"}'},
                }
            ],
        },
        "tool_calls",
    ),
    "refusal": completion({"content": None, "refusal": "I can't help with that."}),
    "truncated": completion({"content": '{"answer": "Par'}, "length"),
    "not-json": completion({"content": "Paris"}),
}
print(json.dumps(cases))
