"""The batched sampler: logits of the rows that sample this step -> one token per row."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from forge_service.sampling import ops
from forge_service.sampling.metadata import SamplingMetadata
from forge_service.structured.bitmask import apply_token_bitmask_

_TINY = torch.finfo(torch.float32).tiny
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1
_LOG2E = math.log2(math.e)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # long [N]
    logprobs: torch.Tensor | None  # float [N]: raw logprob of the chosen token; None if no row asked
    top_ids: torch.Tensor | None  # long [N, K], K = the largest `logprobs` asked for
    top_logprobs: torch.Tensor | None  # float [N, K], descending
    ranks: torch.Tensor | None  # long [N]: 1-based rank of the chosen token in the raw distribution


class Sampler:
    """Samples one token per row in one batched pass.

    Order: logprobs of the raw logits; repetition, frequency and presence penalties,
    logit_bias; the structured-output bitmask; argmax for greedy rows; for the others
    temperature, min_p, top_k, top_p, then an exponential race whose noise comes from the
    row's own generator when it has one, so that a seeded row's tokens do not depend on
    the rest of the batch.
    """

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # logits: float32 [N, V]; never modified.
        assert logits.dtype == torch.float32 and logits.shape == (meta.num_rows, meta.vocab_size)
        raw_logprobs = None if meta.max_num_logprobs is None else torch.log_softmax(logits, -1)
        logits = apply_token_bitmask(apply_penalties(logits, meta), meta.token_bitmask, original=logits)
        token_ids = _choose(logits, meta)
        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None, None, None)
        return with_logprobs(token_ids, raw_logprobs, meta.max_num_logprobs)

    def score(self, logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> SamplerOutput:
        """Given tokens (the prompt's, for prompt logprobs) under the raw distribution of
        `logits` [N, V] float32: each one's logprob and 1-based rank, and the top-k alternatives."""
        return with_logprobs(token_ids, torch.log_softmax(logits, -1), k)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids (-inf elsewhere, which the rest keeps), repetition penalty, frequency and
    presence penalties, then logit_bias.

    logits: [N, V] -> [N, V]; a new tensor when any applies, else `logits` itself.
    """
    if meta.allowed is None and meta.repetition is None and meta.frequency_presence is None \
            and meta.logit_bias is None:
        return logits
    logits = logits.clone() if meta.allowed is None else torch.where(meta.allowed, logits, float("-inf"))
    flat = logits.view(-1)  # [N * V]
    if meta.repetition is not None:
        # HF/vLLM: a seen token's positive logit is divided by the penalty, a negative one multiplied.
        index, penalty = meta.repetition.index, meta.repetition.values
        seen = flat[index]
        flat[index] = torch.where(seen > 0, seen / penalty, seen * penalty)
    if meta.frequency_presence is not None:
        flat.index_add_(0, meta.frequency_presence.index, meta.frequency_presence.values, alpha=-1)
    if meta.logit_bias is not None:
        flat.index_add_(0, meta.logit_bias.index, meta.logit_bias.values)
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor | None,
                        original: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens' logits become -inf. bitmask: packed int32 [N, ceil(V / 32)] (the
    structured-output form) or bool [N, V], True = allowed; None: no mask. Works in place
    unless `logits` is `original` (the caller's tensor, which must not change)."""
    if bitmask is None:
        return logits
    if bitmask.dtype == torch.bool:
        return torch.where(bitmask, logits, float("-inf"))
    return apply_token_bitmask_(logits.clone() if logits is original else logits, bitmask)


def _choose(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logits: [N, V] processed -> long [N]: argmax for greedy rows, a sample for the others."""
    greedy_ids = None if meta.all_random else ops.argmax(logits)
    if meta.all_greedy:
        return greedy_ids
    sampled_ids = ops.race(sampling_weights(logits, meta), _noise(meta, logits.device))
    if greedy_ids is None:
        return sampled_ids
    return torch.where(meta.greedy, greedy_ids, sampled_ids)


def sampling_weights(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logits: [N, V] -> [N, V] unnormalised probabilities after temperature, min_p, top_k, top_p.

    Each row's largest weight is 1; dropped tokens weigh 0. The race needs no normalisation.
    """
    # exp((x - max) / T) as exp2((x - max) * log2(e) / T): exp2 is ~3x faster than exp on CPU.
    scale = _LOG2E if meta.temperature is None else _LOG2E / meta.temperature  # [N, 1]
    weights = (logits - logits.amax(-1, keepdim=True)).mul_(scale).exp2_()  # [N, V]
    floor = _floor(weights, meta)
    if floor is not None:
        _drop_below(weights, floor)
    if meta.top_p is not None:
        applies = meta.top_p < 1.0  # [N, 1]
        threshold = ops.mass_threshold(weights, torch.where(applies, meta.top_p, 0.0).squeeze(1))
        _drop_below(weights, torch.where(applies, threshold, _TINY))
    return weights


def _floor(weights: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor | None:
    """[N, 1]: the smallest weight that min_p and top_k keep (tiny where neither applies)."""
    if meta.min_p is None and meta.top_k is None:
        return None
    floor = torch.full((meta.num_rows, 1), _TINY, device=weights.device)
    if meta.min_p is not None:  # the max weight is 1, so min_p * max prob is min_p
        floor = torch.maximum(floor, meta.min_p)
    if meta.top_k is not None:
        kth = ops.topk(weights, meta.max_top_k)[0]  # [N, max_top_k]
        kth = kth.gather(1, meta.top_k.clamp_max(meta.max_top_k) - 1)  # [N, 1]
        floor = torch.where(meta.top_k < meta.vocab_size, torch.maximum(floor, kth), floor)
    return floor


def _drop_below(weights: torch.Tensor, floor: torch.Tensor) -> None:
    """In place: weights [N, V] in [0, 1] below the row's floor [N, 1] (> 0) become 0.

    Dividing by the floor lets one scalar threshold (a fast op) serve every row:
    w / f >= 1 exactly when w >= f. w / f stays finite because w <= 1 and f >= tiny.
    """
    weights.div_(floor)
    F.threshold_(weights, _BELOW_ONE, 0.0)
    weights.mul_(floor)


def _noise(meta: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """[N, noise_width] Exp(1) draws: one batched draw, then one call per seeded row."""
    noise = torch.ones(meta.num_rows, ops.noise_width(meta.vocab_size), device=device)
    if meta.shared_noise:
        noise.exponential_()
    for row, generator in meta.generators.items():
        noise[row].exponential_(generator=generator)
    return noise.clamp_min_(_TINY)  # q = 0 would turn a zero probability into 0 / 0


def with_logprobs(token_ids: torch.Tensor, raw_logprobs: torch.Tensor, k: int) -> SamplerOutput:
    """Logprob, top-k alternatives and rank of each chosen token under the raw distribution."""
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    top_logprobs, top_ids = ops.topk(raw_logprobs, k)  # [N, k], descending
    ranks = (raw_logprobs > chosen).sum(-1, dtype=torch.int32).long() + 1  # [N]; int32 sums faster
    return SamplerOutput(token_ids, chosen.squeeze(1), top_ids, top_logprobs, ranks)
