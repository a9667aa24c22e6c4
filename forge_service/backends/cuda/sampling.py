"""Typed wrapper for native/sampling.cu: greedy / temperature / min_p / top_k / top_p sampling
with counter-based (Philox) noise keyed by each row's seed and step."""
from __future__ import annotations

import torch

from forge_service.backends.cuda.launch import Kernels, check_tensor, i32, i64, ptr, require

SOURCE = "sampling.cu"
BLOCK = 1024
NAME = f"forge::sample_kernel<{BLOCK}>"


def ci_names() -> tuple[str, ...]:
    return (NAME,)


def sample(kernels: Kernels, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] float32; per row: temperature (<= 0: greedy), top_k (int32; <= 0 or >= V:
    off), top_p (>= 1: off), min_p (<= 0: off), all float32 but top_k; seeds: int64 (read as
    uint64), steps: int64. -> token ids [N] int64."""
    check_tensor(logits, "logits", (torch.float32,), 2, aligned=False)
    n, vocab = logits.shape
    for t, label, dtype in ((temperature, "temperature", torch.float32), (top_k, "top_k", torch.int32),
                            (top_p, "top_p", torch.float32), (min_p, "min_p", torch.float32),
                            (seeds, "seeds", torch.int64), (steps, "steps", torch.int64)):
        check_tensor(t, label, (dtype,), 1, aligned=False)
        require(t.shape == (n,) and t.is_contiguous(), f"{label} must be a contiguous [{n}]")
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    kernels.get(SOURCE, NAME)((n,), BLOCK, [
        ptr(out), ptr(logits), i32(vocab), i64(logits.stride(0)), ptr(temperature), ptr(top_k), ptr(top_p),
        ptr(min_p), ptr(seeds), ptr(steps)])
    return out
