"""GPU: norms, SiLU-and-multiply, rotary and the K/V cache write against the CPU backend."""
from __future__ import annotations

import pytest
import torch

from forge_service.backends.cpu import CpuBackend
from forge_service.backends.cuda import activation, cache, norm, rotary
from forge_service.layers.rotary import RotaryEmbedding
from tests.kernels.helpers import DTYPES, assert_close, poison_allocator

pytestmark = pytest.mark.gpu
ROWS = [1, 7, 33, 257]
EPS = 1e-5


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
@pytest.mark.parametrize("x_dtype", ["float32", "same"])
def test_rms_norm(kernels, dtype, rows, hidden, x_dtype):
    x = rand(rows, hidden, dtype=torch.float32 if x_dtype == "float32" else dtype, seed=rows) * 3
    w = (1 + 0.1 * rand(hidden, seed=1)).to(dtype)
    poison_allocator()
    got = norm.rms_norm(kernels, x.cuda(), w.cuda(), EPS)
    assert got.dtype == dtype
    assert_close(got, CpuBackend.rms_norm(x, w, EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_add_rms_norm_updates_the_residual(kernels, dtype, rows, hidden):
    residual = rand(rows, hidden, seed=rows)  # the fp32 residual stream
    delta = rand(rows, hidden, dtype=dtype, seed=rows + 1)
    w = (1 + 0.1 * rand(hidden, seed=2)).to(dtype)
    gpu_residual = residual.cuda()
    poison_allocator()
    got = norm.add_rms_norm(kernels, gpu_residual, delta.cuda(), w.cuda(), EPS)
    want = CpuBackend.add_rms_norm(residual, delta, w, EPS)  # updates `residual` in place too
    assert_close(gpu_residual, residual, torch.float32)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("ffn", [128, 1536, 14336])
def test_silu_and_mul(kernels, dtype, rows, ffn):
    x = rand(rows, 2 * ffn, dtype=dtype, seed=ffn) * 4
    poison_allocator()
    got = activation.silu_and_mul(kernels, x.cuda())
    assert got.shape == (rows, ffn)
    assert_close(got, CpuBackend.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
def test_rotary_in_place_on_views_of_qkv(kernels, dtype, heads, kv_heads, head_dim, scaling):
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, scaling)
    t = 37
    qkv = rand(t, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=head_dim)
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(3))
    gpu = qkv.cuda()  # before the reference, whose native bf16 kernel rotates qkv's rows in place
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(t, heads + kv_heads, head_dim)
    want_q, want_k = CpuBackend.rotary(qk, heads, CpuBackend.rotary_tables(rope.cos, rope.sin, positions, dtype))
    gq, gk, gv = gpu.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    rotary.rotary_(kernels, gq.view(t, heads, head_dim), gk.view(t, kv_heads, head_dim), positions.cuda(),
                   rope.cos.cuda(), rope.sin.cuda())
    scale = 3.0 if dtype != torch.float32 else 1.0  # the reference rounds each product to dtype
    assert_close(gq.reshape(t, heads, head_dim), want_q, dtype, scale)
    assert_close(gk.reshape(t, kv_heads, head_dim), want_k, dtype, scale)
    assert torch.equal(gv.cpu(), qkv[:, (heads + kv_heads) * head_dim:])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,head_dim", [(3, 64), (8, 128)])
def test_write_kv_by_slot_mapping(kernels, dtype, kv_heads, head_dim):
    slots, t = 16 * 20, 45
    k_cache = torch.full((slots, kv_heads, head_dim), float("nan"), dtype=dtype, device="cuda")
    v_cache = torch.full_like(k_cache, float("nan"))
    kv = rand(t, 2 * kv_heads * head_dim, dtype=dtype, seed=5).cuda()  # a view of k and v as in qkv rows
    k, v = (x.view(t, kv_heads, head_dim) for x in kv.split(kv_heads * head_dim, dim=-1))
    mapping = torch.randperm(slots, generator=torch.Generator().manual_seed(7))[:t]
    mapping[::9] = -1  # padding rows write nothing
    cache.write_kv(kernels, k_cache, v_cache, k, v, mapping.cuda())
    written = mapping[mapping >= 0]
    assert torch.equal(k_cache[written.cuda()].cpu(), k[(mapping >= 0).cuda()].cpu())
    assert torch.equal(v_cache[written.cuda()].cpu(), v[(mapping >= 0).cuda()].cpu())
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[written] = False
    assert k_cache[untouched.cuda()].isnan().all() and v_cache[untouched.cuda()].isnan().all()


def test_wrappers_reject_bad_inputs(kernels):
    from forge_service.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="CUDA tensor"):
        norm.rms_norm(kernels, torch.zeros(2, 8), torch.ones(8, device="cuda"), EPS)
    with pytest.raises(InvalidArgument, match="% 8"):
        norm.rms_norm(kernels, torch.zeros(2, 12, device="cuda"), torch.ones(12, device="cuda"), EPS)
    with pytest.raises(InvalidArgument, match="16-byte"):
        activation.silu_and_mul(kernels, torch.zeros(2, 33, dtype=torch.bfloat16, device="cuda")[:, 1:])
