"""Batched sampling: temperature, min_p, top_k, top_p, penalties, logit_bias, seeds, logprobs."""
from forge_service.sampling.metadata import RowSampling, SamplingMetadata
from forge_service.sampling.sampler import Sampler, SamplerOutput

__all__ = ["RowSampling", "Sampler", "SamplerOutput", "SamplingMetadata"]
