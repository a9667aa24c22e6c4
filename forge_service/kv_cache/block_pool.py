"""The physical KV block pool: ids, reference counts, a free queue and block hashes. Plain ints, no torch."""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from forge_service.kv_cache.block_hash import BlockHash


class BlockPool:
    """Blocks 0..num_blocks-1 with reference counts and a FIFO free queue.

    A block whose count drops to 0 goes to the back of the free queue and `allocate` takes from
    the front, so the least recently freed block is reused first (LRU eviction).

    Prefix caching hooks: a full block may be given a content hash (`cache_block`). Its hash
    stays valid while the block sits in the free queue, so `get_cached_block` can find it and
    `incref` can revive it (taking it out of the queue) until `allocate` reuses the block, which
    evicts the hash.
    """

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0, num_blocks
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Per block: the hash of the tokens it holds (prefix + its own), None when not cached.
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # block hash -> block id
        # An OrderedDict (not a deque) so that a cache hit can take a block out of the middle in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free queue, front (next to be allocated) first."""
        return list(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks with count 1, from the front of the free queue; None (and nothing taken) if fewer are free."""
        assert n >= 0, n
        if n > len(self._free):
            return None
        block_ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        for block_id in block_ids:
            self._evict(block_id)
            self.ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Share blocks; a free (cached) block is taken out of the free queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; a block at 0 goes to the back of the free queue."""
        for block_id in block_ids:
            assert self.ref_counts[block_id] > 0, f"block {block_id} freed more often than referenced"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that an allocated, full block holds the tokens hashed to `block_hash`."""
        assert self.ref_counts[block_id] > 0, f"block {block_id} is not allocated"
        if self.block_hashes[block_id] is not None or block_hash in self.cached:
            return  # already cached, or an identical block already is: keep the first
        self.block_hashes[block_id] = block_hash
        self.cached[block_hash] = block_id

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding `block_hash`, allocated or still in the free queue; the caller increfs it."""
        return self.cached.get(block_hash)

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hashes[block_id] = None
