"""Which node the store talks to: the address in the URL, or the primary a resolver names at each
connect (through Sentinel, sentinel.py; the owner of the domain's slot on a Cluster, cluster.py).

`resolver_for` picks the resolver a URL asks for; `ResolvingConnection` is redis-py's connection
that asks it (the lean script connection takes the resolver itself, resp.py); `redis_client` is a
redis-py client for any of these URLs (the admin state store's).
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import Connection, ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError

from budgets.redis.cluster import SlotOwner, is_cluster_url, parse_cluster_url
from budgets.redis.resp import Address, RespConnectionError, check_primary
from budgets.redis.sentinel import SentinelResolver, is_sentinel_url, parse_sentinel_url

Resolver = SentinelResolver | SlotOwner


def resolver_for(url: str, tag: str, timeout_s: float) -> Resolver | None:
    """The resolver ``url`` asks for (``tag``: the domain's hash tag, whose slot a Cluster URL
    needs); None for a plain address."""
    if is_sentinel_url(url):
        return SentinelResolver(parse_sentinel_url(url), timeout_s)
    if is_cluster_url(url):
        return SlotOwner(parse_cluster_url(url), tag, timeout_s)
    return None


def pool_kwargs(resolver: Resolver) -> dict[str, Any]:
    """What a redis-py pool needs to reach the nodes ``resolver`` names."""
    spec = resolver.spec
    return {
        "connection_class": ResolvingConnection,
        "resolve": resolver,
        "db": resolver.spec.db if isinstance(resolver, SentinelResolver) else 0,  # a cluster has only 0
        "username": spec.username,
        "password": spec.password,
    }


class ResolvingConnection(Connection):
    """redis-py's connection, to the primary a resolver names at each connect (Sentinel's, or the
    Cluster node that owns the domain's slot), checked with ``ROLE``."""

    def __init__(self, *, resolve: Resolver, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._resolve = resolve

    async def _connect(self) -> None:
        try:
            address = await self._resolve()
        except RespConnectionError as err:
            raise RedisConnectionError(str(err)) from err
        self.host, self.port = address.host, address.port
        await super()._connect()

    async def on_connect(self) -> None:
        await super().on_connect()
        await self.send_command("ROLE")
        role = await self.read_response()
        try:
            check_primary(role, Address(self.host, self.port))
        except RespConnectionError as err:
            raise RedisConnectionError(str(err)) from err


def redis_client(url: str, tag: str, **settings: Any) -> Redis:
    """A redis-py client for ``url`` (``settings`` go to its connections): to the primary a
    Sentinel or a Cluster names for ``tag``'s slot at each connect, else ``Redis.from_url``."""
    resolver = resolver_for(url, tag, settings.get("socket_connect_timeout") or 1.0)
    if resolver is None:
        return Redis.from_url(url, **settings)
    return Redis(connection_pool=ConnectionPool(**pool_kwargs(resolver), **settings))
