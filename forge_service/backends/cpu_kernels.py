"""The CPU backend's native kernels (native/cpu/), loaded and called on torch tensors; cpu_build.py
builds them for this CPU at first use.

quant_gemm.c multiplies a few activation rows by group-quantised weights: 4-bit codes with a scale
and an offset per group of 32 inputs, or int8 codes with a scale, against activations quantised to
int8 per group (AVX-512 VNNI). Decode steps are bound by reading weights; these kernels read them
at close to memory speed where torch's 4-bit kernel dequantises each weight to float first.
ops.c holds the bf16 path's norms, SiLU and rotary, decode_attention.c and prefill_attention.c its
attention (what they share in attention.h), one call each; cpu_decode_plan.py runs a whole step's
layers in one call (decode.c). Where the kernels cannot run (no C compiler, a CPU without AVX2,
FORGE_CPU_KERNELS=torch), the callers keep torch's kernels: `library()` returns None.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from dataclasses import dataclass

import torch

from forge_service.backends import cpu_build
from forge_service.backends.base import Int8Weight

log = logging.getLogger(__name__)

NEITHER_BUILD = "this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C; using torch's kernels"
GROUP = 32  # inputs per scale
# With two activation levels, the second covers only the groups that hold one of the row's large
# values: amax > FINE_ABOVE x the row's RMS. The first level's rounding error is amax / 254 per
# value, so these groups carry most of it; in the default model's steps they are about a fifth of
# a row's groups (a third to a half of a block of 8 rows' together: the kernels give the second
# level to the rows that have it only). See linear() for what it costs in fidelity.
FINE_ABOVE = 4.0
TILE = 16  # weight rows per tile
ROWS = 8  # activation rows per pass over a tile (ROWS in quant_gemm.c)
OUT_FP32, OUT_BF16, OUT_BF16_AS_FP32 = 0, 1, 2  # how a GEMM stores its output (quant_gemm.c's out_form)


@dataclass
class QuantWeight:
    """w[n, k] = code * scale[n, k // 32] + offset[n, k // 32], in the kernels' tiled layout.

    q4: codes 0..15, two per byte. q8: codes -127..127 stored as code + 128, offset -128 * scale
    implied. See native/cpu/quant_gemm.c for the layout."""

    bits: int
    shape: tuple[int, int]  # [N, K]
    codes: torch.Tensor  # uint8 [N / 16, K / 32, 256 (q4) or 512 (q8)]
    scale: torch.Tensor  # float16 [N / 16, K / 32, 16]
    offset: torch.Tensor | None  # likewise, q4 only


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot run here."""
    choice = os.environ.get("FORGE_CPU_KERNELS", "native")
    if choice == "torch":
        return None
    if choice not in ("native", "avx2"):
        log.warning("FORGE_CPU_KERNELS=%s is not native, avx2 or torch; taking native", choice)
    flags = cpu_build.cpu_flags()
    if flags and not cpu_build.AVX2_CPU_FLAGS <= flags:  # neither build can run: not worth building
        log.info(NEITHER_BUILD)
        return None
    try:
        lib = ctypes.CDLL(str(cpu_build.build_for_this_cpu()))
    except subprocess.CalledProcessError as error:
        log.warning("native CPU kernels did not build, using torch's: %s\n%s", error, error.stderr)
        return None
    except OSError as error:
        log.warning("native CPU kernels unavailable, using torch's: %s", error)
        return None
    if not lib.forge_supported():
        log.info(NEITHER_BUILD)
        return None
    return declare(lib)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` (a build of the kernels) with its functions' argument and result types set."""
    i64, ptr, flag, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.forge_q4_linear.argtypes = [ptr, flag, i64, i64, i64, ptr, ptr, ptr, ptr, flag, flag, f32, flag]
    lib.forge_q8_linear.argtypes = [ptr, flag, i64, i64, i64, ptr, ptr, ptr, flag, flag, f32, flag]
    lib.forge_add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32, flag]
    lib.forge_silu_mul.argtypes = [ptr, ptr, i64, i64, flag]
    lib.forge_rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, flag]
    lib.forge_add_bias.argtypes = [ptr, i64, i64, i64, ptr, flag]
    lib.forge_head_rms_norm.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, f32, flag]
    lib.forge_lora_add.argtypes = [ptr, flag, i64, ptr, i64, i64, ptr, i64, ptr, i64, ptr, flag, i64, flag]
    lib.forge_decode_attention.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, f32, ptr, flag]
    lib.forge_prefill_attention.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, ptr, flag]
    lib.forge_decode_layers.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, i64, ptr, i64, ptr, ptr,
                                        ptr, i64, flag]
    lib.forge_decode_layers_stalled.argtypes = [*lib.forge_decode_layers.argtypes, ctypes.c_double, ptr]
    lib.forge_split_rows.argtypes = [i64, i64, ptr, i64, ptr, i64, ptr, ctypes.c_double, flag, ptr]
    lib.forge_split_rows.restype = i64
    lib.forge_refine_top.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, flag]
    lib.forge_final_norm.argtypes = [ptr, ptr, i64, ptr, i64, i64, ptr, f32, ptr, ptr]
    for name in ("forge_q4_linear", "forge_q8_linear", "forge_decode_attention", "forge_prefill_attention",
                 "forge_decode_layers", "forge_decode_layers_stalled", "forge_final_norm"):
        getattr(lib, name).restype = ctypes.c_int
    for name in ("forge_add_rms_norm", "forge_silu_mul", "forge_rotary", "forge_add_bias", "forge_head_rms_norm",
                 "forge_lora_add", "forge_refine_top"):
        getattr(lib, name).restype = None
    return lib


def supports(weight_shape: torch.Size | tuple[int, int]) -> bool:
    """Whether the kernels can take a weight of this [N, K] shape on this machine."""
    n, k = weight_shape
    return n % TILE == 0 and k % GROUP == 0 and library() is not None


def _tiled(t: torch.Tensor) -> torch.Tensor:
    # [N, K / 32] per-group values -> [N / 16, K / 32, 16] fp16
    n, groups = t.shape
    return t.view(n // TILE, TILE, groups).transpose(1, 2).half().contiguous()


def _chunks(codes: torch.Tensor) -> torch.Tensor:
    # [N, K] bytes -> [N / 16, K / 32, 8 chunks, 16 rows, 4]: chunk c holds inputs 4c .. 4c + 3 of a group
    n, k = codes.shape
    return codes.view(n // TILE, TILE, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4)


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> QuantWeight:
    """From w = (code - 8) * scale + zero (codes [N, K] 0..15; scale, zero fp32 [N, K / 32]).

    Scales and offsets are kept in fp16: exactly for Q4_0 and Q4_1, whose scales and minimums are
    fp16 in the file; Q4_K's products of a scale and a 6-bit sub-scale round to 11 bits."""
    n, k = codes.shape
    c = _chunks(codes)
    packed = (c[:, :, :4] | (c[:, :, 4:] << 4)).reshape(n // TILE, k // GROUP, -1).contiguous()
    return QuantWeight(4, (n, k), packed, _tiled(scale), _tiled(zero - 8 * scale))


def pack_q8(weight: torch.Tensor) -> QuantWeight:
    """Symmetric int8 with an fp16 scale per group of 32 inputs, from a dense [N, K] weight."""
    return pack_q8_codes(Int8Weight.quantize(weight))


def pack_q8_codes(w: Int8Weight) -> QuantWeight:
    """From int8 codes and fp16-exact scales per group of 32 (w = codes * scale)."""
    n, k = w.codes.shape
    codes = (w.codes.to(torch.int16) + 128).to(torch.uint8)
    return QuantWeight(8, (n, k), _chunks(codes).reshape(n // TILE, k // GROUP, -1).contiguous(), _tiled(w.scale),
                       None)


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The [N, K] fp32 weight the kernels multiply by (for tests and checks)."""
    n, k = w.shape
    t, groups = n // TILE, k // GROUP
    c = w.codes.view(t, groups, -1, TILE, 4)
    if w.bits == 4:
        c = torch.cat([c & 0x0F, c >> 4], dim=2)  # chunks 0..3, then 4..7
    codes = c.permute(0, 3, 1, 2, 4).reshape(n, k).float()  # [N, K]
    scale = w.scale.transpose(1, 2).reshape(n, groups).float()
    offset = -128 * scale if w.offset is None else w.offset.transpose(1, 2).reshape(n, groups).float()
    return (codes.view(n, groups, GROUP) * scale[..., None] + offset[..., None]).view(n, k)


def linear(x: torch.Tensor, w: QuantWeight, levels: int = 2, fine_above: float = FINE_ABOVE,
           widened: bool = False) -> torch.Tensor:
    """x [M, K] (bf16 or fp32) @ w.T -> [M, N] in x's dtype, x quantised to int8 per group of 32.
    widened (bf16 x): fp32 out, holding the bf16 results as they are (what `.float()` of them gives).

    levels=1: one level, coarse where a group holds a large value. levels=2: a second level, carrying
    the first one's rounding error, in the groups whose largest value passes `fine_above` x the
    row's RMS (0: every group, as exact as bf16 activations and half as fast). Measured on the
    default model's layers against fp32, over 805 teacher-forced positions of greedy continuations
    (KL of the next-token distribution, and top tokens that differ):
      second level everywhere  KL 3.5e-4 mean, 4.8e-3 max; 9 flips
      FINE_ABOVE = 4           KL 6.7e-4 mean, 7.4e-3 max; 9 flips
      FINE_ABOVE = 5           KL 9.1e-4 mean, 9.0e-2 max; 12 flips
      one level                KL 2.7e-3 mean, 3.1e-2 max; 22 flips
      the dense bf16 GEMM      KL 3.9e-4 mean, 2.3e-2 max; 8 flips
    The served path (FINE_ABOVE = 4, the lm_head int8 with one level and its leading logits
    refined in fp32): KL 8.1e-4 mean, 7.45e-3 max; 9 flips."""
    if x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected a bf16 or fp32 input [M, {w.shape[1]}], got {x.dtype} {tuple(x.shape)}")
    if levels not in (1, 2):
        raise ValueError(f"activations take 1 or 2 int8 levels, not {levels}")
    if not fine_above >= 0:
        raise ValueError(f"fine_above must be 0 or more, not {fine_above}")
    x = x.contiguous()
    bf16 = x.dtype == torch.bfloat16
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32 if widened else x.dtype)
    lib = library()
    common = (x.data_ptr(), bf16, x.shape[0], w.shape[1], w.shape[0], w.codes.data_ptr(), w.scale.data_ptr())
    form = (OUT_BF16_AS_FP32 if widened else OUT_BF16) if bf16 else OUT_FP32
    tail = (out.data_ptr(), form, levels, fine_above, torch.get_num_threads())
    if w.offset is not None:
        status = lib.forge_q4_linear(*common, w.offset.data_ptr(), *tail)
    else:
        status = lib.forge_q8_linear(*common, *tail)
    if status:
        raise ValueError({1: "unsupported shape", 2: "out of memory"}.get(status, f"kernel status {status}"))
    return out


# ---- the bf16 decode path's other ops: each one call instead of several torch ops ----

def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def bf16(*tensors: torch.Tensor) -> bool:
    # A loop, not all() over a generator: this runs a few hundred times a decode step.
    for t in tensors:
        if t.dtype != torch.bfloat16 or not t.is_cpu:
            return False
    return True


def _residual_stream(x: torch.Tensor) -> bool:
    """Whether the norms' kernels read x as an fp32 residual stream [T, D], D % 16 == 0."""
    return (library() is not None and x.dtype == torch.float32 and x.is_cpu and x.dim() == 2
            and x.is_contiguous() and x.shape[1] % 16 == 0)


def norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """RMSNorm of an fp32 residual stream [T, D] with a bf16 weight."""
    return _residual_stream(x) and bf16(weight)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta in place (when given), then its RMSNorm -> [T, D] bf16 (HF roundings)."""
    t, d = residual.shape
    out = torch.empty(t, d, dtype=torch.bfloat16)
    if delta is not None:
        delta = delta.contiguous()
        assert delta.shape == residual.shape and bf16(delta)
    library().forge_add_rms_norm(residual.data_ptr(), ptr(delta),
                                 weight.contiguous().data_ptr(), out.data_ptr(), t, d, eps, torch.get_num_threads())
    return out


def final_norm_supported(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                         dtype: torch.dtype) -> bool:
    """The final norm of an fp32 residual stream [T, D] plus a bf16 delta, with an fp32 weight, for a
    bf16 lm_head."""
    return (dtype == torch.bfloat16 and _residual_stream(x) and weight.dtype == torch.float32
            and weight.is_contiguous()
            and (delta is None or (bf16(delta) and delta.shape == x.shape and delta.is_contiguous())))


def final_norm(x: torch.Tensor, delta: torch.Tensor | None, rows: torch.Tensor, weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = RMSNorm(x[rows] + delta[rows]) [N, D] fp32 (torch_ref.rms_norm's roundings, an fp32 weight),
    and h rounded to bf16; x is left as it is. A row outside x raises IndexError."""
    rows = rows.to(torch.int64).contiguous()
    n, d = rows.shape[0], x.shape[1]
    h, low = torch.empty(n, d), torch.empty(n, d, dtype=torch.bfloat16)
    if library().forge_final_norm(x.data_ptr(), ptr(delta), x.shape[0], rows.data_ptr(), n, d, weight.data_ptr(),
                                  eps, h.data_ptr(), low.data_ptr()):
        raise IndexError(f"logit rows out of range for {x.shape[0]} rows")
    return h, low


def silu_mul_supported(gate_up: torch.Tensor) -> bool:
    return library() is not None and bf16(gate_up) and gate_up.dim() == 2 and gate_up.shape[1] % 32 == 0


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2F] bf16 -> silu(gate) * up, [T, F] bf16."""
    gate_up = gate_up.contiguous()
    t, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, f, dtype=torch.bfloat16)
    library().forge_silu_mul(gate_up.data_ptr(), out.data_ptr(), t, f, torch.get_num_threads())
    return out


def rotary_supported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x [T, heads, hd] with whole heads contiguous; cos, sin [T, 1, hd] contiguous; all bf16."""
    hd = x.shape[-1]
    return (library() is not None and bf16(x, cos, sin) and x.dim() == 3 and x.stride(2) == 1
            and x.stride(1) == hd and hd % 32 == 0 and cos.is_contiguous() and sin.is_contiguous())


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads, hd] in place by the tables cos, sin [T, 1, hd]."""
    t, heads, hd = x.shape
    library().forge_rotary(x.data_ptr(), t, heads, hd, x.stride(0), cos.data_ptr(), sin.data_ptr(),
                           torch.get_num_threads())


def head_norm_supported(qk: torch.Tensor, weight: torch.Tensor) -> bool:
    """qk [T, heads, hd] bf16 with whole heads contiguous (rows may be strided); weight [hd] bf16."""
    return (library() is not None and bf16(qk, weight) and qk.dim() == 3 and qk.stride(2) == 1
            and qk.stride(1) == qk.shape[2] and qk.shape[2] % 16 == 0 and weight.is_contiguous())


def head_rms_norm_(qk: torch.Tensor, split: int, first: torch.Tensor, rest: torch.Tensor, eps: float) -> None:
    """RMSNorm each head of qk [T, heads, hd] in place: heads below `split` weighed by `first`
    [hd], the others by `rest` (HF roundings, as add_rms_norm)."""
    t, heads, hd = qk.shape
    library().forge_head_rms_norm(qk.data_ptr(), t, heads, split, hd, qk.stride(0), first.data_ptr(),
                                  rest.data_ptr(), eps, torch.get_num_threads())


MAX_LORA_RANK = 256  # ops.c's MAX_LORA_RANK (config.MAX_LORA_RANK bounds --max-lora-rank by it)


def lora_shape(k: int, n: int, rank: int) -> bool:
    """forge_lora_add's shapes: K and N whole 16-lane vectors, the rank within MAX_LORA_RANK."""
    return k % 16 == 0 and n % 16 == 0 and rank <= MAX_LORA_RANK


def lora_supported(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether forge_lora_add takes y [T, N] and x [T, K] (bf16 or fp32, rows contiguous) with A [R, K]."""
    return (library() is not None and all(t.dtype in (torch.bfloat16, torch.float32) and t.stride(-1) == 1
                                          for t in (y, x)) and lora_shape(x.shape[1], y.shape[1], a.shape[0]))


def lora_add_(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> None:
    """y[rows] += (x[rows] @ a.T) @ bt in fp32, in place, each row on its own (a row's result does not
    depend on the others listed): a [R, K] and bt [R, N] fp32 contiguous, rows int64."""
    assert a.dtype == bt.dtype == torch.float32 and a.is_contiguous() and bt.is_contiguous()
    assert rows.dtype == torch.int64 and rows.is_contiguous()
    library().forge_lora_add(x.data_ptr(), bf16(x), x.stride(0), rows.data_ptr(), rows.shape[0], x.shape[1],
                             a.data_ptr(), a.shape[0], bt.data_ptr(), bt.shape[1], y.data_ptr(), bf16(y), y.stride(0),
                             torch.get_num_threads())


def head_dim_supported(hd: int) -> bool:
    return hd % 32 == 0 and hd <= 256  # attention.h: whole 32-value bf16 loads, MAX_HEAD_DIM


def attention_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """q [T, H, hd] with whole heads contiguous, against a contiguous cache; both bf16."""
    hd = q.shape[-1]
    return (library() is not None and bf16(q, k_cache) and q.stride(2) == 1 and q.stride(1) == hd
            and head_dim_supported(hd) and k_cache.is_contiguous())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """q [D, H, hd] (one token per row) against paged caches [slots, Hkv, hd] through block tables
    [D, W] and context lengths [D] -> [D, H, hd] bf16, computed in fp32."""
    d, h, hd = q.shape
    out = torch.empty(d, h, hd, dtype=torch.bfloat16)
    tables = tables.to(torch.int64).contiguous()
    lens = lens.to(torch.int32).contiguous()
    _status(library().forge_decode_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.contiguous().data_ptr(), tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), block_size, d, h, k_cache.shape[1], hd, scale, out.data_ptr(),
        torch.get_num_threads()))
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      scale: float, out: torch.Tensor) -> None:
    """A chunk of L query tokens [L, H, hd], the last L of the context whose K/V sit at `slots` [C]
    of the caches (the chunk's own included), causally -> out [L, H, hd] bf16 (contiguous)."""
    length, h, hd = q.shape
    slots = slots.to(torch.int64).contiguous()
    assert out.is_contiguous() and out.shape == q.shape and bf16(out)
    _status(library().forge_prefill_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.contiguous().data_ptr(), slots.data_ptr(),
        slots.shape[0], length, h, k_cache.shape[1], hd, scale, out.data_ptr(), torch.get_num_threads()))


MAX_REFINE = 64  # ops.c's MAX_REFINE


def refine_supported(logits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, k: int) -> bool:
    """Whether refine_top_ takes these: fp32 logits [N, V] and h [N, D], a bf16 weight [V, D], all
    contiguous, 0 < k <= min(MAX_REFINE, V)."""
    return (library() is not None and logits.dtype == torch.float32 and h.dtype == torch.float32 and bf16(weight)
            and logits.dim() == 2 and h.dim() == 2 and weight.dim() == 2 and logits.shape[0] == h.shape[0]
            and tuple(weight.shape) == (logits.shape[1], h.shape[1]) and 0 < k <= min(MAX_REFINE, logits.shape[1])
            and logits.is_contiguous() and h.is_contiguous() and weight.is_contiguous())


def refine_top_(logits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    """Each row's k largest logits (among equal ones, the lower index) in place <- the fp32 dot of
    the row of h with those rows of weight (refine_supported's shapes)."""
    library().forge_refine_top(logits.data_ptr(), logits.shape[0], logits.shape[1], weight.data_ptr(), h.data_ptr(),
                               h.shape[1], k, torch.get_num_threads())


def _status(code: int) -> None:
    if code:
        raise ValueError(f"attention refused its shapes (status {code})")
