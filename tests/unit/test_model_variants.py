"""Mistral, Qwen2 and Qwen3 checkpoints: a Llama decoder plus Qwen2's q/k/v biases or Qwen3's
per-head q/k norms. In fp32 equal to transformers from SafeTensors and from GGUF; in bf16 the native
fused step gives the per-kernel path's bits."""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from forge_service import LLM, SamplingParams
from forge_service.backends import cpu_kernels
from forge_service.errors import ModelLoadError
from forge_service.loaders import load_checkpoint
from tests.tiny_models import (
    gguf_tensor_name, random_weights, tiny_tokenizer_json, variant_arch, write_gguf, write_safetensors_dir,
)

VARIANTS = ["mistral", "qwen2", "qwen3", "smollm3", "phi3"]
PROMPT = list(range(3, 60))


def _weights(arch, seed: int = 3) -> dict[str, torch.Tensor]:
    w = random_weights(arch, seed)
    w["model.embed_tokens.weight"] *= 10  # confident enough that greedy choices are not near ties
    if "lm_head.weight" in w:
        w["lm_head.weight"] *= 10
    return w


def _hf_steps(model_dir: Path, ids: list[int], n: int, drop: tuple[str, ...] = ()) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs; `drop`: parameters (by name suffix) zeroed first."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for name, p in hf.named_parameters():
            if drop and name.endswith(drop):
                p.zero_()
        # output_logits: the raw logits (the scores have EOS masked by min_new_tokens)
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(out.logits, tokens)]


def _ours(llm: LLM, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0))[0].outputs[0]
    return out.token_ids, [pos[0].logprob for pos in out.logprobs]


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_greedy_decode_equals_transformers(tmp_path: Path, variant: str) -> None:
    greedy_decode_equals_transformers(tmp_path, variant)


def greedy_decode_equals_transformers(tmp_path: Path, variant: str, device: str = "cpu", **sizes: int) -> None:
    """fp32 greedy tokens and logprobs on `device` against transformers' (the GPU tests reuse it)."""
    arch = variant_arch(variant, **sizes)
    write_safetensors_dir(tmp_path, arch, _weights(arch), tokenizer_json=tiny_tokenizer_json())
    assert load_checkpoint(str(tmp_path)).arch == arch
    llm = LLM(model=str(tmp_path), dtype="float32", device=device, max_num_batched_tokens=16)  # 4 prefill chunks
    assert llm.engine.runner.device.type == device
    tokens, logprobs = _ours(llm, PROMPT, 12)
    want_tokens, want_logprobs = _hf_steps(tmp_path, PROMPT, 12)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-4
    extra = {"qwen2": (".bias",), "qwen3": ("q_norm.weight", "k_norm.weight")}.get(variant)
    if extra:  # what the variant adds moves the logprobs by far more than the tolerance
        _, without = _hf_steps(tmp_path, PROMPT, 12, drop=extra)
        assert max(abs(a - b) for a, b in zip(without, want_logprobs)) > 1e-2
    if variant == "smollm3":  # with rotary in every layer it answers otherwise
        roped = tmp_path / "roped"
        write_safetensors_dir(roped, arch, _weights(arch), tokenizer_json=tiny_tokenizer_json(),
                              config_overrides={"no_rope_layers": [1] * arch.num_layers})
        assert max(abs(a - b) for a, b in zip(_hf_steps(roped, PROMPT, 12)[1], want_logprobs)) > 5e-4


@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
def test_qwen_gguf_loads_the_safetensors_weights_with_q_and_k_rows_as_stored(tmp_path: Path, variant: str) -> None:
    # llama.cpp rotates Qwen's heads by halves (NEOX), as Hugging Face does: convert_hf_to_gguf
    # writes its Q/K rows unpermuted, where a Llama's are interleaved.
    # head_dim != hidden / heads (the key_length key); tied embeddings, as the small Qwens have
    arch = variant_arch(variant, head_dim=32, tie_word_embeddings=True)
    weights = _weights(arch)
    path = write_gguf(tmp_path / "m.gguf", arch, weights)
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    for proj in ("q_proj", "k_proj"):
        name = f"model.layers.1.self_attn.{proj}.weight"
        np.testing.assert_array_equal(stored[gguf_tensor_name(name)], weights[name].numpy())
    ckpt = load_checkpoint(str(path))
    assert ckpt.arch == arch
    assert ckpt.weights.keys() == weights.keys()
    assert all(torch.equal(ckpt.weights[n], weights[n]) for n in ckpt.weights)
    st = write_safetensors_dir(tmp_path / "st", arch, weights, tokenizer_json=tiny_tokenizer_json())
    from_gguf = _ours(LLM(model=str(path), dtype="float32"), PROMPT, 8)
    assert from_gguf == _ours(LLM(model=str(st), dtype="float32"), PROMPT, 8)
    assert from_gguf[0] == _hf_steps(st, PROMPT, 8)[0]


def test_a_mistral_gguf_is_a_llama_one(tmp_path: Path) -> None:
    arch = variant_arch("mistral")
    ckpt = load_checkpoint(str(write_gguf(tmp_path / "m.gguf", arch, _weights(arch), architecture="llama")))
    assert ckpt.arch.architecture == "llama"


