"""Redis Cluster: a budget domain lives in one slot, and the store talks to the primary that owns it.

Every key of a domain shares the hash tag ``{tg:<prefix>}`` (keys.py), so a domain is one slot and
one primary; domains with other prefixes spread over the shards. With a
``redis+cluster://[[user]:password@]host:port[,host:port...]`` URL (any nodes of the cluster: seeds)
each connection asks the nodes it knows for the owner of the domain's slot (``CLUSTER SLOTS``; the
last owner first, and every primary it hears of is remembered) and checks with ``ROLE`` that it is a
primary. A reply that says the slot is elsewhere (``MOVED``, ``ASK``) or moving (``TRYAGAIN``) means
the command did not run: the connection is torn down (resp.py), the store is down for a moment,
and its recovery connects to the owner the cluster names then.

Moving a live domain's slot (``redis-cli --cluster reshard``, or `migrate_slot`): the scripts
declare one key (``T:layout``) and reach the domain's other keys by name. While a slot is migrating,
Redis runs a script whose declared key is still on the source, and fails any call inside it that
reaches a key not there (moved, or not made yet) — after the writes before it. So every script
first looks up a key that never exists (lib.lua, ``begin``): refused while the slot moves, it stops
with ``TRYAGAIN`` before writing anything, and the store waits the move out as an outage. Once the
declared key has moved the source answers ``ASK``; once the move is done, ``MOVED``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.crc import key_slot

from budgets.redis.resp import Address, RespConnection, RespConnectionError

SCHEME = "redis+cluster"


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    seeds: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None


def is_cluster_url(url: str) -> bool:
    return url.startswith(SCHEME + "://")


def parse_cluster_url(url: str) -> ClusterSpec:
    """The seed nodes of a ``redis+cluster://`` URL; ValueError saying what is wrong."""
    parts = urlsplit(url)
    if parts.scheme != SCHEME:
        raise ValueError(f"expected {SCHEME}://host:port[,host:port...]")
    auth, _, hosts = parts.netloc.rpartition("@")
    seeds = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"node {item!r}: expected host:port of a cluster node")
        seeds.append((host.strip("[]"), int(port)))
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError("a cluster has only database 0: leave the path out")
    username, password = None, None
    if auth:
        user, sep, secret = auth.partition(":")
        username, password = (unquote(user) or None, unquote(secret)) if sep else (None, unquote(user))
    return ClusterSpec(tuple(seeds), username, password)


def slot_of(tag: str) -> int:
    return int(key_slot(tag.encode()))


class SlotOwner:
    """The primary that owns one domain's slot, asked of the nodes known (the last owner first)."""

    topology = "cluster"

    def __init__(self, spec: ClusterSpec, tag: str, timeout_s: float) -> None:
        self.spec = spec
        self.slot = slot_of(tag)
        self._nodes = list(spec.seeds)
        self._timeout_s = timeout_s
        self.resolved = 0  # addresses given (observability, tests)

    def _address(self, host: str, port: int) -> Address:
        return Address(host, port, None, 0, self.spec.username, self.spec.password)

    async def __call__(self) -> Address:
        problems = []
        for host, port in list(self._nodes):
            conn = RespConnection(
                self._address(host, port), connect_timeout_s=self._timeout_s, op_timeout_s=self._timeout_s
            )
            try:
                slots = await conn.execute("CLUSTER", "SLOTS")
            except Exception as err:
                problems.append(f"{host}:{port}: {err}")
                continue
            finally:
                await conn.close()
            owner = self._learn(slots, host)
            if owner is None:
                problems.append(f"{host}:{port} names no owner of slot {self.slot}")
                continue
            self._nodes.remove(owner)
            self._nodes.insert(0, owner)
            self.resolved += 1
            return self._address(*owner)
        raise RespConnectionError(
            f"no cluster node gave the owner of slot {self.slot}: " + "; ".join(problems)
        )

    def _learn(self, slots: Any, asked: str) -> tuple[str, int] | None:
        """Remember every primary in ``CLUSTER SLOTS``; return the one owning our slot."""
        owner = None
        for entry in slots if isinstance(slots, list) else ():
            start, end, primary = entry[0], entry[1], entry[2]
            node = (str(primary[0]) or asked, int(primary[1]))  # an empty host: the node asked
            if node not in self._nodes:
                self._nodes.append(node)
            if int(start) <= self.slot <= int(end):
                owner = node
        return owner


async def migrate_slot(
    source: Address, target: Address, slot: int, keys_per_migrate: int = 10, timeout_ms: int = 5000
) -> int:
    """Move ``slot`` from ``source`` to ``target`` as ``redis-cli --cluster reshard`` does: importing
    and migrating states, ``keys_per_migrate`` keys per ``MIGRATE``, then the new owner announced.
    Returns how many keys moved."""
    src = RespConnection(source, connect_timeout_s=2, op_timeout_s=timeout_ms / 1000 + 5)
    dst = RespConnection(target, connect_timeout_s=2, op_timeout_s=5)
    try:
        src_id = await src.execute("CLUSTER", "MYID")
        dst_id = await dst.execute("CLUSTER", "MYID")
        await dst.execute("CLUSTER", "SETSLOT", str(slot), "IMPORTING", src_id)
        await src.execute("CLUSTER", "SETSLOT", str(slot), "MIGRATING", dst_id)
        auth: list[str] = []
        if source.password is not None:
            auth = (
                ["AUTH2", source.username, source.password] if source.username else ["AUTH", source.password]
            )
        moved = 0
        while keys := await src.execute("CLUSTER", "GETKEYSINSLOT", str(slot), str(keys_per_migrate)):
            await src.execute(
                "MIGRATE", target.host, str(target.port), "", "0", str(timeout_ms), *auth, "KEYS", *keys
            )
            moved += len(keys)
        for conn in (dst, src):
            await conn.execute("CLUSTER", "SETSLOT", str(slot), "NODE", dst_id)
        return moved
    finally:
        await src.close()
        await dst.close()
