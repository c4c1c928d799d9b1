"""Relaying an SSE completion stream while learning its usage.

Chat and completions: the gateway always asks the backend for ``stream_options.include_usage``
so it learns the real token counts. With include_usage the last event before ``data: [DONE]`` is a chunk with
``"choices": []`` and a ``usage`` object. If the client asked for usage itself the stream is
relayed byte for byte and only read; if not, that one event is cut out again, and so is the
``"usage": null`` field that include_usage adds to every other chunk (OpenAI and vLLM omit the
field entirely without it), so the client sees the stream it would have seen. Events are
separated by a blank line (``\\n\\n``, or ``\\r\\n\\r\\n``).

The Responses API (``/v1/responses``) has no ``stream_options``: its named events carry usage
inside the response object of the final event (``response.completed``, or ``response.incomplete``
/ ``response.failed``): ``data: {"type": "response.completed", "response": {..., "usage":
{"input_tokens": N, "output_tokens": M, ...}}}``. Relay it with ``drop_usage=False``: byte-exact,
nothing is ever cut out. Non-streaming Responses bodies carry ``usage`` at top level.

Only events that contain a usage *object* (``"usage":{``) are parsed, so the relay stays cheap
for the content chunks. `usage_counts` reads either API's usage object in one normalized form.
"""

from __future__ import annotations

from typing import Any

import orjson

# A usage object, not ``"usage": null`` (vLLM puts that on every chunk once include_usage is
# on): only events matching this are parsed.
_USAGE = b'"usage":{'
_USAGE_SPACED = b'"usage": {'


def _has_done(data: bytes) -> bool:
    """Whether complete events hold the stream's ``data: [DONE]`` line. At a line's start only: a
    model may write "[DONE]" in its text, but a JSON string holds no raw newline."""
    if b"[DONE]" not in data:
        return False
    return any(data.startswith(p) or b"\n" + p in data for p in (b"data: [DONE]", b"data:[DONE]"))


# The most of one unfinished event that drop mode holds back (see UsageRelay._let_go).
MAX_HELD_BYTES = 1 << 20

# The null field include_usage adds, as compact and as spaced JSON serializers write it.
_NULL_USAGE = (b',"usage":null', b', "usage": null', b'"usage":null,', b'"usage": null, ')


def _count(value: object) -> int | None:
    # bool is an int subclass, and a negative count is a backend bug: trust neither.
    return value if type(value) is int and value >= 0 else None


def usage_counts(usage: object) -> tuple[int | None, int | None]:
    """(prompt tokens, completion tokens) of a usage object from any API, None where unknown.

    Reads chat/completions' ``prompt_tokens`` / ``completion_tokens`` and the Responses API's
    ``input_tokens`` / ``output_tokens``; a value counts only if it is a non-negative int.
    """
    if not isinstance(usage, dict):
        return None, None
    prompt = _count(usage.get("prompt_tokens"))
    if prompt is None:
        prompt = _count(usage.get("input_tokens"))
    completion = _count(usage.get("completion_tokens"))
    if completion is None:
        completion = _count(usage.get("output_tokens"))
    return prompt, completion


def cached_count(usage: object) -> int | None:
    """Prompt tokens served from the prefix cache (``prompt_tokens_details.cached_tokens``, the
    Responses API's ``input_tokens_details.cached_tokens``), None where not reported."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return _count(details.get("cached_tokens")) if isinstance(details, dict) else None


def _strip_null_usage(data: bytes) -> bytes:
    if b"null" not in data:
        return data
    for pattern in _NULL_USAGE:
        if pattern in data:
            data = data.replace(pattern, b"")
    return data


def _has_usage(data: bytes) -> bool:
    return _USAGE in data or _USAGE_SPACED in data


def _last_boundary(data: bytes | bytearray, start: int = 0) -> int:
    """Index just past the last complete event in ``data`` (searching from ``start``), or -1."""
    i = data.rfind(b"\n\n", start)
    j = data.rfind(b"\r\n\r\n", start)
    if i < 0 and j < 0:
        return -1
    return max(i + 2 if i >= 0 else -1, j + 4 if j >= 0 else -1)


def _events(block: bytes) -> list[bytes]:
    """Split complete events keeping each one's own separator (so re-joining is exact)."""
    out = []
    start = 0
    n = len(block)
    while start < n:
        i = block.find(b"\n\n", start)
        j = block.find(b"\r\n\r\n", start)
        if i < 0 and j < 0:
            out.append(block[start:])
            break
        if j >= 0 and (i < 0 or j < i):
            end = j + 4
        else:
            end = i + 2
        out.append(block[start:end])
        start = end
    return out