def test_a_sliding_window_caps_the_context(tmp_path: Path) -> None:
    arch = variant_arch("mistral")
    weights = _weights(arch)
    for overrides, context in (({"sliding_window": 64}, 64), ({"sliding_window": None}, 256),
                               ({"sliding_window": 4096}, 256),  # wider than the context: nothing to cap
                               ({"sliding_window": 64, "model_type": "qwen2", "use_sliding_window": False}, 256)):
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        if overrides.get("model_type") == "qwen2":
            arch, weights = variant_arch("qwen2"), _weights(variant_arch("qwen2"))
            overrides |= {"architectures": ["Qwen2ForCausalLM"]}
        write_safetensors_dir(root, arch, weights, tokenizer_json=tiny_tokenizer_json(), config_overrides=overrides)
        assert load_checkpoint(str(root)).arch.max_position_embeddings == context, overrides
    with pytest.raises(ModelLoadError, match="sliding_window must be a positive integer"):
        write_safetensors_dir(tmp_path / "bad", arch, weights, config_overrides={"sliding_window": 0})
        load_checkpoint(str(tmp_path / "bad"))


def test_a_variant_s_tensors_are_required_and_only_there(tmp_path: Path) -> None:
    qwen2 = variant_arch("qwen2")
    weights = _weights(qwen2)
    missing = {n: w for n, w in weights.items() if not n.endswith("layers.1.self_attn.v_proj.bias")}
    with pytest.raises(ModelLoadError, match=r"missing tensor blk\.1\.attn_v\.bias"):
        load_checkpoint(str(write_gguf(tmp_path / "missing.gguf", qwen2, missing)))
    llama = variant_arch("llama")
    with pytest.raises(ModelLoadError, match=r"unexpected tensor model\.layers\.0\.self_attn\.k_proj\.bias"):
        load_checkpoint(str(write_gguf(tmp_path / "extra.gguf", llama, weights, architecture="llama")))
    qwen3 = variant_arch("qwen3")
    norms = _weights(qwen3)
    norms["model.layers.0.self_attn.q_norm.weight"] = norms["model.layers.0.self_attn.q_norm.weight"][:8]
    with pytest.raises(ModelLoadError, match=r"attn_q_norm\.weight.*has shape \(8,\), expected \(16,\)"):
        load_checkpoint(str(write_gguf(tmp_path / "shape.gguf", qwen3, norms)))


def test_a_smollm3_gguf_leaves_every_fourth_layer_without_rotary(tmp_path: Path) -> None:
    # llama.cpp's SmolLM3: Q/K rows permuted as a Llama's, every 4th layer NoPE (not in the metadata)
    arch = variant_arch("smollm3", num_layers=4, nope_layers=(3,))
    weights = _weights(arch)
    path = write_gguf(tmp_path / "m.gguf", arch, weights)
    ckpt = load_checkpoint(str(path))
    assert ckpt.arch == arch and all(torch.equal(ckpt.weights[n], weights[n]) for n in ckpt.weights)
    st = write_safetensors_dir(tmp_path / "st", arch, weights, tokenizer_json=tiny_tokenizer_json())
    assert _ours(LLM(model=str(path), dtype="float32"), PROMPT, 8)[0] == _hf_steps(st, PROMPT, 8)[0]
    assert load_checkpoint(str(st)).arch.nope_layers == (3,)
    bad = write_safetensors_dir(tmp_path / "bad", arch, weights, config_overrides={"no_rope_layers": [1, 0]})
    with pytest.raises(ModelLoadError, match="no_rope_layers must list 0 or 1 for each of the 4 layers"):
        load_checkpoint(str(bad))


@pytest.mark.skipif(cpu_kernels.library() is None, reason="the native CPU kernels cannot run on this machine")
@pytest.mark.parametrize("variant", ["qwen2", "qwen3", "smollm3", "phi3"])
def test_bf16_fused_step_equals_the_per_kernel_path(tmp_path: Path, variant: str) -> None:
    # head_dim 64 (the native attention takes multiples of 32); Qwen3's wider than hidden / heads;
    # SmolLM3's 4 layers, the last without rotary (a GGUF's every 4th)
    arch = variant_arch(variant, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2,
                        head_dim=64 if variant == "qwen3" else 32, num_layers=4 if variant == "smollm3" else 2)
    weights = _weights(arch)
    path = str(write_gguf(tmp_path / "m.gguf", arch, weights, qtype="Q8_0"))
    llm = LLM(model=path, dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=24)
    model = llm.engine.runner.model
    assert model.decode_plan is not None
    extras = [(layer.qkv_bias, layer.q_norm) for layer in model.layers]
    assert all((b is not None) == (variant == "qwen2") and (n is not None) == (variant == "qwen3") for b, n in extras)
    assert [layer.rope for layer in model.layers] == [True] * (arch.num_layers - 1) + [variant != "smollm3"]
    prompts = [list(range(3 + i, 3 + i + 9 + 11 * i)) for i in range(5)]  # chunks beside decodes
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True, logprobs=3) for i in range(5)]

    def run() -> list:
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [(o.token_ids, [[(lp.token_id, lp.logprob) for lp in pos] for pos in o.logprobs]) for o in outs]

    fused = run()
    model.decode_plan = None
    assert run() == fused
    # and close to the fp32 reference (the int8 weights and bf16 activations aside)
    reference = LLM(model=path, dtype="float32")
    for prompt, (tokens, logprobs) in zip(prompts, fused):
        want_tokens, want = _ours(reference, prompt, 3)
        assert tokens[:3] == want_tokens
        assert max(abs(pos[0][1] - w) for pos, w in zip(logprobs, want)) < 0.05


