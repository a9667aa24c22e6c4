"""CI, no GPU: the CUDA backend's per-step metadata, derived from what the model runner really
builds (a tiny engine with chunked prefill, on the CPU), describes the same slots; and the CUDA
sampler's per-row parameters follow the batch's sampling parameters."""
from __future__ import annotations

import pytest
import torch

from forge_service import LLM, SamplingParams, backends
from forge_service.backends.base import AttentionMetadata
from forge_service.backends.cpu import CpuBackend
from forge_service.backends.cuda.metadata import ModelShape, prepare
from forge_service.backends.cuda.prefill_attention import tokens_per_tile
from forge_service.backends.cuda.sampler import CudaSampler
from forge_service.sampling import RowSampling, SamplingMetadata
from tests.tiny_models import random_weights, tiny_arch, tiny_tokenizer_json, write_safetensors_dir

GROUP = 2  # tiny_arch: 4 heads over 2 KV heads


class CheckingBackend(CpuBackend):
    """The CPU backend, which also builds the CUDA metadata of every step and checks it."""

    steps: list[str] = []

    @classmethod
    def prepare(cls, meta: AttentionMetadata) -> AttentionMetadata:
        shape = ModelShape(num_kv_heads=2, group=GROUP, dtype=torch.bfloat16)
        check(meta, prepare(meta, shape, torch.device("cpu")))
        cls.steps.append(f"{meta.num_decode_tokens} decodes, {len(meta.prefills)} chunks")
        return meta


def check(meta: AttentionMetadata, cuda) -> None:
    bs, d = meta.block_size, meta.num_decode_tokens
    if d:
        assert torch.equal(cuda.decode_lens.long(), meta.decode_mask.reshape(d, -1).sum(-1))
        assert torch.equal(cuda.decode_tables.long(), meta.decode_block_tables)
    if not meta.prefills:
        assert cuda.prefill is None
        return
    batch, step = cuda.prefill, tokens_per_tile(GROUP)
    for c, seq in enumerate(meta.prefills):
        q_len = seq.q_end - seq.q_start
        assert (batch.q_start[c], batch.q_len[c]) == (seq.q_start, q_len)
        want = meta.slot_mapping[seq.q_start:seq.q_end] if seq.ctx_slots is None else seq.ctx_slots
        ctx = int(batch.ctx_len[c])
        p = torch.arange(ctx)
        assert torch.equal(batch.block_tables[c].long()[p // bs] * bs + p % bs, want)
        # this step's tokens are the context's last q_len positions
        assert torch.equal(want[ctx - q_len:], meta.slot_mapping[seq.q_start:seq.q_end])
        tiles = [int(t) for ch, t in batch.tiles.tolist() if ch == c]
        assert tiles == list(range(0, q_len, step))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    arch = tiny_arch()
    root = tmp_path_factory.mktemp("tiny")
    write_safetensors_dir(root, arch, random_weights(arch), tokenizer_json=tiny_tokenizer_json())
    return root


def test_metadata_of_mixed_chunked_steps(tiny_dir, monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "checking", CheckingBackend)
    CheckingBackend.steps = []
    llm = LLM(model=str(tiny_dir), dtype="float32", device="checking", block_size=4, max_num_batched_tokens=24)
    prompts = [list(range(3, 3 + n)) for n in (5, 31, 9, 60, 17)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    steps = CheckingBackend.steps
    assert any(s.split()[0] != "0" and "0 chunks" not in s for s in steps), steps  # decodes with chunks


def test_sampler_row_parameters():
    rows = [RowSampling(SamplingParams(temperature=0.0), [1], []),
            RowSampling(SamplingParams(temperature=0.5, top_k=7, top_p=0.9, min_p=0.1, seed=2**64 - 1), [1], [5, 6]),
            RowSampling(SamplingParams(temperature=1.0), [1], [5])]
    rows[1].seed = rows[1].params.seed
    meta = SamplingMetadata.build(rows, 100)
    temperature, top_k, top_p, min_p, seeds, steps = CudaSampler(kernels=None)._row_params(meta, torch.device("cpu"))
    assert temperature.tolist() == [0.0, 0.5, 1.0]
    assert top_k.tolist()[1] == 7 and top_k.tolist()[2] >= 100  # off: >= vocab
    assert top_p.tolist()[1] == pytest.approx(0.9) and min_p.tolist()[1] == pytest.approx(0.1)
    assert seeds.tolist()[1] == -1  # 2**64 - 1, as the kernel's uint64
    assert steps.tolist() == [0, 2, 1]


def test_float32_prefill_chunks_take_the_torch_reference():
    """The CUDA backend attends fp32 prefill chunks with torch_ref's SDPA, as the CPU backend does:
    run here on CPU tensors, with no kernels (no decode rows, no 16-bit prefill batch)."""
    from forge_service.backends.base import PrefillSeq
    from forge_service.backends.cuda.backend import CudaBackend
    from forge_service.backends.cuda.metadata import CudaAttentionMetadata

    g = torch.Generator().manual_seed(0)
    bs, hkv, h, hd, slots = 4, 2, 4, 8, 64
    k_cache, v_cache = torch.randn(slots, hkv, hd, generator=g), torch.randn(slots, hkv, hd, generator=g)
    q = torch.randn(9, h, hd, generator=g)
    k, v = torch.randn(9, hkv, hd, generator=g), torch.randn(9, hkv, hd, generator=g)
    ctx = torch.tensor([8, 9, 10, 11, 20, 21, 22])  # 2 cached tokens, then this chunk's 5
    causal = torch.arange(7)[None] <= torch.arange(2, 7)[:, None]  # [5, 7]
    seqs = [PrefillSeq(0, 4), PrefillSeq(4, 9, ctx_slots=ctx, mask=causal)]
    slot_mapping = torch.cat([torch.arange(4), ctx[2:]])
    backend = object.__new__(CudaBackend)  # no GPU here: only the torch path may run
    got = backend.attention(q, k, v, k_cache, v_cache,
                            CudaAttentionMetadata(slot_mapping, bs, 0, torch_prefills=seqs), hd ** -0.5)
    want = CpuBackend.attention(q, k, v, k_cache, v_cache, AttentionMetadata(slot_mapping, bs, 0, prefills=seqs),
                                hd ** -0.5)
    assert got.shape == (9, h * hd) and torch.equal(got, want)
