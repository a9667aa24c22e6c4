"""The official `openai` client (and raw HTTP for what it cannot send) against the real gateway."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from forge_service import SamplingParams
from tests.integration.serving.servers import ForgeProcess, torch_threads

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHAT = [{"role": "user", "content": "Write a haiku about autumn."}]
TEXT = "The best way to learn a new language is"
MAX_TOKENS = 16
CONTEXT = 8192  # SmolLM2-135M-Instruct's context length


# ---- helpers -------------------------------------------------------------------------

def chat_stream(client: openai.OpenAI, **kwargs: Any) -> tuple[dict[int, str], dict[int, str], list[Any]]:
    """(text per choice index, finish_reason per index, all chunks) of a streamed chat."""
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def completion_stream(client: openai.OpenAI, **kwargs: Any) -> tuple[dict[int, str], dict[int, str], list[Any]]:
    chunks = list(client.completions.create(stream=True, **kwargs))
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def offline(llm, prompt: Any, **params: Any):
    """The offline API's one completion (chat when `prompt` is a message list), on one thread like the server."""
    with torch_threads(1):
        sampling = SamplingParams(**params)
        out = llm.chat(prompt, sampling) if isinstance(prompt, list) else llm.generate(prompt, sampling)
    return out[0]


def post(server: ForgeProcess, path: str, body: Any, headers: dict[str, str] | None = None,
         timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=timeout,
                      headers={"content-type": "application/json", **(headers or {})})


