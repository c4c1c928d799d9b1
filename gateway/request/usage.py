"""What a request used, as the engine reported it, or estimated when it reports nothing.

Fair share, learned reservations, the estimate-error metrics and the access line all read the
record's ``prompt_tokens`` / ``completion_tokens``. Engines report them in a ``usage`` object (the
gateway asks a stream for ``stream_options.include_usage``); some never do (llama-cpp-python's
server ignores ``include_usage``). Then the answer's usage is *estimated*: the prompt is the priced
prompt, a stream's output is the output events it relayed (about one token each: an upper
estimate, as the role and finish events count too, capped at what the request reserved), and the
record says so (``usage_estimated``): the estimate-error metrics and the prompt learning skip it, and
each backend counts the answers it left without usage, for /stats and the doctor.

A non-streamed answer without usage gets the priced prompt and no output count (the store then
charges its whole reservation, as for any unmeasured request).
"""

from __future__ import annotations

from gateway.request.exchange import Exchange, RouteKind
from gateway.upstream.pools import Backend
from gateway.upstream.sse import cached_count, usage_counts

# The kinds whose answers carry token usage (pass-through routes are not read).
_METERED = (RouteKind.CHAT, RouteKind.COMPLETION, RouteKind.RESPONSES)


def reported(x: Exchange, usage: object) -> None:
    """Take the engine's usage object (any API's form) into the record, as soon as it is seen."""
    rec = x.record
    rec.prompt_tokens, rec.completion_tokens = usage_counts(usage)
    rec.cached_tokens = cached_count(usage)
    if rec.completion_tokens is not None:
        x.completion_tokens = rec.completion_tokens


def settle(x: Exchange, backend: Backend) -> None:
    """The answer is complete: count whether ``backend`` reported usage, and estimate it if not."""
    rec = x.record
    if x.kind not in _METERED or not 200 <= rec.status < 300:
        return
    if rec.prompt_tokens is not None or rec.completion_tokens is not None:
        backend.usage_reported += 1
        return
    backend.usage_missing += 1
    rec.usage_estimated = True
    rec.prompt_tokens = rec.prefill
    if x.sse:
        done = 1 if x.stream_complete else 0  # the [DONE] line is no token
        reserved = rec.decode + x.extended_tokens
        rec.completion_tokens = max(0, min(x.streamed_tokens - done, reserved))
        x.completion_tokens = rec.completion_tokens


__all__ = ["reported", "settle"]
