"""Response bodies for chat and text completions: pre-encoded SSE frame pieces and full JSON.

A frame is ``head + choice-payload + tail``; everything but the payload is encoded once per
request, so a token costs one ``orjson.dumps`` of its text and a few byte concatenations.
With ``stream_options.include_usage`` every chunk carries ``"usage":null`` and the last chunk
before ``data: [DONE]`` has ``"choices":[]`` and the usage (OpenAI's and vLLM's framing).
"""

from __future__ import annotations

from typing import Any, Literal

import orjson

Kind = Literal["chat", "completion"]
DONE = b"data: [DONE]\n\n"


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class SseFrames:
    def __init__(self, kind: Kind, response_id: str, created: int, model: str, include_usage: bool) -> None:
        self.kind = kind
        obj = b"chat.completion.chunk" if kind == "chat" else b"text_completion"
        self._envelope = (
            b'{"id":' + orjson.dumps(response_id) + b',"object":"' + obj + b'","created":'
            b"" + str(created).encode() + b',"model":' + orjson.dumps(model)
        )
        self._head = b"data: " + self._envelope + b',"choices":[{"index":0,'
        usage = b',"usage":null' if include_usage else b""
        self._tail_running = b',"logprobs":null,"finish_reason":null}]' + usage + b"}\n\n"
        self._usage_tail = usage + b"}\n\n"

    def role(self) -> bytes:
        """Chat streams open with the assistant role and empty content."""
        return self._head + b'"delta":{"role":"assistant","content":""}' + self._tail_running

    def text(self, text: str) -> bytes:
        return self._head + self._payload(text) + self._tail_running

    def finish(self, text: str, reason: str) -> bytes:
        tail = b',"logprobs":null,"finish_reason":' + orjson.dumps(reason) + b"}]" + self._usage_tail
        return self._head + self._payload(text) + tail

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return (
            b"data: "
            + self._envelope
            + b',"choices":[],"usage":'
            + orjson.dumps(usage_dict(prompt_tokens, completion_tokens))
            + b"}\n\n"
        )

    def _payload(self, text: str) -> bytes:
        if self.kind == "chat":
            return b'"delta":{"content":' + orjson.dumps(text) + b"}" if text else b'"delta":{}'
        return b'"text":' + orjson.dumps(text)


def error_frame(message: str) -> bytes:
    return (
        b"data: "
        + orjson.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
        + b"\n\n"
    )


def full_response(
    kind: Kind,
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
) -> bytes:
    choice: dict[str, Any]
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return orjson.dumps(
        {
            "id": response_id,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage_dict(prompt_tokens, completion_tokens),
        }
    )
