"""Structured output at the doors: the proto oneof, the servicer's off-loop compile, the gateway's
OpenAI `response_format` and vLLM `guided_*` fields."""
from __future__ import annotations

import asyncio
import json
import threading

import grpc
import httpx
import openai
import pytest

from forge_gateway import convert as gateway_convert
from forge_gateway.models import ChatCompletionRequest, CompletionRequest
from forge_service import convert
from forge_service.errors import InvalidArgument
from forge_service.pb import forge_pb2 as pb
from forge_service.structured import BACKENDS, Constraint, GrammarCompiler
from tests.unit.fakes import FakeEngine
from tests.unit.test_gateway import chat_body, client, fake, http, stack  # noqa: F401 (fixtures)
from tests.unit.test_server_fake_engine import code_of, run, text_request

pytestmark = pytest.mark.timeout(60)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TAG_TEXT = json.dumps({"structures": [{"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f="]})


# --- proto -> SamplingParams.constraint --------------------------------------------------------

@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"json_schema": '{"type": "integer"}'}, Constraint("json_schema", '{"type": "integer"}')),
    ({"json_object": True}, Constraint("json_object")),
    ({"json_object": False}, None),
    ({"regex": "a+"}, Constraint("regex", "a+")),
    ({"choice": pb.ChoiceList(choices=["x", 'y "z"'])}, Constraint("choice", '["x", "y \\"z\\""]')),
    ({"grammar": 'root ::= "a"'}, Constraint("grammar", 'root ::= "a"')),
    ({"structural_tag": '{"triggers": ["<f"]}'}, Constraint("structural_tag", '{"triggers": ["<f"]}')),
])
def test_the_constraint_oneof_maps_to_a_constraint(fields, expected):
    assert convert.sampling_params(pb.GenerateRequest(text="x", **fields)).constraint == expected


def test_an_empty_constraint_is_invalid():
    with pytest.raises(InvalidArgument, match="regex is empty"):
        convert.sampling_params(pb.GenerateRequest(text="x", regex=""))


# --- the servicer ------------------------------------------------------------------------------

class _StubBackend:
    """Compiles anything but 'bad'; blocks on `gate` first so tests can hold a compile in flight."""

    gate = threading.Event()

    def __init__(self, tokenizer, vocab_size, eos_token_ids) -> None:
        pass

    def compile(self, constraint):
        assert self.gate.wait(timeout=10)
        if constraint.spec == "bad":
            raise InvalidArgument("invalid regex: stub refuses 'bad'")
        return object()


