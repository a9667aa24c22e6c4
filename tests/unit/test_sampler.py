"""The batched sampler: each parameter's exact effect, seeds, logprobs, batch invariance."""
from __future__ import annotations

import math

import pytest
import torch

from forge_service.engine.request import SamplingParams
from forge_service.sampling import RowSampling, Sampler, SamplingMetadata
from forge_service.sampling import ops
from forge_service.sampling.sampler import apply_penalties, sampling_weights

sample = Sampler()


def _meta(params: list[SamplingParams], vocab_size: int, seeds: list[int | None] | None = None,
          prompt: list[int] | None = None, output: list[int] | None = None) -> SamplingMetadata:
    seeds = seeds or [None] * len(params)
    rows = [RowSampling(p, list(prompt or []), list(output or []),
                        None if s is None else torch.Generator().manual_seed(s))
            for p, s in zip(params, seeds)]
    return SamplingMetadata.build(rows, vocab_size)


def _frequencies(logits: torch.Tensor, params: SamplingParams, draws: int = 8000) -> torch.Tensor:
    """Empirical distribution of `draws` samples of one row's logits [V] (deterministic: seeded)."""
    torch.manual_seed(0)
    meta = _meta([params] * draws, logits.shape[0])
    tokens = sample(logits.expand(draws, -1).contiguous(), meta).token_ids
    return torch.bincount(tokens, minlength=logits.shape[0]).float() / draws


def _kept(logits: torch.Tensor, params: SamplingParams) -> list[int]:
    """Tokens that keep a non-zero probability after temperature, min_p, top_k and top_p."""
    weights = sampling_weights(logits.unsqueeze(0), _meta([params], logits.shape[0]))
    return weights[0].nonzero().flatten().tolist()


# Four tokens in a shuffled order: probabilities 0.1, 0.5, 0.15, 0.25.
PROBS = torch.tensor([0.1, 0.5, 0.15, 0.25])
LOGITS = PROBS.log()


def test_greedy_is_argmax_with_first_index_on_ties() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 1000)
    logits[4, 7] = logits[4, 900] = 50.0  # a tie across blocks: the first index wins
    out = sample(logits, _meta([SamplingParams(temperature=0.0)] * 5, 1000))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids[4].item() == 7
    assert out.logprobs is None and out.top_ids is None and out.ranks is None


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    freq = _frequencies(logits, SamplingParams(temperature=temperature))
    expected = torch.softmax(logits / temperature, -1)
    assert (freq - expected).abs().max().item() < 0.02, (freq, expected)


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0])
    top = [_frequencies(logits, SamplingParams(temperature=t), draws=4000)[0].item() for t in (0.3, 1.0, 3.0)]
    assert top[0] > 0.9 > top[1] > 0.4 > top[2] > 0.3, top


def test_race_across_blocks_matches_probabilities() -> None:
    # Mass over three blocks of 256 tokens (the last one padded), two tokens in each.
    logits = torch.full((1000,), float("-inf"))
    tokens, probs = [0, 5, 257, 300, 771, 999], torch.tensor([0.2, 0.1, 0.15, 0.15, 0.25, 0.15])
    logits[tokens] = probs.log()
    freq = _frequencies(logits, SamplingParams(temperature=1.0))
    assert freq[tokens].sum().item() == 1.0
    assert (freq[tokens] - probs).abs().max().item() < 0.02, freq[tokens]


def test_top_k_keeps_exactly_k_candidates() -> None:
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1))
    best = set(logits.topk(5).indices.tolist())
    assert set(_kept(logits, SamplingParams(top_k=5))) == best
    freq = _frequencies(logits, SamplingParams(top_k=5))
    assert set(freq.nonzero().flatten().tolist()) == best
    expected = torch.softmax(logits[sorted(best)], -1)
    assert (freq[sorted(best)] - expected).abs().max().item() < 0.02