def assert_openai_error(response: httpx.Response, status: int, type_: str, code: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == (type_, code), error
    assert error["message"]
    return error


def usage_tuple(usage: Any) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


# ---- chat and completions, streamed and not ------------------------------------------

def test_chat_streamed_and_not_equals_the_offline_api(idle_server, openai_client, model_name, llm_fp32) -> None:
    request = dict(model=model_name, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(openai_client.chat.completions.create, **request)
        streamed = pool.submit(chat_stream, openai_client, stream_options={"include_usage": True}, **request)
        expected = offline(llm_fp32, CHAT, temperature=0, max_tokens=MAX_TOKENS)
        response, (texts, finish, chunks) = whole.result(), streamed.result()
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert usage_tuple(response.usage) == (len(expected.prompt_token_ids), len(expected.outputs[0].token_ids),
                                           len(expected.prompt_token_ids) + len(expected.outputs[0].token_ids))
    assert response.object == "chat.completion" and response.model == model_name
    assert texts == {0: choice.message.content} and finish == {0: choice.finish_reason}
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert last.choices == [] and usage_tuple(last.usage) == usage_tuple(response.usage)
    assert all(c.usage is None and c.object == "chat.completion.chunk" for c in body)
    assert len({c.id for c in chunks}) == 1


def test_completion_streamed_and_not_equals_the_offline_api(idle_server, openai_client, model_name,
                                                            llm_fp32) -> None:
    request = dict(model=model_name, prompt=TEXT, max_tokens=MAX_TOKENS, temperature=0)
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(openai_client.completions.create, **request)
        streamed = pool.submit(completion_stream, openai_client, stream_options={"include_usage": True}, **request)
        expected = offline(llm_fp32, TEXT, temperature=0, max_tokens=MAX_TOKENS)
        response, (texts, finish, chunks) = whole.result(), streamed.result()
    [choice] = response.choices
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason == "length"
    assert usage_tuple(response.usage) == (len(expected.prompt_token_ids), MAX_TOKENS,
                                           len(expected.prompt_token_ids) + MAX_TOKENS)
    assert texts == {0: choice.text} and finish == {0: "length"}
    *body, last = chunks
    assert last.choices == [] and usage_tuple(last.usage) == usage_tuple(response.usage)
    assert all(c.usage is None for c in body)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(idle_server, openai_client, model_name) -> None:
    # vLLM's stream option: each chunk's usage counts the prompt and the tokens generated up to it.
    texts, _, chunks = chat_stream(openai_client, model=model_name, messages=CHAT, max_tokens=MAX_TOKENS, n=2,
                                   temperature=0.8, seed=3, stream_options={"include_usage": True,
                                                                            "continuous_usage_stats": True})
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 2 * MAX_TOKENS
    assert all(c.choices and c.usage is not None for c in body) and len(body) > 2 * 2
    assert [usage_tuple(c.usage) for c in body[:2]] == [(last.usage.prompt_tokens, 0, last.usage.prompt_tokens)] * 2
    so_far = [c.usage.completion_tokens for c in body]
    assert so_far == sorted(so_far) and usage_tuple(body[-1].usage) == usage_tuple(last.usage)
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in body)
    assert set(texts) == {0, 1}


def test_the_responses_api_answers_as_chat_does(idle_server, openai_client, model_name) -> None:
    """POST /v1/responses (the client's responses.create): the same greedy answer as chat, whole and
    streamed, and a required tool call as a function_call item whose arguments fit the tool."""
    chat = openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=MAX_TOKENS,
                                                 temperature=0)
    whole = openai_client.responses.create(model=model_name, input=CHAT, max_output_tokens=MAX_TOKENS, temperature=0)
    assert whole.output_text == chat.choices[0].message.content and whole.status == "incomplete"
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens, MAX_TOKENS)
    events = list(openai_client.responses.create(model=model_name, input=CHAT, max_output_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text

    tool = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    called = openai_client.responses.create(model=model_name, input="What is the weather in Paris?", tools=[tool],
                                            tool_choice="required", temperature=0, max_output_tokens=64)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and called.status == "completed"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    answered = openai_client.responses.create(  # the call's result sent back, as the conversation goes on
        model=model_name, tools=[tool], temperature=0, max_output_tokens=MAX_TOKENS,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C and sunny"}])
    assert answered.output_text and answered.status in ("completed", "incomplete")


def test_tokenize_counts_what_chat_bills_and_detokenize_reverses_it(forge_server, openai_client, model_name) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    for tools in (None, [tool]):
        counted = post(forge_server, "/tokenize", {"model": model_name, "messages": CHAT,
                                                   **({"tools": tools} if tools else {})}).json()
        billed = openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=1,
                                                       **({"tools": tools} if tools else {}))
        assert counted["count"] == billed.usage.prompt_tokens == len(counted["tokens"]), tools
        assert counted["max_model_len"] == CONTEXT
    text = post(forge_server, "/tokenize", {"model": model_name, "prompt": TEXT}).json()
    assert post(forge_server, "/detokenize", {"model": model_name, "tokens": text["tokens"]}).json() == {"prompt": TEXT}


def test_models_lists_the_served_model(openai_client, model_name) -> None:
    [model] = openai_client.models.list().data
    assert model.id == model_name == "SmolLM2-135M-Instruct.Q4_1"


def test_max_tokens_ends_with_finish_reason_length(idle_server, openai_client, model_name) -> None:
    chat = openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=3, temperature=0)
    text = openai_client.completions.create(model=model_name, prompt=TEXT, max_tokens=3, temperature=0)
    for response, choice in ((chat, chat.choices[0]), (text, text.choices[0])):
        assert choice.finish_reason == "length"
        assert response.usage.completion_tokens == 3


def test_n_2_gives_two_seeded_completions(idle_server, openai_client, model_name) -> None:
    request = dict(model=model_name, messages=CHAT, max_tokens=8, temperature=1.0)
    with ThreadPoolExecutor(3) as pool:
        pair = pool.submit(openai_client.chat.completions.create, n=2, seed=11, **request)
        second = pool.submit(openai_client.chat.completions.create, n=1, seed=12, **request)
        streamed = pool.submit(chat_stream, openai_client, n=2, seed=11, **request)
    response = pair.result()
    assert [c.index for c in response.choices] == [0, 1]
    texts = [c.message.content for c in response.choices]
    assert texts[0] != texts[1]
    # The proto's rule: completion i uses seed + i.
    assert texts[1] == second.result().choices[0].message.content
    stream_texts, finish, _ = streamed.result()
    assert stream_texts == {0: texts[0], 1: texts[1]}
    assert finish == {c.index: c.finish_reason for c in response.choices}


def test_stop_strings_end_the_text_before_the_match(idle_server, openai_client, model_name, llm_fp32) -> None:
    greedy = offline(llm_fp32, TEXT, temperature=0, max_tokens=MAX_TOKENS).outputs[0].text
    words = greedy.split()
    stop = words[len(words) // 2]
    expected = greedy[:greedy.index(stop)]
    assert expected, f"pick another stop string: {stop!r} starts {greedy!r}"
    request = dict(model=model_name, prompt=TEXT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop, "never seen"])
    response = openai_client.completions.create(**request)
    [choice] = response.choices
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert choice.model_extra["stop_reason"] == stop
    texts, finish, _ = completion_stream(openai_client, **request)
    assert (texts, finish) == ({0: expected}, {0: "stop"})


def test_seed_makes_sampling_reproducible(idle_server, openai_client, model_name) -> None:
    request = dict(model=model_name, prompt=TEXT, max_tokens=12, temperature=1.0)
    with ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(openai_client.completions.create, seed=seed, **request) for seed in (123, 123, 124)]
        first, again, other = [r.result().choices[0].text for r in runs]
    assert first == again
    assert first != other