class _ConstrainedFake(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        # A test holds a stub compile for longer than the default time limit, which it must survive.
        self.grammar_compiler = GrammarCompiler(None, 256, [0], backend="stub", compile_timeout_s=30)
        self.cached_at_add: list[bool] = []

    def add_request(self, request_id, prompt_token_ids, params, label=None) -> None:
        if params.constraint is not None:
            self.cached_at_add.append(self.grammar_compiler.compile_async(params.constraint).done())
        super().add_request(request_id, prompt_token_ids, params, label)


@pytest.fixture
def stub_backend(monkeypatch):
    monkeypatch.setitem(BACKENDS, "stub", _StubBackend)
    _StubBackend.gate.set()
    yield _StubBackend
    _StubBackend.gate.set()


def test_constraints_are_compiled_before_the_engine_sees_them(stub_backend):
    fake = _ConstrainedFake()

    async def body(h):
        response = await h.stub.Generate(text_request("abc", max_tokens=2, regex="a+"))
        code, details = await code_of(h.stub.Generate(text_request("abc", regex="bad")))
        return response, code, details

    response, code, details = run(body, fake)
    assert response.choices[0].text == "ab"
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "stub refuses 'bad'" in details
    assert fake.cached_at_add == [True] and [fake.labels[i] for i in fake.added] == [response.request_id]  # the bad one never got there


def test_a_slow_compile_does_not_hold_up_the_event_loop_or_other_requests(stub_backend):
    stub_backend.gate.clear()
    fake = _ConstrainedFake()

    async def body(h):
        waiting = asyncio.ensure_future(h.stub.Generate(text_request("abc", max_tokens=2, regex="slow")))
        await asyncio.sleep(0.2)
        other = await h.stub.Generate(text_request("xyz", max_tokens=2))  # unconstrained: served meanwhile
        health = await h.stub.Health(pb.HealthRequest())
        assert not waiting.done() and [fake.labels[i] for i in fake.added] == [other.request_id]
        stub_backend.gate.set()
        return other, health, await waiting

    other, health, constrained = run(body, fake)
    assert other.choices[0].text == "xy" and health.ready and constrained.choices[0].text == "ab"


def test_an_engine_without_structured_output_refuses_constraints():
    code, details = run(lambda h: code_of(h.stub.Generate(text_request("abc", json_object=True))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "structured output" in details


# --- the gateway -------------------------------------------------------------------------------

def _chat(**fields) -> pb.GenerateRequest:
    return gateway_convert.chat_request(ChatCompletionRequest(**chat_body(**fields)), "id")


def test_gateway_maps_every_constraint_field():
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    assert json.loads(_chat(response_format=fmt).json_schema) == SCHEMA
    assert _chat(response_format={"type": "json_object"}).json_object
    assert _chat(response_format={"type": "text"}).WhichOneof("constraint") is None
    assert json.loads(_chat(guided_json=SCHEMA).json_schema) == SCHEMA
    assert _chat(guided_json='{"type": "string"}').json_schema == '{"type": "string"}'
    assert _chat(guided_regex="a+").regex == "a+"
    assert list(_chat(guided_choice=["x", "y"]).choice.choices) == ["x", "y"]
    assert _chat(guided_grammar='root ::= "a"').grammar == 'root ::= "a"'
    tag = _chat(response_format={"type": "structural_tag", **json.loads(TAG_TEXT)}).structural_tag
    assert json.loads(tag) == json.loads(TAG_TEXT)
    completion = CompletionRequest(model="m", prompt=["a", "b"], guided_regex="b+")
    assert [m.regex for m in gateway_convert.completion_requests(completion, "id")] == ["b+", "b+"]


def test_gateway_maps_vllm_s_structured_outputs():
    """vLLM's structured_outputs (its guided_* fields' successor) carries each kind of constraint;
    disable_additional_properties is strict mode."""
    so = _chat(structured_outputs={"json": SCHEMA})
    assert json.loads(so.json_schema) == SCHEMA and not so.json_schema_strict
    strict = _chat(structured_outputs={"json": '{"type": "object"}', "disable_additional_properties": True})
    assert strict.json_schema == '{"type": "object"}' and strict.json_schema_strict
    assert _chat(structured_outputs={"json_object": True, "disable_any_whitespace": True}).json_object
    assert _chat(structured_outputs={"regex": "a+", "disable_fallback": True}).regex == "a+"
    assert list(_chat(structured_outputs={"choice": ["x", "y"]}).choice.choices) == ["x", "y"]
    assert _chat(structured_outputs={"grammar": 'root ::= "a"'}).grammar == 'root ::= "a"'
    assert _chat(structured_outputs={"structural_tag": TAG_TEXT}).structural_tag == TAG_TEXT
    completion = CompletionRequest(model="m", prompt="a", structured_outputs={"choice": ["b"]})
    assert list(gateway_convert.completion_requests(completion, "id")[0].choice.choices) == ["b"]


@pytest.mark.parametrize("fields, param", [
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}", "regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<f>", "end": ""}]}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "structured_outputs.backend"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "a"}, None),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, None),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, None),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, None),
])
def test_gateway_refuses_malformed_or_conflicting_constraints(http: httpx.Client, fake, fields, param):
    response = http.post("/v1/chat/completions", json=chat_body(**fields))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert not fake.requests


def test_openai_client_response_format_reaches_the_service(client: openai.OpenAI, fake):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                   response_format=fmt)
    client.completions.create(model="fake-model", prompt="hi", extra_body={"guided_choice": ["a", "b"]})
    assert json.loads(fake.requests[0].json_schema) == SCHEMA
    assert list(fake.requests[1].choice.choices) == ["a", "b"]
