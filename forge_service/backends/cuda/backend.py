"""CudaBackend: the Backend protocol (base.py) on NVRTC kernels, autotuned GEMMs and CUDA graphs."""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from forge_service.backends import torch_ref
from forge_service.backends.base import AttentionMetadata, Forward, QuantCodes
from forge_service.backends.cuda import activation, cache, decode_attention, norm, prefill_attention, rotary
from forge_service.backends.cuda.driver import INSTALL_HINT, bindings
from forge_service.backends.cuda.gemm import GemmTuner
from forge_service.backends.cuda.graphs import DecodeGraphs, capture_sizes
from forge_service.backends.cuda.launch import Kernels
from forge_service.backends.cuda.metadata import CudaAttentionMetadata, ModelShape, prepare
from forge_service.backends.cuda.sampler import CudaSampler
from forge_service.errors import DeviceUnavailable

log = logging.getLogger("forge.cuda")

RopeTables = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # positions [T], cos [P, hd], sin [P, hd]


class CudaBackend:
    """Ops of one model on one GPU. Kernels compile on first use (cached on disk); `startup`
    captures the decode graphs once the model and its KV cache exist."""

    name = "cuda"

    def __init__(self, device: int | None = None) -> None:
        bindings()  # raises DeviceUnavailable without cuda-python
        if not torch.cuda.is_available():
            build = f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none (a CPU-only build)'}"
            raise DeviceUnavailable(f"--device cuda: no CUDA GPU is visible to torch ({build}); "
                                    f"it needs a GPU, a CUDA build of torch and {INSTALL_HINT}")
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        torch.cuda.set_device(self.device)
        self.kernels = Kernels(self.device)
        self.gemm = GemmTuner(self.device)
        self.graphs: DecodeGraphs | None = None
        self.shape: ModelShape | None = None  # set by startup()
        # id of the model's fp32 cos table -> (that table, kept so the id stays its own; cos, sin on the GPU)
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # ---- weights ----
    def pack_linear(self, weight: torch.Tensor, codes: QuantCodes | None, int8_rows: bool) -> None:
        return None  # the GEMMs read the dense weight

    def needs_dense(self, packed: None) -> bool:
        return True

    def linear(self, x: torch.Tensor, weight: torch.Tensor, packed: None) -> torch.Tensor:
        return self.gemm(x, weight)

    def linear_widened(self, x: torch.Tensor, weight: torch.Tensor, packed: None) -> torch.Tensor:
        return self.gemm(x, weight).float()

    # ---- per-layer ops ----
    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        cache.write_kv(self.kernels, k_cache, v_cache, k, v, slot_mapping)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, meta: CudaAttentionMetadata, scale: float) -> torch.Tensor:
        # q: [T, H, hd] (this step's K/V are already in the cache) -> [T, H * hd]
        t, h, hd = q.shape
        out = torch.empty(t, h * hd, dtype=q.dtype, device=q.device)
        d = meta.num_decode_tokens
        if d:
            decode_attention.paged_decode(self.kernels, out[:d], q[:d], k_cache, v_cache, meta.decode_tables,
                                          meta.decode_lens, meta.block_size, meta.decode_max_len, scale)
        if meta.prefill is not None:
            prefill_attention.paged_prefill(self.kernels, out, q, k_cache, v_cache, meta.prefill, meta.block_size,
                                            scale)
        for seq in meta.torch_prefills:  # float32: the torch reference, on the GPU
            rows = torch_ref.prefill_attention(q, k, v, k_cache, v_cache, seq, scale)  # [L, H, hd]
            out[seq.q_start:seq.q_end] = rows.flatten(1)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm.rms_norm(self.kernels, x, weight, eps)

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        return norm.add_rms_norm(self.kernels, residual, delta, weight, eps)

    def final_norm(self, x: torch.Tensor, delta: torch.Tensor | None, rows: torch.Tensor, weight: torch.Tensor,
                   eps: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.rms_norm(x[rows] if delta is None else x[rows] + delta[rows], weight, eps)
        return h, h.to(dtype)

    def head_rms_norm(self, qk: torch.Tensor, num_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        return torch_ref.head_rms_norm(qk, num_heads, q_weight, k_weight, eps)  # torch ops (Qwen3), no kernel yet

    def refine_leaders(self, logits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, k: int) -> None:
        torch_ref.refine_leaders(logits, h, weight, k)  # torch ops on the device

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, a: torch.Tensor,
                 bt: torch.Tensor) -> None:
        # torch ops; the engine serves adapters on the CPU backend only (decode graphs hold no adapter)
        torch_ref.lora_add(y, x, rows, a, bt)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return activation.silu_and_mul(self.kernels, gate_up)

    def rotary_tables(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      dtype: torch.dtype) -> RopeTables:
        if id(cos) not in self._rope:  # the float32 tables, copied to the GPU once
            self._rope[id(cos)] = (cos, cos.to(self.device).contiguous(), sin.to(self.device).contiguous())
        return (positions, *self._rope[id(cos)][1:])

    def rotary(self, qk: torch.Tensor, num_heads: int, tables: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        # qk: [T, H + Hkv, hd] -> q [T, H, hd], k [T, Hkv, hd], rotated in place
        q, k = qk.split([num_heads, qk.shape[1] - num_heads], dim=1)
        rotary.rotary_(self.kernels, q, k, *tables)
        return q, k

    def decode_plan(self, layers: Sequence[Any], arch: Any, scale: float) -> None:
        return None  # decode steps run op by op, replayed from CUDA graphs (see run)

    # ---- per step and at start-up ----
    def prepare(self, meta: AttentionMetadata) -> CudaAttentionMetadata:
        assert self.shape is not None, "startup() sets the model's shape first"
        return prepare(meta, self.shape, self.device)

    def sampler(self) -> CudaSampler:
        return CudaSampler(self.kernels)

    def startup(self, forward: Forward, arch: Any, dtype: torch.dtype, block_size: int, max_batch: int,
                max_len: int) -> None:
        """Record the model's shape, then capture decode graphs for `forward(ids, positions, meta,
        logit_rows)`, the model bound to its KV cache (max_batch 0: no graphs)."""
        decode_attention.check_shape(dtype, arch.num_heads, arch.num_kv_heads, arch.head_dim)
        self.shape = ModelShape(arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, dtype)
        if max_batch <= 0:
            return
        self.graphs = DecodeGraphs(forward, self.device, block_size, max_batch, max_len)
        with torch.inference_mode():
            self.graphs.capture(capture_sizes(max_batch))

    def run(self, forward: Forward, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: CudaAttentionMetadata, logit_rows: torch.Tensor) -> torch.Tensor:
        """The step's logits: replayed from a graph for a decode-only step, else run eagerly."""
        if self.graphs is not None and logit_rows.shape[0] == meta.num_decode_tokens:
            logits = self.graphs.run(input_ids, positions, meta)
            if logits is not None:
                return logits
        return forward(input_ids, positions, meta, logit_rows)
