"""Relaying an SSE completion stream while learning its usage.

The gateway always asks the backend for ``stream_options.include_usage`` so it learns the real
token counts. With include_usage the last event before ``data: [DONE]`` is a chunk with
``"choices": []`` and a ``usage`` object. If the client asked for usage itself the stream is
relayed byte for byte and only read; if not, that one event is cut out again, and so is the
``"usage": null`` field that include_usage adds to every other chunk (OpenAI and vLLM omit the
field entirely without it), so the client sees the stream it would have seen. Events are
separated by a blank line (``\\n\\n``, or ``\\r\\n\\r\\n``).
"""

from __future__ import annotations

from typing import Any

import orjson

# A usage object, not ``"usage": null`` (vLLM puts that on every chunk once include_usage is
# on): only events matching this are parsed.
_USAGE = b'"usage":{'
_USAGE_SPACED = b'"usage": {'


# The null field include_usage adds, as compact and as spaced JSON serializers write it.
_NULL_USAGE = (b',"usage":null', b', "usage": null', b'"usage":null,', b'"usage": null, ')


def _strip_null_usage(data: bytes) -> bytes:
    if b"null" not in data:
        return data
    for pattern in _NULL_USAGE:
        if pattern in data:
            data = data.replace(pattern, b"")
    return data


def _has_usage(data: bytes) -> bool:
    return _USAGE in data or _USAGE_SPACED in data


def _last_boundary(data: bytes) -> int:
    """Index just past the last complete event in ``data``, or -1."""
    i = data.rfind(b"\n\n")
    j = data.rfind(b"\r\n\r\n")
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


def _usage_of(event: bytes) -> tuple[dict[str, Any] | None, bool]:
    """(usage, is_usage_only_chunk) of one event; (None, False) if it carries none."""
    for line in event.splitlines():
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if not payload.startswith(b"{"):
                return None, False
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return None, False
            if not isinstance(obj, dict):
                return None, False
            usage = obj.get("usage")
            if not isinstance(usage, dict):
                return None, False
            return usage, obj.get("choices") == []
    return None, False


class UsageRelay:
    """Feed upstream chunks in, get the bytes to send to the client out.

    ``drop_usage`` False: output == input, chunk for chunk (byte-exact relay).
    ``drop_usage`` True: output is the input without the usage-only event; bytes of an
    incomplete trailing event are held until the event completes.
    """

    __slots__ = ("_buf", "_drop", "usage")

    def __init__(self, drop_usage: bool) -> None:
        self._drop = drop_usage
        self._buf = b""
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> bytes:
        data = self._buf + chunk if self._buf else chunk
        end = _last_boundary(data)
        if end < 0:
            self._buf = data
            return b"" if self._drop else chunk
        complete, self._buf = data[:end], data[end:]
        if _has_usage(complete):
            kept = []
            for event in _events(complete):
                if _has_usage(event):
                    usage, usage_only = _usage_of(event)
                    if usage is not None:
                        self.usage = usage
                        if usage_only and self._drop:
                            continue
                kept.append(event)
            complete = b"".join(kept)
        return _strip_null_usage(complete) if self._drop else chunk

    def flush(self) -> bytes:
        """What is left at the end of the stream (an unterminated last event)."""
        rest, self._buf = self._buf, b""
        if rest and _has_usage(rest):
            usage, usage_only = _usage_of(rest)
            if usage is not None:
                self.usage = usage
                if usage_only and self._drop:
                    return b""
        return _strip_null_usage(rest) if self._drop else b""
