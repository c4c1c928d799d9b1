"""Redis through Sentinel: every connection goes to the current primary of a named master.

A ``redis+sentinel://[[user]:password@]host:port[,host:port...]/master[/db][?sentinel_password=...]``
URL names the sentinels and the master. Each connection, the lean one the scripts use (resp.py) and redis-py's
(pub/sub, snapshots), asks the sentinels for the master's address as it connects (the first that
answers; it is asked first next time) and then checks with ``ROLE`` that the node really is a
primary: a sentinel may still name a primary it is about to fail over, and a demoted primary that
comes back answers as a replica. Nothing else changes when the primary changes: its connections
break (it died), or its writes fail with ``READONLY`` (it was demoted, resp.py tears the connection
down), the store is down until its recovery connects again, to the new primary, and re-registers
the leases this replica runs there (what an asynchronous replica had not received yet), as after a
Redis restart (failover.py). The user and password before the ``@`` are the data nodes'; sentinels
that want their own (``requirepass`` in sentinel.conf) get ``sentinel_password`` (and
``sentinel_username``, for an ACL user) from the query string, URL-encoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from budgets.redis.resp import Address, RespConnection, RespConnectionError

SCHEME = "redis+sentinel"


@dataclass(frozen=True, slots=True)
class SentinelSpec:
    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None  # the sentinels' own credentials, when they ask for them
    sentinel_password: str | None = None


_QUERY = ("sentinel_username", "sentinel_password")


def is_sentinel_url(url: str) -> bool:
    return url.startswith(SCHEME + "://")


def parse_sentinel_url(url: str) -> SentinelSpec:
    """The sentinels and master of a ``redis+sentinel://`` URL; ValueError saying what is wrong."""
    parts = urlsplit(url)
    if parts.scheme != SCHEME:
        raise ValueError(f"expected {SCHEME}://host:port[,host:port...]/master[/db]")
    auth, _, hosts = parts.netloc.rpartition("@")
    sentinels = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"sentinel {item!r}: expected host:port (the sentinels' port, 26379 by default)")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError("expected the master's name after the sentinels: .../<master>[/<db>]")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"db {path[1]!r}: expected a number")
    username, password = None, None
    if auth:
        user, sep, secret = auth.partition(":")
        username, password = (unquote(user) or None, unquote(secret)) if sep else (None, unquote(user))
    query: dict[str, str] = {}
    for item in parts.query.split("&") if parts.query else ():
        name, sep, value = item.partition("=")
        if name not in _QUERY or not sep:
            raise ValueError(f"query {name!r}: expected {' or '.join(q + '=...' for q in _QUERY)}")
        query[name] = unquote(value)
    return SentinelSpec(
        tuple(sentinels),
        unquote(path[0]),
        int(path[1]) if len(path) == 2 else 0,
        username,
        password,
        query.get("sentinel_username") or None,
        query.get("sentinel_password"),
    )


class SentinelResolver:
    """The master's address, asked of the sentinels in turn (the last that answered first)."""

    topology = "sentinel"

    def __init__(self, spec: SentinelSpec, timeout_s: float) -> None:
        self.spec = spec
        self._order = list(spec.sentinels)
        self._timeout_s = timeout_s
        self.resolved = 0  # addresses given (observability, tests)

    async def __call__(self) -> Address:
        spec = self.spec
        problems = []
        for i, (host, port) in enumerate(self._order):
            conn = RespConnection(
                Address(host, port, None, 0, spec.sentinel_username, spec.sentinel_password),
                connect_timeout_s=self._timeout_s,
                op_timeout_s=self._timeout_s,
            )
            try:
                reply = await conn.execute("SENTINEL", "get-master-addr-by-name", spec.master)
            except Exception as err:
                problems.append(f"{host}:{port}: {err}")
                continue
            finally:
                await conn.close()
            if not reply:
                problems.append(f"{host}:{port} does not know master {spec.master!r}")
                continue
            if i:
                self._order.insert(0, self._order.pop(i))
            self.resolved += 1
            return Address(str(reply[0]), int(reply[1]), None, spec.db, spec.username, spec.password)
        raise RespConnectionError(f"no sentinel gave the primary of {spec.master!r}: " + "; ".join(problems))
