"""`python -m forge_service`: the gRPC service alone. Every flag also reads FORGE_<NAME>."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from forge_service.config import EngineConfig, ServiceConfig, engine_config_from_env, parse_bool, \
    service_config_from_env
from forge_service.logs import log_format


def _bool(value: str) -> bool:
    try:
        return parse_bool(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# (flag, config field, type, help). Unset flags fall back to FORGE_* variables, then defaults.
ENGINE_FLAGS = [
    ("--model", "model", str, "path to a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct)"),
    ("--served-model-name", "served_model_name", str, "name clients use for the model"),
    ("--lora-modules", "lora_modules", str,
     "LoRA adapters served beside the model, NAME=PATH[,NAME=PATH...] (PEFT directories); a request names one as "
     "its model (CPU backend)"),
    ("--max-lora-rank", "max_lora_rank", int, "largest LoRA adapter rank accepted at load (default 64)"),
    ("--chat-template", "chat_template", str,
     "chat template used in place of the model's: a Jinja file's path, or the template itself (default: the "
     "model's own)"),
    ("--generation-config", "generation_config", str,
     "auto (default): sampling fields a request leaves unset take the model's recommended values (its "
     "generation_config.json or GGUF general.sampling.*); forge: Forge's defaults (temperature 1, the rest off)"),
    ("--dtype", "dtype", str, "auto, float32 or bfloat16"),
    ("--device", "device", str, "cpu or cuda"),
    ("--max-model-len", "max_model_len", int, "cap on the context length"),
    ("--block-size", "block_size", int, "tokens per KV-cache block"),
    ("--kv-cache-bytes", "kv_cache_bytes", int, "memory for the KV cache"),
    ("--num-blocks", "num_blocks", int, "number of KV-cache blocks (overrides --kv-cache-bytes)"),
    ("--enable-prefix-caching", "enable_prefix_caching", _bool,
     "share the KV of identical prompt prefixes across requests (true/false; default true)"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget per step"),
    ("--max-tokens-while-decoding", "max_tokens_while_decoding", int,
     "while requests decode, a step's decodes plus prefill chunks stay under this (bounds inter-token "
     "latency under long prompts; 0: no bound)"),
    ("--max-step-ms-while-decoding", "max_step_ms_while_decoding", float,
     "while requests decode, prefill chunks also stay within what this many milliseconds of step hold, at "
     "the measured cost of a token: steadier inter-token latency, later first tokens (default 0: no such bound)"),
    ("--max-num-seqs", "max_num_seqs", int, "most requests running at once"),
    ("--max-waiting", "max_waiting", int, "most requests waiting; past it RESOURCE_EXHAUSTED (0: unbounded)"),
    ("--scheduling-policy", "scheduling_policy", str,
     "fcfs (default): arrival order; priority: by each request's priority (lower first), preempting "
     "lower-ranked running requests for a waiting one that finds no room"),
    ("--max-grammar-bytes", "max_grammar_bytes", int,
     "largest structured-output schema, regex or grammar, in bytes; past it INVALID_ARGUMENT"),
    ("--grammar-compile-timeout-s", "grammar_compile_timeout_s", float,
     "CPU time limit on compiling one structured-output constraint; past it INVALID_ARGUMENT (past 10 "
     "times it in wall-clock time, waiting for a core, RESOURCE_EXHAUSTED)"),
    ("--speculative", "speculative", str,
     "ngram (default): draft tokens from the request's own prompt and output, verify them in the step; or off"),
    ("--spec-max-draft", "spec_max_draft", int, "most tokens one request drafts per step (adapted down per request)"),
    ("--spec-ngram-min", "spec_ngram_min", int, "shortest n-gram matched for a draft"),
    ("--spec-ngram-max", "spec_ngram_max", int, "longest n-gram matched for a draft (tried first)"),
    ("--spec-max-step-tokens", "spec_max_step_tokens", int, "most drafted tokens in one step over all requests"),
    ("--spec-step-base-rows", "spec_step_base_rows", float,
     "a decode step's fixed cost in rows' worth, weighed against the row each drafted token adds "
     "(0, the default: measured on the engine's own decode steps)"),
    ("--num-threads", "num_threads", int, "torch CPU threads (0: torch's default)"),
]
SERVICE_FLAGS = [
    ("--host", "host", str, "address to bind"),
    ("--grpc-port", "grpc_port", int, "gRPC port"),
    ("--http-port", "http_port", int, "gateway HTTP port (forge serve)"),
    ("--drain-timeout-s", "drain_timeout_s", float, "how long in-flight requests may run after SIGTERM"),
    ("--api-key", "api_key", str,
     "require `Authorization: Bearer <key>` at the gateway; KEY[,KEY...] accepts any of them (rotation)"),
    ("--log-level", "log_level", str, "debug, info, warning or error"),
    ("--log-format", "log_format", log_format, "text, or json: one object per line with request and trace ids"),
    ("--metrics-port", "metrics_port", int, "Prometheus /metrics HTTP port of the service (0: off; default 9090)"),
    ("--otlp-traces-endpoint", "otlp_traces_endpoint", str,
     "OTLP/gRPC endpoint for traces (default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; unset: no tracing)"),
    ("--grpc-api-key", "grpc_api_key", str,
     "require gRPC metadata `authorization: Bearer <key>` (default: --api-key); KEY[,KEY...] accepts any of them"),
    ("--enable-reflection", "enable_reflection", _bool, "serve gRPC reflection even while a key is required"),
    ("--tls-cert", "tls_cert", str, "PEM certificate chain: serve gRPC over TLS"),
    ("--tls-key", "tls_key", str, "PEM private key of --tls-cert"),
    ("--tls-client-ca", "tls_client_ca", str, "PEM CA bundle: require client certificates it signed (mTLS)"),
    ("--tokenizer-workers", "tokenizer_workers", int, "threads that render chat templates and tokenize"),
    ("--max-pending-tokenize", "max_pending_tokenize", int,
     "requests waiting to be tokenized; past it RESOURCE_EXHAUSTED"),
    ("--max-messages", "max_messages", int, "chat messages per request"),
    ("--max-message-chars", "max_message_chars", int, "characters per chat message, text prompt or prediction"),
    ("--max-stop-chars", "max_stop_chars", int, "characters per stop string"),
    ("--max-total-tokens", "max_total_tokens", int, "bound on n x max_tokens"),
    ("--max-logit-bias", "max_logit_bias", int, "entries in logit_bias"),
    ("--reasoning-parser", "reasoning_parser", str,
     "auto (default): chat answers of a model whose template knows </think> have their thought split off "
     "into reasoning; think: always; off: the text as written"),
]


def add_arguments(parser: argparse.ArgumentParser, service_flags: bool = True) -> None:
    """Add the engine (and service) flags; `forge serve` reuses this."""
    for flag, dest, kind, help_text in ENGINE_FLAGS + (SERVICE_FLAGS if service_flags else []):
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=help_text)


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServiceConfig]:
    """Flags override FORGE_* variables, which override the dataclass defaults."""
    values = vars(args)
    engine = engine_config_from_env(**{dest: values.get(dest) for _, dest, _, _ in ENGINE_FLAGS})
    service = service_config_from_env(**{dest: values.get(dest) for _, dest, _, _ in SERVICE_FLAGS})
    return engine, service


def setup_logging(level: str, fmt: str = "text") -> None:
    from forge_service.logs import setup_logging as setup

    setup(level, fmt)


def run_or_report(start: Callable[[], None]) -> int:
    """Run a server until it stops: 0. A start that fails for a reason its operator must fix (a
    port in use, a model that cannot load, a bad setting) is one logged error and status 2."""
    from forge_service.errors import ForgeError, StartupError

    try:
        start()
    except (ForgeError, StartupError) as error:
        logging.getLogger("forge").error("cannot start: %s", error)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forge_service", description="Forge gRPC service")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        engine_config, service_config = configs_from_args(args)
    except ValueError as error:  # a FORGE_* variable or a value out of range
        parser.error(str(error))
    setup_logging(service_config.log_level, service_config.log_format)
    from forge_service.server import serve

    return run_or_report(lambda: serve(engine_config, service_config))


if __name__ == "__main__":
    sys.exit(main())
