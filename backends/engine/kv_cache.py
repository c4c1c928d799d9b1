"""KV-cache block manager: a fixed pool of fixed-size blocks and one block table per request.

Blocks are the unit of KV memory (``block_size`` tokens each). A request holds
``ceil(tokens / block_size)`` blocks; allocation is all-or-nothing so a failed grow leaves the
request's table untouched and the caller can preempt someone and retry. No prefix sharing:
every request owns its blocks exclusively, which keeps "no leaked blocks" trivially checkable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

_EMPTY: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (what vLLM reports as ``kv_cache_usage_perc``)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> Sequence[int]:
        # The live list: callers must not mutate it. Tables only grow while a request lives and
        # are detached (not cleared) on free, so a plan holding one stays valid for its step.
        return self._tables.get(request_id, _EMPTY)

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._tables.get(request_id, _EMPTY))

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow ``request_id``'s table to hold ``num_tokens`` tokens; False (and no change) if short."""
        table = self._tables.get(request_id)
        have = len(table) if table is not None else 0
        need = self.blocks_for(num_tokens) - have
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        if table is None:
            table = self._tables[request_id] = []
        popleft = self._free.popleft
        table.extend(popleft() for _ in range(need))
        return True

    def free(self, request_id: str) -> int:
        """Return all of ``request_id``'s blocks to the pool; returns how many. Idempotent."""
        table = self._tables.pop(request_id, None)
        if not table:
            return 0
        self._free.extend(table)
        return len(table)

    def owners(self) -> list[str]:
        return list(self._tables)
