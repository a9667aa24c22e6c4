"""Shared fixtures for tests against the real default model (loaded once per session)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import openai
import pytest
import torch

from forge_service.loaders import default_model_path
from tests.integration.serving.servers import SERVER_THREADS, ForgeProcess, running_forge

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\nx = np.array([1, 2, 3])\n",
    "Water boils at a temperature of",
    "The best way to learn a new language is",
    "1, 2, 3, 4, 5,",
    "Dear hiring manager,\n\nI am writing to",
    "Café, naïve, résumé: these words come from",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of Japan?"}],
    [{"role": "user", "content": "Write a haiku about autumn."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name three fruits."}],
    [{"role": "user", "content": "Explain recursion in one sentence."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "What is 12 times 7?"}],
    [{"role": "system", "content": "You answer like a pirate."}, {"role": "user", "content": "How is the weather?"}],
    [{"role": "user", "content": "Give me a Python one-liner to reverse a string."}],
    [{"role": "user", "content": "Why is the sky blue? 🌤️"}],
]


@pytest.fixture(scope="session")
def model_path() -> Path:
    return Path(default_model_path())


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)


@pytest.fixture(scope="session")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def llm_fp32():
    from forge_service import LLM

    return LLM(dtype="float32")


@pytest.fixture(scope="session")
def fidelity_prompt_ids(hf_tokenizer) -> list[list[int]]:
    """The 20 fidelity prompts as token ids, rendered and tokenized by transformers."""
    raw = [hf_tokenizer.encode(p) for p in RAW_PROMPTS]
    chat = [hf_tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in CHAT_PROMPTS]
    chat = [c["input_ids"] if hasattr(c, "keys") else c for c in chat]
    return raw + [list(c) for c in chat]


# A module's own `forge serve --dtype float32` (the structured-output and tool-calling tests); the
# serving package has its own for the package, and modules needing other flags define `server`.
@pytest.fixture(scope="module")
def server() -> Iterator[ForgeProcess]:
    with running_forge(["--dtype", "float32", *SERVER_THREADS, "--log-level", "warning"]) as forge:
        forge.wait_ready()
        yield forge


@pytest.fixture(scope="module")
def client(server: ForgeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(server: ForgeProcess) -> str:
    return server.health().model
