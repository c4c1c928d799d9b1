"""Usage for billing in Redis (budgets/usage_log.py): one hash per hour under the budget domain's hash
tag (lua/usage_add.lua, lua/usage_read.lua), on the store's connection."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from budgets.redis import replies
from budgets.redis.transport import Down, Transport
from budgets.types import StoreUnavailable
from budgets.usage_log import COUNTS, SEP, RowKey, UsageRow, clean


class RedisUsageLog:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    async def add(self, hour: int, rows: Mapping[RowKey, Sequence[int]], keep_s: int) -> None:
        args = [str(hour), str(int(keep_s))]
        for (tenant, key, model), counts in rows.items():
            prefix = f"{clean(tenant)}{SEP}{clean(key)}{SEP}{clean(model)}{SEP}"
            for name, n in zip(COUNTS, counts, strict=True):
                if n:
                    args += [prefix + name, str(int(n))]
        if len(args) == 2:
            return
        try:
            await self._transport.eval("usage_add", args)
        except Down as err:
            raise StoreUnavailable(f"usage log unreachable: {err}") from None

    async def read(self, hours: Sequence[int]) -> list[UsageRow]:
        if not hours:
            return []
        try:
            reply = await self._transport.eval("usage_read", [str(h) for h in hours])
        except Down as err:
            raise StoreUnavailable(f"usage log unreachable: {err}") from None
        index = {name: i for i, name in enumerate(COUNTS)}
        out: list[UsageRow] = []
        for hour, fields in replies.usage_read(reply):
            cells: dict[RowKey, list[int]] = defaultdict(lambda: [0] * len(COUNTS))
            for field, n in fields:
                tenant, key, model, name = field.split(SEP)
                if name in index:
                    cells[tenant, key, model][index[name]] += n
            out += [UsageRow(hour, t, k, m, tuple(c)) for (t, k, m), c in sorted(cells.items())]
        return out
