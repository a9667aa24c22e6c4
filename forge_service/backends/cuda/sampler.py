"""The sampler on the GPU: the CPU sampler's penalties, bitmask and logprobs (torch ops on the
device), with the choice of each row's token made by native/sampling.cu.

Seeded rows draw Philox noise keyed by (seed, step), step = tokens generated so far, so a seeded
request's tokens depend neither on the batch nor on preemption. Unseeded rows get fresh seeds.
"""
from __future__ import annotations

import random

import torch

from forge_service.backends.cuda import sampling
from forge_service.backends.cuda.launch import Kernels
from forge_service.sampling.metadata import SamplingMetadata
from forge_service.sampling.sampler import SamplerOutput, apply_penalties, apply_token_bitmask

_U64 = 1 << 64


class CudaSampler:
    """Same contract as forge_service.sampling.Sampler: float32 logits [N, V] on the GPU in,
    token ids (and the raw-distribution logprobs asked for) out, on the GPU."""

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels
        self._rng = random.Random()  # seeds of unseeded rows

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        assert logits.dtype == torch.float32 and logits.shape == (meta.num_rows, meta.vocab_size)
        raw_logprobs = None if meta.max_num_logprobs is None else torch.log_softmax(logits, -1)
        bitmask = None if meta.token_bitmask is None else meta.token_bitmask.to(logits.device, non_blocking=True)
        processed = apply_token_bitmask(apply_penalties(logits, meta), bitmask, original=logits)
        token_ids = sampling.sample(self.kernels, processed, *self._row_params(meta, logits.device))
        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None, None, None)
        return with_logprobs(token_ids, raw_logprobs, meta.max_num_logprobs)

    def score(self, logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> SamplerOutput:
        """Given tokens (the prompt's, for prompt logprobs) under the raw distribution of
        `logits` [N, V] float32: each one's logprob and 1-based rank, and the top-k alternatives."""
        return with_logprobs(token_ids, torch.log_softmax(logits, -1), k)

    def _row_params(self, meta: SamplingMetadata, device: torch.device) -> tuple[torch.Tensor, ...]:
        n = meta.num_rows
        temperature = torch.ones(n, device=device) if meta.temperature is None else meta.temperature.view(n).float()
        if meta.all_greedy:
            temperature = torch.zeros(n, device=device)
        elif meta.greedy is not None:
            temperature = torch.where(meta.greedy.to(device), 0.0, temperature)
        top_k = torch.zeros(n, dtype=torch.int32, device=device) if meta.top_k is None else meta.top_k.view(n).int()
        top_p = torch.ones(n, device=device) if meta.top_p is None else meta.top_p.view(n).float()
        min_p = torch.zeros(n, device=device) if meta.min_p is None else meta.min_p.view(n).float()
        seeds = [self._rng.getrandbits(64) if s is None else s % _U64 for s in _seeds(meta)]
        signed = [s - _U64 if s >= 1 << 63 else s for s in seeds]  # the kernel reads them as uint64
        steps = _steps(meta)
        ints = lambda v: torch.tensor(v, dtype=torch.int64).to(device, non_blocking=True)  # noqa: E731
        return (temperature.contiguous(), top_k.contiguous(), top_p.contiguous(), min_p.contiguous(),
                ints(signed), ints(steps))


def _seeds(meta: SamplingMetadata) -> list[int | None]:
    return meta.seeds if meta.seeds else [None] * meta.num_rows


def _steps(meta: SamplingMetadata) -> list[int]:
    return meta.steps if meta.steps else [0] * meta.num_rows


def with_logprobs(token_ids: torch.Tensor, raw_logprobs: torch.Tensor, k: int) -> SamplerOutput:
    """Logprob, top-k alternatives and 1-based rank of each chosen token under the raw distribution."""
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    top_logprobs, top_ids = raw_logprobs.topk(k, dim=-1) if k else (raw_logprobs[:, :0], token_ids[:, None][:, :0])
    ranks = (raw_logprobs > chosen).sum(-1) + 1  # [N]
    return SamplerOutput(token_ids, chosen.squeeze(1), top_ids, top_logprobs, ranks)
