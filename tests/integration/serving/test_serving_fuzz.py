"""Seeded random requests at the real server, through both doors: every HTTP answer is a 200 or a
4xx with an OpenAI error body, every gRPC status one that blames the request, never a 5xx or
INTERNAL; and a stream running beside them all the while gets the very tokens it gets alone.

The requests start from valid ones and mutate one to four fields, with plausible values (which
reach the engine: penalties, constraints, tools, logprobs, n, priorities) or values of any JSON type
and size (which must be refused, naming what is wrong). gRPC requests fill random fields of the
protobuf messages, enums with unknown values and NaNs included."""
from __future__ import annotations

import copy
import json
import random
import threading
from typing import Any, Callable

import grpc
import httpx
import pytest
from google.protobuf.message import Message

from forge_service.pb import forge_pb2 as pb
from tests.integration.serving.servers import ForgeProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HTTP_REQUESTS = 250
GRPC_REQUESTS = 300

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_AND_RESULT = [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]

# Values a field may plausibly take (valid or at the edge of its range).
PLAUSIBLE: dict[str, list[Any]] = {
    "max_tokens": [0, 1, 4, 12], "max_completion_tokens": [1, 6], "max_output_tokens": [1, 6], "n": [1, 2, 3],
    "temperature": [0, 0.7, 2.0], "top_p": [0.0, 0.5, 1.0], "top_k": [-1, 0, 1, 40], "min_p": [0.0, 0.2, 1.0],
    "presence_penalty": [-2, 2], "frequency_penalty": [-2, 1.5], "repetition_penalty": [0.5, 1.3],
    "logit_bias": [{"49151": 100}, {"0": -100, "1": 100}, {"42": 5}], "seed": [0, 7, -1],
    "stop": ["\n", [".", ",", "!", "?"], "a"], "stream": [True, True, False],
    "stream_options": [{"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}],
    "logprobs": [True, False, 0, 3, 20], "top_logprobs": [0, 2, 20], "tools": [[TOOL]],
    "tool_choice": ["auto", "required", "none", {"type": "function", "function": {"name": "get_weather"}}],
    "parallel_tool_calls": [True, False],
    "response_format": [{"type": "json_object"}, {"type": "text"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
                        {"type": "structural_tag", "triggers": [" the"],
                         "structures": [{"begin": " the", "schema": SCHEMA, "end": "!"}]}],
    "structured_outputs": [{"json": SCHEMA}, {"regex": "[a-z]{3}"}, {"choice": ["yes", "no"]},
                           {"grammar": 'root ::= "ok"'}, {"json_object": True}],
    "guided_json": [SCHEMA, json.dumps(SCHEMA)], "guided_regex": ["[0-9]+", "(yes|no)"],
    "guided_choice": [["red", "green"]], "guided_grammar": ['root ::= "a" | "b"'],
    "bad_words": [["hi"], ["Hello", "hello"]], "allowed_token_ids": [[1, 2, 3], [49151]],
    "stop_token_ids": [[2], [0, 1]], "min_tokens": [0, 3], "ignore_eos": [True, False],
    "prompt_logprobs": [0, 2], "truncate_prompt_tokens": [-1, 1, 3], "priority": [-5, 0],
    "num_speculative_tokens": [0, 4, 64], "prediction": [{"type": "content", "content": "Say hi."}],
    "echo": [True, False], "continue_final_message": [True, False], "add_generation_prompt": [True, False],
    "chat_template_kwargs": [{"enable_thinking": False}], "include_reasoning": [True, False],
    "skip_special_tokens": [False], "include_stop_str_in_output": [True],
    "messages": [[{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure, "}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                 CALL_AND_RESULT, [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]],
    "prompt": [[1, 2, 3], [[1, 2], [3, 4]], ["a", "b"], "Hello"], "best_of": [1, 2],
    "input": ["hi", ["a", "b"], [1, 2, 3], [{"role": "user", "content": "hi"}]],
    "instructions": ["Be brief."], "text": [{"format": {"type": "json_object"}}], "reasoning": [{"effort": "low"}],
    "store": [False], "encoding_format": ["float", "base64"], "dimensions": [1, 576, 577],
    "tokens": [[1, 2], [49151], [0, 49152], []],
}


def any_value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value of any type: the edges of numbers, odd strings, nested lists and objects."""
    kind = rng.randrange(9 if depth < 2 else 7)
    return [
        lambda: None,
        lambda: rng.random() < 0.5,
        lambda: rng.choice([0, 1, 2, 20, 21, 49151, 49152, 2**31, 2**63, 10**30, -1, -(2**63) - 1]),
        lambda: rng.choice([0.5, 1e-30, 1e308, -1e308, 3.3, float("nan"), float("inf")]),
        lambda: rng.choice(["", "a", "0", "true", "auto", "none", "required", "(", "\\d+", "\u0000", "\ud800",
                            "🙂", "user", "json_schema", "get_weather", "root ::= x"]),
        lambda: "word " * rng.choice([100, 3000]),
        lambda: rng.choice([[], [[]], [0], [-1], [49152], ["a", "b"], {}, {"0": -100}, {"-5": 1}]),
        lambda: [any_value(rng, depth + 1) for _ in range(rng.randrange(3))],
        lambda: {rng.choice(["type", "name", "content", "role", "schema", "function", "text", "json", "0"]):
                 any_value(rng, depth + 1) for _ in range(rng.randrange(3))},
    ][kind]()


def mutated(rng: random.Random, base: dict[str, Any], fields: list[str], length: str | None = None) -> dict[str, Any]:
    """`base` with one to four of `fields` changed; `length`: the route's output length field."""
    body = copy.deepcopy(base)
    if "stream_options" in fields and rng.random() < 0.4:  # streams, with usage or not, before mutations
        body["stream"] = True
        body["stream_options"] = rng.choice([None, *PLAUSIBLE["stream_options"]])
    for _ in range(rng.choice([1, 1, 2, 3, 4])):
        name = rng.choice(fields + ["unknown_field"])
        roll = rng.random()
        if roll < 0.1:
            body.pop(name, None)
        elif name in PLAUSIBLE and roll < 0.75:
            body[name] = copy.deepcopy(rng.choice(PLAUSIBLE[name]))
        else:
            body[name] = any_value(rng)
    if length is not None:
        bound_length(rng, body, length)
    return body


LENGTHS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
LENGTH_FIELDS = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens",
                 "/v1/responses": "max_output_tokens"}


def bound_length(rng: random.Random, body: dict[str, Any], length: str) -> None:
    """Generation stays short: a length left out (up to the context, 8,192 tokens) or past 32 is
    made small; one of another type or sign stays, for the server to refuse."""
    lengths = [name for name in LENGTHS if name in body]
    for name in lengths:
        if isinstance(body[name], int) and not isinstance(body[name], bool) and body[name] > 32:
            body[name] = rng.choice([1, 6, 16])
    if not lengths:
        body[length] = 6


def http_routes(model: str) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """Each route's valid request and the fields to mutate."""
    sampling = ["n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "logit_bias", "seed", "stop", "stream", "stream_options", "logprobs",
                "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar", "bad_words", "allowed_token_ids", "stop_token_ids", "min_tokens", "ignore_eos",
                "prompt_logprobs", "truncate_prompt_tokens", "priority", "num_speculative_tokens", "prediction",
                "echo", "skip_special_tokens", "include_stop_str_in_output", "model"]
    return {
        "/v1/chat/completions": ({"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6},
                                 sampling + ["messages", "max_tokens", "max_completion_tokens", "top_logprobs", "tools",
                                             "tool_choice", "parallel_tool_calls", "continue_final_message",
                                             "add_generation_prompt", "chat_template_kwargs", "include_reasoning"]),
        "/v1/completions": ({"model": model, "prompt": "Once upon a time", "max_tokens": 6},
                            sampling + ["prompt", "max_tokens", "best_of", "suffix"]),
        "/v1/responses": ({"model": model, "input": "Say hi.", "max_output_tokens": 6},
                          ["input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools",
                           "tool_choice", "text", "reasoning", "store", "model"]),
        "/v1/embeddings": ({"model": model, "input": "hello"}, ["input", "encoding_format", "dimensions", "model"]),
        "/tokenize": ({"model": model, "prompt": "hello"}, ["prompt", "messages", "tools", "model"]),
        "/detokenize": ({"model": model, "tokens": [1, 2, 3]}, ["tokens", "model"]),
    }


def http_fault(route: str, body: dict[str, Any], response: httpx.Response) -> str | None:
    """What is wrong with the answer, or None."""
    if response.status_code == 200:
        if body.get("stream") is True and route != "/v1/responses":
            text = response.text
            return None if text.rstrip().endswith("data: [DONE]") else "a stream without [DONE]"
        if body.get("stream") is not True:
            response.json()
        return None
    if 400 <= response.status_code < 500:
        error = response.json().get("error") or {}
        return None if isinstance(error.get("message"), str) and error["message"] and "type" in error \
            else "a 4xx without an OpenAI error"
    return f"status {response.status_code}"


def fill(rng: random.Random, message: Message, depth: int = 0) -> None:
    """Random values in random fields of `message` (protobuf), recursively."""
    for field in message.DESCRIPTOR.fields:
        if rng.random() < 0.55:
            continue
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry or depth > 3:
                continue
            if field.is_repeated:
                for _ in range(rng.randrange(3)):
                    fill(rng, getattr(message, field.name).add(), depth + 1)
            else:
                getattr(message, field.name).SetInParent()
                fill(rng, getattr(message, field.name), depth + 1)
            continue
        values = [scalar(rng, field) for _ in range(rng.randrange(4) if field.is_repeated else 1)]
        try:
            if field.is_repeated:
                getattr(message, field.name).extend(values)
            else:
                setattr(message, field.name, values[0])
        except (ValueError, TypeError):
            pass  # a value out of the field's type


def scalar(rng: random.Random, field: Any) -> Any:
    t, F = field.type, field
    if field.name in ("max_tokens", "n", "min_tokens"):
        return rng.choice([0, 1, 2, 5, 17])
    if t == F.TYPE_BOOL:
        return rng.random() < 0.5
    if t == F.TYPE_STRING:
        return rng.choice(["", "a", "hello world", "(", "[a-z]{2}", 'root ::= "ok"', "{}", '{"type": "object"}',
                          "\u0000", "x" * 5000, "user", "tool", "get_weather", "null"])
    if t == F.TYPE_BYTES:
        return rng.choice([b"", b"\x00\xff"])
    if t == F.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values] + [99])
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return rng.choice([0.0, 0.5, 1.0, 2.0, -1.0, float("nan"), float("inf"), 1e30])
    if t in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_FIXED32, F.TYPE_FIXED64):
        return rng.choice([0, 1, 5, 20, 21, 49151, 49152, 2**32 - 1])
    return rng.choice([0, 1, -1, 5, 2**31 - 1, -(2**31)])


CLIENT_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED}


def grpc_request(rng: random.Random) -> tuple[str, Message]:
    rpc = rng.choice(["Generate", "Stream", "Tokenize", "Detokenize", "Embed"])
    message = {"Detokenize": pb.DetokenizeRequest, "Embed": pb.EmbedRequest}.get(rpc, pb.GenerateRequest)()
    fill(rng, message)
    if rng.random() < 0.9:
        message.model = ""  # the served model: a random name is only ever NOT_FOUND
    if isinstance(message, pb.GenerateRequest):
        if not message.WhichOneof("input") or rng.random() < 0.3:
            message.text = "Once upon a time"
        if not message.stopping.HasField("max_tokens") or message.stopping.max_tokens > 17:  # unset: 8,192
            message.stopping.max_tokens = rng.choice([1, 4, 8])
    return rpc, message


def grpc_code(stub: Any, rpc: str, message: Message) -> tuple[grpc.StatusCode, str]:
    try:
        answer = getattr(stub, rpc)(message, timeout=120)
        if rpc == "Stream":
            list(answer)
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def greedy_stream(forge_server: ForgeProcess) -> list[int]:
    request = pb.GenerateRequest(text="The history of the printing press", sampling=pb.SamplingParameters(temperature=0),
                                 stopping=pb.StoppingParameters(max_tokens=24, ignore_eos=True))
    return [t for m in forge_server.stub.Stream(request, timeout=300) if m.HasField("chunk") for t in m.chunk.token_ids]


def run_beside_a_witness(forge_server: ForgeProcess, work: Callable[[], list[str]]) -> None:
    """`work` (returning its faults) while greedy streams run beside it, one after another: each
    must get the tokens the same stream gets alone."""
    alone = greedy_stream(forge_server)
    beside: list[list[int]] = []
    stop = threading.Event()

    def witness() -> None:
        while not stop.is_set():
            beside.append(greedy_stream(forge_server))

    thread = threading.Thread(target=witness)
    thread.start()
    try:
        faults = work()
    finally:
        stop.set()
        thread.join(300)
    assert not faults, "\n".join(faults[:20])
    assert beside and all(tokens == alone for tokens in beside), (alone, beside)


def test_random_http_requests_get_an_answer_or_a_4xx_and_spoil_no_other_stream(idle_server: ForgeProcess,
                                                                              model_name: str) -> None:
    rng = random.Random(20261128)
    routes = http_routes(model_name)

    def work() -> list[str]:
        faults, statuses = [], set()
        with httpx.Client(base_url=idle_server.url, timeout=120) as client:
            for _ in range(HTTP_REQUESTS):
                route = rng.choice(list(routes))
                body = mutated(rng, *routes[route], LENGTH_FIELDS.get(route))
                try:
                    response = client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
                except httpx.TimeoutException:
                    faults.append(f"no answer in 120 s: POST {route} {json.dumps(body)[:400]}")
                    continue
                statuses.add(response.status_code)
                fault = http_fault(route, body, response)
                if fault:
                    faults.append(f"{fault}: POST {route} {json.dumps(body)[:400]} -> {response.text[:300]}")
        assert {200, 400} <= statuses  # the mix reached the engine and the validation both
        return faults

    run_beside_a_witness(idle_server, work)


def test_random_grpc_requests_get_an_answer_or_a_client_status_and_spoil_no_other_stream(
        idle_server: ForgeProcess) -> None:
    rng = random.Random(20261128)

    def work() -> list[str]:
        faults, codes = [], set()
        for _ in range(GRPC_REQUESTS):
            rpc, message = grpc_request(rng)
            code, details = grpc_code(idle_server.stub, rpc, message)
            codes.add(code)
            if code not in CLIENT_CODES or (code != grpc.StatusCode.OK and not details):
                faults.append(f"{rpc} -> {code.name} {details[:200]}: {str(message)[:400]!r}")
        assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= codes
        return faults

    run_beside_a_witness(idle_server, work)
