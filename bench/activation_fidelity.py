"""How close the bf16 CPU path's next-token distributions stay to fp32, per way of quantising the
activations of the 4-bit GEMMs (cpu_kernels.linear), on the default model.

fp32 continues each of the 20 fidelity prompts greedily; then every configuration reads the same
prompt + continuation in one teacher-forced pass, and each position's log-softmax is compared with
fp32's: KL(fp32 || config), and whether the top token differs. The native GEMMs serve every row
of every step (prefill chunks and decodes alike, with per-row results that do not depend on the
step: see native/cpu/quant_gemm.c), so a teacher-forced position scores what a decoded one would.

    python bench/activation_fidelity.py [--configs default,dense,all,4,5,one]

default: the served path, lm_head included (int8, leading logits refined in fp32); the others
multiply the lm_head in bf16 so that only the layers' GEMMs differ.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from conftest import CHAT_PROMPTS, RAW_PROMPTS  # noqa: E402

from forge_service import LLM, SamplingParams  # noqa: E402
from forge_service.backends import cpu_kernels  # noqa: E402

MAX_TOKENS = 48


def all_logprobs(llm: LLM, seqs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Each (prompt, full sequence) read in one pass -> log-softmax after each continuation prefix."""
    model = llm.engine.runner.model
    forward, captured = model.forward, []

    def every_row(input_ids, positions, kv_caches, meta, rows):
        logits = forward(input_ids, positions, kv_caches, meta, torch.arange(len(input_ids)))
        captured.append(logits)
        return logits[rows]

    model.forward = every_row
    out = []
    try:
        for prompt, seq in seqs:
            captured.clear()
            llm.generate([seq], SamplingParams(temperature=0, max_tokens=1))
            out.append(torch.log_softmax(torch.cat(captured)[len(prompt) - 1:len(seq) - 1].float(), -1))
    finally:
        model.forward = forward
    return out


def configure(llm: LLM, config: str) -> None:
    if config == "default":
        return
    model = llm.engine.runner.model
    model.decode_plan = None  # the per-kernel path, where the GEMM can be swapped
    model.lm_head.packed.native = None  # the lm_head's own int8 is not what is measured
    model.lm_head.weight = model.lm_head_weight
    levels = 1 if config == "one" else 2
    fine_above = 0.0 if config == "all" else cpu_kernels.FINE_ABOVE if config in ("dense", "one") else float(config)
    for layer in model.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            linear = getattr(layer, name)
            linear.packed.levels = levels
            if config == "dense":  # the bf16 GEMM on the weights the 4-bit codes encode
                linear.weight = cpu_kernels.dequantize(linear.packed.native).bfloat16()
                linear.packed.native = None
    cpu_kernels.linear = functools.partial(ORIGINAL_LINEAR, fine_above=fine_above)


ORIGINAL_LINEAR = cpu_kernels.linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="default,dense,all,4,5,one",
                        help="default: as served; dense: the bf16 GEMM; all: second level in every group; a number: second level "
                             "where amax > that x the row's RMS; one: one level")
    args = parser.parse_args()
    reference = LLM(dtype="float32", enable_prefix_caching=False)
    tok = reference.tokenizer
    prompts = [tok.encode(p) for p in RAW_PROMPTS] + [tok.encode_chat(c) for c in CHAT_PROMPTS]
    outs = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    seqs = [(p, p + o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    want = all_logprobs(reference, seqs)
    print(f"{'config':8s} {'KL mean':>9s} {'KL p99':>9s} {'KL max':>9s} {'top-token flips':>16s}")
    for config in args.configs.split(","):
        llm = LLM(dtype="bfloat16", enable_prefix_caching=False)  # fresh: configure() edits its layers
        configure(llm, config)
        got = all_logprobs(llm, seqs)
        kl = torch.cat([(w.exp() * (w - g)).sum(-1) for w, g in zip(want, got)])
        flips = sum(int((w.argmax(-1) != g.argmax(-1)).sum()) for w, g in zip(want, got))
        print(f"{config:8s} {kl.mean():9.2e} {kl.quantile(0.99):9.2e} {kl.max():9.2e} {flips:>9d} of {len(kl)}",
              flush=True)


if __name__ == "__main__":
    main()
