"""Per-request block tables over a BlockPool. Plain ints, no torch."""
from __future__ import annotations

from forge_service.kv_cache.block_pool import BlockPool


class KVCacheManager:
    """Maps each request id to its block table: block i holds tokens [i*block_size, (i+1)*block_size).

    Tables only grow (by whole blocks, as the request's token count crosses block boundaries)
    until `free` returns them to the pool.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert block_size > 0, block_size
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to cover `num_tokens` tokens in total.

        Returns a copy of the whole table, or None (allocating nothing) when the pool is short.
        """
        table = self._tables.setdefault(request_id, [])
        new_blocks = self.pool.allocate(max(0, self.blocks_needed(num_tokens) - len(table)))
        if new_blocks is None:
            if not table:
                del self._tables[request_id]
            return None
        table.extend(new_blocks)
        return list(table)

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def free(self, request_id: str) -> None:
        """Return the request's blocks to the pool; idempotent.

        Tail first, so that a request's last blocks (the least likely to be shared by a
        future prefix hit) are evicted before its first ones.
        """
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))