def test_chat_logprobs_match_the_offline_api(idle_server, openai_client, model_name, llm_fp32) -> None:
    response = openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=8, temperature=0,
                                                     logprobs=True, top_logprobs=5)
    expected = offline(llm_fp32, CHAT, temperature=0, max_tokens=8, logprobs=5).outputs[0]
    [choice] = response.choices
    content = choice.logprobs.content
    assert len(content) == len(expected.token_ids) == response.usage.completion_tokens
    assert "".join(p.token for p in content) == choice.message.content
    for position, (chosen, *top) in zip(content, expected.logprobs):
        assert position.logprob <= 0
        assert position.logprob == pytest.approx(chosen.logprob, abs=1e-3)
        values = [t.logprob for t in position.top_logprobs]
        assert len(values) == 5 and all(v <= 0 for v in values)
        assert values == sorted(values, reverse=True)
        assert position.top_logprobs[0].token == position.token  # greedy: the chosen one is the likeliest
        assert values == pytest.approx([t.logprob for t in top], abs=1e-3)
        assert bytes(position.bytes) == chosen.bytes  # the engine's exact bytes, not the text re-encoded
    assert b"".join(bytes(p.bytes) for p in content) == choice.message.content.encode()


def test_completion_logprobs_match_the_offline_api(idle_server, openai_client, model_name, llm_fp32) -> None:
    response = openai_client.completions.create(model=model_name, prompt=TEXT, max_tokens=8, temperature=0,
                                                logprobs=3)
    expected = offline(llm_fp32, TEXT, temperature=0, max_tokens=8, logprobs=3).outputs[0]
    [choice] = response.choices
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.token_logprobs == pytest.approx([lp[0].logprob for lp in expected.logprobs], abs=1e-3)
    assert all(v <= 0 for v in logprobs.token_logprobs)
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        values = list(top.values())
        assert len(values) == 3 and values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert top[token] == pytest.approx(value)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]


def test_logit_bias_forces_and_bans_tokens(idle_server, openai_client, model_name, llm_fp32) -> None:
    [banana] = llm_fp32.tokenizer.encode(" banana", add_special_tokens=False)
    request = dict(model=model_name, prompt=TEXT, max_tokens=4, temperature=0, logprobs=0)
    forced = openai_client.completions.create(logit_bias={str(banana): 100}, **request).choices[0]
    assert forced.text == " banana" * 4
    greedy = offline(llm_fp32, TEXT, temperature=0, max_tokens=1).outputs[0].token_ids[0]
    banned = openai_client.completions.create(logit_bias={str(greedy): -100}, **request).choices[0]
    assert banned.logprobs.tokens[0] != llm_fp32.tokenizer.decode([greedy])


