"""vLLM's chat template controls (continue_final_message, add_generation_prompt), chat echo, and
the OpenAI fields Forge refuses rather than ignores: the gateway's fields (a fake service) and the
service's checks (a fake engine)."""
from __future__ import annotations

import grpc
import httpx
import pytest

from forge_service.pb import forge_pb2 as pb
from tests.unit.test_gateway import chat_body, fake, http, sse_events, stack  # noqa: F401 (fixtures)
from tests.unit.test_server_fake_engine import code_of, run

pytestmark = pytest.mark.timeout(60)
PREFILL = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}]


# --- the gateway -------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, continuing, adding", [
    ({}, False, None),
    ({"continue_final_message": True}, True, None),
    ({"continue_final_message": True, "add_generation_prompt": False}, True, False),
    ({"add_generation_prompt": False}, False, False),
    ({"add_generation_prompt": True}, False, True),
])
def test_the_template_controls_reach_the_service(http: httpx.Client, fake, fields, continuing, adding):
    response = http.post("/v1/chat/completions", json={"model": "fake-model", "messages": PREFILL, **fields})
    assert response.status_code == 200, response.text
    chat = fake.requests[-1].chat
    assert chat.continue_final_message == continuing
    assert (chat.add_generation_prompt if chat.HasField("add_generation_prompt") else None) == adding


def test_echo_begins_each_answer_with_the_last_assistant_message(http: httpx.Client, fake):
    """The fake answers `echo <last message> <i>`; echo puts the last message's text before it
    when that message is an assistant's, whole and streamed (with the role, first)."""
    body = {"model": "fake-model", "messages": PREFILL, "n": 2, "echo": True, "continue_final_message": True}
    whole = http.post("/v1/chat/completions", json=body).json()
    assert [c["message"]["content"] for c in whole["choices"]] == ["Well,echo Well, 0", "Well,echo Well, 1"]
    chunks = sse_events(http.post("/v1/chat/completions", json={**body, "stream": True}))
    texts: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]].append(choice["delta"].get("content") or "")
    assert [t[0] for t in texts.values()] == ["Well,", "Well,"]
    assert ["".join(t) for t in texts.values()] == ["Well,echo Well, 0", "Well,echo Well, 1"]
    user_last = http.post("/v1/chat/completions", json=chat_body("hi", echo=True)).json()
    assert user_last["choices"][0]["message"]["content"] == "echo hi 0"  # a user's message is not echoed


@pytest.mark.parametrize("fields, param", [
    ({"modalities": ["text", "audio"]}, "modalities.1"),
    ({"continue_final_message": "yes"}, "continue_final_message"),
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
])
def test_refused_chat_fields_are_400_naming_them(http: httpx.Client, fake, fields, param):
    response = http.post("/v1/chat/completions", json=chat_body(**fields))
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert not fake.requests


def test_text_modality_alone_is_served(http: httpx.Client, fake):
    assert http.post("/v1/chat/completions", json=chat_body(modalities=["text"])).status_code == 200


def test_tokenize_takes_the_template_controls(http: httpx.Client, fake):
    counted = http.post("/tokenize", json={"model": "fake-model", "messages": PREFILL, "continue_final_message": True,
                                           "add_generation_prompt": False})
    assert counted.status_code == 200, counted.text
    chat = fake.requests[-1].chat
    assert chat.continue_final_message and chat.HasField("add_generation_prompt") and not chat.add_generation_prompt
    refused = http.post("/tokenize", json={"model": "fake-model", "prompt": "hi", "add_generation_prompt": False})
    assert refused.status_code == 400 and "need messages" in refused.json()["error"]["message"]


# --- the service -------------------------------------------------------------------------------

def _chat(messages: list[tuple[str, str]], **fields) -> pb.GenerateRequest:
    chat = pb.ChatInput(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages], **fields)
    return pb.GenerateRequest(chat=chat, stopping=pb.StoppingParameters(max_tokens=1))


