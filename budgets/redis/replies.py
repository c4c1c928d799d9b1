"""The Lua scripts' replies, parsed once into typed results.

Every script answers with a flat Redis reply (a list led by a short code, a number, or a list of
ids); a wake-up is one ``SEP``-joined string. The codes are named here, and only here, next to
the one function per script that reads them: the rest of the store matches on the classes below,
never on a letter or a position.

=================  ===========================================================================
script             reply (``budgets/redis/lua/<script>.lua`` documents each)
=================  ===========================================================================
acquire            ``G`` granted | ``Q`` queued | ``FULL`` the tenant's queue is full |
                   ``E`` invalid under the layout | ``NOLAYOUT`` Redis lost the layout
status             ``W`` still waiting | ``G`` granted | ``U`` unknown (Redis lost it)
withdraw           ``W`` withdrawn | ``G`` the grant won the race (kept) | ``R`` it won and was
                   released | ``U`` unknown
release            ``1`` live | ``0`` unknown | ``-1`` reaped
heartbeat          ``NOLAYOUT`` | the ids Redis does not know
reap               ``[leases reaped, tickets withdrawn, more left 0/1]``
restore            leases re-created (``-1`` without a layout)
apply_layout       ``[changed 0/1, version]``
quota_reserve      ``OK, n, used_1..used_n, over...`` reserved | ``R, index, bucket, total, ...``
                   refused by the charge at ``index``, its window's buckets
quota_settle       ``1`` settled | ``0`` not held
quota_expire       ``[settled, more left 0/1]``
quota_usage        ``used_1, reserved_1, used_2, ...``
quota_reset        ``n``: the use forgotten
usage_add          ``n``: the fields added to
usage_read         per hour with counts: ``hour, n, field_1, value_1, ...``
wake-up            ``G<SEP>seq<SEP>granted_at<SEP>queued_s`` granted |
                   ``F<SEP>seq<SEP>kind<SEP>name<SEP>limit`` failed: a new layout can never grant it
=================  ===========================================================================
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from budgets.quota import Refused, Reserved
from budgets.redis.keys import SEP

# Reply codes, as the scripts write them.
GRANTED = "G"
QUEUED = "Q"
QUEUE_FULL = "FULL"
INVALID = "E"
FAILED = "F"  # a wake-up's "invalid": the ticket waited, then a layout change made it impossible
NO_LAYOUT = "NOLAYOUT"
WAITING = "W"  # status
WITHDRAWN = "W"  # withdraw
RELEASED = "R"
UNKNOWN = "U"
QUOTA_RESERVED = "OK"  # quota_reserve
QUOTA_REFUSED = "R"


@dataclass(frozen=True, slots=True)
class Granted:
    """The demand holds its tokens: granted at ``granted_at`` (store time) after ``queued_s`` queued."""

    granted_at: float
    queued_s: float


@dataclass(frozen=True, slots=True)
class Queued:
    """Waiting as ticket ``seq``; its tier lets it wait at most ``max_wait_s``."""

    seq: int
    max_wait_s: float


@dataclass(frozen=True, slots=True)
class QueueIsFull:
    """Refused: the tenant already has ``queued`` tickets waiting (``max_queue_len``)."""

    queued: int
    max_queue_len: int
    retry_after_s: float


@dataclass(frozen=True, slots=True)
class Invalid:
    """The layout cannot grant the demand: ``kind`` is ``tenant``, ``tier`` or ``pool`` (unknown
    ``name``), or ``never`` (pool ``name`` grants at most ``limit`` tokens)."""

    kind: str
    name: str
    limit: int | None


@dataclass(frozen=True, slots=True)
class Withdrawn:
    """The ticket left the queue without a grant."""

    retry_after_s: float


class Outcome(enum.Enum):
    """Replies without data."""

    NO_LAYOUT = "no layout"  # Redis lost the budget layout (restarted or flushed)
    WAITING = "waiting"  # the ticket is still queued
    UNKNOWN = "unknown"  # Redis knows neither the ticket nor its lease
    RELEASED = "released"  # a grant that raced a cancelled waiter, given back by the script


class Release(enum.IntEnum):
    """release.lua's answer."""

    LIVE = 1
    UNKNOWN = 0  # already released, never granted, or lost in a restart
    REAPED = -1  # expired and reaped: gone for good


@dataclass(frozen=True, slots=True)
class Reaped:
    leases: int
    tickets: int
    more: bool  # the batch limit was hit: call again


NoLayout = Literal[Outcome.NO_LAYOUT]
AcquireReply = Granted | Queued | QueueIsFull | Invalid | NoLayout
StatusReply = Granted | Literal[Outcome.WAITING, Outcome.UNKNOWN]
WithdrawReply = Granted | Withdrawn | Literal[Outcome.RELEASED, Outcome.UNKNOWN]
WakeUp = Granted | Invalid


def _unexpected(script: str, reply: Any) -> ValueError:
    return ValueError(f"unexpected reply from {script}.lua: {reply!r}")


