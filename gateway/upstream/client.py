"""The one shared upstream HTTP client and the header rules of a proxy.

aiohttp rather than httpx: measured here, httpx.AsyncClient cost 1.8-4.2 ms of CPU per proxied
request and aiohttp 0.4-1.0 ms. One ClientSession lives for the whole app (created at start-up,
closed at shutdown) over a pooled, keep-alive TCPConnector.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp

# RFC 9110 7.6.1 connection-specific headers, plus the non-standard ones proxies still see.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)

# Client request headers never forwarded: hop-by-hop, the ones the client library recomputes,
# the client's credentials (replaced by the backend's own key) and compression (we relay bytes
# and must read the usage, so ask for identity). The serving stack's own headers are dropped too,
# both ways: `HeaderNames`, config limits.private_headers.
REQUEST_DROP = HOP_BY_HOP | {
    b"host",
    b"content-length",
    b"authorization",
    b"api-key",
    b"x-api-key",
    b"accept-encoding",
    b"expect",
}

# Headers the serving stack behind the gateway reads to place a request, or writes to say where it
# went: vLLM's and SGLang's data-parallel rank (a tenant pinning all its requests to one rank piles
# them onto whoever else is there); SGLang's model gateway, x-smg-* (a worker by index, a
# consistent-hash key, the token ids its cache-aware policy routes by; x-smg-worker-id names the
# worker that served); the Gateway API inference extension (llm-d), x-gateway-* (the fairness id
# its flow control queues by, the objective that sets a request's priority, the endpoint chosen or
# served). A tenant must not steer them, nor learn where its requests ran (which requests share a
# worker, and its cache, with which).
PRIVATE_HEADERS: tuple[str, ...] = ("x-data-parallel-rank", "x-smg-*", "x-gateway-*")


@dataclass(frozen=True, slots=True)
class HeaderNames:
    """A set of lower-case header names: exact names, and prefixes (a pattern ending in ``*``)."""

    exact: frozenset[bytes] = frozenset()
    prefixes: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, patterns: Iterable[str]) -> HeaderNames:
        exact: set[bytes] = set()
        prefixes: list[bytes] = []
        for p in patterns:
            name = p.strip().lower().encode("latin-1")
            if name.endswith(b"*"):
                prefixes.append(name[:-1])
            else:
                exact.add(name)
        return cls(frozenset(exact), tuple(prefixes))

    def __contains__(self, name: bytes) -> bool:
        """``name``: lower case, as ASGI and `response_headers` give names. An underscore counts as
        a hyphen: servers behind a WSGI-style or CGI-style interface (and some proxies) read
        ``x_smg_target_worker`` as ``x-smg-target-worker``."""
        if b"_" in name:
            name = name.replace(b"_", b"-")
        return name in self.exact or (bool(self.prefixes) and name.startswith(self.prefixes))


def header_pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` is not a header name or a prefix of names followed by ``*`` (None if it is)."""
    name = pattern[:-1] if pattern.endswith("*") else pattern
    if not _TOKEN.fullmatch(name):
        return "is not a header name (letters, digits, '-' and the like), or one followed by '*'"
    return None


_TOKEN = re.compile(r"[!#$%&'+.^_`|~0-9A-Za-z-]+")

# Upstream response headers not relayed: hop-by-hop, what the ASGI server sets itself, and the
# backend's own request id (the client gets the gateway's, which was forwarded to the backend).
RESPONSE_DROP = HOP_BY_HOP | {b"content-length", b"date", b"server", b"x-request-id"}


def make_session(*, max_connections: int = 1024, keepalive_s: float = 4.0) -> aiohttp.ClientSession:
    """The shared session. Call inside a running event loop (start-up)."""
    connector = aiohttp.TCPConnector(
        limit=max_connections,
        limit_per_host=0,
        keepalive_timeout=keepalive_s,
        ttl_dns_cache=300,
        enable_cleanup_closed=False,
    )
    return aiohttp.ClientSession(
        connector=connector,
        # We forward the client's headers; don't add ours, don't decompress what we relay.
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None),
        raise_for_status=False,
        trust_env=False,
    )


def response_headers(
    raw: Iterable[tuple[bytes, bytes]], private: HeaderNames = HeaderNames()
) -> list[tuple[bytes, bytes]]:
    """Upstream response headers minus hop-by-hop ones (also those named by Connection) and the
    serving stack's ``private`` ones."""
    out: list[tuple[bytes, bytes]] = []
    extra: set[bytes] | None = None
    for name, value in raw:
        lname = name.lower()
        if lname in RESPONSE_DROP:
            if lname == b"connection":
                extra = {t.strip().lower() for t in value.split(b",")}
            continue
        if lname in private:
            continue
        out.append((lname, value))
    if extra:
        out = [(n, v) for n, v in out if n not in extra]
    return out


@dataclass(frozen=True, slots=True)
class UpstreamFailure:
    """An upstream failure, said twice: ``public`` for the tenant, ``detail`` for the operator's log.

    Tenants see the pool and a stable ``code``; backend addresses and exception text stay in
    ``detail`` (a tenant must not learn where the backends are or what they run).
    """

    status: int  # 502 or 504
    code: str  # stable: upstream_unreachable | upstream_timeout | upstream_error
    public: str
    detail: str
    connect_failure: bool  # counts towards the backend's circuit breaker


def classify_error(exc: BaseException, *, pool: str, backend: str) -> UpstreamFailure:
    """Map an aiohttp/asyncio exception from the upstream call onto the client's answer."""
    where = f"the backend for pool {pool!r}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamFailure(
            504,
            "upstream_unreachable",
            f"Timed out connecting to {where}",
            f"{backend}: connect timeout",
            True,
        )
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamFailure(
            502, "upstream_unreachable", f"Could not connect to {where}", f"{backend}: {exc.os_error}", True
        )
    if isinstance(exc, aiohttp.SocketTimeoutError | asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return UpstreamFailure(
            504,
            "upstream_timeout",
            f"{where[0].upper()}{where[1:]} did not answer in time",
            f"{backend}: read timeout",
            False,
        )
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return UpstreamFailure(
            502,
            "upstream_error",
            f"{where[0].upper()}{where[1:]} closed the connection without a complete answer",
            f"{backend}: server disconnected",
            False,
        )
    return UpstreamFailure(
        502,
        "upstream_error",
        f"Error talking to {where}",
        f"{backend}: {exc.__class__.__name__}: {exc}",
        False,
    )
