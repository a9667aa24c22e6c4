"""Quantised weight kernels: a 4-bit GGUF's own codes, and the int8 lm_head, on the native kernels
(every batch size, no dense copy kept) and on torch's (small batches, where the native ones cannot
run)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from forge_service.backends import cpu_kernels
from forge_service.backends.base import Int4Weight
from forge_service.backends.cpu import CpuBackend
from forge_service.backends.cpu_linear import INT4_MAX_ROWS, INT8_MAX_ROWS
from forge_service.layers.linear import Linear
from forge_service.llm import LLM
from forge_service.loaders import Checkpoint, load_checkpoint
from forge_service.loaders import gguf as gguf_loader
from forge_service.engine.request import SamplingParams
from tests.tiny_models import random_weights, tiny_arch, write_gguf

ARCH = tiny_arch()
WEIGHTS = random_weights(ARCH)
K_ARCH = tiny_arch(hidden_size=256, intermediate_size=256)  # K-quant rows are multiples of 256
K_WEIGHTS = random_weights(K_ARCH, seed=1)
CPU = CpuBackend()
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _dense_and_coded(tmp_path: Path, qtype: str) -> tuple[Checkpoint, Checkpoint, set[str]]:
    """A tiny model written in `qtype`, loaded in fp32 (the reference) and in bf16, and the names
    of its projections."""
    arch, weights = (K_ARCH, K_WEIGHTS) if qtype.endswith("_K") else (ARCH, WEIGHTS)  # K-quant rows: 256s
    path = write_gguf(tmp_path / "m.gguf", arch, weights, qtype=qtype)
    dense = load_checkpoint(path, torch.float32)
    names = {n for n in dense.weights if n.split(".")[-2] in PROJECTIONS}
    assert len(names) == 7 * arch.num_layers
    return dense, load_checkpoint(path, torch.bfloat16), names


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_4bit_codes_reproduce_the_dequantised_weights_exactly(tmp_path: Path, qtype: str) -> None:
    dense, coded, names = _dense_and_coded(tmp_path, qtype)
    assert dense.int4 == {}  # fp32 is the reference: no 4-bit path
    assert set(coded.int4) == names
    for name in names:  # the Q/K row permutation is undone on codes, scales and zeros alike
        assert torch.equal(coded.int4[name].dequantize(), dense.weights[name]), name


def test_8bit_and_float_tensors_have_no_4bit_codes(tmp_path: Path) -> None:
    for qtype in ("Q8_0", "F16"):
        assert load_checkpoint(write_gguf(tmp_path / f"{qtype}.gguf", ARCH, WEIGHTS, qtype=qtype),
                               torch.bfloat16).int4 == {}
    assert load_checkpoint(tmp_path / "F16.gguf", torch.bfloat16).int8 == {}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K", "Q5_K"])
def test_5_to_8_bit_tensors_give_int8_codes(tmp_path: Path, qtype: str) -> None:
    dense, coded, names = _dense_and_coded(tmp_path, qtype)
    assert dense.int8 == {} and coded.int4 == {}
    assert set(coded.int8) == names
    for name in names:  # in HF row order (Q/K unpermuted), Q8_0 exactly, the K-quants within half a step
        w, want = coded.int8[name], dense.weights[name]
        step = w.scale.repeat_interleave(32, dim=1)
        if qtype == "Q8_0":
            assert torch.equal(w.dequantize(), want), name
        else:
            assert ((w.dequantize() - want).abs() <= step / 2 * 1.001).all(), name


def _int4_weight(n: int, k: int) -> Int4Weight:
    g = torch.Generator().manual_seed(n + k)
    return Int4Weight(codes=torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                      scale=torch.rand(n, k // 32, generator=g) * 0.01,
                      zero=torch.randn(n, k // 32, generator=g) * 0.01)


@pytest.fixture(params=["native", "torch"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which small-batch kernels Linear builds: the native ones (skipped where they cannot run
    here) or torch's, which every machine has."""
    if request.param == "native" and cpu_kernels.library() is None:
        pytest.skip("the native CPU kernels cannot run on this machine")
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "supports", lambda shape: False)
    return request.param


