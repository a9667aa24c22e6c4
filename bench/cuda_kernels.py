"""Kernel micro-benchmarks of the CUDA backend at Llama-3.1-8B's shapes: achieved GB/s (memory-bound
kernels) or TFLOP/s (attention prefill, GEMMs) against the device's ceilings measured in the same
run (device-to-device copy bandwidth, bf16 8192^3 matmul rate). Medians of CUDA-event timings;
inputs of the memory-bound kernels are larger than L2 where the shape allows.
Usage: python bench/cuda_kernels.py [--decode-batches 1 64 256] [--context 1024 8192]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--prefill-tokens", type=int, default=4096)
    p.add_argument("--gemm-rows", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    return p.parse_args(argv)


def row(name: str, shape: str, ms: float, nbytes: float = 0.0, flops: float = 0.0, ceil=None) -> dict:
    bw, rate = ceil
    out = {"kernel": name, "shape": shape, "ms": ms}
    if nbytes:
        out["GB/s"] = nbytes / ms / 1e6
        out["% copy bw"] = 100 * nbytes / (ms / 1e3) / bw
    if flops:
        out["TFLOP/s"] = flops / ms / 1e9
        out["% matmul"] = 100 * flops / (ms / 1e3) / rate
    return out


def elementwise_rows(backend, t: int, ceil) -> list[dict]:
    import torch

    from bench.cuda_common import LLAMA_31_8B as a, time_ms

    d, f, bf = a.hidden_size, a.intermediate_size, torch.bfloat16
    x = torch.randn(t, d, device="cuda")  # the fp32 residual stream
    delta = torch.randn(t, d, dtype=bf, device="cuda")
    w = torch.ones(d, dtype=bf, device="cuda")
    gate_up = torch.randn(t, 2 * f, dtype=bf, device="cuda")
    qkv = torch.randn(t, (a.num_heads + 2 * a.num_kv_heads) * a.head_dim, dtype=bf, device="cuda")
    qk = qkv[:, :(a.num_heads + a.num_kv_heads) * a.head_dim].view(t, a.num_heads + a.num_kv_heads, a.head_dim)
    from forge_service.layers.rotary import RotaryEmbedding

    tables = RotaryEmbedding(a.head_dim, 8192, a.rope_theta, a.rope_scaling)
    rope = backend.rotary_tables(tables.cos, tables.sin, torch.arange(t, device="cuda") % 8192, bf)
    shape = f"T={t}"
    return [
        row("rms_norm fp32->bf16", shape, time_ms(lambda: backend.rms_norm(x, w, 1e-5)), t * d * 6, ceil=ceil),
        row("add_rms_norm", shape, time_ms(lambda: backend.add_rms_norm(x, delta, w, 1e-5)), t * d * 12, ceil=ceil),
        row("silu_and_mul", shape, time_ms(lambda: backend.silu_and_mul(gate_up)), t * f * 6, ceil=ceil),
        row("rotary (q, k in place)", shape, time_ms(lambda: backend.rotary(qk, a.num_heads, rope)),
            t * (a.num_heads + a.num_kv_heads) * a.head_dim * 4, ceil=ceil),
    ]


def decode_rows(backend, batches: list[int], contexts: list[int], ceil) -> list[dict]:
    import torch

    from bench.cuda_common import LLAMA_31_8B as a, time_ms
    from forge_service.backends.cuda import decode_attention

    rows, bs = [], 16
    for b in batches:
        for ctx in contexts:
            blocks = b * ctx // bs
            cache = torch.randn(blocks * bs, a.num_kv_heads, a.head_dim, dtype=torch.bfloat16, device="cuda")
            tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(b, ctx // bs)
            lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(b, a.num_heads, a.head_dim, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(b, a.num_heads * a.head_dim, dtype=torch.bfloat16, device="cuda")
            parts = decode_attention.split_parts(ctx)[1]
            ms = time_ms(lambda: decode_attention.paged_decode(backend.kernels, out, q, cache, cache, tables, lens, bs,
                                                               ctx, a.head_dim ** -0.5))
            kv_bytes = 2 * b * ctx * a.num_kv_heads * a.head_dim * 2
            rows.append(row("decode attention", f"B={b} ctx={ctx} parts={parts}", ms, kv_bytes, ceil=ceil))
    return rows


def prefill_rows(backend, tokens: int, ceil) -> list[dict]:
    import torch

    from bench.cuda_common import LLAMA_31_8B as a, time_ms
    from forge_service.backends.cuda import prefill_attention
    from forge_service.backends.cuda.prefill_attention import PrefillBatch, build_tiles

    bs, chunk = 16, 1024
    n = tokens // chunk
    group = a.num_heads // a.num_kv_heads
    cache = torch.randn(tokens, a.num_kv_heads, a.head_dim, dtype=torch.bfloat16, device="cuda")
    ints = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    batch = PrefillBatch(q_start=ints([i * chunk for i in range(n)]), q_len=ints([chunk] * n),
                         ctx_len=ints([chunk] * n),
                         block_tables=torch.arange(tokens // bs, dtype=torch.int32, device="cuda").view(n, -1),
                         tiles=ints(build_tiles([chunk] * n, group)).view(-1, 2))
    q = torch.randn(tokens, a.num_heads, a.head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(tokens, a.num_heads * a.head_dim, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: prefill_attention.paged_prefill(backend.kernels, out, q, cache, cache, batch, bs, 0.088))
    flops = 4 * n * (chunk * (chunk + 1) / 2) * a.num_heads * a.head_dim  # causal: QK^T and PV
    sdpa_q = q.view(n, chunk, a.num_heads, a.head_dim).transpose(1, 2)
    kv = cache.view(n, chunk, a.num_kv_heads, a.head_dim).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_ms = time_ms(lambda: sdpa(sdpa_q, kv, kv, is_causal=True, enable_gqa=True))
    return [row("prefill attention (paged)", f"{n} x {chunk} tokens", ms, flops=flops, ceil=ceil),
            row("torch SDPA (not paged)", f"{n} x {chunk} tokens", sdpa_ms, flops=flops, ceil=ceil)]


def sampling_rows(backend, batches: list[int], ceil) -> list[dict]:
    import torch

    from bench.cuda_common import LLAMA_31_8B as a, time_ms
    from forge_service.backends.cuda import sampling

    rows = []
    for b in batches:
        logits = torch.randn(b, a.vocab_size, device="cuda")
        cuda = {"device": "cuda"}
        for label, top_p, top_k in (("greedy", 1.0, 0), ("top_p=0.9 top_k=50", 0.9, 50)):
            temp = torch.full((b,), 0.0 if label == "greedy" else 0.8, **cuda)
            args = (temp, torch.full((b,), top_k, dtype=torch.int32, **cuda), torch.full((b,), top_p, **cuda),
                    torch.zeros(b, **cuda), torch.arange(b, **cuda), torch.zeros(b, dtype=torch.int64, **cuda))
            ms = time_ms(lambda: sampling.sample(backend.kernels, logits, *args))
            rows.append(row(f"sampling {label}", f"B={b}", ms, b * a.vocab_size * 4, ceil=ceil))
    return rows


def gemm_rows(backend, ms_rows: list[int], ceil) -> list[dict]:
    import torch

    from bench.cuda_common import LLAMA_31_8B as a

    shapes = {"qkv": ((a.num_heads + 2 * a.num_kv_heads) * a.head_dim, a.hidden_size),
              "o_proj": (a.hidden_size, a.num_heads * a.head_dim), "gate_up": (2 * a.intermediate_size, a.hidden_size),
              "down": (a.hidden_size, a.intermediate_size), "lm_head": (a.vocab_size, a.hidden_size)}
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        for m in ms_rows:
            backend.gemm(torch.randn(m, k, dtype=torch.bfloat16, device="cuda"), w)  # tunes this shape
            choice = backend.gemm.table[(m, n, k, str(torch.bfloat16))]
            best = min(choice.cublas_ms, choice.cutlass_ms or float("inf"))
            r = row(f"gemm {name} ({choice.winner})", f"M={m} N={n} K={k}", best, (m * k + n * k + m * n) * 2,
                    2 * m * n * k, ceil=ceil)
            r["cublas_ms"], r["cutlass_ms"], r["note"] = choice.cublas_ms, choice.cutlass_ms, choice.note
            rows.append(r)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from bench.common import machine, table, write_json
    from bench.cuda_common import copy_bandwidth, device_name, matmul_flops
    from forge_service.backends.cuda.backend import CudaBackend

    backend = CudaBackend()
    ceil = (copy_bandwidth(), matmul_flops())
    print(f"device: {device_name()}; copy {ceil[0] / 1e12:.2f} TB/s (read + write), bf16 matmul "
          f"{ceil[1] / 1e12:.0f} TFLOP/s")
    with torch.inference_mode():
        rows = (elementwise_rows(backend, 8192, ceil) + decode_rows(backend, args.decode_batches, args.context, ceil)
                + prefill_rows(backend, args.prefill_tokens, ceil) + sampling_rows(backend, args.decode_batches, ceil)
                + gemm_rows(backend, args.gemm_rows, ceil))
    print(table(rows, ["kernel", "shape", "ms", "GB/s", "% copy bw", "TFLOP/s", "% matmul"]))
    path = write_json("cuda_kernels.json", {"machine": machine(), "device": device_name(),
                                            "copy_bytes_per_s": ceil[0], "matmul_flop_per_s": ceil[1], "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
