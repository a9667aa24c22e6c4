"""Reasoning output: a thinking model's thought (<think>...</think>) split from its answer, in the
splitter itself (whole and streamed alike), in the service (a fake engine whose chat template
renders a "think" role as <think>...</think>), at the gateway (a fake service) and on a tiny model
whose template opens the thought."""
from __future__ import annotations

import dataclasses
import random

import httpx
import openai
import pytest

from forge_service import reasoning
from forge_service.config import ServiceConfig
from forge_service.pb import forge_pb2 as pb
from forge_service.reasoning import ReasoningSplitter
from forge_service.tools.output import OutputProcessor, Piece
from tests.unit.test_gateway import chat_body, client, fake, http, sse_events, stack  # noqa: F401 (fixtures)
from tests.unit.test_server_fake_engine import CONFIG, run, stream_all

pytestmark = pytest.mark.timeout(60)

# text -> (reasoning, answer) for a completion that starts outside a thought, and inside one
CASES = {
    "<think>\nI should add.\nTwo and two.\n</think>\n\nFour.": (("I should add.\nTwo and two.", "Four."),
                                                                ("<think>\nI should add.\nTwo and two.", "Four.")),
    "  <think>x</think>y": (("x", "y"), ("<think>x", "y")),
    "plain answer": (("", "plain answer"), ("plain answer", "")),
    " leading space kept <think>not a thought</think>": (("", " leading space kept <think>not a thought</think>"),
                                                         ("leading space kept <think>not a thought", "")),
    "<think>cut short by max_tokens\n": (("cut short by max_tokens", ""), ("<think>cut short by max_tokens", "")),
    "<think>\n\n</think>\n\nok": (("", "ok"), ("<think>", "ok")),
    "<thi": (("", "<thi"), ("<thi", "")),
    "": (("", ""), ("", "")),
    "<think>a</think": (("a</think", ""), ("<think>a</think", "")),
    "thought</think>\n\nanswer": (("", "thought</think>\n\nanswer"), ("thought", "answer")),
}


def split(text: str, pieces: list[str], in_thought: bool = False) -> tuple[str, str]:
    splitter, thought, answer = ReasoningSplitter(in_thought), "", ""
    for piece in pieces:
        r, a = splitter.feed(piece)
        thought, answer = thought + r, answer + a
    r, a = splitter.finish()
    return thought + r, answer + a


@pytest.mark.parametrize("text", list(CASES))
def test_the_thought_is_split_off_whole_and_streamed_alike(text: str) -> None:
    rng = random.Random(text)
    for in_thought, want in zip((False, True), CASES[text]):
        assert split(text, [text], in_thought) == want
        for _ in range(200):  # the same whatever the deltas' boundaries
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(1, 8))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            assert split(text, pieces, in_thought) == want, pieces


def test_nothing_is_held_back_but_a_possible_tag_or_trailing_whitespace() -> None:
    s = ReasoningSplitter()
    assert s.feed("  ") == ("", "") and s.feed("<th") == ("", "")  # may still open a thought
    assert s.feed("ink>I") == ("I", "")
    assert s.feed(" reckon \n") == (" reckon", "")  # whitespace may end the thought: held
    assert s.feed("so</thi") == (" \nso", "")
    assert s.feed("nk>\n\nYes") == ("", "Yes")
    assert s.feed(" indeed") == ("", " indeed")
    answer = ReasoningSplitter()
    assert answer.feed("No thought") == ("", "No thought")  # the answer as written, at once


def test_modes_and_an_opened_thought() -> None:
    qwen3 = "...{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' }}..."
    assert reasoning.parses_reasoning("auto", qwen3) and not reasoning.parses_reasoning("auto", "{{ messages }}")
    assert not reasoning.parses_reasoning("auto", None) and reasoning.parses_reasoning("think", None)
    assert not reasoning.parses_reasoning("off", qwen3)
    assert reasoning.prompt_opens_thought("<|Assistant|><think>\n")
    assert not reasoning.prompt_opens_thought("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert not reasoning.prompt_opens_thought("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="reasoning_parser must be one of auto, think, off"):
        ServiceConfig(reasoning_parser="qwen3")