def _kernel_rows(linear: Linear, kernels: str, torch_rows: int) -> int | None:
    """The most rows the quantised form serves (None: every batch size)."""
    packed = linear.packed
    if kernels == "native":
        assert packed.native is not None and packed.int4pack is None and packed.int8 is None
        assert linear.weight is None  # the kernels take every batch: no dense copy is kept
        return None
    assert packed.native is None and linear.weight is not None
    return torch_rows


def test_4bit_weights_serve_every_batch_and_torch_s_kernel_only_small_ones(kernels: str) -> None:
    w4 = _int4_weight(96, 128)
    exact = w4.dequantize()
    linear = Linear(CPU, exact.bfloat16(), w4)
    max_rows = _kernel_rows(linear, kernels, INT4_MAX_ROWS)
    assert (linear.packed.int4pack is not None) == (kernels == "torch")
    for rows in (1, 3, 5, 24, 25, 64, 200):
        x = torch.randn(rows, 128).bfloat16()
        got = linear(x)
        if max_rows is not None and rows > max_rows:  # torch's kernels: the dense GEMM above them
            assert torch.equal(got, F.linear(x, linear.weight))
            continue
        want = x.float() @ exact.T
        assert (got.float() - want).abs().max() < 0.02 * want.abs().max()
        if kernels == "native":  # one path for every M: the same row alone gives the same bits
            assert torch.equal(got[-1:], linear(x[-1:]))


def test_the_cpu_keeps_no_small_batch_form_where_its_kernels_do_not_serve() -> None:
    w4 = _int4_weight(96, 128)
    assert Linear(CPU, w4.dequantize(), w4, int8_rows=True).packed is None  # fp32, the reference: dense only
    ragged = _int4_weight(40, 64)  # 40 output rows: not whole tiles of 16
    assert Linear(CPU, ragged.dequantize().bfloat16(), ragged).packed is None
    assert Linear(CPU, ragged.dequantize().bfloat16(), ragged, int8_rows=True).packed.levels == 1