@pytest.mark.parametrize("top_p, kept", [
    (0.3, [1]),  # the top token alone already holds 0.5
    (0.7, [1, 3]),  # 0.5 + 0.25 = 0.75 >= 0.7
    (0.8, [1, 2, 3]),  # 0.75 < 0.8, so 0.15 joins
    (0.95, [0, 1, 2, 3]),
    (1.0, [0, 1, 2, 3]),
])
def test_top_p_keeps_the_nucleus(top_p: float, kept: list[int]) -> None:
    assert _kept(LOGITS, SamplingParams(top_p=top_p)) == kept


def test_top_p_renormalises_after_top_k() -> None:
    # top_k=2 leaves 0.5 and 0.25 (2/3 and 1/3 of the rest); top_p=0.6 then keeps only the first.
    assert _kept(LOGITS, SamplingParams(top_k=2, top_p=0.6)) == [1]
    assert _kept(LOGITS, SamplingParams(top_k=2, top_p=0.7)) == [1, 3]


def test_top_p_frequencies_are_the_renormalised_nucleus() -> None:
    freq = _frequencies(LOGITS, SamplingParams(top_p=0.7), draws=4000)
    assert freq[0].item() == 0.0 and freq[2].item() == 0.0
    assert abs(freq[1].item() - 2 / 3) < 0.02


@pytest.mark.parametrize("min_p, kept", [
    (0.0, [0, 1, 2, 3]),
    (0.25, [1, 2, 3]),  # drops p < 0.125
    (0.4, [1, 3]),  # drops p < 0.2
    (0.6, [1]),  # drops p < 0.3
])
def test_min_p_threshold(min_p: float, kept: list[int]) -> None:
    assert _kept(LOGITS, SamplingParams(min_p=min_p)) == kept


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    meta = _meta([SamplingParams(repetition_penalty=2.0)], 5, prompt=[0, 1, 0], output=[1])
    assert apply_penalties(logits, meta).tolist() == [[1.0, -4.0, 1.0, -1.0, 0.5]]


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(1, 5)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    meta = _meta([params], 5, prompt=[4, 4], output=[2, 2, 3])
    # token 2: 0.5 * 2 + 0.25; token 3: 0.5 * 1 + 0.25; prompt token 4 untouched.
    assert apply_penalties(logits, meta).tolist() == [[0.0, 0.0, -1.25, -0.75, 0.0]]


def test_penalties_apply_in_order_then_logit_bias() -> None:
    logits = torch.tensor([[3.0, -1.0, 0.0]])
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5,
                            logit_bias={0: 2.0, 2: -1.0})
    meta = _meta([params], 3, prompt=[1], output=[0])
    # token 0: 3 / 1.5 - (1 + 0.5) + 2; token 1: -1 * 1.5; token 2: bias only.
    assert apply_penalties(logits, meta).tolist() == [[2.5, -1.5, -1.0]]
    assert logits.tolist() == [[3.0, -1.0, 0.0]]  # the input is never modified


def test_penalties_are_per_row() -> None:
    logits = torch.ones(2, 4)
    meta = SamplingMetadata.build([
        RowSampling(SamplingParams(repetition_penalty=2.0), [0], [1], None),
        RowSampling(SamplingParams(), [0], [1], None),
    ], 4)
    assert apply_penalties(logits, meta).tolist() == [[0.5, 0.5, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]


def test_logit_bias_forces_and_forbids() -> None:
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(2))
    forced = _frequencies(logits, SamplingParams(logit_bias={17: 100.0}), draws=2000)
    assert forced[17].item() == 1.0
    best = int(logits.argmax())
    forbidden = _frequencies(logits, SamplingParams(temperature=0.05, logit_bias={best: -100.0}), draws=2000)
    assert forbidden[best].item() == 0.0
    second = int(logits.topk(2).indices[1])
    assert forbidden[second].item() > 0.9


