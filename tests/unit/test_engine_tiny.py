"""The engine on tiny random-weight Llamas: logits equal transformers', and every stopping rule."""
from __future__ import annotations

import pytest
import torch

from forge_service import LLM, SamplingParams
from forge_service.errors import InvalidArgument
from tests.tiny_models import CHATML_TEMPLATE, random_weights, tiny_arch, tiny_tokenizer_json, write_safetensors_dir


def sharp_weights(arch, seed=0):
    """Random weights with confident logits, so greedy choices are far from ties."""
    w = random_weights(arch, seed)
    w["model.embed_tokens.weight"] *= 50
    if "lm_head.weight" in w:
        w["lm_head.weight"] *= 50
    return w


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    arch = tiny_arch()
    root = tmp_path_factory.mktemp("tiny")
    write_safetensors_dir(root, arch, sharp_weights(arch), tokenizer_json=tiny_tokenizer_json(),
                          chat_template=CHATML_TEMPLATE)
    return root


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=str(tiny_dir), dtype="float32", max_num_batched_tokens=64)


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]


def hf_greedy(model_dir, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}])
def test_forward_matches_transformers(tmp_path, rope_scaling):
    arch = tiny_arch(rope_scaling=rope_scaling, tie_word_embeddings=rope_scaling is not None)
    write_safetensors_dir(tmp_path, arch, sharp_weights(arch, seed=3), tokenizer_json=tiny_tokenizer_json())
    ids = list(range(3, 60))
    llm = LLM(model=str(tmp_path), dtype="float32")
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0].outputs[0]
    ref = torch.log_softmax(hf_logits(tmp_path, ids)[-1], -1)
    assert out.token_ids == [int(ref.argmax())]
    assert abs(out.logprobs[0][0].logprob - float(ref.max())) < 1e-4
    top = [lp.token_id for lp in out.logprobs[0][1:]]
    assert top == ref.topk(5).indices.tolist()


def test_greedy_decode_matches_transformers_across_chunks(tiny_dir):
    ids = list(range(5, 150))  # 145 tokens: three prefill chunks under a 64-token budget
    llm = LLM(model=str(tiny_dir), dtype="float32", max_num_batched_tokens=64)
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert ours.token_ids == hf_greedy(tiny_dir, ids, 20)
    assert ours.finish_reason == "length"