def _usage_of(event: bytes) -> tuple[dict[str, Any] | None, bool, dict[str, Any] | None]:
    """(usage, is_usage_only_chunk, the event's object) of one event; (None, False, None) if it
    carries none."""
    for line in event.splitlines():
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if not payload.startswith(b"{"):
                return None, False, None
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return None, False, None
            if not isinstance(obj, dict):
                return None, False, None
            usage = obj.get("usage")
            if isinstance(usage, dict):
                return usage, obj.get("choices") == [], obj
            # The Responses API: usage sits in the response object of the final event.
            response = obj.get("response")
            usage = response.get("usage") if isinstance(response, dict) else None
            return (usage, False, response) if isinstance(usage, dict) else (None, False, None)
    return None, False, None


class UsageRelay:
    """Feed upstream chunks in, get the bytes to send to the client out.

    ``drop_usage`` False: output == input, chunk for chunk (byte-exact relay).
    ``drop_usage`` True: output is the input without the usage-only event; bytes of an
    incomplete trailing event are held until the event completes.
    """

    __slots__ = ("_buf", "_drop", "finished", "usage", "usage_event")

    def __init__(self, drop_usage: bool) -> None:
        self._drop = drop_usage
        # The incomplete trailing event. Appended to in place and searched only where new bytes
        # arrived, so a large event (a Responses ``response.completed`` repeats the whole output)
        # arriving in many small chunks costs linear, not quadratic, time.
        self._buf = bytearray()
        self.usage: dict[str, Any] | None = None
        self.usage_event: dict[str, Any] | None = None  # the object that carried it (its id, model)
        # The stream's end has come: its ``data: [DONE]`` or a usage object (the final event of
        # either API) is among the complete events fed so far.
        self.finished = False

    def feed(self, chunk: bytes) -> bytes:
        buf = self._buf
        if not buf:  # the common case: nothing held, so no copy unless the chunk ends mid-event
            end = _last_boundary(chunk)
            if end < 0:
                buf += chunk
                return self._let_go() if self._drop else chunk
            complete = chunk
            if end < len(chunk):
                complete = chunk[:end]
                buf += chunk[end:]
        else:
            # A separator may straddle the old tail and the new chunk (at most 3 bytes back).
            start = max(len(buf) - 3, 0)
            buf += chunk
            end = _last_boundary(buf, start)
            if end < 0:
                return self._let_go() if self._drop else chunk
            complete = bytes(buf[:end])
            del buf[:end]
        if not self.finished and _has_done(complete):
            self.finished = True
        if _has_usage(complete):
            kept = []
            for event in _events(complete):
                if _has_usage(event):
                    usage, usage_only, source = _usage_of(event)
                    if usage is not None:
                        self.usage, self.usage_event = usage, source
                        self.finished = True
                        if usage_only and self._drop:
                            continue
                kept.append(event)
            complete = b"".join(kept)
        return _strip_null_usage(complete) if self._drop else chunk

    def _let_go(self) -> bytes:
        """Drop mode, no event complete yet: hold the bytes, unless an event has grown past
        ``MAX_HELD_BYTES`` (no engine writes one; a broken backend might, without end): then pass
        what is held on untouched, so the gateway never holds more than that of a stream."""
        buf = self._buf
        if len(buf) <= MAX_HELD_BYTES:
            return b""
        out = bytes(buf)
        buf.clear()
        return out

    def flush(self) -> bytes:
        """What is left at the end of the stream (an unterminated last event)."""
        rest = bytes(self._buf)
        self._buf.clear()
        if _has_done(rest):
            self.finished = True
        if rest and _has_usage(rest):
            usage, usage_only, source = _usage_of(rest)
            if usage is not None:
                self.usage, self.usage_event = usage, source
                self.finished = True
                if usage_only and self._drop:
                    return b""
        return _strip_null_usage(rest) if self._drop else b""