@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
def test_yarn_rope_scaling_equals_transformers_and_opens_its_context(tmp_path: Path, variant: str) -> None:
    # Qwen2.5 / Qwen3 long context: YaRN with factor 4 over an original context of 64 positions
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    arch = variant_arch(variant, rope_scaling=yarn, max_position_embeddings=64)
    write_safetensors_dir(tmp_path, arch, _weights(arch), tokenizer_json=tiny_tokenizer_json())
    loaded = load_checkpoint(str(tmp_path)).arch
    assert loaded.max_position_embeddings == 256 and loaded.rope_scaling == yarn  # 4 x 64
    llm = LLM(model=str(tmp_path), dtype="float32")
    prompt = list(range(3, 100)) + list(range(3, 40))  # 134 positions: past the original 64
    tokens, logprobs = _ours(llm, prompt, 12)
    want_tokens, want_logprobs = _hf_steps(tmp_path, prompt, 12)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-4
    plain = tmp_path / "plain"  # the same weights without the scaling answer otherwise
    write_safetensors_dir(plain, arch, _weights(arch), tokenizer_json=tiny_tokenizer_json(),
                          config_overrides={"rope_scaling": None, "max_position_embeddings": 256})
    # at least 5x the tolerance above (qwen2 1.2e-3, qwen3 5e-2): the comparison can tell them apart
    assert max(abs(a - b) for a, b in zip(_hf_steps(plain, prompt, 12)[1], want_logprobs)) > 5e-4


def test_yarn_attention_factor_and_its_defaults() -> None:
    from forge_service.layers.rotary import attention_factor, inverse_frequencies

    assert attention_factor({"rope_type": "yarn", "factor": 4.0}) == pytest.approx(0.1 * math.log(4) + 1)
    assert attention_factor({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.5}) == 0.5
    assert attention_factor({"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}) == 1.0
    assert attention_factor({"rope_type": "linear", "factor": 4.0}) == attention_factor(None) == 1.0
    base = inverse_frequencies(64, 10000.0, None)
    scaled = inverse_frequencies(64, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 4096})
    assert torch.equal(scaled[:4], base[:4])  # fast dimensions kept
    assert torch.allclose(scaled[-4:], base[-4:] / 4)  # slow ones interpolated


def test_a_phi3_gguf_keeps_its_fused_projections_and_its_sliding_window(tmp_path: Path) -> None:
    # llama.cpp's Phi-3: attn_qkv and ffn_up (gate and up) as the checkpoint fused them, rows as
    # they are (NEOX rotary), and the window of attention.sliding_window (Phi-3 mini's 2047)
    arch = variant_arch("phi3", tie_word_embeddings=False)
    weights = _weights(arch)
    assert "model.layers.0.self_attn.qkv_proj.weight" in weights and "model.layers.0.mlp.up_proj.weight" not in weights
    path = write_gguf(tmp_path / "m.gguf", arch, weights)
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"} <= names and "blk.0.attn_q.weight" not in names
    ckpt = load_checkpoint(str(path))
    assert ckpt.arch == arch and all(torch.equal(ckpt.weights[n], weights[n]) for n in ckpt.weights)
    st = write_safetensors_dir(tmp_path / "st", arch, weights, tokenizer_json=tiny_tokenizer_json())
    assert _ours(LLM(model=str(path), dtype="float32"), PROMPT, 8)[0] == _hf_steps(st, PROMPT, 8)[0]
    windowed = write_gguf(tmp_path / "w.gguf", arch, weights, uint32_keys={"phi3.attention.sliding_window": 64})
    assert load_checkpoint(str(windowed)).arch.max_position_embeddings == 64


def test_partial_rotary_embeddings_and_longrope_are_refused_by_name(tmp_path: Path) -> None:
    arch = variant_arch("phi3")
    root = write_safetensors_dir(tmp_path, arch, _weights(arch), config_overrides={"partial_rotary_factor": 0.75})
    with pytest.raises(ModelLoadError, match=r"partial rotary embeddings \(partial_rotary_factor 0.75\)"):
        load_checkpoint(str(root))
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    root = write_safetensors_dir(tmp_path / "long", arch, _weights(arch), config_overrides={"rope_scaling": longrope})
    with pytest.raises(ModelLoadError, match="rope scaling 'longrope' is not supported; supported: default, linear"):
        load_checkpoint(str(root))
