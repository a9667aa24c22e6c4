"""JSON Schema coverage on a corpus of real-world schemas (bench/data/schema_corpus.jsonl).

For each schema, before and after approximation (issue 16):
- accepted: the structured-output compiler takes it (before: llguidance exact or INVALID_ARGUMENT;
  after: exact, else approximated: oneOf as anyOf, unimplemented keywords ignored; see
  forge_service/structured/schema.py);
- with generation (not --accept-only): greedy decoding on the default model, at most
  --max-tokens tokens, batched: the share of all schemas whose output finishes with `stop` and
  validates against the full schema (jsonschema). `after` runs plain JSON Schema semantics and
  `after_strict` OpenAI's strict mode (objects closed), which the SDK's parse() helpers send.

Usage: python bench/schema_corpus.py [--accept-only] [--max-tokens 512] [--limit N] [--num-threads 1]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, table, write_json  # noqa: E402

CORPUS = Path(__file__).resolve().parent / "data" / "schema_corpus.jsonl"
PROMPT_SCHEMA_CHARS = 3000  # the longest schemas would not fit the context; the grammar still has them whole


def load(limit: int | None) -> list[dict[str, Any]]:
    with open(CORPUS) as f:
        entries = [json.loads(line) for line in f]
    return entries[:limit] if limit else entries


def before_json_schema(spec: str) -> str:
    """The compiler's JSON Schema builder before approximation: exact or refused."""
    import llguidance

    from forge_service.errors import InvalidArgument
    from forge_service.structured.llguidance_backend import JSON_OPTIONS

    schema = json.loads(spec)
    schema = {} if schema is True else schema
    if not isinstance(schema, dict):
        raise InvalidArgument("json_schema must be a JSON object (or true)")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def acceptance(compiler: Any, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from forge_service.errors import InvalidArgument
    from forge_service.structured import Constraint
    from forge_service.structured import llguidance_backend as backend

    rows = []
    for entry in entries:
        spec, row = json.dumps(entry["schema"]), {"name": entry["name"]}
        for policy, builder in (("before", before_json_schema), ("after", backend._json_schema)):
            compiler.clear_cache()
            backend.GRAMMAR_BUILDERS["json_schema"] = builder
            try:
                compiler.compile(Constraint("json_schema", spec))
                row[policy] = "ok"
            except InvalidArgument as e:
                row[policy] = f"refused: {str(e)[:100]}"
        backend.GRAMMAR_BUILDERS["json_schema"] = backend._json_schema
        if row["after"] == "ok":
            row["approximated"] = bool(backend.prepare_schema(entry["schema"], entry["name"])[1])
        rows.append(row)
    compiler.clear_cache()
    return rows


def chat(entry: dict[str, Any]) -> list[dict[str, str]]:
    text = json.dumps(entry["schema"])
    if len(text) > PROMPT_SCHEMA_CHARS:
        text = text[:PROMPT_SCHEMA_CHARS] + " ..."
    return [{"role": "user", "content": f"Write one JSON document ({entry['name']}) that matches this JSON Schema:\n"
                                        f"{text}"}]


def generate(llm: Any, entries: list[dict[str, Any]], rows: list[dict[str, Any]], policy: str,
             max_tokens: int) -> None:
    """Greedy outputs for every schema the policy accepts; sets row[f"{policy}_valid"]."""
    import jsonschema

    from forge_service import SamplingParams
    from forge_service.errors import InvalidArgument
    from forge_service.structured import Constraint
    from forge_service.structured import llguidance_backend as backend
    from forge_service.structured.schema import close_objects

    backend.GRAMMAR_BUILDERS["json_schema"] = before_json_schema if policy == "before" else backend._json_schema
    llm.engine.runner.grammars.compiler.clear_cache()
    compiler = llm.engine.runner.grammars.compiler
    chosen, params = [], []
    for entry, row in zip(entries, rows):
        if row["before" if policy == "before" else "after"] != "ok":
            continue
        schema = close_objects(entry["schema"]) if policy == "after_strict" else entry["schema"]
        constraint = Constraint("json_schema", json.dumps(schema))
        try:  # closing a schema's objects can make it unsatisfiable: refused, so not valid
            compiler.compile(constraint)
        except InvalidArgument as e:
            row[f"{policy}_error"] = f"refused: {str(e)[:100]}"
            continue
        chosen.append((entry, row))
        params.append(SamplingParams(temperature=0, max_tokens=max_tokens, constraint=constraint))
    try:
        outputs = llm.chat([chat(e) for e, _ in chosen], params)
    finally:
        backend.GRAMMAR_BUILDERS["json_schema"] = backend._json_schema
    for row in rows:
        row[f"{policy}_valid"] = False
    print(f"{policy}: {len(chosen)} schemas generated", flush=True)
    for (entry, row), out in zip(chosen, outputs):
        c = out.outputs[0]
        row[f"{policy}_finish"] = c.finish_reason
        if c.finish_reason == "stop":
            try:
                jsonschema.validate(json.loads(c.text), entry["schema"])
                row[f"{policy}_valid"] = True
            except (json.JSONDecodeError, jsonschema.ValidationError) as e:
                row[f"{policy}_error"] = str(e)[:120]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accept-only", action="store_true", help="only compile; no model, no generation")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--limit", type=int, default=None, help="the first N schemas only")
    p.add_argument("--num-threads", type=int, default=1)
    args = p.parse_args()
    entries = load(args.limit)
    started = time.perf_counter()
    if args.accept_only:
        from forge_service.loaders import default_model_path
        from forge_service.structured import GrammarCompiler
        from forge_service.tokenizer.tokenizer import Tokenizer

        tok = Tokenizer.from_path(str(default_model_path()))
        compiler = GrammarCompiler(tok.backend, tok.vocab_size, tok.eos_token_ids)
        rows = acceptance(compiler, entries)
        compiler.shutdown()
        policies: list[str] = []
    else:
        from forge_service import LLM

        llm = LLM(num_threads=args.num_threads, max_num_seqs=len(entries))
        rows = acceptance(llm.engine.runner.grammars.compiler, entries)
        policies = ["before", "after", "after_strict"]
        for policy in policies:
            generate(llm, entries, rows, policy, args.max_tokens)
            valid = sum(r[f"{policy}_valid"] for r in rows)
            print(f"{policy}: valid and stopped {valid}/{len(rows)}", flush=True)
    n = len(rows)
    summary = {"schemas": n,
               "accepted_before_pct": 100 * sum(r["before"] == "ok" for r in rows) / n,
               "accepted_after_pct": 100 * sum(r["after"] == "ok" for r in rows) / n,
               "approximated_pct": 100 * sum(bool(r.get("approximated")) for r in rows) / n}
    for policy in policies:
        summary[f"{policy}_valid_stop_pct"] = 100 * sum(r[f"{policy}_valid"] for r in rows) / n
    summary["seconds"] = time.perf_counter() - started
    print(f"machine: {machine()}")
    print(f"corpus: {CORPUS.name}, {n} schemas; max_tokens {args.max_tokens}, greedy")
    print(table([summary], list(summary)))
    refused = [r for r in rows if r["after"] != "ok"]
    for r in refused:
        print(f"  refused after: {r['name']}: {r['after']}")
    path = write_json("schema_corpus.json", {"machine": machine(), "args": vars(args), "summary": summary,
                                             "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
