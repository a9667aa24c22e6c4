"""Tokenizer layer: HF `tokenizers` built from tokenizer.json or a GGUF vocabulary, chat templates,
incremental detokenization and stop strings."""
from forge_service.tokenizer.detokenizer import IncrementalDetokenizer
from forge_service.tokenizer.stop import StopStringMatcher
from forge_service.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "Tokenizer"]