def test_int4_weights_fuse_along_the_output_dimension() -> None:
    parts = [_int4_weight(n, 64) for n in (32, 16, 16)]
    fused = Int4Weight.cat(parts)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_int8_rows_stay_close_to_the_dense_product(kernels: str) -> None:
    w = (torch.randn(320, 64) * 0.05).bfloat16()
    linear = Linear(CPU, w, int8_rows=True)
    max_rows = _kernel_rows(linear, kernels, INT8_MAX_ROWS)
    assert (linear.packed.int8 is not None) == (kernels == "torch")
    for rows in (*range(1, INT8_MAX_ROWS + 1), 25, 64):
        x = torch.randn(rows, 64).bfloat16()
        if max_rows is not None and rows > max_rows:
            assert torch.equal(linear(x), F.linear(x, w))
            continue
        want = x.float() @ w.float().T
        assert (linear(x).float() - want).abs().max() < 0.02 * want.abs().max()


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_bf16_engine_on_a_quantised_file_computes_with_its_codes_and_tracks_fp32(tmp_path: Path, kernels: str,
                                                                                 qtype: str) -> None:
    path = str(write_gguf(tmp_path / "m.gguf", ARCH, WEIGHTS, qtype=qtype))
    fast = LLM(model=path, dtype="bfloat16")
    model = fast.engine.model
    small = [model.lm_head] + [linear for layer in model.layers for linear in (layer.qkv, layer.down)]
    if kernels == "native":
        assert all(linear.packed.native is not None and linear.weight is None for linear in small)
        assert {linear.packed.native.bits for linear in small[1:]} == {4 if qtype == "Q4_1" else 8}
    elif qtype == "Q4_1":
        assert all(linear.packed.int4pack is not None for linear in small[1:]) and model.lm_head.packed.int8 is not None
    else:  # no torch kernel for int8 groups: the dense GEMM
        assert all(linear.packed is None for linear in small[1:])
    reference = LLM(model=path, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompt = [[5, 17, 40, 99, 120, 7]]
    a = fast.generate(prompt, params)[0].outputs[0]
    b = reference.generate(prompt, params)[0].outputs[0]
    # The same first choices, scored alike: the 4-bit path must not drift far from fp32.
    assert a.token_ids[:3] == b.token_ids[:3]
    diffs = [abs(x[0].logprob - y[0].logprob) for x, y in zip(a.logprobs[:3], b.logprobs[:3])]
    assert max(diffs) < 0.05, diffs


def test_a_projection_fused_from_mixed_quantisations_runs_on_int8_codes(tmp_path: Path) -> None:
    """A Q4_K_M-style file: Q4_K q/k beside a Q6_K v. The fused qkv is re-quantised to int8 per 32
    inputs, so no dense copy is kept and the fused decode still runs every layer."""
    if cpu_kernels.library() is None:
        pytest.skip("the native CPU kernels cannot run on this machine")
    overrides = {f"model.layers.{i}.self_attn.v_proj.weight": "Q6_K" for i in range(K_ARCH.num_layers)}
    path = str(write_gguf(tmp_path / "m.gguf", K_ARCH, K_WEIGHTS, qtype="Q4_K", tensor_qtypes=overrides))
    model = LLM(model=path, dtype="bfloat16").engine.model
    reference = load_checkpoint(path, torch.float32).weights
    assert model.decode_plan is not None
    for i, layer in enumerate(model.layers):
        assert layer.qkv.packed.native.bits == 8 and layer.qkv.weight is None
        assert layer.gate_up.packed.native.bits == 4
        want = torch.cat([reference[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert (cpu_kernels.dequantize(layer.qkv.packed.native) - want).abs().max() <= want.abs().max() / 127


def test_a_lazy_checkpoint_leaves_coded_projections_to_decode_on_demand(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", ARCH, WEIGHTS, qtype="Q4_1")
    eager, lazy = load_checkpoint(path, torch.bfloat16), load_checkpoint(path, torch.bfloat16, lazy_coded=True)
    assert set(lazy.decoders) == set(lazy.int4) and len(lazy.decoders) == 7 * ARCH.num_layers
    for name, weight in eager.weights.items():
        got = lazy.weights[name]
        assert (got.shape, got.dtype) == (weight.shape, weight.dtype)
        assert got.is_meta == (name in lazy.decoders)
        assert torch.equal(lazy.decoders[name]() if got.is_meta else got, weight), name


def test_an_engine_decodes_only_the_projections_its_kernels_cannot_serve_from_codes(
        tmp_path: Path, kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(write_gguf(tmp_path / "m.gguf", ARCH, WEIGHTS, qtype="Q4_1"))
    decoded, decode = [], gguf_loader._decode
    monkeypatch.setattr(gguf_loader, "_decode", lambda t, name, *args: decoded.append(name) or decode(t, name, *args))
    model = LLM(model=path, dtype="bfloat16").engine.model
    projections = [name for name in decoded if name.split(".")[-2] in PROJECTIONS]
    if kernels == "native":  # served from codes alone: never decoded
        assert projections == [] and all(layer.qkv.weight is None for layer in model.layers)
        return
    assert len(projections) == 7 * ARCH.num_layers  # torch's 4-bit kernel serves small batches only
    eager = load_checkpoint(path, torch.bfloat16).weights
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        assert torch.equal(layer.qkv.weight, torch.cat([eager[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]))
        assert torch.equal(layer.down.weight, eager[f"{p}mlp.down_proj.weight"])
