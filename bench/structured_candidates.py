"""Adapters giving xgrammar, llguidance, outlines-core and Forge's own interface one small surface.

Used by bench/structured_backends.py. Every adapter produces single-line JSON with json.dumps'
separators (", ", ": ") and no free whitespace, so one tokenised document drives them all.
"""
from __future__ import annotations

import torch


def byte_level_bytes(tok) -> dict[int, bytes]:
    """Token id -> raw bytes for a GPT-2 style byte-level vocabulary (outlines-core needs bytes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    unicode_to_byte = {chr(c): b for b, c in chars.items()}
    return {i: bytes(unicode_to_byte[c] for c in s) for s, i in tok.get_vocab(with_added_tokens=True).items()}


def special_ids(tok) -> set[int]:
    return {i for i, t in tok.get_added_tokens_decoder().items() if t.special}


# --- candidates: the same small surface over each library ----------------------------------

class XGrammarCandidate:
    name = "xgrammar"
    module = "xgrammar"

    def __init__(self, tok, vocab_size: int, eos: list[int]) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        specials = special_ids(tok)
        encoded = [""] * vocab_size
        for s, i in tok.get_vocab(with_added_tokens=True).items():
            encoded[i] = "" if i in specials else s
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema_text: str):
        return self.compiler.compile_json_schema(schema_text, any_whitespace=False)

    def clear_cache(self) -> None:
        self.compiler.clear_cache()

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def can_end(self, m) -> bool:
        return m.is_completed()

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


class LLGuidanceCandidate:
    name = "llguidance"
    module = "llguidance"
    OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def __init__(self, tok, vocab_size: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.torch as lt
        self.llg, self.lt = llguidance, lt
        self.tokenizer = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, schema_text: str):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema_text, overrides=self.OPTIONS)
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def clear_cache(self) -> None:
        pass  # llguidance keeps no compile cache

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def can_end(self, m) -> bool:
        return m.is_accepting()

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        self.lt.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)


class OutlinesCoreCandidate:
    name = "outlines-core"
    module = "outlines_core"

    def __init__(self, tok, vocab_size: int, eos: list[int]) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
        self.oc, self.to_regex = outlines_core, build_regex_from_schema
        specials = special_ids(tok)
        vocab: dict[bytes, list[int]] = {}
        for i, b in byte_level_bytes(tok).items():
            if i not in specials:
                vocab.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos[0], vocab)  # one EOS only

    def compile(self, schema_text: str):
        return self.oc.Index(self.to_regex(schema_text), self.vocabulary)

    def clear_cache(self) -> None:
        pass

    def matcher(self, index):
        return self.oc.Guide(index)

    def accept(self, m, token: int) -> bool:
        try:
            m.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def can_end(self, m) -> bool:
        return m.is_finished()

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        view = bitmask[row]
        m.write_mask_into(view.data_ptr(), view.numel(), 4)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):  # no batch API
            self.fill(m, bitmask, i)


class ForgeCandidate:
    """The winner behind Forge's own interface: what the engine will pay, wrapper included."""

    name = "forge"
    module = "llguidance"

    def __init__(self, tok, vocab_size: int, eos: list[int]) -> None:
        from forge_service.structured import Constraint, GrammarCompiler, GrammarMatcher
        self.constraint, self.matcher_cls = Constraint, GrammarMatcher
        self.compiler = GrammarCompiler(tok, vocab_size, eos)

    def compile(self, schema_text: str):
        return self.compiler.compile(self.constraint("json_schema", schema_text))

    def clear_cache(self) -> None:
        self.compiler.clear_cache()

    def matcher(self, grammar):
        return self.matcher_cls(grammar)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def can_end(self, m) -> bool:
        return m.can_end()

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        m.fill_mask(bitmask, row)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.compiler.fill_bitmasks(matchers, bitmask)


CANDIDATES = {c.name: c for c in (XGrammarCandidate, LLGuidanceCandidate, OutlinesCoreCandidate, ForgeCandidate)}
