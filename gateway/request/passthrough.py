"""Which ``/v1`` routes beyond the priced ones the gateway forwards: an explicit allowlist.

Every route that can make a backend work must be priced, or a tenant can hold a budget's worth of
GPU for free (a 30k-token request on an unpriced route held 16 tokens). So the priced OpenAI routes
are built in, ``GET /v1/models`` and ``GET /v1/models/{id}`` are answered by the gateway itself
(each tenant sees only the models it may use), and anything else under
``/v1`` is forwarded only when ``passthrough.routes`` names it (method + path glob); the rest is a
404 that names the setting. An allowed POST is priced from its body
(``classifiers.Pricer.aprice_passthrough``): its text's tokens, plus the output limit it names, or
the default reservation when ``generates`` (the default for every method but GET).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PassthroughRoute:
    method: str  # upper case, or "*"
    path: str  # a glob over the checked path ("*" also matches "/")
    generates: bool = True  # the route may produce tokens when the body names no output limit


DEFAULT_ROUTES: tuple[PassthroughRoute, ...] = ()


class PassthroughRoutes:
    """Matches (method, path) against the allowlist; exact paths by dict, globs compiled once."""

    def __init__(self, routes: tuple[PassthroughRoute, ...]) -> None:
        self._exact: dict[tuple[str, str], PassthroughRoute] = {}
        self._globs: list[tuple[str, re.Pattern[str], PassthroughRoute]] = []
        for r in routes:
            if any(c in r.path for c in "*?[") or r.method == "*":
                self._globs.append((r.method, re.compile(fnmatch.translate(r.path)), r))
            else:
                self._exact.setdefault((r.method, r.path), r)

    def match(self, method: str, path: str) -> PassthroughRoute | None:
        route = self._exact.get((method, path))
        if route is not None:
            return route
        for m, pattern, r in self._globs:
            if (m == "*" or m == method) and pattern.match(path):
                return r
        return None
