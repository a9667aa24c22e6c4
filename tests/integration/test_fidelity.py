"""Forge against Hugging Face transformers on the default model: greedy tokens and logprobs."""
from __future__ import annotations

import json

import pytest
import torch

from forge_service import LLM, SamplingParams

MAX_TOKENS = 48
pytestmark = pytest.mark.slow


def hf_greedy(model, prompt_ids: list[int], eos_id: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=eos_id, pad_token_id=eos_id)
    return out[0, len(prompt_ids):].tolist()


def hf_token_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """Teacher-forced log-probability of each output token under transformers."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.inference_mode():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(output_ids)[:, None])[:, 0].tolist()


def check_fidelity(llm: LLM, hf, prompt_ids: list[list[int]]) -> None:
    eos = 2
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0))
    matches = 0
    for ids, out in zip(prompt_ids, outs):
        ours = out.outputs[0]
        theirs = hf_greedy(hf, ids, eos)
        matches += ours.token_ids == theirs
        ref = hf_token_logprobs(hf, ids, ours.token_ids)
        got = [lp[0].logprob for lp in ours.logprobs]
        worst = max(abs(a - b) for a, b in zip(got, ref))
        assert worst < 1e-3, f"logprob differs by {worst} on prompt {ids[:8]}..."
    assert matches >= 19, f"only {matches}/20 greedy continuations match transformers"


def test_gguf_matches_transformers(llm_fp32, hf_model, fidelity_prompt_ids):
    assert len(fidelity_prompt_ids) == 20
    check_fidelity(llm_fp32, hf_model, fidelity_prompt_ids)


def test_safetensors_dir_matches_transformers(tmp_path, llm_fp32, hf_tokenizer, fidelity_prompt_ids):
    """Save the dequantized weights as a Hugging Face directory; Forge and transformers load it alike."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from forge_service.loaders import default_model_path, load_checkpoint

    ckpt = load_checkpoint(default_model_path(), torch.float32)
    arch = ckpt.arch
    save_file({k: v.contiguous() for k, v in ckpt.weights.items()}, str(tmp_path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta, "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32", "hidden_act": "silu",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    hf_tokenizer.save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    llm = LLM(model=str(tmp_path), dtype="float32")
    check_fidelity(llm, hf, fidelity_prompt_ids[::2] + fidelity_prompt_ids[1::2])


def test_bf16_agrees_with_fp32(llm_fp32, fidelity_prompt_ids, capsys):
    llm_bf16 = LLM(dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=32)
    a = [o.outputs[0].text for o in llm_fp32.generate(fidelity_prompt_ids, params)]
    b = [o.outputs[0].text for o in llm_bf16.generate(fidelity_prompt_ids, params)]
    equal = sum(x == y for x, y in zip(a, b))
    with capsys.disabled():
        print(f"\nbf16 vs fp32: {equal}/{len(a)} greedy 32-token continuations identical")
    assert equal >= len(a) // 2, f"bf16 greedy text equals fp32 on only {equal}/{len(a)} prompts"