def test_the_service_renders_with_the_controls_it_is_given():
    """The fake template writes `<role>content</role>` per message and `<assistant>` as the
    generation prompt; the billed prompt shows what was rendered."""
    talk = [("user", "hi"), ("assistant", "Well,")]

    async def body(h):
        return [(await h.stub.Generate(_chat(talk, **fields))).usage.prompt_tokens for fields in (
            {}, {"continue_final_message": True}, {"add_generation_prompt": False},
            {"continue_final_message": True, "add_generation_prompt": False})]

    closed = len("<user>hi</user><assistant>Well,</assistant>")
    assert run(body) == [closed + len("<assistant>"), closed - len("</assistant>"), closed, closed - len("</assistant>")]


@pytest.mark.parametrize("messages, fields, words", [
    ([("user", "hi")], {"continue_final_message": True}, "messages[0] is not"),
    ([("user", "hi"), ("assistant", "Well,")], {"continue_final_message": True, "add_generation_prompt": True},
     "cannot be combined with add_generation_prompt"),
])
def test_the_service_refuses_a_message_it_cannot_continue(messages, fields, words):
    async def body(h):
        return await code_of(h.stub.Generate(_chat(messages, **fields)))

    code, details = run(body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and words in details


def test_a_message_with_tool_calls_is_not_continued():
    request = _chat([("user", "hi")], continue_final_message=True)
    request.chat.messages.add(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="f", arguments="{}")])

    async def body(h):
        return await code_of(h.stub.Generate(request))

    code, details = run(body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "messages[1] is not" in details


# --- chat_template_kwargs ----------------------------------------------------------------------

PERSONA_TEMPLATE = ("{{ '<|im_start|>' + (persona | default('plain')) + '\\n' }}"
                    "{% for m in messages %}{{ m['content'] + '<|im_end|>' }}{% endfor %}")


@pytest.fixture(scope="module")
def persona_tokenizer(tmp_path_factory):
    from forge_service.tokenizer import Tokenizer
    from tests.tiny_models import random_weights, tiny_arch, tiny_tokenizer_json, write_safetensors_dir

    arch = tiny_arch()
    root = tmp_path_factory.mktemp("persona")
    write_safetensors_dir(root, arch, random_weights(arch, 0), tokenizer_json=tiny_tokenizer_json(),
                          chat_template=PERSONA_TEMPLATE)
    return Tokenizer.from_path(str(root))


def _rendered(tokenizer, kwargs: str) -> str:
    from forge_service import convert

    request = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi")],
                                                   chat_template_kwargs=kwargs))
    return tokenizer.decode(convert.input_token_ids(request, tokenizer), skip_special_tokens=False)


def test_chat_template_kwargs_reach_the_template(persona_tokenizer):
    assert _rendered(persona_tokenizer, "") == "<|im_start|>plain\nhi<|im_end|>"
    assert _rendered(persona_tokenizer, '{"persona": "pirate"}') == "<|im_start|>pirate\nhi<|im_end|>"


def test_a_special_token_in_a_template_kwarg_is_plain_text(persona_tokenizer):
    from forge_service import convert

    request = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi")],
                                                   chat_template_kwargs='{"persona": "<|im_end|>"}'))
    ids = convert.input_token_ids(request, persona_tokenizer)
    end = persona_tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert ids.count(end[0]) == 1  # the template's own end of message, not the kwarg's text


@pytest.mark.parametrize("kwargs, words", [
    ('{"messages": []}', "cannot set messages"), ('{"bos_token": "x", "tools": 1}', "cannot set bos_token, tools"),
    ("[1]", "must be a JSON object"), ("{nope", "is not JSON")])
def test_template_kwargs_the_server_owns_or_that_are_not_an_object_are_invalid(persona_tokenizer, kwargs, words):
    from forge_service.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=words) as error:
        _rendered(persona_tokenizer, kwargs)
    assert error.value.field == "chat.chat_template_kwargs"


def test_the_gateway_passes_template_kwargs_and_refuses_a_template(http: httpx.Client, fake):
    body = {"model": "fake-model", "messages": PREFILL, "chat_template_kwargs": {"date_string": "1 Jan 2026"}}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert fake.requests[-1].chat.chat_template_kwargs == '{"date_string": "1 Jan 2026"}'
    assert http.post("/tokenize", json=body).status_code == 200
    assert fake.requests[-1].chat.chat_template_kwargs == '{"date_string": "1 Jan 2026"}'
    refused = http.post("/v1/chat/completions", json=chat_body(chat_template="{{ messages }}"))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
