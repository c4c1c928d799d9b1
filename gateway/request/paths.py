"""Request paths are checked before anything routes on them, and forwarded exactly as checked.

A path is accepted only in a form whose meaning cannot change on the way to the backend:

* it starts with ``/`` and has no empty segment (``//``, or a trailing ``/`` after anything);
* no segment is ``.`` or ``..``;
* no percent-escape decodes to ``.``, ``/``, ``\\``, ``%``, a control character or a non-ASCII
  byte (``%2e``, ``%2f``, ``%5c``, ``%25``, ``%00``, ...), and every ``%`` starts a valid escape;
* no raw control character, backslash, or non-ASCII byte.

Why reject rather than normalise: a client library, an HTTP proxy or the backend's framework may each
resolve dot segments and escapes differently; any difference between what the gateway priced and what
the backend serves is a way around the budget (``/v1/x/../chat/completions`` priced as a pass-through
and served as a chat completion) or out of ``/v1`` (``/v1/%2e%2e/sleep``). Nothing legitimate needs
these forms, so the only safe canonical form is the one the client already sent.

The upstream URL is then built from the raw path (``scope["raw_path"]``) and sent without any
re-encoding or normalisation (``yarl.URL(..., encoded=True)``).
"""

from __future__ import annotations

_HEX = frozenset(b"0123456789abcdefABCDEF")
# Bytes that may appear literally in an accepted path: RFC 3986 pchar minus '%' (checked apart).
_ALLOWED = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&'()*+,;=:@/")
# Escapes that may decode to these are refused: they could become path syntax downstream.
_FORBIDDEN_DECODED = frozenset(b"./\\%") | frozenset(range(0x20)) | {0x7F}


def path_problem(raw_path: bytes) -> str | None:
    """Why ``raw_path`` is refused, or None when it is acceptable as is."""
    if not raw_path.startswith(b"/"):
        return "the path must start with '/'"
    if raw_path != b"/" and raw_path.endswith(b"/"):
        return "the path must not end with '/'"
    if b"//" in raw_path:
        return "the path must not contain empty segments ('//')"
    i, n = 0, len(raw_path)
    while i < n:
        c = raw_path[i]
        if c == 0x25:  # '%'
            if i + 2 >= n or raw_path[i + 1] not in _HEX or raw_path[i + 2] not in _HEX:
                return "the path contains a '%' that does not start a valid percent-escape"
            decoded = int(raw_path[i + 1 : i + 3], 16)
            if decoded in _FORBIDDEN_DECODED or decoded >= 0x80:
                return (
                    f"the path contains the percent-escape %{raw_path[i + 1 : i + 3].decode()} "
                    "(encoded dots, slashes, backslashes, '%' and control characters are not allowed)"
                )
            i += 3
            continue
        if c not in _ALLOWED:
            return "the path contains a character that is not allowed in a path (send it percent-encoded)"
        i += 1
    for segment in raw_path.split(b"/"):
        if segment == b"." or segment == b"..":
            return "the path must not contain '.' or '..' segments"
    return None
