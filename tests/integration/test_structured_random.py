"""Structured output on random JSON schemas in `forge serve`'s default configuration (bf16, n-gram
drafting on), sampled: every output that finishes with `stop` parses and validates against its schema.

The corpus test (test_structured_output.py) names each keyword once, mostly greedy in fp32; here
seeded random schemas nest objects, arrays, enums, bounds, patterns and `anyOf` the way clients
combine them, the rows sample at several temperatures, and drafted tokens are verified against
the grammar, so a mask, a rollback of rejected drafts or a matcher state that let one wrong token
through shows as an output that does not validate.
"""
from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from forge_service import LLM, SamplingParams
from forge_service.structured import Constraint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_SCHEMAS = 48
STREAMS = 4
MAX_TOKENS = 96
NAMES = ["a", "name", "age", "tags", "x_y", "é", "id", "value", "items", "ok"]
PATTERNS = ["^[a-z]+$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$", "^A.*Z$"]


def leaf(rnd: random.Random) -> dict[str, Any]:
    kind = rnd.choice(["string", "integer", "number", "boolean", "null", "enum", "const", "bounded"])
    if kind == "enum":
        return {"enum": rnd.sample(["red", "green", 1, 2.5, None, True, "a b", '"q"'], rnd.randint(1, 4))}
    if kind == "const":
        return {"const": rnd.choice(["x", 3, False, None, "long const value"])}
    if kind != "bounded":
        return {"type": kind}
    shape = rnd.choice(["string", "pattern", "integer", "number"])
    if shape == "string":
        low = rnd.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": rnd.randint(low, 12)}
    if shape == "pattern":
        return {"type": "string", "pattern": rnd.choice(PATTERNS)}
    low = rnd.randint(-100, 100)
    if shape == "integer":
        return {"type": "integer", "minimum": low, "maximum": low + rnd.randint(0, 1000)}
    return {"type": "number", "minimum": rnd.choice([0, -1.5, 2.25]), "maximum": rnd.choice([10, 3.5, 1e6])}


def schema(rnd: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random schema of what the grammar enforces exactly (nothing approximated)."""
    r = rnd.random()
    if depth >= 3 or r < 0.4:
        return leaf(rnd)
    if r < 0.7:
        properties = {name: schema(rnd, depth + 1) for name in rnd.sample(NAMES, rnd.randint(1, 4))}
        out = {"type": "object", "properties": properties, "required": rnd.sample(list(properties),
                                                                                   rnd.randint(0, len(properties)))}
        if rnd.random() < 0.6:
            out["additionalProperties"] = False
        return out
    if r < 0.85:
        low = rnd.randint(0, 2)
        return {"type": "array", "items": schema(rnd, depth + 1), "minItems": low, "maxItems": rnd.randint(low, 4)}
    if r < 0.95:
        return {"anyOf": [schema(rnd, depth + 1) for _ in range(rnd.randint(1, 3))]}
    return {"type": rnd.choice([["string", "null"], ["integer", "string"]])}


def test_random_schemas_sampled_with_drafting_give_valid_json() -> None:
    rnd = random.Random(20261128)
    schemas = [schema(rnd) for _ in range(NUM_SCHEMAS)]
    llm = LLM(speculative="ngram")  # the server's defaults: bf16, n-gram drafting
    # The compile budget (0.5 s of the compiling thread's CPU time) guards a server against runaway
    # schemas, and test_structured_limits.py tests it. These compiles take 2-26 ms; when the budget
    # was wall-clock time, late in a long test process one was held past it (a collector pause or
    # another test's thread). This test is about drafting under a grammar, so it gives them room.
    llm.engine.grammar_compiler.compile_timeout_s = 30.0
    tokenizer = llm.engine.tokenizer
    prompts, params = [], []
    for i, s in enumerate(schemas):
        messages = [{"role": "user", "content": f"Request {i}. Write an example that follows this JSON Schema: "
                                                f"{json.dumps(s)}"}]
        prompts.append(tokenizer.encode_chat(messages))
        params.append(SamplingParams(temperature=[0.0, 0.7, 1.0, 1.5][i % 4], top_p=[1.0, 0.9][i % 2], seed=i,
                                     max_tokens=MAX_TOKENS, constraint=Constraint("json_schema", json.dumps(s))))
    # Four at a time: drafts fill the free rows of a step's one block of 8 (none from 8 streams on).
    outputs = [out for i in range(0, NUM_SCHEMAS, STREAMS)
               for out in llm.generate(prompts[i:i + STREAMS], params[i:i + STREAMS])]
    stopped = drafted = 0
    for s, out in zip(schemas, outputs):
        [completion] = out.outputs
        drafted += completion.num_drafted_tokens
        if completion.finish_reason == "length":
            assert len(completion.token_ids) == MAX_TOKENS
            continue
        assert completion.finish_reason == "stop", completion.finish_reason
        jsonschema.validate(json.loads(completion.text), s)
        stopped += 1
    # Most documents are short; some run on in long strings or arrays at high temperatures.
    assert stopped >= NUM_SCHEMAS // 2, stopped
    assert drafted > 0  # the grammar's own runs (keys, enums, consts) are drafted from the prompt
