"""Speculative decoding in the engine, on tiny random-weight Llamas: the output is exactly what it
would be without speculation (greedy tokens, seeded samples, the sampled distribution), stops
inside an accepted run cut at their token, rejected drafts leave no KV behind, and structured
output stays valid."""
from __future__ import annotations

import math
import re
from collections import Counter

import pytest
import torch

from forge_service import LLM, SamplingParams
from forge_service.errors import InvalidArgument
from forge_service.runner import model_runner
from forge_service.structured import Constraint
from tests.tiny_models import tiny_arch, tiny_tokenizer_json, unigram_weights, write_safetensors_dir
from tests.unit.test_engine_tiny import tiny_dir  # noqa: F401 (a fixture: the sharp tiny model)

# Prompts after which the tiny model's greedy output settles into loops: drafts get accepted.
LOOPING = [[5, 6, 7, 8, 9] * 7, list(range(3, 40)), [11, 12, 13] * 10, list(range(50, 90))]
SHARED = list(range(120, 160))  # a prefix shared by two prompts (prefix-cache hits)
PROMPTS = LOOPING + [SHARED + [7, 8, 9], SHARED + [7, 8, 9, 10, 11]]


# Tiny models' steps cost about the same at any row count: drafts are as long as the caps allow.
FREE_ROWS = 1e9


def engines(tiny_dir, **kwargs) -> tuple[LLM, LLM]:
    """The same engine without and with speculation."""
    return (LLM(model=str(tiny_dir), dtype="float32", **kwargs),
            LLM(model=str(tiny_dir), dtype="float32", speculative="ngram", spec_step_base_rows=FREE_ROWS, **kwargs))


def mixed_params(i: int) -> SamplingParams:
    """Greedy, seeded sampling with every processor, and greedy with logprobs, in turn."""
    if i % 3 == 0:
        return SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    if i % 3 == 1:
        return SamplingParams(temperature=0.9, top_k=12, top_p=0.95, min_p=0.01, repetition_penalty=1.1,
                              frequency_penalty=0.2, presence_penalty=0.1, logit_bias={9: 1.5}, seed=100 + i,
                              max_tokens=40, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)


def test_mixed_batch_with_preemption_and_prefix_cache_is_unchanged(tiny_dir):
    # 14 blocks of 8 tokens cannot hold six prompts of up to 45 tokens plus 40 outputs at once.
    off, on = engines(tiny_dir, num_blocks=14, block_size=8, max_num_batched_tokens=32)
    params = [mixed_params(i) for i in range(len(PROMPTS))]
    want = off.generate(PROMPTS, params)
    got = on.generate(PROMPTS, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
    for w, g in ((w.outputs[0], g.outputs[0]) for w, g in zip(want, got) if w.outputs[0].logprobs):
        assert [[(p.token_id, p.rank) for p in pos] for pos in g.logprobs] == \
               [[(p.token_id, p.rank) for p in pos] for pos in w.logprobs]
        assert [pos[0].logprob for pos in g.logprobs] == pytest.approx([pos[0].logprob for pos in w.logprobs],
                                                                       abs=1e-4)
    assert on.engine.num_preemptions > 0 and off.engine.num_preemptions > 0
    assert any(g.num_cached_tokens > 0 for g in got)
    drafted = sum(g.outputs[0].num_drafted_tokens for g in got)
    accepted = sum(g.outputs[0].num_accepted_tokens for g in got)
    assert 0 < accepted < drafted  # drafts were accepted and rejected
    assert all(w.outputs[0].num_drafted_tokens == 0 for w in want)
    assert on.engine.kv.num_used_blocks == 0


def test_a_request_can_opt_out(tiny_dir):
    _, on = engines(tiny_dir)
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    out = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, num_speculative_tokens=0)
    a, b = on.generate(LOOPING, plain), on.generate(LOOPING, out)
    assert [x.outputs[0].token_ids for x in a] == [x.outputs[0].token_ids for x in b]
    assert sum(x.outputs[0].num_accepted_tokens for x in a) > 0
    assert sum(x.outputs[0].num_drafted_tokens for x in b) == 0
    with pytest.raises(InvalidArgument, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=65).validate(320)


def test_drafts_stay_within_the_per_request_and_per_step_caps(tiny_dir, monkeypatch):
    on = LLM(model=str(tiny_dir), dtype="float32", speculative="ngram", spec_max_draft=3, spec_max_step_tokens=5,
             spec_step_base_rows=FREE_ROWS)
    drafts: list[list[int]] = []
    execute = on.engine.runner.execute

    def spy(out, on_launch=None):
        drafts.append([(len(c.draft), c.request.sampling_params.num_speculative_tokens) for c in out.chunks])
        return execute(out, on_launch)

    monkeypatch.setattr(on.engine.runner, "execute", spy)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, num_speculative_tokens=2)] * 2
    on.generate(LOOPING, params)
    lengths = [[n for n, _ in step] for step in drafts]
    assert max(map(max, lengths)) == 3 and max(map(sum, lengths)) == 5  # both caps reached, never passed
    assert max(n for step in drafts for n, wanted in step if wanted == 2) == 2


