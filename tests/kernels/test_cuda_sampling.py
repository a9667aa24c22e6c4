"""GPU: the sampling kernel and CudaSampler against the CPU sampler's rules."""
from __future__ import annotations

import pytest
import torch

from forge_service.backends.cuda import sampling
from forge_service.engine.request import SamplingParams
from forge_service.sampling import RowSampling, Sampler, SamplingMetadata
from forge_service.sampling.sampler import sampling_weights

pytestmark = pytest.mark.gpu


def params(n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
           seed0: int = 0, step: int = 0) -> tuple[torch.Tensor, ...]:
    cuda = {"device": "cuda"}
    return (torch.full((n,), temperature, **cuda), torch.full((n,), top_k, dtype=torch.int32, **cuda),
            torch.full((n,), top_p, **cuda), torch.full((n,), min_p, **cuda),
            torch.arange(seed0, seed0 + n, dtype=torch.int64, **cuda),
            torch.full((n,), step, dtype=torch.int64, **cuda))


def test_greedy_is_the_first_argmax(kernels):
    logits = torch.randn(33, 128256, device="cuda")
    logits[3, [10, 500, 90000]] = 100.0  # a three-way tie: the first index wins, as torch.argmax
    got = sampling.sample(kernels, logits, *params(33, temperature=0.0))
    assert torch.equal(got, logits.argmax(-1))
    assert got[3] == 10


def test_top_k_one_is_greedy(kernels):
    logits = torch.randn(64, 49152, device="cuda")
    got = sampling.sample(kernels, logits, *params(64, temperature=1.3, top_k=1))
    assert torch.equal(got, logits.argmax(-1))


def test_seeded_rows_are_batch_invariant_and_step_keyed(kernels):
    logits = torch.randn(16, 32000, device="cuda") * 2
    batch = sampling.sample(kernels, logits, *params(16, seed0=100, step=5))
    for i in (0, 7, 15):
        alone = sampling.sample(kernels, logits[i:i + 1].contiguous(), *params(1, seed0=100 + i, step=5))
        assert alone.item() == batch[i].item()
    assert torch.equal(batch, sampling.sample(kernels, logits, *params(16, seed0=100, step=5)))
    steps = torch.stack([sampling.sample(kernels, logits, *params(16, seed0=100, step=s)) for s in range(8)])
    assert (steps != steps[0]).any()  # other steps draw other noise


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_frequencies_follow_the_softmax(kernels, temperature):
    n, logits = 40000, torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.2, 1.7], device="cuda")
    got = sampling.sample(kernels, logits.expand(n, -1).contiguous(), *params(n, temperature=temperature))
    freq = torch.bincount(got, minlength=8).float() / n
    want = torch.softmax(logits / temperature, -1)
    sigma = (want * (1 - want) / n).sqrt()
    assert ((freq - want).abs() <= 5 * sigma + 1e-4).all(), (freq, want)


@pytest.mark.parametrize("top_k,top_p,min_p", [(3, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.2), (5, 0.9, 0.05)])
def test_filters_keep_the_cpu_samplers_support(kernels, top_k, top_p, min_p):
    n, vocab = 20000, 12
    logits = torch.tensor([3.0, 2.5, 2.4, 2.0, 1.0, 0.9, 0.5, 0.0, -0.5, -1.0, -2.0, -4.0])
    meta = SamplingMetadata.build([RowSampling(SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p, min_p=min_p),
                                               [], [])], vocab)
    weights = sampling_weights(logits[None], meta)[0]  # the CPU sampler's kept weights
    got = sampling.sample(kernels, logits.cuda().expand(n, -1).contiguous(),
                          *params(n, temperature=0.9, top_k=top_k, top_p=top_p, min_p=min_p))
    freq = torch.bincount(got.cpu(), minlength=vocab).float() / n
    want = weights / weights.sum()
    assert (freq[want == 0] == 0).all(), "a filtered token was sampled"
    sigma = (want * (1 - want) / n).sqrt()
    assert ((freq - want).abs() <= 5 * sigma + 1e-4).all(), (freq, want)


def test_large_vocab_top_p_top_k_stay_in_support(kernels):
    n, vocab = 64, 128256
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3
    rows = [RowSampling(SamplingParams(temperature=0.8, top_k=40 + i, top_p=0.7 + 0.004 * i, seed=i), [], [])
            for i in range(n)]
    meta = SamplingMetadata.build(rows, vocab)
    support = sampling_weights(logits, meta) > 0
    cuda = {"device": "cuda"}
    got = sampling.sample(kernels, logits.cuda(), torch.full((n,), 0.8, **cuda),
                          torch.tensor([40 + i for i in range(n)], dtype=torch.int32, **cuda),
                          torch.tensor([0.7 + 0.004 * i for i in range(n)], **cuda), torch.zeros(n, **cuda),
                          torch.arange(n, **cuda), torch.zeros(n, dtype=torch.int64, **cuda))
    assert support[torch.arange(n), got.cpu()].all()


def test_cuda_sampler_matches_the_cpu_sampler_when_greedy(cuda_backend):
    vocab = 4096
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1))
    rows = [RowSampling(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.3, logit_bias={5: 4.0}),
                        [1, 2, 3], [4, 5]) for _ in range(6)]
    want = Sampler()(logits, SamplingMetadata.build(rows, vocab))
    got = cuda_backend.sampler()(logits.cuda(), SamplingMetadata.build(rows, vocab, "cuda"))
    assert torch.equal(got.token_ids.cpu(), want.token_ids)
    assert torch.equal(got.top_ids.cpu(), want.top_ids) and torch.equal(got.ranks.cpu(), want.ranks)
    torch.testing.assert_close(got.logprobs.cpu(), want.logprobs, atol=1e-5, rtol=1e-5)
