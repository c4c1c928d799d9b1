"""Parsing and validating OpenAI request bodies for the reference backend.

Honoured: model, messages / prompt, max_tokens, max_completion_tokens (wins over max_tokens),
n (only 1: several choices are not supported and get a 400), temperature, top_p, seed, stop
(string or list), ignore_eos, priority, stream, stream_options (only with ``stream: true``, as
vLLM requires). Every other field is ignored. Any malformed field raises ``ApiError`` (400)
naming the field.

Benchmark-only extension: ``tokengate_stop_after: N`` (an integer >= 1) ends the answer after N
output tokens as if the model had emitted EOS there (``finish_reason: "stop"``, usage N), while
``max_tokens`` stays what the client sent. A load test can then send what real clients send
(``max_tokens: 4096``, or none) and still get a replayed trace's real output length. No real server
knows the field; it is not part of the OpenAI API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.reference.errors import bad_request


@dataclass(slots=True)
class GenerationParams:
    model: str
    max_tokens: int | None  # None: up to the context length
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stop_after: int | None  # benchmarks: tokengate_stop_after (see the module docstring)
    priority: int
    stream: bool
    include_usage: bool


@dataclass(slots=True)
class ChatRequest:
    params: GenerationParams
    messages: list[tuple[str, str]]  # (role, text content)


@dataclass(slots=True)
class CompletionRequest:
    params: GenerationParams
    prompt: str | list[int]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _opt_int(body: dict[str, Any], name: str, minimum: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {v!r}", name)
    if minimum is not None and v < minimum:
        raise bad_request(f"'{name}' must be at least {minimum}, got {v}", name)
    return int(v)


def _opt_number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise bad_request(f"'{name}' must be a number, got {v!r}", name)
    if not lo <= v <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return float(v)


def _opt_bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {v!r}", name)
    return v


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,) if v else ()
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(s for s in v if s)
    raise bad_request("'stop' must be a string or a list of strings", "stop")


def _params(body: dict[str, Any]) -> GenerationParams:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string", "model")
    max_tokens = _opt_int(body, "max_tokens", 1)
    max_completion = _opt_int(body, "max_completion_tokens", 1)
    n = _opt_int(body, "n", 1)
    if n is not None and n > 1:
        raise bad_request("n > 1 is not supported by the reference backend; send n separate requests", "n")
    stream = _opt_bool(body, "stream")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(opts, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        usage = opts.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
        include_usage = bool(usage)
    priority = _opt_int(body, "priority")
    return GenerationParams(
        model=model,
        max_tokens=max_completion if max_completion is not None else max_tokens,
        temperature=_opt_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_opt_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=_opt_int(body, "seed"),
        stop=_stop(body),
        ignore_eos=_opt_bool(body, "ignore_eos"),
        stop_after=_opt_int(body, "tokengate_stop_after", 1),
        priority=priority or 0,
        stream=stream,
        include_usage=include_usage,
    )


def _body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(f"'{where}[{j}]' must be an object with a 'type'", "messages")
            if part["type"] != "text":
                raise bad_request(
                    f"'{where}[{j}]': content type {part['type']!r} is not supported (text only)", "messages"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"'{where}[{j}].text' must be a string", "messages")
            texts.append(text)
        return "".join(texts)
    raise bad_request(f"'{where}' must be a string, a list of content parts or null", "messages")


def parse_chat(raw: Any) -> ChatRequest:
    body = _body(raw)
    params = _params(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required and must be a non-empty list", "messages")
    parsed: list[tuple[str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise bad_request(f"'messages[{i}]' must be an object", "messages")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(f"'messages[{i}].role' must be a non-empty string", "messages")
        parsed.append((role, _content_text(msg.get("content"), f"messages[{i}].content")))
    return ChatRequest(params=params, messages=parsed)


def parse_completion(raw: Any) -> CompletionRequest:
    body = _body(raw)
    params = _params(body)
    prompt = body.get("prompt")
    # A one-element batch is the same as its element; larger batches are several choices.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        return CompletionRequest(params=params, prompt=prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return CompletionRequest(params=params, prompt=[int(t) for t in prompt])
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise bad_request(
            "batched prompts are not supported by the reference backend; send one prompt", "prompt"
        )
    raise bad_request(
        "'prompt' is required: a non-empty string, a list of token ids, or a one-element list of either",
        "prompt",
    )