def test_tool_calls_and_the_schema_check_see_the_answer_alone() -> None:
    from forge_service.tools.setup import tool_setup
    from tests.unit.test_tool_setup import QWEN_LIKE, request

    processor = OutputProcessor("r", tool_setup(request(), QWEN_LIKE), reasoning=True)  # Hermes calls
    text = '<think>Call the tool.\n<tool_call>\n{"name": "not", "arguments": {}}\n</tool_call>\n</think>\n\n' \
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pieces = [processor.feed(0, text[at:at + 5]) for at in range(0, len(text), 5)]
    last, calls, reason = processor.finish(0, "stop")
    thought = "".join(p.reasoning for p in [*pieces, last])
    assert thought == 'Call the tool.\n<tool_call>\n{"name": "not", "arguments": {}}\n</tool_call>'
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')] and reason == "tool_calls"
    assert "".join(p.text for p in [*pieces, last]) == ""
    seen = []
    schema = OutputProcessor("s", None, json_schema={"type": "object"}, reasoning=True, include_reasoning=False,
                             on_validated=lambda what, ok: seen.append((what, ok)))
    piece = schema.feed(0, '<think>not JSON</think>{"a": 1}')
    assert (piece.reasoning, piece.text) == ("", '{"a": 1}')  # the thought dropped, the answer checked
    schema.finish(0, "stop")
    assert seen == [("json_schema", True)]


def test_a_grammar_shaped_answer_has_no_thought_even_after_a_template_that_opens_one() -> None:
    from forge_service import convert
    from forge_service.tools.setup import tool_setup
    from tests.unit.fakes import FakeTokenizer
    from tests.unit.test_tool_setup import QWEN_LIKE, request

    tokenizer, prompt = FakeTokenizer(), FakeTokenizer().encode("<assistant><think>\n")
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="q")])
    free = convert.output_processor(pb.GenerateRequest(chat=chat), "a", None, tokenizer, prompt, "think")
    assert free.feed(0, '{"a": 1}</think>b') == Piece("b", reasoning='{"a": 1}')  # the opened thought
    for req in (pb.GenerateRequest(chat=chat, json_object=True), pb.GenerateRequest(chat=chat, regex="[a-z]+"),
                request(choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED))):
        setup = tool_setup(req, QWEN_LIKE) if req.tools else None
        processor = convert.output_processor(req, "b", setup, tokenizer, prompt, "think")
        assert processor.feed(0, '{"a": 1}').reasoning == "", req


def test_reasoning_tokens_are_the_thought_s_tags_included() -> None:
    def count(pieces: list[str], in_thought: bool = False, close_token: int | None = None,
              steps: list[int] | None = None) -> int:
        """Reasoning tokens of `pieces` (token i's text), fed a token a step or `steps` tokens at a time."""
        processor = OutputProcessor("r", None, reasoning=True, in_thought=in_thought, close_token=close_token)
        at = 0
        for n in steps or [1] * len(pieces):
            processor.feed(0, "".join(pieces[at:at + n]), [TOKEN_IDS[p] for p in pieces[at:at + n]])
            at += n
        processor.finish(0, "stop")
        return processor.reasoning_tokens(0)

    qwen3 = ["<think>", "\n", "I", " think", ".", "\n", "</think>", "\n\n", "Answer", "."]
    assert count(qwen3) == 7
    assert count(["<thi", "nk>", "x", "</think>", "y"]) == 4  # the tag's first piece waited, then counted
    assert count([" ", "<b", ">bold"]) == 0 and count(["plain", " answer"]) == 0
    assert count(["so", " it", "</think>", "ok"], in_thought=True) == 3
    # several tokens a step (a consumer that fell behind): the step that closes the thought counts
    # through the closing tag where that is one token, whole where it is not
    assert count(qwen3, close_token=TOKEN_IDS["</think>"], steps=[4, 6]) == 7
    assert count(qwen3, close_token=TOKEN_IDS["</think>"], steps=[10]) == 7
    assert count(qwen3, steps=[4, 6]) == 10
    off = OutputProcessor("o", None)
    off.feed(0, "<think>x</think>y", [1, 2, 3])
    assert off.reasoning_tokens(0) == 0


