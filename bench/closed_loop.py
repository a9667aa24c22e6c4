"""bench/serve.py's closed loop without the servers: `concurrency` streams send requests back to back
through the engine thread (AsyncEngine, the server's default engine configuration) in this process,
with the same prompts, greedy and ignoring EOS. No gRPC, HTTP, SSE or client work shares the cores.

Against bench/serve.py at the same concurrency, the gap is what the servers and the client cost on
the same machine; against bench/decode_step.py at as many rows, what requests turning over cost:
steps that prefill the next requests' prompts, and decode steps with fewer rows. Reported per
concurrency: output tok/s; steps, their prefill tokens and decode rows; the share of the time in
steps that prefill; decode-only steps' mean rows and median time; the time to the first token's
median; tokens drafted and accepted.

    python bench/closed_loop.py --concurrency 16,32 --max-tokens 128 --prompt-words 16
    python bench/closed_loop.py --prompt-words 880 --concurrency 8 --num-requests 16 --max-tokens 64
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, table, write_report  # noqa: E402
from bench.serve import request_bodies  # noqa: E402
from forge_service.config import EngineConfig, ModelConfig, SpeculativeConfig  # noqa: E402
from forge_service.engine.async_engine import AsyncEngine  # noqa: E402
from forge_service.engine.engine import LLMEngine  # noqa: E402
from forge_service.engine.request import SamplingParams  # noqa: E402


class StepLog:
    """Each engine step's time, prefill tokens and decode rows, recorded around the engine's own calls."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[tuple[float, int, int]] = []  # (seconds, prefill tokens, decode rows)
        self._scheduled = (0, 0)
        schedule, step = engine.scheduler.schedule, engine.step

        def logged_schedule() -> Any:
            out = schedule()
            # a decode: the request's last token (after its prompt) and the draft after it, a row each
            decodes = [c for c in out.chunks if c.start == c.request.num_tokens - 1 >= c.request.num_prompt_tokens]
            rows = sum(c.num_tokens for c in decodes)
            self._scheduled = (sum(c.num_tokens for c in out.chunks) - rows, rows)
            return out

        def logged_step(*args: Any, **kwargs: Any) -> Any:
            self._scheduled = (0, 0)
            start = time.perf_counter()
            result = step(*args, **kwargs)
            self.steps.append((time.perf_counter() - start, *self._scheduled))
            return result

        engine.scheduler.schedule = logged_schedule
        engine.step = logged_step


async def one_run(engine: LLMEngine, log: StepLog, prompts: list[list[int]], concurrency: int,
                  max_tokens: int) -> dict[str, Any]:
    async_engine = AsyncEngine(engine)
    async_engine.start()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    left = iter(prompts)
    tokens = drafted = accepted = 0
    ttft: list[float] = []

    async def stream() -> None:
        nonlocal tokens, drafted, accepted
        for prompt in left:
            sent, first = time.perf_counter(), True
            async for output in async_engine.generate(uuid.uuid4().hex, prompt, params):
                if first:
                    ttft.append(time.perf_counter() - sent)
                    first = False
                tokens += sum(len(o.token_ids) for o in output.outputs)
                if output.finished:
                    drafted += sum(o.num_drafted_tokens for o in output.outputs)
                    accepted += sum(o.num_accepted_tokens for o in output.outputs)

    log.steps.clear()
    start = time.perf_counter()
    try:
        await asyncio.gather(*(stream() for _ in range(concurrency)))
    finally:
        await async_engine.shutdown()
    seconds = time.perf_counter() - start
    with_prefill = [s for s in log.steps if s[1]]
    decode_only = [s for s in log.steps if s[2] and not s[1]]
    return {"concurrency": concurrency, "requests": len(prompts), "output_tokens": tokens,
            "output_tok_s": round(tokens / seconds, 1), "steps": len(log.steps),
            "prefill_tokens": sum(s[1] for s in log.steps), "decode_rows": sum(s[2] for s in log.steps),
            "prefill_step_share": round(sum(s[0] for s in with_prefill) / seconds, 3),
            "decode_rows_mean": round(statistics.mean(s[2] for s in decode_only), 1) if decode_only else None,
            "decode_step_ms_p50": round(statistics.median(s[0] for s in decode_only) * 1000, 2) if decode_only else None,
            "ttft_ms_p50": round(statistics.median(ttft) * 1000, 1), "drafted": drafted, "accepted": accepted}


def serve_prompts(engine: LLMEngine, args: argparse.Namespace) -> Callable[[int], list[list[int]]]:
    """The next n prompts as bench/serve.py sends them (its request bodies, numbered on from one call
    to the next, so that no prompt is another's prefix-cache hit), through the model's chat template."""
    _, body = request_bodies(SimpleNamespace(max_tokens=args.max_tokens, prompt_words=args.prompt_words,
                                             same_prompt=False, endpoint="chat"), "model")
    return lambda n: [engine.tokenizer.encode_chat(body()["messages"]) for _ in range(n)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32])
    parser.add_argument("--num-requests", type=int, default=0, help="per run (default: 4 x concurrency, >= 8)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=16)
    parser.add_argument("--speculative", choices=["ngram", "off"], default=SpeculativeConfig.speculative)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=args.model),
                                    speculative=SpeculativeConfig(speculative=args.speculative)))
    log, prompts = StepLog(engine), serve_prompts(engine, args)
    await one_run(engine, log, prompts(2), 1, 4)  # warm-up
    rows = []
    for concurrency in args.concurrency:
        n = args.num_requests or max(4 * concurrency, 8)
        rows.append(await one_run(engine, log, prompts(n), concurrency, args.max_tokens))
    return {"benchmark": "closed_loop", "model": engine.model_name, "max_tokens": args.max_tokens,
            "prompt_words": args.prompt_words, "speculative": args.speculative, "machine": machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": rows}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(bench(args))
    print(f"closed loop in process: {report['model']}, max_tokens={args.max_tokens}, "
          f"speculative={args.speculative}; {report['machine']['cpu']}, {report['machine']['cores']} cores")
    print(table(report["results"], list(report["results"][0])))
    write_report(args.out, "closed_loop", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
