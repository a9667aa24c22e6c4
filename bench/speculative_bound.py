"""How much n-gram drafting can gain at one stream on this machine, and how near the adaptive
draft length comes: a replay, in process, of bench/speculative.py's c=1 cells.

Each prompt of a workload is answered greedily with drafting off; greedy identity makes these
the tokens drafting yields too. Each answer is then replayed step by step through the n-gram
index, with two ways of choosing how many tokens to draft:

    adaptive  the scheduler's own (AdaptiveDraftLength at one stream, --spec-step-base-rows)
    oracle    exactly the tokens that will be accepted, up to --spec-max-draft: no policy
              choosing draft lengths can do better with this proposer

A step costs the engine's step time at its number of rows and a request its time to the first
token, both measured here first, so each ratio predicts that cell of bench/speculative.py without
the servers: 'with prefill' counts the time to the first token, as tokens/s through the gateway do.

    python bench/speculative_bound.py --requests 12
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, table, write_json  # noqa: E402
from bench.speculative import WORKLOADS, step_rows  # noqa: E402
from forge_service import LLM, SamplingParams  # noqa: E402
from forge_service.config import SpeculativeConfig  # noqa: E402
from forge_service.speculative.ngram import AdaptiveDraftLength, NgramIndex  # noqa: E402
from forge_service.speculative.step_cost import PRIOR_BASE_ROWS, base_from_line  # noqa: E402


def step_cost(measured: dict[int, float]) -> Callable[[int], float]:
    """Step seconds at any row count, linear between the measured ones."""
    counts = sorted(measured)

    def cost(rows: int) -> float:
        for low, high in zip(counts, counts[1:]):
            if rows <= high:
                return measured[low] + (measured[high] - measured[low]) * (rows - low) / (high - low)
        return measured[counts[-1]]

    return cost


def replay(prompt: list[int], answer: list[int], config: SpeculativeConfig, oracle: bool,
           cost: Callable[[int], float], base_rows: float) -> tuple[float, int]:
    """Seconds of decode steps for `answer` after its first token with drafting, and the steps."""
    index = NgramIndex(config.spec_ngram_min, config.spec_ngram_max, prompt + answer[:1])
    length = AdaptiveDraftLength(config.spec_max_draft)
    worth = 1.0 / (base_rows + 1.0)  # the scheduler's at one decode row
    done, seconds, steps = 1, 0.0, 0
    while done < len(answer):
        room = min(config.spec_max_draft, len(answer) - done - 1)
        want = room if oracle or room <= 0 else min(room, length.draft_len(worth))  # the proposer's order
        draft = index.propose(want) if want > 0 else []
        accepted = 0
        while accepted < len(draft) and draft[accepted] == answer[done + accepted]:
            accepted += 1
        if oracle:
            draft = draft[:accepted]  # what an oracle would have verified
        length.update(len(draft), accepted)
        index.extend(answer[done:done + accepted + 1])
        done += accepted + 1
        seconds += cost(1 + len(draft))
        steps += 1
    return seconds, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=12, help="per workload (its prompts in turn)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--spec-max-draft", type=int, default=SpeculativeConfig.spec_max_draft)
    parser.add_argument("--spec-step-base-rows", type=float, default=SpeculativeConfig.spec_step_base_rows,
                        help="0 (the default): fitted to the step times measured first, as the scheduler does")
    args = parser.parse_args(argv)
    config = SpeculativeConfig(spec_max_draft=args.spec_max_draft, spec_step_base_rows=args.spec_step_base_rows)

    llm = LLM(enable_prefix_caching=False)
    measured = step_rows(sorted({1, 2, 3, 5, 9, 1 + args.spec_max_draft}), llm)
    cost = step_cost({r["rows"]: r["step_ms"] / 1000 for r in measured})
    # 0: as the scheduler would measure it, a line through the step times
    base_rows = args.spec_step_base_rows or base_from_line([(r["rows"], r["step_ms"], 1) for r in measured]) \
        or PRIOR_BASE_ROWS
    print(f"the adaptive length drafts with a base of {base_rows:.2f} rows")
    off = SamplingParams(temperature=0, max_tokens=args.max_tokens, num_speculative_tokens=0)
    first = SamplingParams(temperature=0, max_tokens=1, num_speculative_tokens=0)
    rows = []
    for workload, prompts in WORKLOADS.items():
        totals = {"answer": 0, "ttft": 0.0, "plain": 0.0, "adaptive": 0.0, "oracle": 0.0, "adaptive_steps": 0,
                  "oracle_steps": 0}
        for n in range(args.requests):
            message = {"role": "user", "content": f"Request {n}. {prompts[n % len(prompts)]}"}
            prompt = llm.tokenizer.encode_chat([message])
            answer = llm.generate([prompt], off)[0].outputs[0].token_ids
            ttft = []
            for _ in range(3):
                start = time.perf_counter()
                llm.generate([prompt], first)
                ttft.append(time.perf_counter() - start)
            totals["answer"] += len(answer)
            totals["ttft"] += statistics.median(ttft)
            totals["plain"] += (len(answer) - 1) * cost(1)
            for mode in ("adaptive", "oracle"):
                seconds, steps = replay(prompt, answer, config, mode == "oracle", cost, base_rows)
                totals[mode] += seconds
                totals[f"{mode}_steps"] += steps
        plain = totals["plain"]
        for mode in ("adaptive", "oracle"):
            rows.append({"workload": workload, "drafting": mode,
                         "tokens_per_step": round((totals["answer"] - args.requests) / totals[f"{mode}_steps"], 2),
                         "decode_ratio": round(plain / totals[mode], 3),
                         "with_prefill": round((totals["ttft"] + plain) / (totals["ttft"] + totals[mode]), 3),
                         "prefill_share": round(totals["ttft"] / (totals["ttft"] + plain), 3)})
    columns = ["workload", "drafting", "tokens_per_step", "decode_ratio", "with_prefill", "prefill_share"]
    print(table(rows, columns))
    path = write_json("speculative_bound.json", {"machine": machine(), "args": vars(args), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