TOKEN_IDS: dict[str, int] = {}
TOKEN_IDS.update((p, i) for i, p in enumerate(["<think>", "\n", "I", " think", ".", "</think>", "\n\n", "Answer",
                                                "<thi", "nk>", "x", "y", " ", "<b", ">bold", "plain", " answer",
                                                "so", " it", "ok"]))


# --- the service (a fake engine that echoes the prompt: "<think>plan</think><user>q</user><assistant>") ---

THINKING = dataclasses.replace(CONFIG, reasoning_parser="think")
MESSAGES = [pb.ChatMessage(role="think", content="plan"), pb.ChatMessage(role="user", content="q")]


def test_the_service_returns_the_thought_apart_whole_and_streamed() -> None:
    response_usage: dict[str, int] = {}

    async def body(h):
        request = pb.GenerateRequest(chat=pb.ChatInput(messages=MESSAGES))
        whole = (await h.stub.Generate(request)).choices[0]
        streamed = await stream_all(h, request)
        chunks = [m.chunk for m in streamed if m.HasField("chunk")]
        left_out = await h.stub.Generate(pb.GenerateRequest(chat=pb.ChatInput(messages=MESSAGES),
                                                            include_reasoning=False))
        text = await h.stub.Generate(pb.GenerateRequest(text="<think>plan</think>answer"))
        finals = [m.final for m in streamed if m.HasField("final")]
        response_usage.update(whole=(await h.stub.Generate(request)).usage.reasoning_tokens,
                              streamed=finals[0].usage.reasoning_tokens, left_out=left_out.usage.reasoning_tokens)
        assert text.usage.reasoning_tokens == 0
        return whole, chunks, left_out.choices[0], text.choices[0]

    whole, chunks, left_out, text = run(body, config=THINKING)
    assert (whole.reasoning, whole.text) == ("plan", "<user>q</user><assistant>")
    # <think>plan</think> is 19 tokens (one per byte, so </think> is no one token): deltas that
    # queued up while the servicer was busy count whole, the one that closed the thought may add
    # the answer's (exact counts: test_reasoning_tokens_are_the_thought_s_tags_included)
    assert all(19 <= count <= len(whole.token_ids) for count in response_usage.values()), response_usage
    assert "".join(c.reasoning for c in chunks) == "plan" and "".join(c.text for c in chunks) == whole.text
    first_text = next(i for i, c in enumerate(chunks) if c.text)
    assert max(i for i, c in enumerate(chunks) if c.reasoning) <= first_text  # the thought comes first
    assert (left_out.reasoning, left_out.text) == ("", whole.text)
    assert (text.reasoning, text.text) == ("", "<think>plan</think>answer")  # text input: as written


def test_off_leaves_the_text_as_written() -> None:
    async def body(h):
        return (await h.stub.Generate(pb.GenerateRequest(chat=pb.ChatInput(messages=MESSAGES)))).choices[0]

    choice = run(body)  # the fake's template is not a thinking model's: auto is off
    assert (choice.reasoning, choice.text) == ("", "<think>plan</think><user>q</user><assistant>")


def test_an_assistant_message_s_reasoning_reaches_the_template_and_only_an_assistant_s() -> None:
    from forge_service.tools.prompt import template_inputs

    messages = [pb.ChatMessage(role="user", content="q"), pb.ChatMessage(role="assistant", content="a", reasoning="r")]
    rendered, _ = template_inputs(messages, None, None)
    assert rendered[1] == {"role": "assistant", "content": "a", "reasoning_content": "r"}
    from forge_service.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=r"messages\[0\]: only assistant messages carry reasoning"):
        template_inputs([pb.ChatMessage(role="user", content="q", reasoning="r")], None, None)


# --- the gateway (a fake service: a prompt beginning "think" gets a thought) ----------------------