# ---- errors ----------------------------------------------------------------------------

def test_malformed_json_is_400(forge_server) -> None:
    response = post(forge_server, "/v1/chat/completions", '{"model": "x", "messages": [')
    error = assert_openai_error(response, 400, "invalid_request_error", "invalid_json")
    assert "JSON" in error["message"]


def test_validation_errors_are_400_with_the_numbers(forge_server, openai_client, model_name, llm_fp32) -> None:
    with pytest.raises(openai.BadRequestError) as negative:
        openai_client.chat.completions.create(model=model_name, messages=CHAT, temperature=-1)
    assert "temperature must be in [0, 100], got -1" in negative.value.message

    response = post(forge_server, "/v1/chat/completions", {"model": model_name, "messages": CHAT, "n": 0})
    error = assert_openai_error(response, 400, "invalid_request_error", "invalid_value")
    assert error["param"] == "n" and "greater than or equal to 1" in error["message"]

    prompt = "hello " * 9000
    n = len(llm_fp32.tokenizer.encode(prompt))
    assert n >= CONTEXT
    with pytest.raises(openai.BadRequestError) as too_long:
        openai_client.completions.create(model=model_name, prompt=prompt, max_tokens=1)
    message = too_long.value.message
    assert f"the prompt has {n} tokens" in message and f"context length is {CONTEXT}" in message
    assert f"by {n - CONTEXT + 1} tokens" in message
    assert (too_long.value.code, too_long.value.param) == ("context_length_exceeded", "prompt")

    m = len(llm_fp32.tokenizer.encode(TEXT))
    with pytest.raises(openai.BadRequestError) as too_many:
        openai_client.completions.create(model=model_name, prompt=TEXT, max_tokens=9000)
    assert (f"the prompt has {m} tokens and max_tokens is 9000: {m + 9000} tokens exceed the model's context "
            f"length of {CONTEXT} by {m + 9000 - CONTEXT}") in too_many.value.message
    assert (too_many.value.code, too_many.value.param) == ("context_length_exceeded", "prompt")
    with pytest.raises(openai.BadRequestError) as chat_too_many:
        openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=9000)
    assert (chat_too_many.value.code, chat_too_many.value.param) == ("context_length_exceeded", "messages")
    with pytest.raises(openai.BadRequestError) as bias:  # the service's check: the gateway knows no vocabulary
        openai_client.chat.completions.create(model=model_name, messages=CHAT, logit_bias={"999999": 1})
    assert bias.value.param == "logit_bias" and "outside the vocabulary" in bias.value.message


def test_unknown_model_is_404(openai_client) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        openai_client.chat.completions.create(model="gpt-17", messages=CHAT, max_tokens=1)
    assert missing.value.code == "model_not_found" and "gpt-17" in missing.value.message


def test_passed_deadline_is_504_and_frees_blocks(idle_server, model_name) -> None:
    body = {"model": model_name, "prompt": TEXT, "max_tokens": 4000, "ignore_eos": True}
    started = time.monotonic()
    response = post(idle_server, "/v1/completions", body, headers={"X-Request-Timeout": "1"})
    assert time.monotonic() - started < 5
    assert_openai_error(response, 504, "timeout", "deadline_exceeded")
    idle_server.wait_idle(timeout_s=10)

    # Once the stream has started, the deadline arrives as an `error` event, which ends the stream (no [DONE]).
    with httpx.stream("POST", idle_server.url + "/v1/completions", json={**body, "stream": True},
                      headers={"X-Request-Timeout": "1"}, timeout=30) as stream:
        assert stream.status_code == 200
        lines = [line for line in stream.iter_lines() if line]
    assert lines[-2] == "event: error" and "[DONE]" not in lines[-1]
    assert json.loads(lines[-1].removeprefix("data: "))["error"]["code"] == "deadline_exceeded"
    assert all("choices" in json.loads(line.removeprefix("data: ")) for line in lines[:-2])


