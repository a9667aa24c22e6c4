"""The physical KV block pool: ids, reference counts, a free queue and block hashes. Plain ints, no torch."""
from __future__ import annotations

import bisect
import struct
from collections import OrderedDict
from typing import Iterable, Sequence

from forge_service.kv_cache.block_hash import BlockHash


class BlockPool:
    """Blocks 0..num_blocks-1 with reference counts and a FIFO free queue.

    A block whose count drops to 0 goes to the back of the free queue and `allocate` takes from
    the front, so the least recently freed block is reused first (LRU eviction).

    Prefix caching hooks: a full block may be given a content hash (`cache_block`). Its hash
    stays valid while the block sits in the free queue, so `get_cached_block` can find it and
    `incref` can revive it (taking it out of the queue) until `allocate` reuses the block, which
    evicts the hash. Given its parent's key and its tokens too, the block is also found by the
    first tokens of its own (`partial_block`), for a prompt that leaves the cached text inside
    the block.
    """

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0, num_blocks
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Per block: the hash of the tokens it holds (prefix + its own), None when not cached.
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # block hash -> block id
        # Cached blocks by parent: parent key -> (their tokens packed 4 bytes each, sorted; their
        # ids in the same order). Of sorted strings, those that begin with the most of a query sit
        # next to where the query would sort, so the best partial hit is one of two neighbours.
        # About 390 bytes a cached block (1.1 MB over the default 1 GiB cache's 2,900 blocks); an
        # index keyed by each of a block's beginnings (15 keys) took 3.5 KB.
        self._children: dict[BlockHash, tuple[list[bytes], list[int]]] = {}
        self._child_of: list[tuple[BlockHash, bytes] | None] = [None] * num_blocks
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

    def cache_block(self, block_id: int, block_hash: BlockHash, parent: BlockHash | None = None,
                    tokens: Sequence[int] = ()) -> None:
        """Record that an allocated, full block holds the tokens hashed to `block_hash`; given the
        key of the block before it (`parent`) and its `tokens`, `partial_block` finds it too."""
        assert self.ref_counts[block_id] > 0, f"block {block_id} is not allocated"
        if self.block_hashes[block_id] is not None or block_hash in self.cached:
            return  # already cached, or an identical block already is: keep the first
        self.block_hashes[block_id] = block_hash
        self.cached[block_hash] = block_id
        if parent is not None and tokens:
            packed = _pack(tokens)
            keys, ids = self._children.setdefault(parent, ([], []))
            at = bisect.bisect_left(keys, packed)
            keys.insert(at, packed)
            ids.insert(at, block_id)
            self._child_of[block_id] = (parent, packed)

    def partial_block(self, parent: BlockHash, tokens: Sequence[int]) -> tuple[int, int] | None:
        """The cached block after `parent` that begins with the most of `tokens`: (block id, how
        many of them), or None when none begins with the first. The caller increfs the block
        while it reads from it."""
        keys, ids = self._children.get(parent, ((), ()))
        if not keys or not tokens:
            return None
        query = _pack(tokens)
        at = bisect.bisect_left(keys, query)
        best = max(((_common(keys[i], query), ids[i]) for i in (at - 1, at) if 0 <= i < len(keys)))
        return (best[1], best[0]) if best[0] > 0 else None

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding `block_hash`, allocated or still in the free queue; the caller increfs it."""
        return self.cached.get(block_hash)

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hashes[block_id] = None
        child = self._child_of[block_id]
        if child is not None:
            parent, packed = child
            keys, ids = self._children[parent]
            at = bisect.bisect_left(keys, packed)
            while ids[at] != block_id:  # equal tokens after one parent are cached once, but be sure
                at += 1
            del keys[at], ids[at]
            if not keys:
                del self._children[parent]
            self._child_of[block_id] = None


def _pack(tokens: Sequence[int]) -> bytes:
    return struct.pack(f">{len(tokens)}I", *tokens)


def _common(a: bytes, b: bytes) -> int:
    """How many tokens (4 bytes each) a and b begin with alike."""
    n = min(len(a), len(b))
    first_diff = next((i for i in range(n) if a[i] != b[i]), n)
    return first_diff // 4
