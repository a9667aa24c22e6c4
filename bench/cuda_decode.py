"""Single-stream decode on the CUDA backend: ms per token against the HBM roofline.

The model is random-weight with Llama-3.1-8B's exact shapes, built in GPU memory. The roofline is
the bytes of weights one decode step reads over the device-to-device copy bandwidth measured in
the same run. Each decode step is one engine.step() (a CUDA graph replay plus sampling and the
host work around it). Usage: python bench/cuda_decode.py [--prompt-len 128] [--tokens 256] [--profile]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256, help="decode steps timed")
    p.add_argument("--repeats", type=int, default=3, help="generations; the median step time is reported")
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    p.add_argument("--profile", action="store_true", help="print the CUDA kernels of 16 decode steps")
    return p.parse_args(argv)


def decode_step_ms(engine, prompt: list[int], tokens: int) -> list[float]:
    """Wall time of each decode step of one greedy request (the prefill step excluded)."""
    import torch

    from forge_service import SamplingParams

    engine.add_request(f"r{random.random()}", prompt, SamplingParams(temperature=0.0, max_tokens=tokens + 1,
                                                                     ignore_eos=True))
    engine.step()  # prefill and the first token
    times = []
    while engine.has_unfinished_requests():
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()  # the token id crosses to the host: the step is complete when it returns
        times.append((time.perf_counter() - start) * 1e3)
    return times


def profile_table(engine, prompt: list[int]) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode_step_ms(engine, prompt, 16)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from bench.common import machine, median, table, write_json
    from bench.cuda_common import LLAMA_31_8B, build_engine, copy_bandwidth, decode_weight_bytes, device_name

    bandwidth = copy_bandwidth()
    started = time.perf_counter()
    engine = build_engine(max_num_seqs=1, max_num_batched_tokens=max(512, args.prompt_len),
                          kv_cache_bytes=int(args.kv_cache_gib * 2**30),
                          max_model_len=args.prompt_len + args.tokens + 8)
    load_s = time.perf_counter() - started
    prompt = [random.Random(0).randrange(LLAMA_31_8B.vocab_size) for _ in range(args.prompt_len)]
    decode_step_ms(engine, prompt, 8)  # warm-up
    runs = [median(decode_step_ms(engine, prompt, args.tokens)) for _ in range(args.repeats)]
    ms = median(runs)
    weight_bytes = decode_weight_bytes(LLAMA_31_8B, torch.bfloat16)
    roofline_ms = weight_bytes / bandwidth * 1e3
    row = {"device": device_name(), "ms_per_token": ms, "tok_s": 1e3 / ms, "roofline_ms": roofline_ms,
           "fraction_of_roofline": roofline_ms / ms, "weight_gb": weight_bytes / 1e9,
           "copy_tb_s": bandwidth / 1e12}
    print(table([row], list(row)))
    print(f"engine start-up (weights, graphs, GEMM tuning): {load_s:.1f} s")
    if args.profile:
        print(profile_table(engine, prompt))
    path = write_json("cuda_decode.json", {"machine": machine(), "args": vars(args), "result": row, "runs_ms": runs,
                                           "gemm_table": engine.runner.backend.gemm.rows(), "startup_s": load_s})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