def test_bad_x_request_timeout_is_400(forge_server, model_name) -> None:
    body = {"model": model_name, "prompt": TEXT, "max_tokens": 1}
    for value in ("soon", "nan", "-1"):
        response = post(forge_server, "/v1/completions", body, headers={"X-Request-Timeout": value})
        assert_openai_error(response, 400, "invalid_request_error", "invalid_value")


def test_echo_scores_a_continuation_as_an_evaluation_harness_reads_it(idle_server, openai_client, model_name,
                                                                     llm_fp32) -> None:
    """lm-evaluation-harness's loglikelihood: the prompt is context + continuation, echo with
    logprobs=1 and max_tokens=1; the continuation's tokens are token_logprobs[ctxlen:-1], and it is
    greedy when each is the largest of its top_logprobs."""
    greedy = openai_client.completions.create(model=model_name, prompt=TEXT, max_tokens=4, temperature=0, logprobs=1)
    continuation = greedy.choices[0]
    ctxlen = len(llm_fp32.tokenizer.encode(TEXT))

    def score(text: str) -> tuple[Any, float, bool]:
        response = openai_client.completions.create(model=model_name, prompt=text, max_tokens=1, temperature=0,
                                                    logprobs=1, echo=True)
        lp = response.choices[0].logprobs
        assert response.choices[0].text.startswith(text) and "".join(lp.tokens) == response.choices[0].text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        tokens, tops = lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1]
        return lp, sum(tokens), all(t == max(top.values()) for t, top in zip(tokens, tops))

    lp, total, is_greedy = score(TEXT + continuation.text)
    assert lp.tokens[ctxlen:-1] == continuation.logprobs.tokens  # the same tokens, scored in the prompt
    assert lp.token_logprobs[ctxlen:-1] == pytest.approx(continuation.logprobs.token_logprobs, abs=1e-3)
    assert is_greedy and total == pytest.approx(sum(continuation.logprobs.token_logprobs), abs=1e-3)
    with torch_threads(1):
        [offline_scores] = llm_fp32.generate(TEXT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    assert lp.token_logprobs[1:ctxlen] == pytest.approx(
        [entry[0].logprob for entry in offline_scores.prompt_logprobs[1:]], abs=1e-3)
    _, other, other_greedy = score(TEXT + " to eat a banana")
    assert not other_greedy and other < total

    # Legacy scoring, max_tokens 0: the prompt alone, with the same logprobs, and no completion billed.
    alone = openai_client.completions.create(model=model_name, prompt=TEXT + continuation.text, max_tokens=0,
                                             temperature=0, logprobs=1, echo=True)
    [choice] = alone.choices
    assert choice.text == TEXT + continuation.text and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == lp.token_logprobs[:-1] and alone.usage.completion_tokens == 0


def test_echo_streams_each_prompt_first_and_decodes_token_prompts(idle_server, openai_client, model_name,
                                                                   llm_fp32) -> None:
    prompts = [llm_fp32.tokenizer.encode(TEXT), llm_fp32.tokenizer.encode("Hello, world")]
    params = dict(model=model_name, prompt=prompts, max_tokens=4, temperature=0, n=2, echo=True)
    whole = openai_client.completions.create(**params)
    texts: dict[int, str] = {}
    firsts: dict[int, str] = {}
    for chunk in openai_client.completions.create(**params, stream=True):
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice.text)
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == [0, 1, 2, 3]
    for choice in whole.choices:
        prompt = [TEXT, "Hello, world"][choice.index // 2]
        assert firsts[choice.index] == prompt  # the echo comes first, whole
        assert texts[choice.index] == choice.text and choice.text.startswith(prompt) and len(choice.text) > len(prompt)


def test_vllm_prompt_logprobs_on_completions_and_chat(idle_server, openai_client, model_name) -> None:
    echoed = openai_client.completions.create(model=model_name, prompt=TEXT, max_tokens=1, temperature=0,
                                              logprobs=0, echo=True)
    scored = openai_client.completions.create(model=model_name, prompt=TEXT, max_tokens=1, temperature=0,
                                              extra_body={"prompt_logprobs": 2})
    [choice] = scored.choices
    assert choice.text == echoed.choices[0].text[len(TEXT):]  # no echo: the completion alone
    entries = choice.model_extra["prompt_logprobs"]
    prompt_tokens = scored.usage.prompt_tokens
    assert entries[0] is None and len(entries) == prompt_tokens
    for entry, token, value in zip(entries[1:], echoed.choices[0].logprobs.tokens[1:prompt_tokens],
                                   echoed.choices[0].logprobs.token_logprobs[1:prompt_tokens], strict=True):
        # the prompt's token (with its rank) and the two most likely: 2 entries when it is one of them
        assert 2 <= len(entry) <= 3 and {1, 2} <= {v["rank"] for v in entry.values()}
        assert any(v["decoded_token"] == token and v["logprob"] == pytest.approx(value, abs=1e-4)
                   for v in entry.values())
    chat = openai_client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=1, temperature=0,
                                                 extra_body={"prompt_logprobs": 0})
    chat_entries = chat.model_extra["prompt_logprobs"]
    assert chat_entries[0] is None and len(chat_entries) == chat.usage.prompt_tokens
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in chat_entries[1:])


