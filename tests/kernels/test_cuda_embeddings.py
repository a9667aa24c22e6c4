"""GPU: embeddings (tests/unit/test_embeddings.py) on the CUDA backend, on a Qwen3-shaped model whose
head_dim (64) the GPU's decode kernel takes: fp32 embeddings are transformers' last hidden state,
and an embedding beside generation (and from the prefix cache) changes neither: the same bits in
bf16, within fp32's rounding in fp32."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.kernels.helpers import engines_on
from tests.tiny_models import GPU_SIZES, tiny_tokenizer_json, variant_arch, write_safetensors_dir
from tests.unit import test_embeddings as embedding_tests
from tests.unit.test_model_variants import _weights

pytestmark = pytest.mark.gpu
on_the_gpu = engines_on("cuda", embedding_tests)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    arch = variant_arch("qwen3", tie_word_embeddings=True, **GPU_SIZES)
    root = tmp_path_factory.mktemp("qwen3_embed_gpu")
    write_safetensors_dir(root, arch, _weights(arch), tokenizer_json=tiny_tokenizer_json())
    return root


def test_an_embedding_beside_generation_changes_neither(qwen3_dir: Path) -> None:
    # bf16 (the GPU's default) gives a row the same bits in any batch; fp32's GEMMs differ by an ulp
    # with the batch's rows (4.8e-7 on values up to 3.2 on an H200)
    embedded, beside, cached = embedding_tests.embeddings_beside_generation(
        embedding_tests.LLM(model=str(qwen3_dir), dtype="bfloat16"))
    assert beside == embedded and cached == embedded
    embedded, beside, cached = embedding_tests.embeddings_beside_generation(
        embedding_tests.LLM(model=str(qwen3_dir), dtype="float32"))
    for other in (beside, cached):
        assert torch.allclose(torch.tensor(other), torch.tensor(embedded), rtol=1e-6, atol=1e-6)


def test_fp32_embeddings_are_transformers_last_hidden_state(qwen3_dir: Path) -> None:
    llm = embedding_tests.LLM(model=str(qwen3_dir), dtype="float32", max_num_batched_tokens=16)  # chunks
    assert llm.engine.runner.device.type == "cuda"
    for prompt, got in zip(embedding_tests.PROMPTS, llm.embed(embedding_tests.PROMPTS, normalize=False)):
        want = embedding_tests.hf_last_hidden(qwen3_dir, prompt)
        assert len(got) == want.numel() == GPU_SIZES["hidden_size"]
        assert torch.allclose(torch.tensor(got), want, atol=1e-4, rtol=1e-4)