def test_batch_equals_solo_with_preemption(tiny_dir):
    prompts = [list(range(3 + i, 3 + i + 10 + 7 * i)) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    big = LLM(model=str(tiny_dir), dtype="float32")
    alone = [big.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    small = LLM(model=str(tiny_dir), dtype="float32", num_blocks=12, block_size=8, max_num_batched_tokens=32)
    together = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert together == alone
    assert small.engine.num_preemptions > 0
    assert small.engine.kv.num_used_blocks == 0


def test_a_step_calls_on_launch_once_its_inputs_are_built_before_the_model_runs(llm, monkeypatch):
    engine, calls = llm.engine, []
    forward = engine.runner.forward

    def counted(*args):
        calls.append("forward")
        return forward(*args)

    monkeypatch.setattr(engine.runner, "forward", counted)
    engine.add_request("launch", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step(on_launch=lambda: calls.append("launch"))
    assert calls == ["launch", "forward"] * 2  # the prompt with its first token, then a decode


def test_n_completions_and_seeds(llm):
    p = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=8, ignore_eos=True)
    a = llm.generate(["hello"], p)[0]
    b = llm.generate(["hello"], p)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # each completion has its own seed
    assert a.usage["completion_tokens"] == 24


def test_stop_token_ids_and_eos(llm):
    first = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    stop_at = first.token_ids[2]
    out = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_at],
                                               ignore_eos=True))[0].outputs[0]
    assert out.token_ids == first.token_ids[:first.token_ids.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_stop_string_cuts_text(llm):
    first = llm.generate(["xyz"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    stop = first.text[3:5]
    assert stop
    out = llm.generate(["xyz"], SamplingParams(temperature=0, max_tokens=10, stop=[stop], ignore_eos=True))[0]
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == first.text[:first.text.index(stop)]
    kept = llm.generate(["xyz"], SamplingParams(temperature=0, max_tokens=10, stop=[stop], ignore_eos=True,
                                                include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == first.text[:first.text.index(stop) + len(stop)]


def test_chat_uses_template(llm):
    conv = [{"role": "user", "content": "hi"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False)


def test_over_long_prompt_is_rejected_with_counts(llm):
    with pytest.raises(InvalidArgument, match=r"250 tokens.*max_tokens is 10.*260.*256 by 4"):
        llm.generate([[5] * 250], SamplingParams(max_tokens=10))
    assert not llm.engine.has_unfinished_requests()


def test_bad_parameters_are_rejected(llm):
    for bad in (SamplingParams(temperature=-1), SamplingParams(top_p=0), SamplingParams(logit_bias={10_000: 1.0}),
                SamplingParams(logprobs=99), SamplingParams(n=0)):
        with pytest.raises(InvalidArgument):
            llm.generate(["hi"], bad)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        llm.generate([[5, 999_999]], SamplingParams())


def test_bf16_follows_fp32(tiny_dir, llm):
    """bf16 (fp32 residual stream, refined leading logits, grouped decode attention) tracks fp32."""
    bf16 = LLM(model=str(tiny_dir), dtype="bfloat16", max_num_batched_tokens=64)
    prompts = [list(range(5, 40)), list(range(50, 130))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    ref = llm.generate(prompts, params)
    got = bf16.generate(prompts, params)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        diffs = [abs(a[0].logprob - b[0].logprob) for a, b in zip(g.outputs[0].logprobs, r.outputs[0].logprobs)]
        assert max(diffs) < 0.1


def test_prefix_caching_reuses_blocks_without_changing_outputs(tiny_dir):
    shared = list(range(3, 67))  # 64 tokens: four full blocks of 16
    prompts = [shared + [100 + i, 120 + i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(model=str(tiny_dir), dtype="float32", enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert plain.generate(prompts[:1], params)[0].num_cached_tokens == 0
    cached = LLM(model=str(tiny_dir), dtype="float32")  # on by default
    first = cached.generate(prompts[:1], params)[0]
    assert first.num_cached_tokens == 0
    rest = cached.generate(prompts[1:], params)
    assert [first.outputs[0].token_ids] + [o.outputs[0].token_ids for o in rest] == want
    assert [o.num_cached_tokens for o in rest] == [64, 64, 64]
    assert cached.engine.kv.num_used_blocks == 0


def test_a_prefix_that_ends_inside_a_block_is_copied_not_recomputed(tiny_dir):
    """A shared prefix of 40 tokens (a system prompt, say) ends 8 tokens into the third block of
    16: later requests share two blocks and copy the third one's first 8 tokens, with the outputs
    of no caching at all, and every block (the copies' sources too) goes back to the pool. (The
    tokens alone would not tell: this model's greedy choices survive 8 zeroed keys, which move
    its logprobs by ~8e-3; the copied ones move them by ~1e-6.)"""
    shared = list(range(3, 43))
    prompts = [shared + [100 + i, 120 + i, 7] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    plain = LLM(model=str(tiny_dir), dtype="float32", enable_prefix_caching=False)
    want = plain.generate(prompts, params)
    cached = LLM(model=str(tiny_dir), dtype="float32")
    got = cached.generate(prompts[:1], params) + cached.generate(prompts[1:], params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        diffs = [abs(a[0].logprob - b[0].logprob) for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs)]
        assert max(diffs) < 1e-4
    assert [o.num_cached_tokens for o in got] == [0, 40, 40, 40]
    assert cached.engine.kv.num_used_blocks == 0


def test_a_prompt_s_last_token_alone_takes_the_prefill_path(tiny_dir):
    """After a prefix-cache hit only the prompt's last token is left: it is attended as a prefill
    chunk over the cached context (as it was inside the whole prompt), not as a decode row, whose
    kernel rounds differently on the GPU. The tokens generated after it are decodes."""
    llm = LLM(model=str(tiny_dir), dtype="float32")
    backend, steps = llm.engine.runner.backend, []
    prepare = backend.prepare

    def recording(meta):
        steps.append((meta.num_decode_tokens, [(s.q_end - s.q_start, s.ctx_slots is not None) for s in meta.prefills]))
        return prepare(meta)

    backend.prepare = recording
    prompt, params = list(range(3, 20)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    assert steps == [(0, [(17, False)]), (1, []), (1, [])]
    steps.clear()
    again = llm.generate([prompt], params)[0]
    assert again.num_cached_tokens == 16  # a whole block
    assert steps == [(0, [(1, True)]), (1, []), (1, [])]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("step_ms, first_chunk", [(1e-6, 16), (0, 100)])
def test_steps_are_timed_and_prefill_chunks_fit_the_step_time_while_streams_decode(tiny_dir, step_ms, first_chunk):
    llm = LLM(model=str(tiny_dir), dtype="float32", max_step_ms_while_decoding=step_ms)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("short", [5, 6, 7], params)
    engine.step()  # its prefill: the first measure of a token's cost
    assert engine.scheduler.token_ms > 0
    engine.add_request("long", list(range(5, 105)), params)
    outputs = {}

    def step():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)

    step()  # with "short" decoding: however fast this machine, 1e-6 ms hold only one block
    assert engine.scheduler.get("long").num_computed_tokens == first_chunk
    while engine.has_unfinished_requests():
        step()
    alone = llm.generate([list(range(5, 105))], params)[0].outputs[0].token_ids
    assert outputs["long"] == alone  # the same tokens, whatever its chunks