def test_an_answer_begun_by_the_client_is_continued(forge_server, idle_server, openai_client, model_name) -> None:
    """continue_final_message: begun with the first words of the model's own greedy answer, the
    model goes on exactly as that answer does (rows are batch- and chunk-invariant), whole and
    streamed; echo gives the answer whole; the continued prompt is billed as /tokenize counts it."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = openai_client.chat.completions.create(model=model_name, messages=question, max_tokens=32,
                                                   temperature=0).choices[0]
    assert answer.finish_reason == "stop" and answer.message.content.count(" ") >= 3, answer
    text = answer.message.content
    begun = text[:text.index(" ", len(text) // 3)]  # whole words: tokenized as the model wrote them
    messages = question + [{"role": "assistant", "content": begun}]
    params = dict(model=model_name, messages=messages, max_tokens=32, temperature=0)
    go_on = {"continue_final_message": True}
    continued = openai_client.chat.completions.create(**params, extra_body=go_on)
    assert continued.choices[0].message.content == text[len(begun):]
    echoed = openai_client.chat.completions.create(**params, extra_body={**go_on, "echo": True})
    assert echoed.choices[0].message.content == text
    streamed, finish, chunks = chat_stream(openai_client, **params, extra_body={**go_on, "echo": True})
    assert streamed == {0: text} and finish == {0: "stop"} and chunks[0].choices[0].delta.content == begun
    counted = post(forge_server, "/tokenize", {"model": model_name, "messages": messages, **go_on}).json()
    assert counted["count"] == continued.usage.prompt_tokens
    new_turn = openai_client.chat.completions.create(**params)  # without it, a new message after the closed one
    assert new_turn.usage.prompt_tokens > continued.usage.prompt_tokens


@pytest.mark.parametrize("messages, fields, param", [
    (CHAT, {"continue_final_message": True}, "messages[0]"),
    (CHAT + [{"role": "assistant", "content": "An"}], {"continue_final_message": True, "add_generation_prompt": True},
     "add_generation_prompt"),
])
def test_a_message_that_cannot_be_continued_is_400(forge_server, model_name, messages, fields, param) -> None:
    response = post(forge_server, "/v1/chat/completions", {"model": model_name, "messages": messages, **fields})
    assert assert_openai_error(response, 400, "invalid_request_error", None)["param"] == param


def test_min_tokens_holds_off_the_end(idle_server, openai_client, model_name) -> None:
    """vLLM's min_tokens: the greedy answer goes on where it ended, past the end-of-sequence it
    would have sampled, to at least min_tokens tokens."""
    params = dict(model=model_name, messages=[{"role": "user", "content": "What is the capital of France?"}],
                  max_tokens=64, temperature=0)
    short = openai_client.chat.completions.create(**params)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20, short
    longer = openai_client.chat.completions.create(**params, extra_body={"min_tokens": 24})
    assert longer.usage.completion_tokens >= 24
    assert longer.choices[0].message.content.startswith(short.choices[0].message.content)


def test_bad_words_never_come(idle_server, openai_client, model_name) -> None:
    """vLLM's bad_words: the greedy answer names Paris; banned, the word does not come, whole or in
    a stream."""
    params = dict(model=model_name, messages=[{"role": "user", "content": "What is the capital of France?"}],
                  max_tokens=32, temperature=0)
    assert "Paris" in openai_client.chat.completions.create(**params).choices[0].message.content
    banned = openai_client.chat.completions.create(**params, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned.choices[0].message.content and banned.usage.completion_tokens > 0
    streamed, _, _ = chat_stream(openai_client, **params, extra_body={"bad_words": ["Paris"]})
    assert streamed == {0: banned.choices[0].message.content}


def test_a_priority_on_a_first_come_first_served_server_is_400(forge_server, model_name) -> None:
    response = post(forge_server, "/v1/chat/completions", {"model": model_name, "messages": CHAT, "priority": 1})
    error = assert_openai_error(response, 400, "invalid_request_error", None)
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]


def test_a_prompt_past_the_context_is_cut_to_its_last_tokens(forge_server, openai_client, model_name) -> None:
    """vLLM's truncate_prompt_tokens: a prompt longer than the context is served on its last 64
    tokens, the same greedy completion as those tokens sent alone; unset, it is a 400. (-1, the
    context's worth, is left to the unit test: an 8k-token prefill takes tens of seconds here.)"""
    prompt = "The quick brown fox jumps over the lazy dog. " * 1000  # about 10k tokens, past 8192
    params = dict(model=model_name, max_tokens=8, temperature=0)
    cut = openai_client.completions.create(prompt=prompt, extra_body={"truncate_prompt_tokens": 64}, **params)
    tokens = post(forge_server, "/tokenize", {"model": model_name, "prompt": prompt}).json()["tokens"]
    alone = openai_client.completions.create(prompt=tokens[-64:], **params)
    assert cut.usage.prompt_tokens == 64 and cut.choices[0].text == alone.choices[0].text
    with pytest.raises(openai.BadRequestError) as error:
        openai_client.completions.create(prompt=prompt, **params)
    assert error.value.code == "context_length_exceeded"


def test_allowed_token_ids_restrict_the_answer(forge_server, openai_client, model_name) -> None:
    """vLLM's allowed_token_ids: a one-token answer is one of the listed tokens, sampled or greedy,
    where the free answer is neither."""
    prompt = "Question: is the sky green? Answer with one word.\nAnswer:"
    labels = [post(forge_server, "/tokenize", {"model": model_name, "prompt": w}).json()["tokens"][0]
              for w in (" Maybe", " Perhaps")]
    free = openai_client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0)
    assert free.choices[0].text not in (" Maybe", " Perhaps")
    limited = openai_client.completions.create(model=model_name, prompt=prompt, max_tokens=1, n=8, temperature=1.0,
                                               seed=5, extra_body={"allowed_token_ids": labels})
    assert {c.text for c in limited.choices} <= {" Maybe", " Perhaps"}


def test_chat_template_kwargs_the_server_owns_are_400(forge_server, model_name) -> None:
    body = {"model": model_name, "messages": CHAT, "max_tokens": 2}
    assert post(forge_server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"date_string": "x"}}) \
        .status_code == 200
    response = post(forge_server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"eos_token": "x"}})
    error = assert_openai_error(response, 400, "invalid_request_error", None)
    assert error["param"] == "chat_template_kwargs" and "cannot set eos_token" in error["message"]
