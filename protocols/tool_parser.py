"""Tool calls out of generated text, streamed: text, then a call's name, then its arguments.

Reads the forms common chat models use: Hermes/Qwen `<tool_call>{"name", "arguments"}</tool_call>`,
Mistral `[TOOL_CALLS][{...}]`, Llama 3.x `<|python_tag|>{...}` or a bare `{"name", "parameters"}`
object as the whole reply. A call's arguments are passed on while they are generated; text that
only looked like a call comes back as text, never as an error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_OPENERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
_CLOSERS = ("</tool_call>", "<|eom_id|>", "<|eot_id|>")
_HEAD = re.compile(r'\s*\[?\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_BARE_START = '{"name"'


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(frozen=True, slots=True)
class ToolArgumentsDelta:
    index: int
    json_text: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int
    name: str
    arguments: dict[str, Any]


ParsedPart = TextPart | ToolCallStart | ToolArgumentsDelta | ToolCallEnd


class _JsonScanner:
    """Tracks nesting of a JSON value as it arrives, to know where it ends and how to close it."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.in_string = False
        self.escaped = False
        self.started = False

    def feed(self, char: str) -> bool:
        """Consume one character; True once the value is complete (after its closing bracket)."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
            return False
        if char in "{[":
            self.stack.append("}" if char == "{" else "]")
            self.started = True
        elif char in "}]":
            if self.stack:
                self.stack.pop()
            return self.started and not self.stack
        elif char == '"':
            self.in_string = True
            self.started = True
        return False

    def closing(self) -> str:
        return ('"' if self.in_string else "") + "".join(reversed(self.stack))


class ToolCallParser:
    """Feed generated text in pieces; get text and tool-call parts back in order."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.num_calls = 0
        self._buffer = ""
        self._in_call = False
        self._seen_text = False
        self._name: str | None = None
        self._arguments = ""
        self._scanner = _JsonScanner()
        self._arguments_done = False
        self._raw = ""

    def feed(self, text: str) -> list[ParsedPart]:
        if not self.enabled:
            return [TextPart(text)] if text else []
        self._buffer += text
        parts: list[ParsedPart] = []
        while self._buffer:
            before = (self._buffer, self._in_call)
            parts += self._call_step() if self._in_call else self._text_step()
            if (self._buffer, self._in_call) == before:
                break
        return parts

    def finish(self) -> list[ParsedPart]:
        """End of generation: settle a call that was cut short and release held-back text."""
        if not self.enabled:
            return []
        parts: list[ParsedPart] = []
        if self._in_call:
            parts += self._end_call(at_end=True)
        elif self._buffer:
            parts.append(TextPart(self._buffer))
            self._buffer = ""
        return parts

    def _text_step(self) -> list[ParsedPart]:
        buffer = self._buffer
        starts = [(buffer.find(opener), opener) for opener in _OPENERS if opener in buffer]
        if not self._seen_text and buffer.lstrip().startswith(_BARE_START):
            self._open_call(buffer[: len(buffer) - len(buffer.lstrip())], buffer.lstrip(), "")
            return []
        if starts:
            at, opener = min(starts)
            before = buffer[:at]
            self._open_call(before, buffer[at + len(opener) :], opener)
            return [TextPart(before)] if before else []
        keep = _held_back(buffer, self._seen_text)
        emit = buffer[: len(buffer) - keep]
        self._buffer = buffer[len(emit) :]
        if emit:
            if emit.strip():
                self._seen_text = True
            return [TextPart(emit)]
        return []

    def _open_call(self, before: str, rest: str, opener: str) -> None:
        if before.strip():
            self._seen_text = True
        self._in_call = True
        self._buffer = rest
        self._raw = opener
        self._name = None
        self._arguments = ""
        self._scanner = _JsonScanner()
        self._arguments_done = False

    def _call_step(self) -> list[ParsedPart]:
        parts: list[ParsedPart] = []
        if self._name is None:
            head = _HEAD.match(self._buffer)
            if head is not None and head.end() == len(self._buffer):
                return []  # whitespace after the key may go on; wait for the value's first character
            if head is None:
                closer = _first_closer(self._buffer)
                if closer is not None or (len(self._buffer) > 200 and '"name"' not in self._buffer):
                    return self._end_call(at_end=False)
                return []
            self._name = json.loads(f'"{head.group(1)}"')
            self._raw += self._buffer[: head.end()]
            self._buffer = self._buffer[head.end() :]
            parts.append(ToolCallStart(self.num_calls, self._name))
        if not self._arguments_done:
            consumed = 0
            for char in self._buffer:
                consumed += 1
                if self._scanner.feed(char):
                    self._arguments_done = True
                    break
            piece = self._buffer[:consumed]
            self._arguments += piece
            self._raw += piece
            self._buffer = self._buffer[consumed:]
            if piece:
                parts.append(ToolArgumentsDelta(self.num_calls, piece))
        if self._arguments_done:
            closer = _first_closer(self._buffer)
            if closer is not None:
                at, token = closer
                self._buffer = self._buffer[at + len(token) :]
                parts += self._end_call(at_end=False, consumed_closer=True)
            elif self._buffer.lstrip().startswith(("}", "]")):
                self._buffer = self._buffer.lstrip()[1:]
        return parts

    def _end_call(self, at_end: bool, consumed_closer: bool = False) -> list[ParsedPart]:
        self._in_call = False
        name = self._name
        if name is None:
            # Never became a call: give the text back, closer included.
            raw, self._raw = self._raw + self._buffer, ""
            self._buffer = ""
            self._seen_text = True
            return [TextPart(raw)] if raw else []
        parts: list[ParsedPart] = []
        arguments_text = self._arguments
        if not self._arguments_done:
            closing = self._scanner.closing()
            if closing:
                parts.append(ToolArgumentsDelta(self.num_calls, closing))
                arguments_text += closing
        if at_end and not consumed_closer:
            self._buffer = ""
        arguments = _decode_arguments(arguments_text)
        parts.append(ToolCallEnd(self.num_calls, name, arguments))
        self.num_calls += 1
        self._name = None
        self._raw = ""
        return parts


def _decode_arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return {}
    return value if isinstance(value, dict) else {}


def _first_closer(text: str) -> tuple[int, str] | None:
    found = [(text.find(closer), closer) for closer in _CLOSERS if closer in text]
    return min(found) if found else None


def _held_back(buffer: str, seen_text: bool) -> int:
    """How many trailing characters might be the start of a call marker."""
    if not seen_text and _BARE_START.startswith(buffer.lstrip()):
        return len(buffer)
    for size in range(min(len(buffer), max(len(o) for o in _OPENERS)), 0, -1):
        tail = buffer[-size:]
        if any(opener.startswith(tail) for opener in _OPENERS):
            return size
    return 0
