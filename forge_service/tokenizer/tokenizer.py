"""The model's tokenizer: an HF `tokenizers.Tokenizer` plus the special tokens and chat template around it.

Built from a GGUF file's vocabulary metadata or from a Hugging Face directory (tokenizer.json,
tokenizer_config.json, generation_config.json). Encodes and decodes as transformers does.
"""
from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

from tokenizers import AddedToken, Tokenizer as BackendTokenizer, decoders

from forge_service.errors import InvalidArgument, ModelLoadError
from forge_service.tokenizer.chat_template import ChatTemplate
from forge_service.tokenizer.gguf_vocab import BYTE_ALPHABET, add_bos, bos_eos_processor, build_backend, \
    read_gguf_vocab, special_token_texts

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback
_BYTE_VALUES = {char: byte for byte, char in BYTE_ALPHABET.items()}


class Tokenizer:
    """Text <-> token ids for one model, and its chat template.

    `backend` is the HF tokenizers object (structured output builds token masks from it).
    `eos_token_ids` are every id that ends generation; `add_bos` says whether `encode` prepends BOS.
    """

    def __init__(self, backend: BackendTokenizer, special_tokens: dict[str, str],
                 eos_token_ids: tuple[int, ...] | None = None, chat_template: str | None = None) -> None:
        self.backend = backend
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(self.special_tokens.get("eos_token"))
        default_eos = (self.eos_token_id,) if self.eos_token_id is not None else ()
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids) if eos_token_ids else default_eos
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self.add_bos = self.bos_token_id is not None and backend.encode("").ids[:1] == [self.bos_token_id]
        self.set_chat_template(chat_template)
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added_ids = frozenset(added)
        specials = sorted({t.content for t in added.values() if t.special and t.content}, key=len, reverse=True)
        # Longest first, so an alternation matches as tokenizers' added-token matcher does (leftmost-longest).
        self._special_pattern = re.compile("|".join(map(re.escape, specials))) if specials else None

    def set_chat_template(self, source: str | None) -> None:
        """Render chats with this template (None: none); a server's --chat-template replaces the model's."""
        self.chat_template = source
        self._template = ChatTemplate(source, self.special_tokens) if source else None

    # --- construction ------------------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str) -> Tokenizer:
        """A `.gguf` file (vocabulary from its metadata) or a Hugging Face model directory."""
        if os.path.isdir(path):
            return cls.from_hf_dir(path)
        if path.endswith(".gguf") and os.path.isfile(path):
            return cls.from_gguf(path)
        raise ModelLoadError(path, "expected a .gguf file or a directory with tokenizer.json")

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        vocab = read_gguf_vocab(path)
        backend = build_backend(vocab, path)
        ids = vocab.special_ids
        eos = tuple(dict.fromkeys(ids[k] for k in ("eos", "eot", "eom") if k in ids))
        tokenizer = cls(backend, special_token_texts(vocab), eos, vocab.chat_template)
        assert tokenizer.add_bos == add_bos(vocab)
        return tokenizer

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        tokenizer_json = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_json):
            raise ModelLoadError(path, "no tokenizer.json in the directory")
        backend = BackendTokenizer.from_file(tokenizer_json)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        special = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
        if "add_bos_token" in config or "add_eos_token" in config:
            # transformers rebuilds the post-processor when the config states these flags; so do we.
            bos = special["bos_token"] if config.get("add_bos_token") else None
            eos = special["eos_token"] if config.get("add_eos_token") else None
            backend.post_processor = bos_eos_processor(bos, eos, backend)
        generation = _read_json(os.path.join(path, "generation_config.json"))
        eos_ids = generation.get("eos_token_id")
        eos_ids = (eos_ids,) if isinstance(eos_ids, int) else tuple(eos_ids or ())
        return cls(backend, special, eos_ids, _hf_chat_template(path, config))

    # --- encode / decode ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special tokens written in the text (e.g. "<|im_start|>") are matched whole."""
        # encode_batch releases the GIL while it works (encode does not): a long prompt tokenized
        # in a worker thread then leaves the event loop free.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    def is_special(self, i: int) -> bool:
        return i in self._special_ids

    def token_bytes(self, i: int) -> bytes:
        """The exact bytes token `i` stands for, which may be part of a UTF-8 character (its
        decoded text would then be U+FFFD)."""
        token = self.backend.id_to_token(i)
        if token is None:
            return b""
        if i in self._added_ids:
            return token.encode()
        if isinstance(self.backend.decoder, decoders.ByteLevel):
            return bytes(_BYTE_VALUES.get(c, 0x3F) for c in token)
        byte = _BYTE_TOKEN.fullmatch(token)
        if byte:
            return bytes([int(byte.group(1), 16)])
        return token.replace("\u2581", " ").encode()

    # --- chat --------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for a conversation. `chat_template=` overrides the model's template;
        `continue_final_message=True` leaves the last message open (see ChatTemplate.render).

        Raises InvalidArgument when there is no template, or it fails or rejects the messages."""
        source = kwargs.pop("chat_template", None)
        template = ChatTemplate(source, self.special_tokens) if source else self._template
        if template is None:
            raise InvalidArgument("this model has no chat template; send a plain prompt instead")
        return template.render(messages, add_generation_prompt, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Render then encode without adding BOS/EOS: the template writes them (as transformers does).

        Control tokens come only from the template. A special token's text written inside the
        messages (content, names), tools or other template variables, such as "<|im_start|>" typed
        by a user, is encoded as plain text, so a message can never fake a turn of another role.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        # What the template reads as data: the messages and its variables (tools, documents, a
        # request's template kwargs); not the template's own source or flags.
        data = (messages, {k: v for k, v in kwargs.items() if k not in ("chat_template", "continue_final_message")})
        if self._special_pattern is None or not _mentions(data, self._special_pattern):
            return self.encode(text, add_special_tokens=False)  # nothing to tell apart: the common case
        defused = _defuse(data, self._special_pattern)
        shadow = self.apply_chat_template(defused[0], add_generation_prompt, **{**kwargs, **defused[1]})
        return self._encode_with_controls(text, self._template_controls(text, shadow))

    def _template_controls(self, text: str, shadow: str) -> list[re.Match]:
        """The special tokens of `text` that the template wrote: those `shadow` (the same render
        with every special token inside the messages replaced by private-use characters) has too."""
        own, expected, at = [], [], 0  # `expected`: text with the messages' special tokens defused
        for m in self._special_pattern.finditer(text):
            if shadow[m.start():m.end()] == m.group():
                own.append(m)
            else:
                expected += [text[at:m.start()], _DEFUSE * len(m.group())]
                at = m.end()
        if "".join(expected) + text[at:] != shadow:  # the template did more than copy the messages
            raise InvalidArgument("the chat template renders messages that contain special tokens differently; "
                                  "remove special tokens such as <|...|> from the messages")
        return own

    def _encode_with_controls(self, text: str, controls: list[re.Match]) -> list[int]:
        """`text` encoded as one piece (so it splits into sections exactly as `encode` would), the
        `controls` as their control tokens and every other special token's text as plain text."""
        if _SENTINEL_MARK in text:
            raise InvalidArgument("the prompt contains the reserved characters U+E001 U+E002")
        backend, controls_of = self._text_only
        parts, at = [], 0
        for m in controls:
            parts += [text[at:m.start()], _SENTINEL.format(self.backend.token_to_id(m.group()))]
            at = m.end()
        ids = backend.encode("".join(parts) + text[at:], add_special_tokens=False).ids
        return [controls_of.get(i, i) for i in ids]

    @functools.cached_property
    def _text_only(self) -> tuple[BackendTokenizer, dict[int, int]]:
        """A copy of the backend that encodes special tokens' text as ordinary text, plus one
        non-special stand-in per special token (same matching flags, so it splits the text the same
        way) and the map from each stand-in's id back to its special token's id."""
        backend = BackendTokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True  # non-special added tokens are still matched
        specials = {i: t for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        stand_ins = [AddedToken(_SENTINEL.format(i), special=False, normalized=False, lstrip=t.lstrip,
                                rstrip=t.rstrip, single_word=t.single_word) for i, t in specials.items()]
        backend.add_tokens(stand_ins)
        return backend, {backend.token_to_id(a.content): i for a, i in zip(stand_ins, specials)}

    def _id_of(self, token: str | None) -> int | None:
        return self.backend.token_to_id(token) if token is not None else None


_DEFUSE = "\ue000"  # a private-use character: stands in for each character of a defused special token
_SENTINEL_MARK = "\ue001\ue002"
_SENTINEL = _SENTINEL_MARK + "{}\ue003"  # stands in for the template's control token of this id while encoding


def _mentions(value: Any, pattern: re.Pattern) -> bool:
    """Whether any string inside `value` (dicts, lists, tuples) contains a special token."""
    if isinstance(value, str):
        return pattern.search(value) is not None
    if isinstance(value, dict):
        return any(_mentions(k, pattern) or _mentions(v, pattern) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_mentions(v, pattern) for v in value)
    return False


def _defuse(value: Any, pattern: re.Pattern) -> Any:
    """`value` with every special token in its strings replaced by as many private-use characters."""
    if isinstance(value, str):
        return pattern.sub(lambda m: _DEFUSE * len(m.group()), value)
    if isinstance(value, dict):
        return {_defuse(k, pattern): _defuse(v, pattern) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_defuse(v, pattern) for v in value)
    return value


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ModelLoadError(path, f"invalid JSON ({e})") from e


def _token_text(value: Any) -> str | None:
    """tokenizer_config writes a special token as a string or as an AddedToken dict {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _hf_chat_template(path: str, config: dict) -> str | None:
    """The default chat template: a string, a list of {name, template}, or a chat_template.jinja file."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    jinja_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    return template
