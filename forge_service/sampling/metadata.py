"""The sampling parameters of one step's batch, gathered once into tensors."""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from itertools import chain

import torch

from forge_service.engine.request import SamplingParams


@dataclass
class RowSampling:
    """One row of the batch: a sequence that samples a token this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Set for seeded rows that sample: the noise of this row's position alone (the runner seeds it
    # from the request's seed and the position), so the batch around it never changes its token.
    generator: torch.Generator | None = None
    # The request's seed, for samplers with counter-based noise keyed by (seed, step).
    seed: int | None = None
    # Tokens this row may not sample: its stop tokens while its output is shorter than min_tokens.
    banned: frozenset[int] = frozenset()
    # The only tokens this row may sample (allowed_token_ids as a long tensor); None: any.
    allowed: torch.Tensor | None = None


@dataclass
class SparseLogits:
    """Values at positions (row, token) of a [N, V] logits tensor, as flat indices row * V + token."""

    index: torch.Tensor  # long [M]
    values: torch.Tensor  # float [M]


@dataclass
class SamplingMetadata:
    """Batched sampling parameters. A field that no row uses is None, and the sampler skips it.

    Greedy rows carry neutral values (temperature 1, no min_p/top_k/top_p) so that the
    sampled path can run over every row; their token is the argmax instead.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy: torch.Tensor | None  # bool [N]; None when every row is greedy or none is
    temperature: torch.Tensor | None  # float [N, 1]; None when every sampled row uses 1.0
    min_p: torch.Tensor | None  # float [N, 1]; 0 disables
    top_k: torch.Tensor | None  # long [N, 1]; vocab_size disables
    max_top_k: int  # the largest top_k below vocab_size, 0 when none
    top_p: torch.Tensor | None  # float [N, 1]; 1 disables
    repetition: SparseLogits | None  # the row's penalty at each prompt or output token
    frequency_presence: SparseLogits | None  # freq * count + presence at each output token
    logit_bias: SparseLogits | None
    generators: dict[int, torch.Generator]  # row -> its generator, for seeded rows that sample
    shared_noise: bool  # some row samples without a generator: one batched draw serves them all
    max_num_logprobs: int | None  # the largest `logprobs` asked for; None when no row asked
    # Rows with allowed_token_ids: True at the tokens each may sample (bool [N, V]); None: no row.
    allowed: torch.Tensor | None = None
    # Allowed tokens, set by structured output after build: packed int32 [N, ceil(V / 32)]
    # (bit j of word w allows token 32w + j; forge_service/structured/bitmask.py) or bool [N, V].
    token_bitmask: torch.Tensor | None = None
    # Per row: the seed (None when unseeded) and the number of tokens generated so far, for
    # samplers keyed by (seed, step) instead of generator state (the CUDA sampler).
    seeds: list[int | None] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, rows: list[RowSampling], vocab_size: int,
              device: torch.device | str = "cpu") -> SamplingMetadata:
        params = [r.params for r in rows]
        greedy = [p.greedy for p in params]
        sampled = [p for p in params if not p.greedy]
        top_k = [vocab_size if p.greedy or not 0 < p.top_k < vocab_size else p.top_k for p in params]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            all_greedy=not sampled,
            all_random=0 < len(sampled) == len(rows),
            greedy=torch.tensor(greedy, device=device) if 0 < len(sampled) < len(rows) else None,
            temperature=_column([1.0 if p.greedy else p.temperature for p in params], 1.0, device),
            min_p=_column([0.0 if p.greedy else p.min_p for p in params], 0.0, device),
            top_k=_column(top_k, vocab_size, device, torch.long),
            max_top_k=max((k for k in top_k if k < vocab_size), default=0),
            top_p=_column([1.0 if p.greedy else p.top_p for p in params], 1.0, device),
            repetition=_repetition(rows, vocab_size, device),
            frequency_presence=_frequency_presence(rows, vocab_size, device),
            logit_bias=_logit_bias(rows, vocab_size, device),
            allowed=_allowed(rows, vocab_size, device),
            generators={i: r.generator for i, r in enumerate(rows)
                        if r.generator is not None and not r.params.greedy},
            shared_noise=any(r.generator is None and not r.params.greedy for r in rows),
            max_num_logprobs=max(asked) if asked else None,
            seeds=[r.seed for r in rows],
            steps=[len(r.output_token_ids) for r in rows],
        )


def _column(values: list[float], neutral: float, device: torch.device | str,
            dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """values as a [N, 1] tensor, or None when every row has the neutral value."""
    if all(v == neutral for v in values):
        return None
    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)


def _flat_tokens(token_lists: list[tuple[int, list[int]]],
                 vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row * V + token, row), each long [M], over every (row, tokens) pair; None when M = 0."""
    lengths = [len(tokens) for _, tokens in token_lists]
    if not sum(lengths):
        return None
    # array + frombuffer converts ints ~4x faster than torch.tensor(list).
    tokens = torch.frombuffer(array("q", chain.from_iterable(t for _, t in token_lists)), dtype=torch.long)
    row = torch.repeat_interleave(torch.tensor([r for r, _ in token_lists]), torch.tensor(lengths))
    return row * vocab_size + tokens, row


def _repetition(rows: list[RowSampling], vocab_size: int, device: torch.device | str) -> SparseLogits | None:
    """Each penalised row's penalty at its prompt and output tokens (repeats included: they
    rewrite the same value)."""
    token_lists = [(i, tokens) for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0
                   for tokens in (r.prompt_token_ids, r.output_token_ids)]
    flat = _flat_tokens(token_lists, vocab_size)
    if flat is None:
        return None
    index, row = flat
    penalty = torch.tensor([r.params.repetition_penalty for r in rows])[row]
    return SparseLogits(index.to(device), penalty.to(device))


def _frequency_presence(rows: list[RowSampling], vocab_size: int,
                        device: torch.device | str) -> SparseLogits | None:
    """freq * count + presence at each distinct output token of the rows that set either."""
    token_lists = [(i, r.output_token_ids) for i, r in enumerate(rows)
                   if r.params.frequency_penalty or r.params.presence_penalty]
    flat = _flat_tokens(token_lists, vocab_size)
    if flat is None:
        return None
    index, counts = torch.unique(flat[0], return_counts=True)  # [M']
    row = index // vocab_size
    freq = torch.tensor([r.params.frequency_penalty for r in rows])[row]
    presence = torch.tensor([r.params.presence_penalty for r in rows])[row]
    return SparseLogits(index.to(device), (freq * counts + presence).to(device))


def _logit_bias(rows: list[RowSampling], vocab_size: int, device: torch.device | str) -> SparseLogits | None:
    """logit_bias, and -inf at each row's banned tokens."""
    biased = [(i * vocab_size + int(token), bias) for i, r in enumerate(rows)
              for token, bias in (r.params.logit_bias or {}).items()]
    biased += [(i * vocab_size + token, -math.inf) for i, r in enumerate(rows) if r.banned for token in r.banned]
    if not biased:
        return None
    return SparseLogits(torch.tensor([i for i, _ in biased], device=device),
                        torch.tensor([b for _, b in biased], dtype=torch.float32, device=device))


def _allowed(rows: list[RowSampling], vocab_size: int, device: torch.device | str) -> torch.Tensor | None:
    """True where a row may sample: everywhere for rows without allowed_token_ids."""
    limited = [(i, r.allowed) for i, r in enumerate(rows) if r.allowed is not None]
    if not limited:
        return None
    mask = torch.ones(len(rows), vocab_size, dtype=torch.bool)
    for i, ids in limited:
        mask[i] = False
        mask[i, ids] = True
    return mask.to(device)
