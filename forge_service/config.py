"""Configuration: one frozen dataclass per layer. The only module that reads environment variables."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from forge_service.reasoning import MODES as REASONING_MODES

ENV_PREFIX = "FORGE_"


def require_at_least(config: object, minimum: float, *names: str) -> None:
    """ValueError naming the first of `names` (fields of `config`) below `minimum`; None passes.
    A setting out of range fails at start, where it would stall or break requests later (no
    sequence could ever be scheduled with max_num_seqs 0)."""
    for name in names:
        value = getattr(config, name)
        if value is not None and not value >= minimum:  # NaN too
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


def require_positive(config: object, *names: str) -> None:
    """ValueError naming the first of `names` that is not above 0 (a timeout of 0 would expire at once)."""
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def require_ports(config: object, *names: str) -> None:
    """ValueError naming the first of `names` that is not a port number (0: the OS picks one, or off)."""
    for name in names:
        value = getattr(config, name)
        if not 0 <= value <= 65535:
            raise ValueError(f"{name} must be a port number (0 to 65535), got {value}")


def api_keys(value: str | None, name: str = "api_key") -> tuple[str, ...]:
    """An API key setting's keys: one, or several separated by commas, any of which is accepted
    (the first is the one a Forge gateway presents), so that a key can be rotated without refusing
    anyone: old,new -> new,old -> new. None or "": no key. ValueError for an empty key in a list."""
    if not value:
        return ()
    keys = tuple(key.strip() for key in value.split(","))
    if not all(keys):
        raise ValueError(f"{name}: an empty key in the list (keys are separated by commas)")
    return keys


_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
MAX_LORA_RANK = 256  # the CPU kernel's bound (native/cpu/ops.c)


@dataclass(frozen=True)
class ModelConfig:
    # Path to a .gguf file or a Hugging Face directory; None means the default model.
    model: str | None = None
    # "auto" picks the fastest dtype for the device; "float32" or "bfloat16" force one.
    dtype: str = "auto"
    # Caps the context length below the model's own; None keeps the model's.
    max_model_len: int | None = None
    # Name under which the model is served; None derives it from the file name.
    served_model_name: str | None = None
    device: str = "cpu"
    # LoRA adapters served beside the model, "NAME=PATH[,NAME=PATH...]" (PEFT directories); a
    # request names one as its model. None: none.
    lora_modules: str | None = None
    # The largest adapter rank accepted at load.
    max_lora_rank: int = 64
    # The chat template used in place of the model's (for a model without one, or to change it): a
    # file's path, or the Jinja text itself. None: the model's own.
    chat_template: str | None = None
    # "auto": what a request leaves of temperature, top_p, top_k, min_p and repetition_penalty
    # takes the model's recommended value (a Hugging Face directory's generation_config.json, a
    # GGUF's general.sampling.*), where it has one; "forge": Forge's own defaults.
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        require_at_least(self, 1, "max_model_len", "max_lora_rank")
        if self.generation_config not in ("auto", "forge"):
            raise ValueError(f"generation_config must be 'auto' or 'forge', got {self.generation_config!r}")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be at most {MAX_LORA_RANK}, got {self.max_lora_rank}")
        self.lora_paths()  # raises ValueError for a malformed list

    def lora_paths(self) -> dict[str, str]:
        """lora_modules as {name: path}, in the order given; ValueError naming what is wrong."""
        modules: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in (self.lora_modules or "").split(","))):
            name, sep, path = (part.strip() for part in item.partition("="))
            if not sep or not path:
                raise ValueError(f"lora_modules: {item!r} is not NAME=PATH")
            if not _ADAPTER_NAME.fullmatch(name):
                raise ValueError(f"lora_modules: adapter name {name!r} must be 1 to 128 letters, digits or ._:/- "
                                 "(the first a letter or digit)")
            if name in modules:
                raise ValueError(f"lora_modules: adapter name {name!r} is given twice")
            modules[name] = path
        return modules


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Memory for the K/V tensors; the number of blocks follows from it.
    kv_cache_bytes: int = 1 << 30
    # Overrides kv_cache_bytes when set (tests use it to force preemption).
    num_blocks: int | None = None
    # Reuse the KV of full blocks whose whole prefix matches an earlier request's.
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        require_at_least(self, 1, "block_size", "kv_cache_bytes", "num_blocks")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    # While requests are decoding, prefill chunks get only what is left of this many tokens after
    # the step's decodes (at least one KV block's worth): a long prompt then delays running streams
    # by a bounded step, not by a whole max_num_batched_tokens chunk. Prefills alone use the full
    # budget. 0: no such bound.
    max_tokens_while_decoding: int = 128
    # And, when set, to what fits in this many milliseconds of step at the cost of a token the engine
    # measures on its steps that prefill (0: no such bound). Where a token costs more (a slower CPU,
    # longer prompts), chunks shrink, so that streams wait about as long between tokens on any
    # machine; prompts then take more steps to prefill, so first tokens come later (see README).
    max_step_ms_while_decoding: float = 0.0
    max_num_seqs: int = 64
    # Bound on waiting requests; past it, new requests are refused. 0 means unbounded.
    max_waiting: int = 256
    # "fcfs": requests run in arrival order. "priority": by each request's priority (lower first),
    # then arrival; a waiting request that outranks running ones and finds no seat or no KV
    # blocks makes the lowest-ranked of them give way (preempted, recomputed later).
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        require_at_least(self, 1, "max_num_batched_tokens", "max_num_seqs")
        require_at_least(self, 0, "max_tokens_while_decoding", "max_step_ms_while_decoding", "max_waiting")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")


@dataclass(frozen=True)
class StructuredConfig:
    # Largest schema, regex, choice list or grammar one request may send, in bytes.
    max_grammar_bytes: int = 128 * 1024
    # Limit on the CPU time compiling one constraint takes; past it the request gets INVALID_ARGUMENT
    # (and past 10 times it in wall-clock time, waiting for a core, RESOURCE_EXHAUSTED).
    grammar_compile_timeout_s: float = 0.5

    def __post_init__(self) -> None:
        require_at_least(self, 1, "max_grammar_bytes")
        require_positive(self, "grammar_compile_timeout_s")


@dataclass(frozen=True)
class SpeculativeConfig:
    # "ngram": prompt-lookup drafts verified in the normal step (forge_service/speculative); "off".
    # On by default: bench/speculative.py measured no workload losing more than 2% with it.
    speculative: str = "ngram"
    spec_max_draft: int = 8  # the most tokens one request drafts in one step
    spec_ngram_min: int = 2  # the shortest suffix matched against the request's own tokens
    spec_ngram_max: int = 4  # the longest, tried first
    # The most drafted tokens in one step over all requests: past a batch of a few, a step is no
    # longer bound by reading the weights, and verifying drafts costs as much as new tokens.
    spec_max_step_tokens: int = 16
    # A decode step's cost that does not grow with its rows, in units of one row's cost: drafting
    # weighs this against the row each drafted token adds. 0: measured on the engine's own decode
    # steps (speculative/step_cost.py; 2.2 until then, the CPU backend's on the default model and
    # 2 cores, bench/speculative.py --step-rows); a GPU's is far larger.
    spec_step_base_rows: float = 0.0

    def __post_init__(self) -> None:
        if self.speculative not in ("ngram", "off"):
            raise ValueError(f"speculative must be 'ngram' or 'off', got {self.speculative!r}")
        if not 1 <= self.spec_ngram_min <= self.spec_ngram_max:
            raise ValueError(f"need 1 <= spec_ngram_min <= spec_ngram_max, got {self.spec_ngram_min}, "
                             f"{self.spec_ngram_max}")
        require_at_least(self, 0, "spec_max_draft", "spec_max_step_tokens", "spec_step_base_rows")

    @property
    def enabled(self) -> bool:
        return self.speculative == "ngram" and self.spec_max_draft > 0 and self.spec_max_step_tokens > 0


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    structured: StructuredConfig = StructuredConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    # torch intra-op threads on CPU; 0 keeps torch's default.
    num_threads: int = 0

    def __post_init__(self) -> None:
        require_at_least(self, 0, "num_threads")


@dataclass(frozen=True)
class LimitsConfig:
    """Bounds on one request, checked by the servicer before any work; past one, INVALID_ARGUMENT."""

    # Chat messages in one request.
    max_messages: int = 1024
    # Characters in one chat message's content, and in a text prompt.
    max_message_chars: int = 1 << 20
    # Characters in one stop string (their number is capped at 16 by SamplingParams).
    max_stop_chars: int = 1024
    # n x max_tokens when n > 1 (max_tokens unset: what is left of the context after the prompt).
    max_total_tokens: int = 65536
    # Entries in logit_bias.
    max_logit_bias: int = 1024


@dataclass(frozen=True)
class ServiceConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    # How long in-flight requests may run after SIGTERM.
    drain_timeout_s: float = 30.0
    # When set, the gateway requires `Authorization: Bearer <api_key>`.
    api_key: str | None = None
    # When set, gRPC calls need metadata `authorization: Bearer <grpc_api_key>` (health excepted);
    # unset, api_key is used. Set it to "" to leave the gRPC port open while the gateway has a key.
    grpc_api_key: str | None = None
    # Serve reflection even while a key is required (off then by default).
    enable_reflection: bool = False
    # TLS on the gRPC port (PEM files); with tls_client_ca, clients must present a certificate it signed.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # Threads that render chat templates and tokenize, off the event loop.
    tokenizer_workers: int = 2
    # Requests waiting for (or in) those threads; past it RESOURCE_EXHAUSTED (queue_full). As deep as
    # the engine's waiting queue (max_waiting), so a burst the engine would queue is not refused here.
    max_pending_tokenize: int = 256
    limits: LimitsConfig = LimitsConfig()
    log_level: str = "info"
    # "text" or "json" (one object per line, with the request id and trace ids).
    log_format: str = "text"
    # Prometheus /metrics on this HTTP port (`forge serve` and `python -m forge_service`); 0: off.
    metrics_port: int = 9090
    # OTLP/gRPC endpoint for traces; unset: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else tracing is off.
    otlp_traces_endpoint: str | None = None
    # Chat completions of thinking models: "auto" splits the thought (<think>...</think>) off into
    # `reasoning` when the model's chat template knows </think>; "think" always; "off" never.
    reasoning_parser: str = "auto"

    def __post_init__(self) -> None:
        if self.reasoning_parser not in REASONING_MODES:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_MODES)}, "
                             f"got {self.reasoning_parser!r}")
        require_ports(self, "grpc_port", "http_port", "metrics_port")
        api_keys(self.api_key, "api_key")
        api_keys(self.grpc_api_key, "grpc_api_key")
        require_at_least(self, 0, "drain_timeout_s")
        require_at_least(self, 1, "tokenizer_workers", "max_pending_tokenize")

    @property
    def grpc_key(self) -> str | None:
        """The key gRPC calls must carry, or None when the port is open."""
        key = self.api_key if self.grpc_api_key is None else self.grpc_api_key
        return key or None


def traces_endpoint(configured: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """Where traces go: the flag or FORGE_OTLP_TRACES_ENDPOINT, else the standard OTEL_* variables;
    None (tracing off) when none is set or OTEL_SDK_DISABLED / OTEL_TRACES_EXPORTER=none say so."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or env.get("OTEL_TRACES_EXPORTER", "") == "none":
        return None
    return (configured or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def malloc_arenas(env: Mapping[str, str] | None = None) -> int | None:
    """How many glibc malloc arenas the serving process caps itself at: one per CPU it may run on,
    unless MALLOC_ARENA_MAX is set (then glibc applies that itself, and this is None)."""
    env = os.environ if env is None else env
    if "MALLOC_ARENA_MAX" in env:
        return None
    usable = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere there is no glibc to cap
    return len(usable(0)) if usable else os.cpu_count()


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def parse_bool(value: str) -> bool:
    """A boolean setting's text: 1/true/yes/on or 0/false/no/off (any case); anything else is a
    ValueError, not a silent false."""
    if value.lower() not in _TRUE + _FALSE:
        raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE[:-1])}, got {value!r}")
    return value.lower() in _TRUE


