"""Tool-calling overhead: mean decode-step time of tool-call-constrained rows against unconstrained ones.

Like bench/structured_overhead.py (whose pairing and timing it reuses): B chat requests with
tools in the prompt decode `--steps` tokens together on the default model, unconstrained in one
engine and under a tool_calls grammar in a second engine over the same weights, stepping
alternately; only steps where every row decodes are timed; medians over `--rounds` runs.

- `required`: the whole output is a call of a tool whose arguments (24+ objects) outlast --steps.
- `auto`: free text under the lazy grammar (a call, once started, is constrained). EOS is biased
  away in both engines so that rows keep decoding.

Usage: python bench/tool_overhead.py [--rounds 5] [--steps 48] [--batch 1 16] [--mode required auto]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, median, table, write_json  # noqa: E402
from bench.structured_overhead import Timer, all_decoding  # noqa: E402

ADDRESS_BOOK = {"type": "object", "required": ["people"], "additionalProperties": False, "properties": {
    "people": {"type": "array", "minItems": 24, "items": {
        "type": "object", "required": ["name", "age", "email"], "additionalProperties": False,
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                       "email": {"type": "string"}}}}}}
TOOLS = (("save_contacts", ADDRESS_BOOK),
         ("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
PROMPT = [{"role": "user", "content": "Save everyone in my address book, then tell me about them."}]


def tool_request_parts(engine: Any, mode: str) -> tuple[list[int], Any]:
    """The prompt with the tools rendered as the servicer renders them, and the grammar constraint."""
    import json

    from forge_service.convert import prompt_token_ids, tools
    from forge_service.pb import forge_pb2 as pb

    request = pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(**m) for m in PROMPT]),
        tools=[pb.Tool(name=n, parameters=json.dumps(s)) for n, s in TOOLS],
        tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED if mode == "required" else pb.TOOL_CHOICE_MODE_AUTO))
    setup = tools(request, engine.tokenizer)
    return prompt_token_ids(request, engine.tokenizer, engine.max_model_len, setup), setup.constraint()


def add_requests(engine: Any, tag: str, batch: int, steps: int, mode: str, constrained: bool) -> None:
    from forge_service import SamplingParams

    prompt, constraint = tool_request_parts(engine, mode)
    bias = {eos: -100.0 for eos in engine.tokenizer.eos_token_ids} if mode == "auto" else None
    params = SamplingParams(temperature=0.7, max_tokens=steps + 1, ignore_eos=True, logit_bias=bias,
                            constraint=constraint if constrained else None)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", prompt, dataclasses.replace(params, seed=i))


def step(engine: Any, batch: int, times: list[float]) -> None:
    decoding = all_decoding(engine, batch)
    start = time.perf_counter()
    engine.step()
    if decoding:
        times.append(time.perf_counter() - start)


def run(free: Any, masked: Any, batch: int, steps: int, mode: str, tag: str) -> dict[str, float]:
    from forge_service.sampling import sampler

    add_requests(free.engine, f"free-{tag}", batch, steps, mode, False)
    add_requests(masked.engine, f"masked-{tag}", batch, steps, mode, True)
    grammars = masked.engine.runner.grammars
    fill, apply = Timer(grammars.bitmask), Timer(sampler.apply_token_bitmask)
    grammars.bitmask, sampler.apply_token_bitmask = fill, apply
    times: dict[str, list[float]] = {"free": [], "masked": []}
    try:
        while free.engine.has_unfinished_requests() or masked.engine.has_unfinished_requests():
            for name, llm in (("free", free), ("masked", masked)):
                if llm.engine.has_unfinished_requests():
                    step(llm.engine, batch, times[name])
    finally:
        del grammars.bitmask
        sampler.apply_token_bitmask = apply.fn
    n = max(len(times["masked"]), 1)
    return {"free_mean_ms": 1e3 * sum(times["free"]) / max(len(times["free"]), 1),
            "masked_mean_ms": 1e3 * sum(times["masked"]) / n,
            "free_median_ms": 1e3 * median(times["free"]), "masked_median_ms": 1e3 * median(times["masked"]),
            "steps": len(times["masked"]), "fill_ms": 1e3 * fill.seconds / n, "apply_ms": 1e3 * apply.seconds / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--mode", nargs="+", default=["required", "auto"], choices=["required", "auto"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads; 0 keeps torch's default")
    args = p.parse_args()

    import torch

    from forge_service import LLM

    engines = [LLM(dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=max(args.batch),
                   kv_cache_bytes=256 << 20) for _ in range(2)]
    rows = []
    for mode in args.mode:
        run(*engines, 2, 4, mode, f"warm-up-{mode}")  # compiles the grammar once
        for batch in args.batch:
            runs = [run(*engines, batch, args.steps, mode, f"{mode}-{batch}-{r}") for r in range(args.rounds)]
            row = {k: median([r[k] for r in runs]) for k in runs[0]}
            row["overhead_mean_pct"] = 100 * (row["masked_mean_ms"] / row["free_mean_ms"] - 1)
            row["overhead_median_pct"] = 100 * (row["masked_median_ms"] / row["free_median_ms"] - 1)
            rows.append({"mode": mode, "batch": batch, **row, "runs": runs})
    info = {**machine(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "dtype": str(engines[1].engine.dtype), "model": engines[1].engine.model_name}
    print(f"machine: {info}")
    print(f"workload: batch x {args.steps} decode steps, temperature 0.7, tools in the prompt; every row under a "
          f"tool_calls grammar (or none); median over {args.rounds} paired runs")
    print(table(rows, ["mode", "batch", "free_mean_ms", "masked_mean_ms", "overhead_mean_pct", "free_median_ms",
                       "masked_median_ms", "overhead_median_pct", "fill_ms", "apply_ms"]))
    print(f"wrote {write_json('tool_overhead.json', {'machine': info, 'args': vars(args), 'results': rows})}")


if __name__ == "__main__":
    main()
