"""Request ids: one per request, in the access line, forwarded upstream and returned as ``x-request-id``.

The gateway's own ids are UUID-shaped (``5f3a9c1e-2b4d-4e8f-9a1b-00000000002a``): a per-process random
prefix of 76 bits, written as the first four groups of a version-4 UUID, and a counter as the last
group. Unique across replicas and restarts for any practical purpose, far cheaper than a uuid4 per
request, and accepted by every engine that reads the header: some validate it as a UUID and refuse
the request otherwise (llama-cpp-python's server answers 400 with an empty body). Which header
carries it upstream is a per-backend setting (``request_id_header``: a name, or none).
A client's ``x-request-id`` is adopted only when ``logging.trust_request_id`` is on (the clients are
trusted to send unique ids); otherwise it is kept in the access line as ``client_request_id`` while
the gateway uses its own. Whatever comes from a client is checked first: it is echoed in a response
header and written to the log, so at most 128 characters of ``A-Z a-z 0-9 . _ : / + = @ -``; anything
else is never adopted, and is logged with the other characters replaced by ``_``.
"""

from __future__ import annotations

import itertools
import os
import re

HEADER = b"x-request-id"
MAX_LENGTH = 128
_VALID = re.compile(rb"[A-Za-z0-9._:/+=@-]{1,128}")
_INVALID_CHARS = re.compile(r"[^A-Za-z0-9._:/+=@-]")

_prefix = ""
_counter = itertools.count(1)


def _reseed() -> None:
    """A new prefix and counter (at import, and in a forked child, which must not repeat its parent's ids)."""
    global _prefix, _counter
    r = os.urandom(10).hex()
    variant = "89ab"[int(r[16], 16) & 3]  # RFC 4122 variant bits
    _prefix = f"{r[:8]}-{r[8:12]}-4{r[13:16]}-{variant}{r[17:20]}-"
    _counter = itertools.count(1)


_reseed()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reseed)


def new_id() -> str:
    return f"{_prefix}{next(_counter) & 0xFFFFFFFFFFFF:012x}"


def accepted(value: bytes) -> str | None:
    """``value`` as a request id when it is safe to echo and log as it is, else None."""
    return value.decode("ascii") if _VALID.fullmatch(value) else None


def sanitised(value: bytes) -> str:
    """A client's id made safe to log: clipped, other characters replaced."""
    return _INVALID_CHARS.sub("_", value[:MAX_LENGTH].decode("latin-1")) or "_"


def from_client(value: bytes, trusted: bool) -> tuple[str | None, str | None]:
    """(the id to use instead of ours, or None; the client's id to log beside ours, or None)."""
    if trusted:
        ok = accepted(value)
        if ok is not None:
            return ok, None
    return None, sanitised(value)


__all__ = ["HEADER", "MAX_LENGTH", "accepted", "from_client", "new_id", "sanitised"]
