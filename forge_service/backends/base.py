"""What a backend is: the `Backend` protocol, and the data that crosses it.

The model, its layers and the model runner call a backend only through these methods; they never
import a concrete backend. The CPU backend (cpu.py) and the CUDA backend (cuda/backend.py) each
implement every method themselves. Torch code that both use lives in torch_ref.py, called by name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from forge_service.sampling import Sampler

INT4_GROUP = 32  # inputs per scale and zero of a 4-bit weight
QUANTIZE_ROWS = 4096  # rows per run when quantising a dense weight (bounds its temporaries)


@dataclass
class Int4Weight:
    """A checkpoint's 4-bit weight: w[n, k] = (codes[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]."""

    codes: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K / 32] float32
    zero: torch.Tensor  # [N, K / 32] float32

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Stack along the output dimension (fusing Q/K/V or gate/up)."""
        return Int4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "zero")))

    def rows(self, index: torch.Tensor) -> Int4Weight:
        return Int4Weight(self.codes[index], self.scale[index], self.zero[index])

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        groups = (self.codes.float() - 8).view(n, k // INT4_GROUP, INT4_GROUP)
        return (groups * self.scale[..., None] + self.zero[..., None]).view(n, k)


@dataclass
class Int8Weight:
    """A checkpoint's 5- to 8-bit weight as int8 codes: w[n, k] ~ codes[n, k] * scale[n, k // 32].
    Exact for Q8_0; Q6_K and Q5_K are re-quantised to it (one scale per 32 inputs, error at most
    half a step of 1/127 of the group's largest weight)."""

    codes: torch.Tensor  # [N, K] int8 in -127..127
    scale: torch.Tensor  # [N, K / 32] float32, each exact in fp16

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight:
        """Stack along the output dimension (fusing Q/K/V or gate/up)."""
        return Int8Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale")))

    def rows(self, index: torch.Tensor) -> Int8Weight:
        return Int8Weight(self.codes[index], self.scale[index])

    @staticmethod
    def quantize(weight: torch.Tensor) -> Int8Weight:
        """Symmetric int8 per group of 32 inputs of a dense [N, K] weight: scale = amax / 127,
        rounded to fp16 (the kernels' scale format) before the codes are rounded against it."""
        n, k = weight.shape
        codes = torch.empty(n, k, dtype=torch.int8, device=weight.device)
        scale = torch.empty(n, k // INT4_GROUP, dtype=torch.float32, device=weight.device)
        for r in range(0, n, QUANTIZE_ROWS):  # in runs of rows: a [V, D] lm_head's fp32 temporaries are large
            rows = slice(r, r + QUANTIZE_ROWS)
            groups = weight[rows].float().view(-1, k // INT4_GROUP, INT4_GROUP)
            scale[rows] = (groups.abs().amax(dim=-1) / 127).half().float()  # [rows, K / 32]
            divisor = scale[rows].masked_fill(scale[rows] == 0, 1)[..., None]
            codes[rows] = torch.round(groups / divisor).clamp(-127, 127).to(torch.int8).view(-1, k)
        return Int8Weight(codes, scale)

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        return (self.codes.float().view(n, k // INT4_GROUP, INT4_GROUP) * self.scale[..., None]).view(n, k)


# The quantised forms a checkpoint may carry beside a dense weight.
QuantCodes = Int4Weight | Int8Weight


@dataclass
class PrefillSeq:
    """A chunk of q_len > 1 tokens of one sequence, at rows [q_start, q_end) of the flat batch."""

    q_start: int
    q_end: int
    # Gather indices of the whole context (cached + this chunk) in the flat cache; None when the
    # chunk starts at position 0, so its own K/V are the whole context.
    ctx_slots: torch.Tensor | None = None
    # [q_len, ctx_len] bool, True = attend; None with ctx_slots None (plain causal).
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Paged attention inputs, built once per step by the model runner on the CPU and turned into
    the backend's own form by `Backend.prepare`."""

    slot_mapping: torch.Tensor  # [T] long: flat cache slot of each new token
    block_size: int
    num_decode_tokens: int  # rows [0, D) have q_len 1 and are attended in one padded batch
    # [D, W] block tables of the decode rows (padded with block 0); keys are gathered a whole
    # block at a time, Lmax = W * block_size.
    decode_block_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, Lmax] bool, True = attend
    decode_lens: torch.Tensor | None = None  # [D] int32 context lengths, the mask's own
    prefills: list[PrefillSeq] = field(default_factory=list)
    # LoRA: (adapter, its rows [M] int64) for each adapter some of the step's rows take (the
    # model's 1-based adapter index); empty when no row does.
    lora: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class FusedDecode(Protocol):
    """Every decoder layer of a step in one call (see `Backend.decode_plan`).

    `max_rows`: the most rows it takes (None: any); `row_block`: its kernels take rows in blocks
    of this many, so that a step's cost jumps where its rows open a block (1: no such steps)."""

    max_rows: int | None
    row_block: int

    def takes(self, meta: Any, tokens: int) -> bool:
        """Whether it runs this step: `meta` in the backend's form, `tokens` rows in the batch."""
        ...

    def add_adapter(self, adapter: Any) -> None:
        """Take a LoRA adapter (forge_service/lora.py) that a step's meta.lora names by its 1-based
        index, in the order added."""
        ...

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any) -> torch.Tensor:
        """x [T, D] fp32 residual stream, updated in place through the last layer's attention, the
        rows meta.lora names with their adapters' updates; cos, sin: the step's rotary tables -> the
        last layer's MLP output [T, D], still to be added."""
        ...


# model(input_ids [T], positions [T], meta, logit_rows [N]) -> logits [N, V] float32
Forward = Callable[[torch.Tensor, torch.Tensor, Any, torch.Tensor], torch.Tensor]


class Backend(Protocol):
    """The ops of one model on one device. `meta` is always in the form `prepare` returned."""

    name: str  # what --device calls it
    device: torch.device  # where the weights, the KV cache and the step's inputs live

    # ---- weights ----
    def pack_linear(self, weight: torch.Tensor, codes: QuantCodes | None, int8_rows: bool) -> Any:
        """The form of a linear layer's weight [N, K] that this backend's kernels read besides the
        dense one, or None when the dense weight is all it needs. `codes` is the checkpoint's own
        4-bit or 8-bit form where it has one; `int8_rows` allows an int8 copy of a dense weight (the
        lm_head, whose leading logits the model recomputes in fp32)."""
        ...

    def needs_dense(self, packed: Any) -> bool:
        """Whether `linear` may read the dense weight beside `packed` (from pack_linear). When not,
        the layer drops the dense weight, and `linear` receives None for it."""
        ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor | None, packed: Any) -> torch.Tensor:
        """x [T, K] @ weight.T -> [T, N], reading `packed` (from pack_linear) where it serves."""
        ...

    def linear_widened(self, x: torch.Tensor, weight: torch.Tensor | None, packed: Any) -> torch.Tensor:
        """linear(x, weight, packed) as fp32 [T, N]: each value as linear rounds it in x's dtype (the
        logits of a bf16 lm_head, which the sampler reads in fp32)."""
        ...

    # ---- per-layer ops ----
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x [T, D] (the fp32 residual stream) -> [T, D] in weight's dtype, with Hugging
        Face Llama roundings: normalised in fp32, scaled in the compute dtype."""
        ...

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """residual += delta in place (rounded as `residual + delta`), then rms_norm(residual)."""
        ...

    def final_norm(self, x: torch.Tensor, delta: torch.Tensor | None, rows: torch.Tensor, weight: torch.Tensor,
                   eps: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The final RMSNorm of the rows that need logits: h = rms_norm(x[rows] + delta[rows]) [N, D]
        fp32, for x [T, D] (the fp32 residual stream), delta [T, D] (the last sublayer's output, not
        yet added; None where there is none), rows int64 [N] and an fp32 weight [D]; and h in `dtype`
        (the lm_head's input). x is left as it is."""
        ...

    def head_rms_norm(self, qk: torch.Tensor, num_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """RMSNorm of each head of qk [T, H + Hkv, hd] (the query heads, then the key heads) with
        q_weight or k_weight [hd] (Qwen3), rms_norm's roundings -> [T, H + Hkv, hd]. qk is the
        step's fresh projection: a backend may normalise it in place."""
        ...

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, a: torch.Tensor,
                 bt: torch.Tensor) -> None:
        """A LoRA adapter's update, in place: y[rows] += (x[rows] @ a.T) @ bt for y [T, N] (a
        projection's fresh output), x [T, K] (its input), rows int64 [M], a [R, K] and bt [R, N]
        fp32 (the adapter's scale folded into bt). Each listed row's result depends on that row
        alone."""
        ...

    def refine_leaders(self, logits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, k: int) -> None:
        """Each row's k largest logits [N, V] fp32, in place <- the fp32 dot of the row's final
        hidden state h [N, D] fp32 with those rows of the lm_head weight [V, D]. Each row's result
        depends on that row alone."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2F] -> silu(gate) * up [T, F]."""
        ...

    def rotary_tables(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      dtype: torch.dtype) -> Any:
        """The step's rotary tables for `positions` [T], from the model's fp32 tables cos, sin
        [P, hd] indexed by absolute position; shared by every layer of the step."""
        ...

    def rotary(self, qk: torch.Tensor, num_heads: int, tables: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate qk [T, H + Hkv, hd] (the query heads, then the key heads) by `tables` from
        rotary_tables -> q [T, H, hd], k [T, Hkv, hd]. qk is the step's fresh projection: a backend
        may rotate it in place."""
        ...

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store this step's k, v [T, Hkv, hd] at the flat cache slots `slot_mapping` [T] of the
        caches [S, Hkv, hd] (S = num_blocks * block_size)."""
        ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, meta: Any, scale: float) -> torch.Tensor:
        """Causal paged attention of q [T, H, hd] over each row's context in the caches (this step's
        k, v [T, Hkv, hd] are already written there) -> [T, H * hd]. Rows [0, D) are decodes, the
        rest prefill chunks (meta.prefills)."""
        ...

    def decode_plan(self, layers: Sequence[Any], arch: Any, scale: float) -> FusedDecode | None:
        """A call that runs every one of `layers` (each with input_norm, post_norm and the Linear
        layers qkv, o_proj, gate_up, down) at once for the steps its `takes` accepts, or None: the
        model then runs them op by op."""
        ...

    # ---- per step and at start-up ----
    def prepare(self, meta: AttentionMetadata) -> Any:
        """The step's metadata in this backend's form, on its device: what attention, run and the
        decode plan receive. Called once per step."""
        ...

    def sampler(self) -> Sampler:
        """A sampler for logits [N, V] float32 on this device (forge_service.sampling.Sampler's contract)."""
        ...

    def startup(self, forward: Forward, arch: Any, dtype: torch.dtype, block_size: int, max_batch: int,
                max_len: int) -> None:
        """Called once the model and its KV cache exist, with `forward` bound to that cache: steps of
        up to max_batch decode rows over contexts of up to max_len tokens are to come."""
        ...

    def run(self, forward: Forward, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
            logit_rows: torch.Tensor) -> torch.Tensor:
        """One step's logits [N, V] float32 of `logit_rows` [N]: forward(input_ids, positions, meta,
        logit_rows), or what a backend has recorded of it (the CUDA backend's graphs)."""
        ...