def test_rejected_drafts_leave_no_kv_behind(tiny_dir):
    _, on = engines(tiny_dir, block_size=4, max_num_batched_tokens=64)
    engine = on.engine
    for i, prompt in enumerate(LOOPING):  # seeded sampling: some drafts are rejected
        engine.add_request(f"r{i}", prompt, mixed_params(i))
    counts = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for o in delta.outputs:
                counts[delta.request_id] = (o.num_drafted_tokens, o.num_accepted_tokens)
        for request in engine.scheduler.running:
            # a running request holds exactly the blocks of its computed tokens, as without drafts
            assert len(engine.kv.block_ids(request.request_id)) == engine.kv.blocks_needed(request.num_computed_tokens)
    assert sum(d - a for d, a in counts.values()) > 0
    assert engine.kv.num_used_blocks == 0


def test_stops_inside_an_accepted_run_cut_at_their_token(tiny_dir, monkeypatch):
    # (A stop token inside a run is cut by Scheduler.advance: test_speculative_scheduler.py.)
    off, on = engines(tiny_dir)
    prompt = LOOPING[0]
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = off.generate([prompt], base)[0].outputs[0]
    for stop in sorted(set(ref.token_ids)):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
        got = on.generate([prompt], params)[0].outputs[0]
        assert got.token_ids == ref.token_ids[:ref.token_ids.index(stop) + 1]
        assert got.finish_reason == "stop" and got.stop_reason == stop
    for n in (1, 2, 5, 9, 17):
        got = on.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0]
        assert got.token_ids == ref.token_ids[:n] and got.finish_reason == "length"
    emitted_runs = []
    emit_run = on.engine._emit_run

    def spy_emit(request, run, deltas, now):
        before = len(request.output_token_ids)
        emit_run(request, run, deltas, now)
        if len(request.output_token_ids) < before:
            emitted_runs.append(len(run))
    monkeypatch.setattr(on.engine, "_emit_run", spy_emit)
    for start in range(0, len(ref.text) - 3, 3):
        stop = ref.text[start:start + 3]
        got = on.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0]
        want = off.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0]
        assert (got.outputs[0].text, got.outputs[0].token_ids, got.outputs[0].finish_reason) == \
               (want.outputs[0].text, want.outputs[0].token_ids, want.outputs[0].finish_reason)
    assert emitted_runs  # a stop string ended the output before the end of an accepted run


def test_structured_output_stays_valid_and_unchanged(tiny_dir):
    off, on = engines(tiny_dir)
    pattern = r"(ab|ba|abc){4,12}"
    prompts = [on.tokenizer.encode("ab ab ab abc abc ba ab ab abc ab"), on.tokenizer.encode("ba ba abc abc abc")]
    prompts += LOOPING[:2]
    params = SamplingParams(temperature=0, max_tokens=40, constraint=Constraint("regex", pattern))
    want = off.generate(prompts, params)
    got = on.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert re.fullmatch(pattern, g.outputs[0].text), g.outputs[0].text
    assert sum(g.outputs[0].num_drafted_tokens for g in got) > 0


# ---- the sampled distribution ----

N_DRAWS = 3000
TOP_K = 4


@pytest.fixture(scope="module")
def unigram_dir(tmp_path_factory):
    """Every token embedded alike: every position's hidden state, and so its next-token
    distribution, is the same whatever the context (a unigram model), so the exact law of a
    sampled pair is the product of two known distributions."""
    arch = tiny_arch()
    root = tmp_path_factory.mktemp("tiny_unigram")
    write_safetensors_dir(root, arch, unigram_weights(arch, seed=5), tokenizer_json=tiny_tokenizer_json())
    return root


def _top(llm: LLM, prompt: list[int]) -> dict[int, float]:
    """The next-token law under top_k = TOP_K, temperature 1 (the raw top TOP_K, renormalised)."""
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=TOP_K))[0].outputs[0]
    probs = {p.token_id: math.exp(p.logprob) for p in out.logprobs[0][1:]}
    return {t: p / sum(probs.values()) for t, p in probs.items()}


def _pairs(llm: LLM, prompt: list[int]) -> tuple[Counter, int, int]:
    """The first two tokens of N_DRAWS seeded samples; tokens drafted and accepted."""
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=3, ignore_eos=True, seed=i)
              for i in range(N_DRAWS)]
    outs = [o.outputs[0] for o in llm.generate([prompt] * N_DRAWS, params)]
    return (Counter(tuple(o.token_ids[:2]) for o in outs), sum(o.num_drafted_tokens for o in outs),
            sum(o.num_accepted_tokens for o in outs))


