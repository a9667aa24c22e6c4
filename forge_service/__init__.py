"""Forge: an LLM inference engine and service for Llama-family models.

Offline use: `from forge_service import LLM, SamplingParams`.
"""
from __future__ import annotations

from typing import Any

from forge_service.engine.request import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from forge_service.llm import LLM

        return LLM
    raise AttributeError(name)
