"""Incremental tool-call parsing: generated text in, content deltas and tool-call deltas out.

The servicer runs one parser per completion over the detokenizer's text deltas, for Stream and
Generate alike, so a stream's assembled deltas equal the whole response by construction; the
parser itself gives the same output however the text is split (tests split at every byte).

Rules, the same for every format (formats.py):
- Text outside call regions is content. A possible start of the call markup is held back until
  it cannot be one, so markup never leaks into content; whitespace next to markup, and at the
  end, is dropped.
- A call's first delta carries its id and name; later deltas carry the next fragment of the
  arguments' JSON text, exactly as generated (trailing whitespace is held until more follows).
  A call whose arguments come before its name is sent once its name is known.
- With `calls_only` (tool_choice required or a named function, whose grammar admits calls alone),
  a start tag cut short at the end is dropped, not flushed as content.
- An unterminated call (max_tokens) keeps the arguments generated so far, and nothing more: a
  call cut before its arguments has none ("" rather than an invented "{}"), and it is not
  `complete` (a call whose object closed without arguments has "{}").
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from forge_service.tools.formats import ToolCallFormat

_ARGUMENT_KEYS = ("arguments", "parameters")
_BETWEEN_OBJECTS = " \t\r\n[],;"


@dataclass
class ToolCallDelta:
    """A piece of call `index`: id and name in its first piece, then argument fragments."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False  # its JSON object closed: the arguments are whole


@dataclass
class _Object:
    """One JSON object of a call region, scanned character by character."""

    text: str = ""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    expect_key: bool = True
    key: str | None = None
    key_start: int = -1
    value_start: int = -1
    values: dict[str, str] = field(default_factory=dict)
    call: int = -1  # index into the parser's calls once announced
    sent: int = 0  # characters of the raw arguments already sent

    def feed(self, ch: str) -> bool:
        """Take one character; True when it closed the object."""
        at = len(self.text)
        self.text += ch
        if self.in_string:
            self._string_char(ch, at)
            return False
        if ch == '"':
            self.in_string = True
            if self.depth == 1 and self.expect_key:
                self.key_start = at
            else:
                self._maybe_value_start(at)
        elif ch in "{[":
            self.depth += 1
            self._maybe_value_start(at)
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.end_value(at)
                return True
        elif self.depth == 1 and ch == ":":
            self.expect_key = False
        elif self.depth == 1 and ch == ",":
            self.end_value(at)
            self.expect_key = True
        elif not ch.isspace():
            self._maybe_value_start(at)
        return False

    def _string_char(self, ch: str, at: int) -> None:
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.in_string = False
            if self.depth == 1 and self.expect_key and self.key_start >= 0:
                self.key = _loads_str(self.text[self.key_start:at + 1])
                self.key_start = -1

    def _maybe_value_start(self, at: int) -> None:
        depth = self.depth - 1 if self.text[at] in "{[" else self.depth
        if depth == 1 and not self.expect_key and self.value_start < 0 and self.key is not None:
            self.value_start = at

    def end_value(self, at: int) -> None:
        if self.key is not None and self.value_start >= 0:
            self.values[self.key] = self.text[self.value_start:at].strip()
        self.key, self.value_start = None, -1

    def string_value_started(self) -> bool:
        return self.value_start >= 0 and self.text[self.value_start] == '"'


