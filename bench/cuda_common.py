"""Shared by the CUDA benchmarks: a random-weight model with Llama-3.1-8B's exact shapes, built in
GPU memory (no download), a word-level tokenizer for its vocabulary, the device's measured
ceilings (copy bandwidth, bf16 matmul rate), and CUDA-event timing."""
from __future__ import annotations

import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from forge_service.backends.cuda.gemm import time_ms  # noqa: E402  (CUDA-event medians)
from forge_service.models.arch import ArchConfig  # noqa: E402

LLAMA_31_8B = ArchConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=131072, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
)


def random_weights(arch: ArchConfig, dtype: torch.dtype, device: str = "cuda",
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named weights, N(0, 0.02) matrices and norms near 1, drawn on the device. Each tensor's
    generator is seeded by its name, so the same weights can be rebuilt (for transformers)."""
    from forge_service.loaders.common import expected_shapes

    weights = {}
    for name, shape in expected_shapes(arch).items():
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        w = torch.randn(shape, generator=g, device=device, dtype=torch.float32 if len(shape) == 1 else dtype)
        weights[name] = (1.0 + 0.05 * w).to(dtype) if len(shape) == 1 else w.mul_(0.02)
    return weights


def random_checkpoint(arch: ArchConfig = LLAMA_31_8B, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    from forge_service.loaders import Checkpoint

    return Checkpoint(path="random-llama-3.1-8b", format="random", arch=arch,
                      weights=random_weights(arch, dtype, seed=seed))


def word_tokenizer(vocab_size: int, eos: tuple[int, ...]):
    """One word per id ("w0" ... ): any id decodes, cheaply, as real detokenization would run."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from forge_service.tokenizer import Tokenizer

    backend = Backend(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, {}, eos_token_ids=eos)


def build_engine(max_num_seqs: int, max_num_batched_tokens: int, kv_cache_bytes: int, max_model_len: int,
                 dtype: str = "bfloat16", seed: int = 0):
    """An LLMEngine on the CUDA backend over the random 8B-shaped model."""
    from forge_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from forge_service.engine.engine import LLMEngine

    config = EngineConfig(
        model=ModelConfig(dtype=dtype, device="cuda", max_model_len=max_model_len, served_model_name="random-8b"),
        cache=CacheConfig(kv_cache_bytes=kv_cache_bytes),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                  max_waiting=0))
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    return LLMEngine(config, checkpoint=random_checkpoint(LLAMA_31_8B, torch_dtype, seed),
                     tokenizer=word_tokenizer(LLAMA_31_8B.vocab_size, LLAMA_31_8B.eos_token_ids))


def decode_weight_bytes(arch: ArchConfig, dtype: torch.dtype) -> int:
    """Bytes of weights one decode step must read: every matrix but the embedding (one row of it)."""
    from forge_service.loaders.common import expected_shapes

    size = torch.finfo(dtype).bits // 8
    total = 0
    for name, shape in expected_shapes(arch).items():
        n = shape[-1] if name == "model.embed_tokens.weight" else int(torch.tensor(shape).prod())
        total += n * size
    return total


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), repeats=10)
    return 2 * nbytes / (ms / 1e3)


def matmul_flops(n: int = 8192) -> float:
    """bf16 matmul rate in FLOP/s on random [n, n] inputs."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: a @ b, repeats=10)
    return 2 * n ** 3 / (ms / 1e3)


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
