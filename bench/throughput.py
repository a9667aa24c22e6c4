"""Offline throughput: 64 chat prompts x 128 output tokens (ignore_eos) on the default model.

Runs Forge in bf16 and fp32 and Hugging Face transformers' batched `generate` on the same prompts,
each in its own process (so peak RSS is per configuration), and prints output tok/s, the ratio
to transformers, and peak RSS.  Usage: python bench/throughput.py [--repeats 3] [--skip-hf]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import chat_prompts, machine, median, table, write_json  # noqa: E402


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_forge(args: argparse.Namespace) -> dict:
    from forge_service import LLM, SamplingParams

    llm = LLM(dtype=args.dtype, max_num_seqs=args.num_prompts, max_num_batched_tokens=args.batched_tokens)
    convs = chat_prompts(args.num_prompts)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm.chat(convs[:4], SamplingParams(max_tokens=4))  # warm-up
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        outs = llm.chat(convs, params)
        times.append(time.perf_counter() - t)
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
    tokens = args.num_prompts * args.output_len
    if args.profile:
        print(profile_table(llm, convs, args), file=sys.stderr)
    return {"system": f"forge {args.dtype}", "seconds": median(times), "tok_s": tokens / median(times),
            "runs": times, "peak_rss_mib": peak_rss_mib()}


def profile_table(llm, convs, args: argparse.Namespace) -> str:
    """torch profiler table of the same workload with 16 output tokens: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    from forge_service import SamplingParams

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.chat(convs, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))
    return f"--- forge {args.dtype}: profile of {len(convs)} prompts x 16 tokens ---\n" + \
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def run_hf(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forge_service.loaders import default_model_path

    path = Path(default_model_path())
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chat_prompts(args.num_prompts)]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    gen = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
               pad_token_id=tok.pad_token_id)
    times = []
    with torch.inference_mode():
        model.generate(**tok(texts[:4], return_tensors="pt", padding=True), max_new_tokens=4)  # warm-up
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = model.generate(**batch, **gen)
            times.append(time.perf_counter() - t)
    new_tokens = (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    return {"system": f"transformers {args.dtype}", "seconds": median(times), "tok_s": new_tokens / median(times),
            "runs": times, "peak_rss_mib": peak_rss_mib()}


WORKERS = {"forge": run_forge, "hf": run_hf}


def child(worker: str, dtype: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", worker, "--dtype", dtype, "--repeats", str(args.repeats),
           "--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len),
           "--batched-tokens", str(args.batched_tokens)]
    if args.profile:
        cmd.append("--profile")
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batched-tokens", type=int, default=512)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--profile", action="store_true", help="print a torch profiler table per Forge dtype")
    p.add_argument("--worker", choices=list(WORKERS))
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args)))
        return
    runs = [("forge", "bfloat16"), ("forge", "float32")] + ([] if args.skip_hf else [("hf", "float32"), ("hf", "bfloat16")])
    rows = [child(w, d, args) for w, d in runs]
    baseline = next((r for r in rows if r["system"] == "transformers float32"), None)
    for r in rows:
        r["vs_hf_fp32"] = r["tok_s"] / baseline["tok_s"] if baseline else None
    print(f"machine: {machine()}")
    print(f"workload: {args.num_prompts} chat prompts x {args.output_len} output tokens, ignore_eos, "
          f"median of {args.repeats}")
    print(table(rows, ["system", "seconds", "tok_s", "vs_hf_fp32", "peak_rss_mib"]))
    path = write_json("throughput.json", {"machine": machine(), "args": vars(args), "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
