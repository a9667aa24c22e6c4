"""Speculative decoding's gain: streaming chat through the gateway, drafting on and off, one run.

One `forge serve --speculative ngram` (the default model, bf16); "off" requests opt out with
`num_speculative_tokens: 0`, so both modes share the process, its warm-up and the machine's
drift. Workloads, one after the other:

    grounded   the answer copies from the prompt: repeat or edit code and text, summaries that
               quote the document, JSON extracted from a given document
    open       open chat with nothing to copy
    predicted  open chat asked again: each request sends the answer its prompt got before (with
               another request number) as OpenAI's `prediction`, as a client regenerating an
               answer or re-running an agent's step would; `--workloads grounded,open` leaves it out

Each (workload, concurrency) cell runs --rounds rounds; a round runs on and off back to back
(alternating which goes first), each over the same --requests-per-stream x concurrency prompts
(the next ones each round). Every request starts with its own request number, so the prefix
cache never skips a prefill. Reported: median output tok/s per mode and the ratio on/off;
drafted tokens accepted (acceptance rate); and tokens per step, completion tokens / (completion
tokens - accepted), the mean run a request gets from one forward pass.

    python bench/speculative.py --concurrency 1,16 --rounds 3
    python bench/speculative.py --step-rows 1,2,4,8,16,24,32   # the step cost per row
    python bench/speculative.py --draft-steps 4,12             # drafting on and off, in process
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, table, write_json  # noqa: E402
from bench.observability_overhead import free_port  # noqa: E402

CODE = '''def merge_intervals(intervals):
    """Merge overlapping intervals and return them sorted."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]