def test_bitmask_forbids_tokens() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]] * 2)
    meta = _meta([SamplingParams(temperature=0.0), SamplingParams(temperature=5.0)], 4)
    meta.token_bitmask = torch.tensor([[False, True, False, True]] * 2)
    assert sample(logits, meta).token_ids[0].item() == 1
    freq = _frequencies(logits[0], SamplingParams(temperature=5.0), draws=4000)
    assert freq.min().item() > 0.0  # every token is possible without the mask
    big = logits[:1].expand(4000, -1).contiguous()
    meta = _meta([SamplingParams(temperature=5.0)] * 4000, 4)
    meta.token_bitmask = torch.tensor([[False, True, False, True]]).expand(4000, -1)
    assert set(sample(big, meta).token_ids.tolist()) == {1, 3}


def _seeded_sequence(seed: int, steps: int, others: list[SamplingParams], position: int,
                     params: SamplingParams) -> list[int]:
    """Tokens a seeded row samples over `steps` steps, sharing each step's batch with `others`."""
    vocab = 1000
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for step in range(steps):
        logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(100 + step))
        batch_params = others[:position] + [params] + others[position:]
        rows = [RowSampling(p, [1, 2], [], None) for p in batch_params]
        rows[position] = RowSampling(params, [1, 2], list(tokens), generator)
        batch_logits = torch.randn(len(rows), vocab) * 3  # other rows: different logits every call
        batch_logits[position] = logits[0]
        tokens.append(int(sample(batch_logits, SamplingMetadata.build(rows, vocab)).token_ids[position]))
    return tokens


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.01, frequency_penalty=0.5),
])
def test_same_seed_same_tokens_whatever_the_batch(params: SamplingParams) -> None:
    alone = _seeded_sequence(7, 8, [], 0, params)
    others = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.5, seed=3),
              SamplingParams(temperature=1.3, top_k=5), SamplingParams(logprobs=3)]
    assert _seeded_sequence(7, 8, others, 2, params) == alone
    assert _seeded_sequence(7, 8, others[:1], 1, params) == alone
    assert _seeded_sequence(8, 8, others, 2, params) != alone
    assert len(set(alone)) > 1  # the rows really sample


def test_logprobs_are_of_the_raw_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 500)
    params = [SamplingParams(temperature=0.5, logprobs=2, repetition_penalty=1.5, logit_bias={9: 10.0}),
              SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=1.0)]
    out = sample(logits, _meta(params, 500, prompt=[3, 4]))
    raw = torch.log_softmax(logits, -1)
    assert torch.equal(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    assert out.top_ids.shape == (3, 5)
    expected = raw.topk(5)
    assert torch.equal(out.top_logprobs, expected.values)
    assert torch.equal(out.top_ids, expected.indices)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())
    order = raw.argsort(-1, descending=True)
    ranks = [order[i].tolist().index(t) + 1 for i, t in enumerate(out.token_ids.tolist())]
    assert out.ranks.tolist() == ranks
    assert out.ranks[1].item() == 1  # the greedy row took the top token


def test_logprobs_zero_gives_the_chosen_token_only() -> None:
    logits = torch.randn(2, 300)
    out = sample(logits, _meta([SamplingParams(temperature=0.0, logprobs=0)] * 2, 300))
    assert out.top_ids.shape == (2, 0) and out.logprobs.shape == (2,)
    assert out.ranks.tolist() == [1, 1]


def test_mixed_batch_rows_equal_rows_sampled_alone() -> None:
    vocab = 700
    torch.manual_seed(3)
    logits = torch.randn(5, vocab) * 2
    rows = [
        (SamplingParams(temperature=0.0, repetition_penalty=1.3), [1, 2, 3], [4], None),
        (SamplingParams(temperature=0.7, top_k=20), [5], [6, 6], 11),
        (SamplingParams(temperature=1.2, top_p=0.9, min_p=0.05, frequency_penalty=0.7,
                        presence_penalty=0.2, logit_bias={10: 3.0}), [7], [8, 9, 8], 12),
        (SamplingParams(temperature=1.0, logprobs=4), [], [], 13),
        (SamplingParams(temperature=0.0, logit_bias={0: 100.0}), [], [], None),
    ]

    def build(subset: list[int]) -> SamplingMetadata:
        return SamplingMetadata.build([
            RowSampling(rows[i][0], rows[i][1], rows[i][2],
                        None if rows[i][3] is None else torch.Generator().manual_seed(rows[i][3]))
            for i in subset], vocab)

    together = sample(logits, build(list(range(5))))
    for i in range(5):
        alone = sample(logits[i:i + 1], build([i]))
        assert alone.token_ids.item() == together.token_ids[i].item(), i
    assert together.token_ids[4].item() == 0
    assert together.token_ids[0].item() == apply_penalties(logits[:1], build([0])).argmax().item()


