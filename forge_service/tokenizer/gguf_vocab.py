"""A `tokenizers.Tokenizer` rebuilt from the vocabulary a GGUF file stores in its metadata.

A GGUF carries no tokenizer.json: it stores llama.cpp's description of the tokenizer under
`tokenizer.ggml.*` (model kind, tokens, merges or scores, token types, the pre-tokenizer's name).
We turn that back into the HF `tokenizers` pipeline the model was trained with. Hand-written
because only `transformers` does this, and it is a test-only dependency here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from forge_service.errors import ModelLoadError
from forge_service.loaders.gguf_file import read_gguf

log = logging.getLogger(__name__)
K = gguf.Keys.Tokenizer
T = gguf.TokenType

# --- pre-tokenizer splits, by the name llama.cpp writes to `tokenizer.ggml.pre` --------------------

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DIGIT_SPLIT = r"\p{N}"  # every digit on its own, before the word regex (StarCoder-style vocabularies)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """Regexes applied in order (each match isolated), then the byte-level alphabet mapping."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # llama.cpp and Llama 3's tokenizer.json look whole words up first


_GPT2 = PreTokenizerSpec((GPT2_SPLIT,))
_DIGITS_GPT2 = PreTokenizerSpec((DIGIT_SPLIT, GPT2_SPLIT))
_LLAMA3 = PreTokenizerSpec((LLAMA3_SPLIT,), ignore_merges=True)
_QWEN2 = PreTokenizerSpec((QWEN2_SPLIT,))

PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": _GPT2,
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "smollm": _DIGITS_GPT2,
    "starcoder": _DIGITS_GPT2,
    "refact": _DIGITS_GPT2,
    "codeshell": _DIGITS_GPT2,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}


# --- what the file says ----------------------------------------------------------------------------

