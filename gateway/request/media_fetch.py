"""The gateway fetches a request's media itself, so the engine fetches nothing (``pricing.media_urls.fetch``).

`classifiers.media_urls` checks a media URL as written; two things it cannot see are where a public
name resolves (``127.0.0.1.nip.io``, a name rebound between two lookups) and where a public URL
redirects, and an engine that fetches follows both. With ``fetch: true`` the gateway fetches every
http(s) media URL an allowed request carries, before it is priced, and sends the engine the bytes
as a ``data:`` URL instead:

* every address a name resolves to must be public (unless the host is listed in ``hosts`` or
  ``private_hosts`` is on), and the connection goes to the address that was checked: the check is
  the resolver of the fetcher's own connection pool, so nothing resolves the name a second time;
* a redirect is followed (at most ``_MOST_REDIRECTS``) only to a URL the policy allows, through the
  same resolver; cookies are neither sent nor kept;
* at most ``fetch_max_bytes`` per URL, within ``fetch_timeout_s``; the fetched bytes count against
  the request's held body bytes (gateway/request/held_bodies.py);
* a tenant runs at most ``fetch_per_tenant`` fetches at once; its others wait for one of its own.
  The connection pool is shared (``_CONNECTIONS``), and its queue is first come, first served: a
  tenant whose media server is a tar pit (slow to answer, or never) filled it, and every other
  tenant's fetch then waited behind its fetches until it timed out. Now filling the pool takes
  ``_CONNECTIONS / fetch_per_tenant`` tenants doing so at once;
* a failure is a 400 ``media_fetch_failed`` naming the part and, in a few words, why (the status,
  a timeout, a private address), never the exception's text.

An inlined image is then priced by its real size, where a remote one was priced at the most.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urljoin

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from classifiers.media_urls import MediaUrls, TooManyElements, is_public, media_refs
from gateway.request.errors import ApiError

_MOST_REDIRECTS = 3
# Connections the fetcher opens at most (all tenants): sixteen tenants' default share.
_CONNECTIONS = 256
_REDIRECTS = frozenset((301, 302, 303, 307, 308))


def _no_hold(n: int) -> None:
    pass


class PrivateAddress(OSError):
    """A media host resolved to an address outside the public internet."""


class CheckedResolver(AbstractResolver):
    """Resolves with ``inner`` and refuses a name any of whose addresses is not public, unless the
    policy allows private hosts or lists the name."""

    def __init__(self, policy: Callable[[], MediaUrls], inner: AbstractResolver | None = None) -> None:
        self._policy = policy
        self._inner = inner or aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        policy = self._policy()
        if policy.private_hosts or host.lower().rstrip(".") in policy.hosts:
            return found
        for r in found:
            if not is_public(ipaddress.ip_address(r["host"])):
                raise PrivateAddress(f"{host} resolves to a private address")
        return found

    async def close(self) -> None:
        await self._inner.close()


class MediaFetcher:
    """Inlines the http(s) media of request bodies (module docstring). ``policy`` is read per call:
    the pricing section applies live."""

    def __init__(self, policy: Callable[[], MediaUrls], resolver: AbstractResolver | None = None) -> None:
        self._policy = policy
        self._resolver = resolver
        self._session: aiohttp.ClientSession | None = None
        self._slots: dict[str, _Slots] = {}  # per tenant with fetches running or waiting

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=_CONNECTIONS,
                resolver=CheckedResolver(self._policy, self._resolver),
                use_dns_cache=False,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
                auto_decompress=True,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def inline(
        self,
        body: dict[str, Any],
        limit: int,
        hold: Callable[[int], None] = _no_hold,
        tenant: str | None = None,
    ) -> int:
        """Replace each fetchable http(s) media URL in ``body`` by a data: URL of its bytes; the
        number of bytes sent inline. Media the policy refuses is left for pricing to refuse.
        ``tenant``: whose share of fetches (``fetch_per_tenant``) these take; None (open mode, one
        tenant for everyone): no share, only the fetcher's connections bound them.
        ``limit``: the most elements looked at (pricing.max_items). ``hold(n)``: called with the most
        the fetches can bring (``fetch_max_bytes`` each, as base64) before any starts, and may
        refuse; the caller gives back what that is above the number returned."""
        policy = self._policy()
        if not policy.fetch:
            return 0
        try:
            found = media_refs(body, limit)
        except TooManyElements:
            return 0  # (pricing refuses such a body)
        targets = [
            (where, holder, key)
            for where, holder, key in found
            if isinstance(url := holder[key], str)
            and url[:5].lower() in ("http:", "https")
            and policy.problem(url) is None
        ]
        if not targets:
            return 0
        hold(most_inline(len(targets), policy.fetch_max_bytes))
        if tenant is None:
            slots = _Slots(len(targets))  # (never waited for)
        else:
            slots = self._slots.get(tenant) or self._slots.setdefault(tenant, _Slots(policy.fetch_per_tenant))
        slots.users += 1
        try:  # (the first failure cancels the other fetches)
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(self._fetch(h[k], where, policy, slots)) for where, h, k in targets
                ]
        except* ApiError as failed:
            raise failed.exceptions[0] from None
        finally:
            slots.users -= 1
            if not slots.users and tenant is not None:
                del self._slots[tenant]
        fetched = [t.result() for t in tasks]
        for (_, holder, key), data_url in zip(targets, fetched, strict=True):
            holder[key] = data_url
        return sum(len(v) for v in fetched)

    async def _fetch(self, url: str, where: str, policy: MediaUrls, slots: _Slots) -> str:
        started = False
        try:
            async with asyncio.timeout(policy.fetch_timeout_s), slots.running:
                started = True
                for _ in range(_MOST_REDIRECTS + 1):
                    async with self._client().get(url, allow_redirects=False) as resp:
                        if resp.status in _REDIRECTS and "location" in resp.headers:
                            url = urljoin(url, resp.headers["location"])
                            why = policy.problem(url)
                            if why is not None:
                                raise _failed(where, f"it redirects to a URL that {why}")
                            continue
                        if resp.status != 200:
                            raise _failed(where, f"its server answered HTTP {resp.status}")
                        data = await resp.content.read(policy.fetch_max_bytes + 1)
                        if len(data) > policy.fetch_max_bytes:
                            raise _failed(
                                where,
                                f"it is larger than {policy.fetch_max_bytes:,} bytes (pricing.media_urls.fetch_max_bytes)",
                            )
                        kind = (
                            resp.headers.get("content-type", "application/octet-stream").split(";")[0].strip()
                        )
                        return f"data:{kind or 'application/octet-stream'};base64,{base64.b64encode(data).decode()}"
                raise _failed(where, f"it redirects more than {_MOST_REDIRECTS} times")
        except ApiError:
            raise
        except TimeoutError:
            if not started:
                raise _failed(
                    where,
                    f"it waited {policy.fetch_timeout_s:g} s for one of this tenant's "
                    f"{slots.size} concurrent fetches (pricing.media_urls.fetch_per_tenant), "
                    "all taken by its other fetches",
                ) from None
            raise _failed(where, f"it did not arrive within {policy.fetch_timeout_s:g} s") from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            # (aiohttp wraps what the resolver raised in its connector error)
            inner = getattr(exc, "os_error", None) or exc.__cause__
            if isinstance(exc, PrivateAddress) or isinstance(inner, PrivateAddress):
                raise _failed(where, "its host resolves to a private address") from None
            raise _failed(where, "its host could not be reached") from None


class _Slots:
    """One tenant's share of the fetcher: at most ``size`` fetches running, and how many requests
    use it (the entry goes when none does). Its size is the policy's when the first of them came."""

    __slots__ = ("running", "size", "users")

    def __init__(self, size: int) -> None:
        self.size = size
        self.running = asyncio.Semaphore(size)
        self.users = 0


def most_inline(urls: int, max_bytes: int) -> int:
    """The most bytes ``urls`` fetches of at most ``max_bytes`` each become inline (base64, header)."""
    return urls * ((max_bytes + 2) // 3 * 4 + 64)


def _failed(where: str, why: str) -> ApiError:
    return ApiError(
        400,
        f"{where}: the gateway could not fetch this media: {why}; send it inline as a data: URL",
        param=where,
        code="media_fetch_failed",
    )
