"""Prefix-cache keys: a flat hash chain over full KV blocks. Plain bytes, no torch.

Block i's key is BLAKE2b-256 over (block i-1's key, block i's token ids, an optional extra key).
The first block chains from `ROOT`. A key is a flat 32-byte string whatever the prefix length, so
hashing and comparing it cost the same for block 1 and block 100,000 (nested-tuple keys recursed
once per block and overflowed the interpreter's recursion limit on long prompts).

Why a collision can be ignored:
- The input is encoded injectively: the parent key has a fixed 32 bytes, the token count comes
  before the tokens (4 bytes each, little-endian), and the extra key is last. So two different
  (prefix, block, extra) triples hash different byte strings.
- Equal keys then mean equal whole prefixes unless BLAKE2b-256 itself collides somewhere along
  the chain. By the birthday bound, N distinct blocks collide with probability at most
  N^2 / 2^257: a server hashing a million blocks per second for ten years (N ~ 3.2e14) stays below
  1e-48. Python's `hash()` would not do: it is 64 bits and unkeyed for ints, so a client could
  craft two prompts whose blocks share a key and read another client's KV.
- Finding any BLAKE2b-256 collision on purpose takes about 2^128 work; none is known.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

BlockHash = bytes  # 32 bytes
DIGEST_SIZE = 32
ROOT: BlockHash = hashlib.blake2b(b"forge kv-cache prefix root", digest_size=DIGEST_SIZE).digest()


def chain_root(salt: bytes = b"") -> BlockHash:
    """Where a request's key chain starts: `ROOT`, or for a salt (a LoRA adapter's name) a root of
    its own, so that no block or partial-block lookup of one salt can match another's."""
    return hash_block(ROOT, (), b"root:" + salt) if salt else ROOT


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """The key of a full block holding `token_ids` after the prefix whose last key is `parent`
    (`ROOT` for the first block). `extra` separates caches that must not share blocks (adapters,
    per-tenant salts); blocks with different extras never match."""
    assert len(parent) == DIGEST_SIZE, len(parent)
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    h.update(extra)
    return h.digest()