def _coerce(value: str, current: Any, name: str) -> Any:
    if isinstance(current, bool):
        return parse_bool(value)
    if isinstance(current, int):
        return int(value)
    if isinstance(current, float):
        return float(value)
    if value == "" and current is None:
        return None
    # Fields whose default is None take ints when the string is numeric.
    if current is None and name in _INT_OR_NONE:
        return int(value)
    return value


_INT_OR_NONE = {"max_model_len", "num_blocks"}


def from_env(cls: type, env: Mapping[str, str] | None = None, **overrides: Any):
    """Build `cls` from FORGE_<FIELD> variables, then apply non-None overrides (CLI flags)."""
    env = os.environ if env is None else env
    obj = cls()
    values: dict[str, Any] = {}
    for f in fields(cls):
        key = ENV_PREFIX + f.name.upper()
        if key in env:
            try:
                values[f.name] = _coerce(env[key], getattr(obj, f.name), f.name)
            except ValueError as error:
                raise ValueError(f"{key}={env[key]!r}: {error}") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    return replace(obj, **values)


def service_config_from_env(env: Mapping[str, str] | None = None, **overrides: Any) -> ServiceConfig:
    """ServiceConfig from FORGE_* variables; `overrides` are its fields or LimitsConfig's."""
    limit_names = {f.name for f in fields(LimitsConfig)}
    limits = from_env(LimitsConfig, env, **{k: v for k, v in overrides.items() if k in limit_names})
    own = {k: v for k, v in overrides.items() if k not in limit_names}
    return from_env(ServiceConfig, env, limits=limits, **own)


def engine_config_from_env(env: Mapping[str, str] | None = None, **overrides: Any) -> EngineConfig:
    """EngineConfig from FORGE_* variables; `overrides` are field names of any sub-config."""
    def pick(cls: type) -> dict[str, Any]:
        names = {f.name for f in fields(cls)}
        return {k: v for k, v in overrides.items() if k in names}

    return from_env(
        EngineConfig, env,
        model=from_env(ModelConfig, env, **pick(ModelConfig)),
        cache=from_env(CacheConfig, env, **pick(CacheConfig)),
        scheduler=from_env(SchedulerConfig, env, **pick(SchedulerConfig)),
        structured=from_env(StructuredConfig, env, **pick(StructuredConfig)),
        speculative=from_env(SpeculativeConfig, env, **pick(SpeculativeConfig)),
        num_threads=overrides.get("num_threads"),
    )