def test_the_gateway_returns_reasoning_and_reasoning_content(http: httpx.Client, fake) -> None:
    body = chat_body("think hard", n=2)
    message = http.post("/v1/chat/completions", json=body).json()["choices"][1]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "thought 1 about think hard"
    assert message["content"] == "echo think hard 1"
    plain = http.post("/v1/chat/completions", json=chat_body("hi")).json()["choices"][0]["message"]
    assert "reasoning" not in plain and "reasoning_content" not in plain
    events = sse_events(http.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [c["delta"] for e in events for c in e["choices"] if c["index"] == 0]
    thought = [d for d in deltas if "reasoning" in d]
    assert "".join(d["reasoning"] for d in thought) == "thought 0 about think hard"
    assert all(d["reasoning"] == d["reasoning_content"] and "content" not in d for d in thought)
    assert "".join(d.get("content") or "" for d in deltas) == "echo think hard 0"
    usage = http.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    totals = sse_events(usage)[-1]["usage"]
    assert totals["completion_tokens_details"]["reasoning_tokens"] == 2 * len("thought 0 about think hard")
    whole = http.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens_details"]
    assert whole["reasoning_tokens"] == 2 * len("thought 0 about think hard")


def test_include_reasoning_and_a_message_s_reasoning_reach_the_service(http: httpx.Client, fake) -> None:
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r1"},
               {"role": "assistant", "content": "b", "reasoning": "r2"}, {"role": "user", "content": "hi"}]
    assert http.post("/v1/chat/completions", json={"model": "m", "messages": history,
                                                   "include_reasoning": False}).status_code == 200
    sent = fake.requests[-1]
    assert [m.reasoning for m in sent.chat.messages] == ["", "r1", "r2", ""]
    assert sent.HasField("include_reasoning") and not sent.include_reasoning
    http.post("/v1/chat/completions", json=chat_body("hi"))
    assert not fake.requests[-1].HasField("include_reasoning")


def test_the_openai_client_reads_the_thought(client: openai.OpenAI, fake) -> None:
    response = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "think"}])
    assert response.choices[0].message.model_extra["reasoning"] == "thought 0 about think"


# --- a tiny model whose template opens the thought --------------------------------------------

def test_a_template_that_opens_the_thought_makes_the_whole_answer_reasoning_until_it_closes(tmp_path) -> None:
    from forge_service import LLM
    from tests.tiny_models import CHATML_TEMPLATE, tiny_arch, tiny_tokenizer_json, write_safetensors_dir
    from tests.unit.test_engine_tiny import sharp_weights

    # DeepSeek-R1's way: the generation prompt ends in "<think>\n" (and the template knows </think>)
    template = CHATML_TEMPLATE.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'") + \
        "{# a thought ends at </think> #}"
    assert template != CHATML_TEMPLATE + "{# a thought ends at </think> #}"
    arch = tiny_arch()
    write_safetensors_dir(tmp_path, arch, sharp_weights(arch), tokenizer_json=tiny_tokenizer_json(),
                          chat_template=template)
    request = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hello")]),
                                 sampling=pb.SamplingParameters(temperature=0),
                                 stopping=pb.StoppingParameters(max_tokens=12, ignore_eos=True))
    engine = LLM(model=str(tmp_path), dtype="float32").engine

    async def body(h):
        answer = await h.stub.Generate(request)
        return answer.choices[0], answer.usage, await stream_all(h, request)

    (whole, usage, streamed) = run(body, factory=lambda: engine)  # auto: the template knows </think>
    (raw, raw_usage, _) = run(body, factory=lambda: engine, config=dataclasses.replace(CONFIG, reasoning_parser="off"))
    assert usage.reasoning_tokens == usage.completion_tokens == 12 and raw_usage.reasoning_tokens == 0
    assert "</think>" not in raw.text and raw.text.strip()
    assert (whole.reasoning, whole.text) == (raw.text.strip(), "")
    chunks = [m.chunk for m in streamed if m.HasField("chunk")]
    assert "".join(c.reasoning for c in chunks) == whole.reasoning and not any(c.text for c in chunks)
    assert whole.token_ids == raw.token_ids