def test_unused_fields_are_none_and_all_greedy_is_argmax() -> None:
    meta = _meta([SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)] * 3, 100)
    assert meta.all_greedy and meta.greedy is None
    assert meta.temperature is None and meta.top_p is None and meta.top_k is None and meta.min_p is None
    assert meta.repetition is None and meta.frequency_presence is None and meta.logit_bias is None
    assert meta.max_num_logprobs is None and not meta.generators and not meta.shared_noise
    logits = torch.randn(3, 100)
    assert torch.equal(sample(logits, meta).token_ids, logits.argmax(-1))


def test_seeded_greedy_rows_leave_their_generator_alone() -> None:
    generator = torch.Generator().manual_seed(5)
    state = generator.get_state()
    meta = SamplingMetadata.build([RowSampling(SamplingParams(temperature=0.0), [], [], generator)], 50)
    sample(torch.randn(1, 50), meta)
    assert torch.equal(generator.get_state(), state)


# The hand-written selection ops against torch.


@pytest.mark.parametrize("vocab", [256, 1000, 4099])
def test_ops_argmax_and_topk_match_torch(vocab: int) -> None:
    x = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(ops.argmax(x), x.argmax(-1))
    for k in (1, 5, 20):
        values, indices = ops.topk(x, k)
        assert torch.equal(values, x.topk(k).values) and torch.equal(indices, x.topk(k).indices)


def test_ops_argmax_on_cpu_and_on_any_device_agree_with_torch() -> None:
    """The CPU's numpy pass and the blocked reductions other devices take give torch's index: the
    first of tied maxima (within a block and across blocks), NaN as the maximum, 0 for a row masked
    whole, on strided views too; bf16 takes the blocked path."""
    x = torch.randn(7, 4099, generator=torch.Generator().manual_seed(1))
    x[1, 3] = x[1, 200] = 40.0  # tied within a block
    x[2, 10] = x[2, 4000] = 40.0  # tied across blocks
    x[3, 2500] = float("nan")
    x[4] = float("-inf")
    x[5, 4098] = 50.0  # in the last, padded block
    for view in (x, x[::2], x[:, 1:]):
        expected = view.argmax(-1)
        assert torch.equal(ops.argmax(view), expected) and torch.equal(ops._blocked_argmax(view), expected)
    half = x.to(torch.bfloat16)
    assert torch.equal(ops.argmax(half), half.argmax(-1))


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])
def test_ops_mass_threshold_matches_a_sort(scale: float) -> None:
    probs = torch.softmax(torch.randn(16, 5000, generator=torch.Generator().manual_seed(1)) * scale, -1)
    fraction = torch.linspace(0.05, 0.99, 16)
    threshold = ops.mass_threshold(probs, fraction)
    ordered = probs.sort(-1, descending=True).values.double()
    before = ordered.cumsum(-1) - ordered  # mass strictly above each entry
    count = (before < fraction.double().unsqueeze(1) * ordered.sum(-1, keepdim=True)).sum(-1)
    expected = ordered.gather(1, (count - 1).unsqueeze(1)).float()
    assert torch.equal(threshold, expected)
    assert math.isclose(float((probs >= threshold).sum()), float(count.sum()))


def test_ops_mass_threshold_reaching_the_fraction_exactly_stops() -> None:
    probs = torch.tensor([[0.125, 0.5, 0.125, 0.25]])
    assert ops.mass_threshold(probs, torch.tensor([0.75])).item() == 0.25
    assert ops.mass_threshold(probs, torch.tensor([0.76])).item() == 0.125