def _loads_str(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


class ToolCallParser:
    """Splits one completion's text into content and tool calls, incrementally."""

    def __init__(self, fmt: ToolCallFormat, make_id: Callable[[], str], calls_only: bool = False) -> None:
        self.format = fmt
        self._calls_only = calls_only
        self._start, self._end = fmt.start.strip(), fmt.end.strip()
        self._make_id = make_id
        self.calls: list[ParsedCall] = []
        self._buf = ""
        self._in_region = False
        self._object: _Object | None = None
        self._pending_ws = ""
        self._strip_lead = not self._start  # untagged: leading whitespace never counts
        self._at_start = True
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content and call pieces completed by `text`."""
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Everything still held back, at the end of the completion."""
        self._run(final=True)
        if self._in_region and self._object is not None:
            self._close_object()
        if not self._in_region and self._buf and not self._calls_only:
            self._emit_content(self._buf)
        self._buf, self._pending_ws = "", ""
        return self._take()

    # ---- text outside regions ---------------------------------------------------------

    def _run(self, final: bool) -> None:
        while self._buf:
            progressed = self._scan_region() if self._in_region else self._scan_text(final)
            if not progressed:
                return

    def _scan_text(self, final: bool) -> bool:
        if not self._start:
            return self._scan_untagged()
        at = self._buf.find(self._start)
        if at >= 0:
            self._emit_content(self._buf[:at])
            self._pending_ws = ""
            self._buf = self._buf[at + len(self._start):]
            self._open_region()
            return True
        keep = 0 if final and not self._calls_only else _partial_suffix(self._buf, self._start)
        self._emit_content(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _scan_untagged(self) -> bool:
        """A region opens only if the output's first non-space character is '{'."""
        if self._at_start:
            stripped = self._buf.lstrip()
            if not stripped:
                return False
            self._at_start = False
            if stripped[0] == "{":
                self._buf = stripped
                self._open_region()
                return True
        self._emit_content(self._buf)
        self._buf = ""
        return False

    def _open_region(self) -> None:
        self._in_region, self._at_start = True, False

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        if self._strip_lead:
            text = text.lstrip()
            if not text:
                return
            self._strip_lead = False
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        if body:
            self._content.append(body)

    # ---- call regions -----------------------------------------------------------------

    def _scan_region(self) -> bool:
        obj = self._object
        i = 0
        while i < len(self._buf):
            if self._end and (obj is None or not obj.in_string):
                if self._buf.startswith(self._end, i):
                    self._consume(i)
                    self._buf = self._buf[len(self._end):]
                    if obj is not None:
                        self._close_object()
                    self._in_region, self._strip_lead = False, True
                    return True
                if len(self._buf) - i < len(self._end) and self._end.startswith(self._buf[i:]):  # wait for more
                    self._consume(i)
                    return False
            ch = self._buf[i]
            if obj is None:
                if ch == "{":
                    obj = self._object = _Object()
                    obj.feed(ch)
            elif obj.feed(ch):
                self._consume(i + 1)
                self._close_object()
                return True
            i += 1
        self._consume(i)
        return False

    def _consume(self, upto: int) -> None:
        self._buf = self._buf[upto:]
        if self._object is not None:
            self._announce(self._object, closed=False)

    def _announce(self, obj: _Object, closed: bool) -> None:
        name = obj.values.get("name")
        name = _loads_str(name) if name is not None else None
        if name is None:
            return
        if obj.call < 0:
            obj.call = len(self.calls)
            self.calls.append(ParsedCall(self._make_id(), name))
            self._deltas.append(ToolCallDelta(obj.call, self.calls[obj.call].id, name))
        self._send_arguments(obj, closed)

    def _send_arguments(self, obj: _Object, closed: bool) -> None:
        key = next((k for k in _ARGUMENT_KEYS if k in obj.values or obj.key == k), None)
        if key is None:
            if closed and not obj.sent:  # an object without arguments
                self._append_arguments(obj, "{}")
            return
        raw = obj.values.get(key)
        if raw is None:  # still being generated
            if obj.string_value_started():
                return
            raw = obj.text[obj.value_start:].rstrip() if obj.value_start >= 0 else ""
        elif raw.startswith('"'):  # arguments sent as a JSON string: send its content
            raw = _loads_str(raw) or ""
        self._append_arguments(obj, raw[obj.sent:])

    def _append_arguments(self, obj: _Object, piece: str) -> None:
        if not piece:
            return
        obj.sent += len(piece)
        self.calls[obj.call].arguments += piece
        self._deltas.append(ToolCallDelta(obj.call, arguments=piece))

    def _close_object(self) -> None:
        obj = self._object
        assert obj is not None
        closed = obj.depth == 0
        if not closed and not obj.in_string:  # cut short (end tag or end of output)
            obj.end_value(len(obj.text))
        self._announce(obj, closed)
        if closed and obj.call >= 0:
            self.calls[obj.call].complete = True
        self._object = None

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
