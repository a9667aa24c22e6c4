"""The offline API: `LLM(model).generate(prompts, params)`, `LLM.chat(conversations, params)` and
`LLM.embed(prompts)`."""
from __future__ import annotations

import uuid
from typing import Any, Sequence, Union

from forge_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from forge_service.engine.engine import LLMEngine
from forge_service.engine.output_types import CompletionOutput, RequestOutput
from forge_service.engine.request import SamplingParams

Prompt = Union[str, list[int]]
Message = dict[str, Any]


class LLM:
    """Runs the engine to completion over a list of prompts, batching them all together."""

    def __init__(self, model: str | None = None, dtype: str = "auto", *, max_model_len: int | None = None,
                 block_size: int = 16, kv_cache_bytes: int = 1 << 30, num_blocks: int | None = None,
                 max_num_batched_tokens: int = 512, max_num_seqs: int = 64, num_threads: int = 0,
                 max_tokens_while_decoding: int = SchedulerConfig.max_tokens_while_decoding,
                 max_step_ms_while_decoding: float = SchedulerConfig.max_step_ms_while_decoding,
                 enable_prefix_caching: bool = True, device: str = "cpu", speculative: str = "off",
                 spec_max_draft: int = 8, spec_ngram_min: int = 2, spec_ngram_max: int = 4,
                 spec_max_step_tokens: int = 16, spec_step_base_rows: float = 0.0,
                 scheduling_policy: str = "fcfs", lora_modules: str | None = None,
                 max_lora_rank: int = 64, chat_template: str | None = None,
                 generation_config: str = "auto") -> None:
        """`generation_config`: "auto", prompts given no SamplingParams sample as the model's files
        recommend (see forge_service/sampling/model_defaults.py); "forge": SamplingParams()'s defaults."""
        self.engine = LLMEngine(EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, device=device,
                              lora_modules=lora_modules, max_lora_rank=max_lora_rank,
                              chat_template=chat_template, generation_config=generation_config),
            cache=CacheConfig(block_size=block_size, kv_cache_bytes=kv_cache_bytes, num_blocks=num_blocks,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                      max_tokens_while_decoding=max_tokens_while_decoding,
                                      max_step_ms_while_decoding=max_step_ms_while_decoding,
                                      max_num_seqs=max_num_seqs, max_waiting=0,
                                      scheduling_policy=scheduling_policy),
            speculative=SpeculativeConfig(speculative=speculative, spec_max_draft=spec_max_draft,
                                          spec_ngram_min=spec_ngram_min, spec_ngram_max=spec_ngram_max,
                                          spec_max_step_tokens=spec_max_step_tokens,
                                          spec_step_base_rows=spec_step_base_rows),
            num_threads=num_threads,
        ))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Prompts are strings or token-id lists; returns one RequestOutput per prompt, in order.

        A prompt that made the engine fail comes back with `error` set and finish reason "error"
        (its other completions "abort"); the other prompts are unaffected."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(ids, texts, sampling_params)

    def chat(self, conversations: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[RequestOutput]:
        """Each conversation is a list of {"role", "content"} messages rendered with the model's template.
        continue_final_message (with add_generation_prompt=False): the model goes on writing the
        last message (an answer's beginning given by the caller)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        flags = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        texts = [self.tokenizer.apply_chat_template(c, **flags) for c in conversations]
        ids = [self.tokenizer.encode_chat(c, **flags) for c in conversations]
        return self._run(ids, texts, sampling_params)

    def embed(self, prompts: Prompt | Sequence[Prompt], dimensions: int | None = None,
              normalize: bool = True) -> list[list[float]]:
        """Each prompt's embedding: its last token's final hidden state (see embeddings.py), its
        first `dimensions` values, unit length with `normalize`."""
        from forge_service import embeddings

        embeddings.check_dimensions(dimensions, self.engine.arch.hidden_size)
        outputs = self.generate(prompts, embeddings.embed_params())
        return [embeddings.pooled(o.outputs[0].embedding, dimensions, normalize) for o in outputs]

    def _run(self, prompts: list[list[int]], texts: list[str | None],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[RequestOutput]:
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        order = []
        try:
            for prompt, text, p in zip(prompts, texts, params):
                p = p or SamplingParams(**self.engine.sampling_defaults)
                request_id = uuid.uuid4().hex
                self.engine.add_request(request_id, prompt, p)
                results[request_id] = RequestOutput(request_id, prompt, [CompletionOutput(i) for i in range(p.n)],
                                                    prompt=text)
                order.append(request_id)
        except Exception:
            for request_id in order:  # a bad prompt rejects the whole call, leaving nothing queued
                self.engine.abort_request(request_id)
            raise
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                results[delta.request_id].extend(delta)
        return [results[r] for r in order]