def _granted(reply: Sequence[Any]) -> Granted:
    # acquire, status and withdraw all answer a grant as [G, granted_at, queued_s].
    return Granted(float(reply[1]), float(reply[2]))


def _invalid(kind: Any, name: Any, limit: Any = None) -> Invalid:
    return Invalid(str(kind), str(name), int(limit) if limit not in (None, "") else None)


def acquire(reply: Sequence[Any]) -> AcquireReply:
    code = reply[0]
    if code == GRANTED:
        return _granted(reply)
    if code == QUEUED:
        return Queued(int(reply[1]), float(reply[3]))
    if code == QUEUE_FULL:
        return QueueIsFull(int(reply[1]), int(reply[2]), float(reply[3]))
    if code == INVALID:
        return _invalid(*reply[1:4])
    if code == NO_LAYOUT:
        return Outcome.NO_LAYOUT
    raise _unexpected("acquire", reply)


def status(reply: Sequence[Any]) -> StatusReply:
    code = reply[0]
    if code == GRANTED:
        return _granted(reply)
    if code == WAITING:
        return Outcome.WAITING
    if code == UNKNOWN:
        return Outcome.UNKNOWN
    raise _unexpected("status", reply)


def withdraw(reply: Sequence[Any]) -> WithdrawReply:
    code = reply[0]
    if code == WITHDRAWN:
        return Withdrawn(float(reply[1]))
    if code == GRANTED:
        return _granted(reply)
    if code == RELEASED:
        return Outcome.RELEASED
    if code == UNKNOWN:
        return Outcome.UNKNOWN
    raise _unexpected("withdraw", reply)


def wake_up(payload: str) -> tuple[int, str | None, WakeUp]:
    """A wake-up message: the ticket's seq, its lease id and what happened to it.

    The seq alone does not name a ticket for good (a Redis that restarted empty numbers tickets
    from 1 again); seq and lease id together do. The lease id is None in a message written by the
    scripts of an older version (``G seq at queued`` / ``F seq code message limit``, without it),
    which a replica of that version still sends during a rolling upgrade.
    """
    fields = payload.split(SEP)
    code, seq = fields[0], int(fields[1])
    if code == GRANTED:
        if len(fields) == 4:
            return seq, None, Granted(float(fields[2]), float(fields[3]))
        return seq, fields[2], Granted(float(fields[3]), float(fields[4]))
    if code == FAILED:
        if len(fields) == 5:
            return seq, None, _invalid(*fields[2:5])
        return seq, fields[2], _invalid(*fields[3:6])
    raise _unexpected("wake-up", payload)


def release(reply: Any) -> Release:
    return Release(int(reply))


def extend(reply: Any) -> int | None:
    """extend.lua's answer: the overdraft (>= 0), or None when the lease is not live."""
    over = int(reply)
    return None if over < 0 else over


def heartbeat(reply: Sequence[Any]) -> list[str] | NoLayout:
    """The ids Redis does not know, or NO_LAYOUT."""
    if reply[:1] == [NO_LAYOUT]:
        return Outcome.NO_LAYOUT
    return list(reply)


def reap(reply: Sequence[Any]) -> Reaped:
    leases, tickets, more = reply
    return Reaped(int(leases), int(tickets), bool(int(more)))


def restore(reply: Any) -> int:
    return int(reply)


def layout_version(reply: Sequence[Any]) -> int:
    """apply_layout's version of the layout now in Redis."""
    return int(reply[1])


def quota_reserve(reply: Sequence[Any]) -> Reserved | Refused:
    code = reply[0]
    if code == QUOTA_REFUSED:
        flat = [int(v) for v in reply[2:]]
        return Refused(int(reply[1]), dict(sorted(zip(flat[::2], flat[1::2], strict=True))))
    if code != QUOTA_RESERVED:
        raise _unexpected("quota_reserve", reply)
    n = int(reply[1])
    return Reserved(tuple(int(v) for v in reply[2 : 2 + n]), tuple(int(v) for v in reply[2 + n :]))


def quota_expire(reply: Sequence[Any]) -> tuple[int, bool]:
    """(reservations settled, more left)."""
    settled, more = reply
    return int(settled), bool(int(more))


def usage_read(reply: Sequence[Any]) -> list[tuple[int, list[tuple[str, int]]]]:
    """Per hour: its (field, count) pairs."""
    out: list[tuple[int, list[tuple[str, int]]]] = []
    i = 0
    while i < len(reply):
        hour, n = int(reply[i]), int(reply[i + 1])
        flat = reply[i + 2 : i + 2 + 2 * n]
        fields = [(_text(f), int(v)) for f, v in zip(flat[::2], flat[1::2], strict=True)]
        out.append((hour, fields))
        i += 2 + 2 * n
    return out


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def quota_usage(reply: Sequence[Any]) -> list[tuple[int, int]]:
    flat = [int(v) for v in reply]
    return list(zip(flat[::2], flat[1::2], strict=True))
