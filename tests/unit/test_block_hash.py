"""Prefix-cache keys: a flat BLAKE2b-256 chain; long prompts hit the cache without recursing."""
from __future__ import annotations

import hashlib
import struct

from forge_service.kv_cache.block_hash import ROOT, hash_block
from forge_service.kv_cache.manager import KVCacheManager


def fill_and_cache(kv: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    assert kv.allocate_slots(request_id, len(tokens)) is not None
    kv.cache_computed(request_id, len(tokens), lambda a, b: tokens[a:b])


def test_a_20k_token_prompt_hits_the_cache():
    # 1,250 blocks: nested-tuple keys recursed once per block and raised RecursionError here.
    tokens = [(i * 7919) % 50_000 for i in range(20_000)]
    kv = KVCacheManager(num_blocks=2600, block_size=16, prefix_caching=True)
    fill_and_cache(kv, "a", tokens)
    kv.free("a")
    assert kv.match_prefix("b", tokens) == 20_000 - 1  # all but the last token (15 of it copied)
    assert kv.match_prefix("c", tokens + [1, 2, 3]) == 20_000


def test_keys_are_flat_32_byte_digests_of_parent_and_tokens():
    key = hash_block(ROOT, [1, 2, 3])
    assert isinstance(key, bytes) and len(key) == 32
    expected = hashlib.blake2b(ROOT + struct.pack("<4I", 3, 1, 2, 3), digest_size=32).digest()
    assert key == expected
    assert hash_block(key, [4, 5, 6]) == hashlib.blake2b(key + struct.pack("<4I", 3, 4, 5, 6),
                                                         digest_size=32).digest()


def test_equal_blocks_after_different_prefixes_get_different_keys():
    a = hash_block(hash_block(ROOT, [1, 2]), [7, 8])
    b = hash_block(hash_block(ROOT, [1, 3]), [7, 8])
    assert a != b
    assert a == hash_block(hash_block(ROOT, [1, 2]), [7, 8])
    # Token-count prefix: a block cannot be confused with a longer one that shares its bytes.
    assert hash_block(ROOT, [1, 2]) != hash_block(ROOT, [1, 2, 0])
    # The extra key separates caches.
    assert hash_block(ROOT, [1, 2], b"adapter-a") != hash_block(ROOT, [1, 2], b"adapter-b")
    assert hash_block(ROOT, [1, 2], b"") != hash_block(ROOT, [1, 2], b"x")


def test_a_prefix_matches_up_to_the_first_differing_block():
    bs = 4
    tokens = list(range(100, 140))  # 10 blocks
    kv = KVCacheManager(num_blocks=40, block_size=bs, prefix_caching=True)
    fill_and_cache(kv, "a", tokens)
    changed = list(tokens)
    changed[5 * bs + 2] = 999  # block 5 differs
    assert kv.match_prefix("b", changed) == 5 * bs + 2  # and block 5's first 2 tokens, copied
    assert kv.block_ids("b")[:5] == kv.block_ids("a")[:5]
    assert kv.pending_copy("b") == (kv.block_ids("a")[5], kv.block_ids("b")[5], 2)
    first = [0] + tokens[1:]
    assert kv.match_prefix("c", first) == 0
    assert kv.block_ids("c") == []
    assert kv.match_prefix("d", list(tokens)) == 10 * bs - 1  # equal prompts: all but the last token


def test_the_engine_serves_a_prefix_hit_over_1200_blocks(tmp_path):
    # Block size 1 makes a 1,300-token prompt 1,299 cached blocks: the old keys' RecursionError
    # escaped the engine's step here, on a model whose context is only 2k tokens.
    from forge_service import LLM, SamplingParams
    from tests.tiny_models import random_weights, tiny_arch, tiny_tokenizer_json, write_safetensors_dir

    arch = tiny_arch(max_position_embeddings=2048)
    write_safetensors_dir(tmp_path, arch, random_weights(arch), tokenizer_json=tiny_tokenizer_json())
    llm = LLM(model=str(tmp_path), dtype="float32", block_size=1, num_blocks=4000, max_num_batched_tokens=1024)
    prompt = [3 + (i * 37) % 300 for i in range(1300)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert second.num_cached_tokens == 1299 and first.num_cached_tokens == 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.outputs[0].finish_reason == "length"