@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer metadata of one GGUF file, under plain names."""

    model: str
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    special_ids: dict[str, int] = field(default_factory=dict)  # bos, eos, unk, pad, eot, eom
    add_bos: bool | None = None
    add_eos: bool | None = None
    add_space_prefix: bool | None = None
    chat_template: str | None = None

    def token(self, name: str) -> str | None:
        """The text of a named special token (`"bos"`, `"eos"`, ...), if the file names a valid one."""
        i = self.special_ids.get(name)
        return self.tokens[i] if i is not None and 0 <= i < len(self.tokens) else None


_SPECIAL_ID_KEYS = {"bos": K.BOS_ID, "eos": K.EOS_ID, "unk": K.UNK_ID, "pad": K.PAD_ID,
                    "eot": K.EOT_ID, "eom": K.EOM_ID}


def read_gguf_vocab(path: str) -> GGUFVocab:
    """Read the `tokenizer.*` metadata of a GGUF file."""
    meta = {name: f.contents() for name, f in read_gguf(path).fields.items() if name.startswith("tokenizer.")}
    if K.MODEL not in meta or K.LIST not in meta:
        raise ModelLoadError(path, "the GGUF file has no tokenizer vocabulary (tokenizer.ggml.model/tokens)")
    tokens = meta[K.LIST]
    return GGUFVocab(
        model=meta[K.MODEL],
        tokens=tokens,
        token_types=meta.get(K.TOKEN_TYPE) or [T.NORMAL] * len(tokens),
        scores=meta.get(K.SCORES),
        merges=meta.get(K.MERGES),
        pre=meta.get(K.PRE),
        special_ids={name: meta[key] for name, key in _SPECIAL_ID_KEYS.items() if key in meta},
        add_bos=meta.get(K.ADD_BOS),
        add_eos=meta.get(K.ADD_EOS),
        add_space_prefix=meta.get(K.ADD_PREFIX),
        chat_template=meta.get(K.CHAT_TEMPLATE),
    )


# --- building the tokenizers pipeline --------------------------------------------------------------

def build_backend(vocab: GGUFVocab, path: str = "<gguf>") -> Tokenizer:
    """The HF tokenizer the vocabulary describes, with its special tokens and BOS/EOS post-processor."""
    builder = TOKENIZER_BUILDERS.get(vocab.model)
    if builder is None:
        raise ModelLoadError(path, f"unsupported tokenizer model {vocab.model!r} "
                                   f"(supported: {sorted(TOKENIZER_BUILDERS)})")
    backend = builder(vocab)
    _add_special_tokens(backend, vocab)
    backend.post_processor = bos_eos_processor(vocab.token("bos") if add_bos(vocab) else None,
                                               vocab.token("eos") if vocab.add_eos else None, backend)
    return backend


def add_bos(vocab: GGUFVocab) -> bool:
    """Whether encode prepends BOS. Absent flag: SentencePiece vocabularies do (llama.cpp and transformers agree)."""
    if vocab.add_bos is not None:
        return bool(vocab.add_bos) and vocab.token("bos") is not None
    return vocab.model == "llama" and vocab.token("bos") is not None


def bos_eos_processor(bos: str | None, eos: str | None, backend: Tokenizer) -> processors.PostProcessor:
    """TemplateProcessing that wraps a sequence in optional BOS/EOS (the only thing a GGUF can ask for)."""
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    pair = f"{single} " + " ".join(([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else []))
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _byte_level(vocab: GGUFVocab) -> Tokenizer:
    """GPT-2 style byte-level BPE ("gpt2" in llama.cpp): Llama 3, SmolLM, Qwen2, StarCoder..."""
    spec = PRE_TOKENIZERS.get(vocab.pre or "default")
    if spec is None:
        log.warning("unknown GGUF pre-tokenizer %r; falling back to the GPT-2 default split", vocab.pre)
        spec = _GPT2
    alphabet = set(BYTE_ALPHABET.values())
    spelled = [t if vocab.token_types[i] != T.NORMAL or set(t) <= alphabet else _respell(t)
               for i, t in enumerate(vocab.tokens)]
    model = BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=_merges(vocab.merges or []),
                ignore_merges=spec.ignore_merges)
    backend = Tokenizer(model)
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in spec.splits]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(vocab: GGUFVocab) -> Tokenizer:
    """SentencePiece-style BPE ("llama" in llama.cpp): ▁ for spaces, <0xXX> byte fallback, merges by score."""
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    merges = _merges(vocab.merges) if vocab.merges else merges_from_scores(vocab.tokens, vocab.scores)
    unk = vocab.token("unk")
    backend = Tokenizer(BPE(vocab=ids, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = vocab.add_space_prefix is not False  # absent means SentencePiece's default: add it
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


TOKENIZER_BUILDERS: dict[str, Callable[[GGUFVocab], Tokenizer]] = {
    "gpt2": _byte_level,
    "llama": _sentencepiece,
}


def merges_from_scores(tokens: list[str], scores: list[float] | None) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: every split of a token into two tokens, best score first.

    Same order as transformers' `generate_merges`, so ties break identically."""
    if scores is None:
        scores = [-float(i) for i in range(len(tokens))]
    ids = {t: i for i, t in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))
    merges: list[tuple[str, str, float]] = []
    for token, score in score_of.items():
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in ids and token[k:] in ids]
        merges.extend(sorted(local, key=lambda m: (ids[m[0]], ids[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _add_special_tokens(backend: Tokenizer, vocab: GGUFVocab) -> None:
    """Control/unknown tokens (and the named bos/eos/...) become special added tokens, user-defined
    ones plain added tokens: both are then matched whole in text, never cut by the model."""
    named = set(vocab.special_ids.values())
    special, plain = [], []
    for i, (token, kind) in enumerate(zip(vocab.tokens, vocab.token_types)):
        if kind in (T.CONTROL, T.UNKNOWN) or (i in named and kind != T.BYTE):
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == T.USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def _merges(merges: list[str]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) for m in merges]  # type: ignore[misc]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


BYTE_ALPHABET = _bytes_to_unicode()


def _respell(token: str) -> str:
    return "".join(BYTE_ALPHABET[b] for b in token.encode("utf-8"))


def special_token_texts(vocab: GGUFVocab) -> dict[str, Any]:
    """The special token texts a chat template can refer to (`bos_token`, `eos_token`, ...)."""
    return {f"{name}_token": vocab.token(name) for name in ("bos", "eos", "unk", "pad") if vocab.token(name)}
