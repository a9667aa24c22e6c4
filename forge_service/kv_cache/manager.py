"""Per-request block tables over a BlockPool. Plain ints, no torch."""
from __future__ import annotations

from typing import Callable

from forge_service.kv_cache.block_hash import ROOT, BlockHash, hash_block
from forge_service.kv_cache.block_pool import BlockPool


class KVCacheManager:
    """Maps each request id to its block table: block i holds tokens [i*block_size, (i+1)*block_size).

    Tables only grow (by whole blocks, as the request's token count crosses block boundaries)
    until `free` returns them to the pool.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        assert block_size > 0, block_size
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.prefix_caching = prefix_caching
        self._tables: dict[str, list[int]] = {}
        self._keys: dict[str, list[BlockHash]] = {}  # keys of each request's full, computed blocks
        # A request whose prefix-cache hit ends inside a block: (cached block, the request's own
        # block, tokens) to copy before its first step; the cached block is held until then.
        self._copies: dict[str, tuple[int, int, int]] = {}

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

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Shrink the request's table to the blocks that hold its first `num_tokens` tokens (after
        a rejected speculative draft); returns how many blocks went back to the pool. Blocks
        registered in the prefix cache hold only computed tokens and are never among them."""
        table = self._tables.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if not table or len(table) <= keep:
            return 0
        assert keep >= len(self._keys.get(request_id, ())), (request_id, keep)
        extra = table[keep:]
        del table[keep:]
        self.pool.free(reversed(extra))
        return len(extra)

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def free(self, request_id: str) -> None:
        """Return the request's blocks to the pool; idempotent.

        Tail first, so that a request's last blocks (the least likely to be shared by a
        future prefix hit) are evicted before its first ones.
        """
        table = self._tables.pop(request_id, None)
        self._keys.pop(request_id, None)
        self.copy_done(request_id)
        if table:
            self.pool.free(reversed(table))

    # ---- automatic prefix caching ----
    def match_prefix(self, request_id: str, token_ids: list[int], root: BlockHash = ROOT) -> int:
        """Before a request's first allocation: share the cached blocks holding a prefix of
        `token_ids`. Returns how many tokens they cover (always fewer than len(token_ids), so at
        least one token is computed and yields logits).

        Where the cached text goes on past the last whole block shared, into a cached block that
        the prompt leaves partway (a system prompt that ends inside a block, say), the request
        gets a block of its own for it, and that block's first tokens are copied from the cached
        one (`pending_copy`) instead of computed: their keys and values are what the request
        would compute, as the same tokens after the same prefix at the same positions."""
        if not self.prefix_caching or self._tables.get(request_id):
            return 0
        blocks: list[int] = []
        keys: list[BlockHash] = []
        parent = root  # the key of the last block matched (`root`: the request's chain, see chain_root)
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            key = hash_block(parent, token_ids[i * bs:(i + 1) * bs])
            block = self.pool.get_cached_block(key)
            if block is None:
                break
            blocks.append(block)
            keys.append(key)
            parent = key
        self.pool.incref(blocks)  # first: allocating below must not evict them
        matched = len(blocks) * bs
        rest = token_ids[matched:matched + min(bs - 1, len(token_ids) - 1 - matched)]
        partial = self.pool.partial_block(parent, rest) if rest else None
        if partial is not None:
            source, count = partial
            self.pool.incref([source])
            own = self.pool.allocate(1)
            if own is None:
                self.pool.free([source])
            else:
                blocks.append(own[0])
                self._copies[request_id] = (source, own[0], count)
                matched += count
        if blocks:
            self._tables[request_id], self._keys[request_id] = blocks, keys
        return matched

    def pending_copy(self, request_id: str) -> tuple[int, int, int] | None:
        """(cached block, the request's block, tokens): the request's partial prefix-cache hit,
        whose first `tokens` slots the runner copies before the request's first step; None if
        it has none."""
        return self._copies.get(request_id)

    def copy_done(self, request_id: str) -> None:
        """The runner copied the request's partial hit: let go of the cached block it read."""
        copy = self._copies.pop(request_id, None)
        if copy is not None:
            self.pool.free([copy[0]])

    def cache_computed(self, request_id: str, num_computed: int,
                       token_ids_slice: Callable[[int, int], list[int]], root: BlockHash = ROOT) -> None:
        """Register the request's blocks that its first `num_computed` tokens have filled."""
        if not self.prefix_caching:
            return
        keys = self._keys.setdefault(request_id, [])
        table = self._tables.get(request_id, [])
        bs = self.block_size
        for i in range(len(keys), min(num_computed // bs, len(table))):
            parent, tokens = keys[-1] if keys else root, token_ids_slice(i * bs, (i + 1) * bs)
            key = hash_block(parent, tokens)
            keys.append(key)
            self.pool.cache_block(table[i], key, parent, tokens)
