"""The `forge` command: `forge generate` (offline) and `forge serve` (service + gateway)."""
from __future__ import annotations

import argparse
import json
import sys


def _generate(args: argparse.Namespace) -> int:
    from forge_service import LLM, SamplingParams
    from forge_service.errors import ForgeError, StartupError

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            top_p=args.top_p, top_k=args.top_k)
    try:
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device, chat_template=args.chat_template)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            out = llm.generate(args.prompt, params)[0]
    except (ForgeError, StartupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    completion = out.outputs[0]
    if args.json:
        print(json.dumps({"text": completion.text, "token_ids": completion.token_ids,
                          "finish_reason": completion.finish_reason, "usage": out.usage}))
    else:
        print(completion.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from forge_service.__main__ import configs_from_args, run_or_report, setup_logging

    try:
        engine_config, service_config = configs_from_args(args)
    except ValueError as error:  # a FORGE_* variable or a value out of range, as argparse reports its own
        print(f"forge serve: error: {error}", file=sys.stderr)
        return 2
    setup_logging(service_config.log_level, service_config.log_format)  # before gRPC loads: see there
    from forge_service.serve import run_all

    return run_or_report(lambda: run_all(engine_config, service_config))


def build_parser() -> argparse.ArgumentParser:
    from forge_service.__main__ import add_arguments

    parser = argparse.ArgumentParser(prog="forge", description="Forge LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline from one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="print JSON with token ids and usage")
    serve = sub.add_parser("serve", help="start the gRPC service and the OpenAI gateway (flags also read FORGE_*)")
    add_arguments(serve)
    gen.add_argument("--model", default=None, help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    gen.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    gen.add_argument("--chat-template", default=None,
                     help="with --chat: a chat template in place of the model's (a Jinja file's path or the template)")
    gen.set_defaults(func=_generate)
    serve.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
