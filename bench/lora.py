"""What serving a LoRA adapter costs: offline decode throughput on the default model (bf16) with no
request adapted, every request on one random rank-R adapter of every projection, and half of them,
measured alternately in one process; medians.

    python bench/lora.py [--rank 16] [--streams 16] [--tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from forge_service import LLM, SamplingParams  # noqa: E402
from forge_service.loaders import default_model_path, load_checkpoint  # noqa: E402

MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(root: Path, rank: int) -> Path:
    """A PEFT-format LoRA of the default model: every projection of every layer, N(0, 0.01) weights."""
    arch = load_checkpoint(default_model_path(), torch.float32, lazy_coded=True).arch
    d, f, hd = arch.hidden_size, arch.intermediate_size, arch.head_dim
    shapes = {"q_proj": (arch.num_heads * hd, d), "k_proj": (arch.num_kv_heads * hd, d),
              "v_proj": (arch.num_kv_heads * hd, d), "o_proj": (d, arch.num_heads * hd),
              "gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(arch.num_layers):
        for block, names in MODULES.items():
            for name in names:
                out, inp = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, root / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": [n for names in MODULES.values() for n in names]}
    (root / "adapter_config.json").write_text(json.dumps(config))
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(lora_modules=f"bench={write_adapter(Path(tmp) / 'adapter', args.rank)}", dtype="bfloat16",
                  enable_prefix_caching=False)
        prompts = [f"Write a short story about the number {i}." for i in range(args.streams)]
        cases = {"none": [None] * args.streams, "half": ["bench", None] * (args.streams // 2),
                 "all": ["bench"] * args.streams}
        rates: dict[str, list[float]] = {name: [] for name in cases}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name, adapters in cases.items():
                params = [SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, adapter=a)
                          for a in adapters]
                started = time.perf_counter()
                outs = llm.generate(prompts, params)
                elapsed = time.perf_counter() - started
                if repeat:
                    rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    base = statistics.median(rates["none"])
    print(f"rank {args.rank} on every projection, {args.streams} streams x {args.tokens} tokens, "
          f"median of {args.repeats}:")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"  adapted {name:>4}: {rate:8.1f} tok/s  ({rate / base:.2f}x of none)")


if __name__ == "__main__":
    main()