'''
STORY = ("The lighthouse keeper climbed the spiral stairs every evening at six. He wound the clockwork, "
         "polished the great lens, and lit the lamp. Ships passing the rocks saw the light sweep across the "
         "water every ten seconds. In winter the storms came from the north, and the keeper wrote each one "
         "in his logbook: the date, the wind, the height of the waves, and the names of the ships that passed.")
INVOICE = ("INVOICE 2024-0117\nBilled to: Harbor Supplies Ltd, 14 Quay Street, Portsmouth\nDate: 3 March 2024\n"
           "Items: 12 brass hinges at 4.50 each; 3 tins of marine varnish at 18.00 each; 1 coil of rope at 32.00\n"
           "Total due: 140.00 GBP\nPayment terms: 30 days")
GROUNDED = [
    f"Repeat the following Python code exactly, with no changes:\n\n{CODE}",
    f"Rewrite this function with the name combine_ranges instead of merge_intervals. Keep everything "
    f"else the same:\n\n{CODE}",
    f"Copy this paragraph word for word:\n\n{STORY}",
    f"Summarize this text in two sentences, quoting its exact words where you can:\n\n{STORY}",
    f"Extract the invoice number, customer, date, items and total from this document as JSON:\n\n{INVOICE}",
    f"Rewrite this paragraph, replacing 'lighthouse keeper' with 'old sailor' and keeping the rest:\n\n{STORY}",
]
OPEN = [
    "Write a short story about a dragon who is afraid of the dark.",
    "What are three good reasons to learn a second language?",
    "Explain how a bicycle stays upright.",
    "Give me some ideas for a rainy afternoon with children.",
    "Why do cats purr?",
    "Describe your ideal weekend in a few sentences.",
]
WORKLOADS = {"grounded": GROUNDED, "open": OPEN}


async def one_request(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, int]:
    """Stream one chat completion; its usage (completion tokens, drafted, accepted)."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        usage = None
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                usage = event.get("usage") or usage
    details = usage["completion_tokens_details"]
    accepted, rejected = details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]
    return {"completion": usage["completion_tokens"], "drafted": accepted + rejected, "accepted": accepted}


async def answer(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> str:
    """The greedy answer to `prompt` asked once before the runs (request number -1)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "num_speculative_tokens": 0,
            "messages": [{"role": "user", "content": f"Request -1. {prompt}"}]}
    response = await client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


async def one_run(client: httpx.AsyncClient, model: str, prompts: list[tuple[str, str | None]], concurrency: int,
                  num: int, max_tokens: int, spec: bool, numbers: itertools.count, first: int = 0) -> dict[str, float]:
    """`num` requests over `concurrency` streams, of (prompt, predicted output or None): prompts
    first, first + 1, ... (cycled), each under a request number of its own; tok/s over the wall time,
    summed usage."""
    todo = iter(range(num))
    totals = {"completion": 0, "drafted": 0, "accepted": 0}

    async def worker() -> None:
        for i in todo:
            n = next(numbers)
            prompt, prediction = prompts[(first + i) % len(prompts)]
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": f"Request {n}. {prompt}"}]}
            if prediction is not None:
                body["prediction"] = {"type": "content", "content": prediction}
            if not spec:
                body["num_speculative_tokens"] = 0
            for key, value in (await one_request(client, body)).items():
                totals[key] += value

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {**totals, "tok_s": totals["completion"] / (time.perf_counter() - start)}


async def measure(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    numbers = itertools.count()
    rows = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=80)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for spec in (True, False):  # warm-up
            await one_run(client, model, [(p, None) for p in OPEN], 2, 2, 16, spec, numbers)
        workloads = {name: [(p, None) for p in prompts] for name, prompts in WORKLOADS.items()}
        if "predicted" in args.workloads:
            workloads["predicted"] = [(p, await answer(client, model, p, args.max_tokens)) for p in OPEN]
        for workload in args.workloads:
            prompts = workloads[workload]
            for c in args.concurrency:
                runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
                num = args.requests_per_stream * c
                for r in range(args.rounds):  # both modes of a round answer the same prompts
                    for spec in ((True, False) if r % 2 == 0 else (False, True)):
                        runs[spec].append(await one_run(client, model, prompts, c, num, args.max_tokens, spec, numbers,
                                                        first=r * num))
                on, off = runs[True], runs[False]
                drafted, accepted = sum(x["drafted"] for x in on), sum(x["accepted"] for x in on)
                completion = sum(x["completion"] for x in on)
                row = {"workload": workload, "concurrency": c,
                       "off_tok_s": round(statistics.median(x["tok_s"] for x in off), 1),
                       "on_tok_s": round(statistics.median(x["tok_s"] for x in on), 1),
                       "acceptance": round(accepted / drafted, 3) if drafted else None,
                       "tokens_per_step": round(completion / (completion - accepted), 2),
                       "drafted": drafted, "accepted": accepted}
                row["ratio"] = round(row["on_tok_s"] / row["off_tok_s"], 3)
                rows.append(row)
                print(table([row], list(row)), flush=True)
    return rows


def step_rows(counts: list[int], llm: Any = None) -> list[dict[str, Any]]:
    """Median engine step time at M decode rows (M greedy streams, no drafts), in process: the cost
    model behind --spec-step-base-rows (a step costs about base + M rows' worth). `llm`: an LLM
    without prefix caching (default: a new one)."""
    from forge_service import LLM, SamplingParams

    llm = llm or LLM(enable_prefix_caching=False)
    engine = llm.engine
    prompt = llm.tokenizer.encode("Tell me a long story about the sea and the ships that sail on it.")
    rows = []
    for m in counts:
        for i in range(m):
            engine.add_request(f"m{m}-{i}", [i + 5, *prompt],
                               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                              num_speculative_tokens=0))
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        rows.append({"rows": m, "step_ms": round(statistics.median(times[5:-2]) * 1000, 2)})
    one = [r["step_ms"] for r in rows if r["rows"] <= 24]
    per_row = (one[-1] - one[0]) / (min(24, max(counts)) - counts[0])
    print(table(rows, ["rows", "step_ms"]))
    print(f"per row {per_row:.2f} ms; base {(one[0] - per_row * counts[0]) / per_row:.2f} rows")
    return rows


def draft_steps(counts: list[int], rounds: int = 40, steps: int = 8) -> list[dict[str, Any]]:
    """In process, M greedy streams on long text (ignore_eos; a small model's long answers repeat),
    in two engines, one drafting and one not, their steps alternated `steps` at a time for `rounds`
    rounds: output tok/s of each over its own steps, and the drafting engine's acceptance and median
    step. Where drafted rows pay for themselves, at each M, without a server's noise between the two."""
    from forge_service import LLM, SamplingParams

    engines = {mode: LLM(speculative=mode, enable_prefix_caching=False).engine for mode in ("off", "ngram")}
    prompt = engines["off"].tokenizer.encode_chat([{"role": "user", "content": OPEN[0]}])
    rows = []
    for m in counts:
        tokens = dict.fromkeys(engines, 0)
        times: dict[str, list[float]] = {mode: [] for mode in engines}
        drafted = accepted = 0
        for mode, engine in engines.items():
            for i in range(m):
                engine.add_request(f"d{m}-{i}", [i + 5, *prompt], SamplingParams(  # no stream ends early:
                    temperature=0, max_tokens=rounds * steps * 9 + 100, ignore_eos=True))  # <= 9 tokens a step
            for _ in range(5):  # prefills
                engine.step()
        for _ in range(rounds):
            for mode, engine in engines.items():
                for _ in range(steps):
                    start = time.perf_counter()
                    outputs = engine.step()
                    times[mode].append(time.perf_counter() - start)
                    tokens[mode] += sum(len(o.outputs[0].token_ids) for o in outputs)
        for mode, engine in engines.items():
            for request in list(engine.scheduler.running):
                if mode == "ngram":
                    drafted += request.num_drafted_tokens
                    accepted += request.num_accepted_tokens
                engine.abort_request(request.parent_id)
        off, on = (tokens[mode] / sum(times[mode]) for mode in ("off", "ngram"))
        rows.append({"streams": m, "off_tok_s": round(off, 1), "on_tok_s": round(on, 1), "ratio": round(on / off, 3),
                     "acceptance": round(accepted / drafted, 3) if drafted else None,
                     "off_step_ms": round(statistics.median(times["off"]) * 1000, 2),
                     "on_step_ms": round(statistics.median(times["ngram"]) * 1000, 2)})
    print(table(rows, list(rows[0])))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--serve-args", default="", help="more `forge serve` flags, e.g. '--spec-max-draft 6'")
    parser.add_argument("--workloads", type=lambda s: s.split(","), default=["grounded", "open", "predicted"])
    parser.add_argument("--step-rows", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="instead: time engine steps at these row counts, e.g. 1,2,4,8,16,24,32")
    parser.add_argument("--draft-steps", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="instead: drafting on and off in process at these stream counts, e.g. 4,12")
    args = parser.parse_args(argv)
    unknown = set(args.workloads) - {*WORKLOADS, "predicted"}
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; known: {', '.join(WORKLOADS)}, predicted")
    if args.step_rows:
        step_rows(args.step_rows)
        return 0
    if args.draft_steps:
        draft_steps(args.draft_steps)
        return 0

    from bench.observability_overhead import forge_serve

    args.serve_args = f"--speculative ngram {args.serve_args}"
    with forge_serve("metrics", args, free_port()) as url:
        rows = asyncio.run(measure(url, args))
    columns = ["workload", "concurrency", "off_tok_s", "on_tok_s", "ratio", "acceptance", "tokens_per_step"]
    print(table(rows, columns))
    path = write_json("speculative.json", {"machine": machine(), "args": vars(args), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
