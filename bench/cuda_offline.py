"""Offline throughput on the CUDA backend: 1,000 requests, input 128-1024 and output 128-512 tokens
(uniform, seeded), on a random-weight model with Llama-3.1-8B's exact shapes; and Hugging Face
transformers' `generate` on the same weights and GPU, in the same run, for the ratio.

transformers pads static batches and is slow, so it runs a subset (--hf-requests) of the same
requests, each batch generating to its longest output; only requested tokens are counted.
Usage: python bench/cuda_offline.py [--requests 1000] [--hf-requests 64] [--skip-hf]
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--input-len", type=int, nargs=2, default=[128, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[128, 512], metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-gib", type=float, default=40.0)
    p.add_argument("--hf-requests", type=int, default=64)
    p.add_argument("--hf-batch", type=int, default=32)
    p.add_argument("--skip-hf", action="store_true")
    return p.parse_args(argv)


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    return [([rng.randrange(vocab) for _ in range(rng.randint(*args.input_len))], rng.randint(*args.output_len))
            for _ in range(args.requests)]


def run_forge(args: argparse.Namespace, requests: list[tuple[list[int], int]]) -> dict:
    from forge_service import SamplingParams
    from bench.cuda_common import build_engine

    started = time.perf_counter()
    engine = build_engine(args.max_num_seqs, args.max_num_batched_tokens, int(args.kv_cache_gib * 2**30),
                          max_model_len=args.input_len[1] + args.output_len[1] + 16)
    startup = time.perf_counter() - started
    for i, (prompt, out_len) in enumerate(requests[:8]):  # warm-up: prefill shapes, sampling
        engine.add_request(f"w{i}", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    started = time.perf_counter()
    for i, (prompt, out_len) in enumerate(requests):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    generated = steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated += sum(len(c.token_ids) for c in out.outputs)
        steps += 1
    seconds = time.perf_counter() - started
    result = {"system": "forge cuda bf16", "requests": len(requests), "output_tokens": generated,
              "seconds": seconds, "output_tok_s": generated / seconds, "steps": steps,
              "preemptions": engine.num_preemptions, "startup_s": startup}
    del engine
    gc.collect()
    return result


def hf_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.cuda_common import LLAMA_31_8B as a, random_weights

    config = LlamaConfig(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                         num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads,
                         num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
                         rope_theta=a.rope_theta, rope_scaling=a.rope_scaling,
                         max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(random_weights(a, torch.bfloat16), assign=True, strict=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config, device="cuda")  # its buffers were on meta
    return model.to(torch.bfloat16).eval()


def run_hf(args: argparse.Namespace, requests: list[tuple[list[int], int]]) -> dict:
    import torch

    model = hf_model()
    subset = requests[:args.hf_requests]
    counted = 0
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(subset), args.hf_batch):
            batch = subset[b:b + args.hf_batch]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device="cuda")  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device="cuda")
            new = max(n for _, n in batch)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
            counted += sum(n for _, n in batch)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {"system": "transformers generate bf16", "requests": len(subset), "output_tokens": counted,
            "seconds": seconds, "output_tok_s": counted / seconds}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.common import machine, table, write_json
    from bench.cuda_common import LLAMA_31_8B, device_name

    requests = workload(args, LLAMA_31_8B.vocab_size)
    rows = [run_forge(args, requests)]
    if not args.skip_hf:
        import torch

        torch.cuda.empty_cache()
        rows.append(run_hf(args, requests))
        rows[0]["vs_transformers"] = rows[0]["output_tok_s"] / rows[1]["output_tok_s"]
    print(f"device: {device_name()}")
    print(table(rows, ["system", "requests", "output_tokens", "seconds", "output_tok_s", "vs_transformers"]))
    path = write_json("cuda_offline.json", {"machine": machine(), "device": device_name(), "args": vars(args),
                                            "results": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