def _chi_square_p(counts: Counter, target: dict[tuple[int, int], float], n: int) -> float:
    """Pearson's goodness of fit over the pairs (cells expected below 5 pooled, with any pair the
    law gives 0); the p-value."""
    cells, pooled_expected, pooled_seen = [], 0.0, n - sum(counts.get(pair, 0) for pair in target)
    for pair, p in target.items():
        if n * p < 5:
            pooled_expected += n * p
            pooled_seen += counts.get(pair, 0)
        else:
            cells.append((counts.get(pair, 0), n * p))
    cells.append((pooled_seen, max(pooled_expected, 1e-9)))
    stat = sum((seen - expected) ** 2 / expected for seen, expected in cells)
    return torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2, dtype=torch.float64),
                                   torch.tensor(stat / 2, dtype=torch.float64)).item()


def test_sampled_tokens_follow_the_target_distribution(unigram_dir, monkeypatch):
    llm = LLM(model=str(unigram_dir), dtype="float32", speculative="ngram", spec_ngram_min=1, spec_ngram_max=1,
              spec_max_step_tokens=1024, spec_step_base_rows=FREE_ROWS, max_num_seqs=256, max_num_batched_tokens=1024)
    law = _top(llm, [3, 4, 5])
    likeliest = max(law, key=law.get)
    # In the prompt every likely token is followed by the likeliest one, which the 1-gram index
    # drafts after whatever comes first: accepted with its probability, rejected otherwise.
    prompt = list(range(200, 230)) + [t for a in law if a != likeliest for t in (a, likeliest)] + [likeliest] * 2
    assert _top(llm, prompt) == pytest.approx(law)
    target = {(a, b): law[a] * law[b] for a in law for b in law}
    counts, drafted, accepted = _pairs(llm, prompt)
    assert drafted > N_DRAWS * 0.9 and N_DRAWS * 0.1 < accepted < drafted
    assert _chi_square_p(counts, target, N_DRAWS) > 1e-3

    # The same test catches a verifier whose rejected position takes a token from the wrong law
    # (the one sampled after the draft token, not the residual at the rejected position).
    def wrong_run(draft, sampled):
        n = 0
        while n < len(draft) and sampled[n] == draft[n]:
            n += 1
        return sampled[:n] + [sampled[n + 1]] if n < len(draft) else sampled[:n + 1]

    monkeypatch.setattr(model_runner, "accepted_run", wrong_run)
    wrong, _, _ = _pairs(llm, prompt)
    assert _chi_square_p(wrong, target, N_DRAWS) < 1e-6


def test_a_draft_through_the_end_of_structured_output_stops_there(tiny_dir):
    # The prompt repeats the only allowed answer followed by EOS, so drafts run through the EOS
    # (and past it): the output ends at the EOS, complete, like without drafts.
    off, on = engines(tiny_dir, spec_ngram_min=1)
    answer = on.tokenizer.encode("abc")
    prompt = (answer + [2]) * 4 + answer[:1]
    params = SamplingParams(temperature=0, max_tokens=20, constraint=Constraint("choice", '["abc"]'))
    want = off.generate([prompt], params)[0].outputs[0]
    got = on.generate([prompt], params)[0].outputs[0]
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason) == ("abc", "stop")
    assert got.num_accepted_tokens > 0


def test_a_predicted_output_is_drafted_from_and_changes_no_output(tiny_dir):
    off, on = engines(tiny_dir)
    prompts = [list(range(200, 230)), [17, 3, 99, 45, 8] * 4]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    answers = [o.outputs[0].token_ids for o in off.generate(prompts, greedy)]
    plain = on.generate(prompts, greedy)
    for prediction in (answers, [a[:10] + [1, 2, 3] + a[14:] for a in answers]):  # as answered; edited mid-way
        params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prediction=p) for p in prediction]
        got = on.generate(prompts, params)
        assert [g.outputs[0].token_ids for g in got] == answers
        for g, p in zip(got, plain):  # more accepted than drafting from the context alone
            assert g.outputs[0].num_accepted_tokens > p.outputs[0].num_accepted_tokens
    exact = on.generate(prompts, [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prediction=a)
                                  for a in answers])
    assert all(g.outputs[0].num_accepted_tokens >= 32 for g in exact)  # of 39 after the first token
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    sampled = off.generate(prompts, seeded)
    with_prediction = on.generate(prompts, [SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True,
                                                           prediction=a) for a in answers])
    assert [s.outputs[0].token_ids for s in sampled] == [w.outputs[0].token_ids for w in with_prediction]
    opted_out = on.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                    prediction=answers[0], num_speculative_tokens=0))
    assert all(o.outputs[0].num_drafted_tokens == 0 for o in opted_out)
