"""Tool calls out of generated text, streamed: text as it arrives, then each call once it is closed.

The served model's format (`actors/prompting/tool_format.py`) gives the markers around a call block and the
parser of what is between them, both from mlx-lm. mlx-lm's own `TextStateMachine` splits the
stream at the markers, holding back only what may be the start of one; a closed block goes to
mlx-lm's `parse_tool_call` with the request's tools (its parsers type the arguments by the tools'
schemas), and each call in it comes out as ToolCallStart, one ToolArgumentsDelta holding the
arguments' JSON, and ToolCallEnd.

Ours, where mlx-lm has nothing (its server drops what fails to parse and takes what parses as is):
- a block that no parser reads comes back as text, markers included, so text that only looked
  like a call stays text;
- a JSON call with trailing junk is read up to its value's end, and one cut off by the end of
  generation (max_tokens) is closed into valid JSON;
- each parsed call is checked (a name, arguments an object; arguments sent as a JSON string
  decoded, Llama's `parameters` read as `arguments`);
- a reply that opens with a bare `{"name"` object is a call, for Llama 3.x;
- a call's inner block written without the block's own markers (Qwen3-Coder's `<function=...>`
  without `<tool_call>`) is a call;
- the block's closer written again right after a call closed (nothing but whitespace between) is a
  stray marker, dropped, not text;
- what went wrong with a call (cut off, unreadable) is kept in `failures`, for the log.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlx_lm.generate import TextStateMachine

from semantic.actors.interface import HERMES, ToolFormat, ToolSchemas

_BARE_CALL = '{"name"'


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


class ToolCallParser:
    """Feed generated text in pieces; get text and tool-call parts back in order."""

    def __init__(
        self, tool_format: ToolFormat = HERMES, tools: ToolSchemas | None = None, enabled: bool = True
    ) -> None:
        self.enabled = enabled
        self.num_calls = 0
        self._format = tool_format
        self._tools = tools
        ends = [(tool_format.end, "normal")] if tool_format.end else []
        starts = [(tool_format.start, "tool")]
        states = {"normal": starts, "tool": ends}
        if tool_format.inner_start:
            starts.append((tool_format.inner_start, "inner"))
            states["inner"] = [(tool_format.inner_end, "normal")]
        self._machine = TextStateMachine(states)
        self.failures: list[str] = []  # what went wrong with calls, for the log
        self._state = self._machine.make_state("normal")
        self._call_opener: str | None = None  # the marker that opened the block being read
        self._call_text = ""
        # Held while the reply may still open with a bare JSON call (None: it cannot any more).
        self._reply_head: str | None = "" if tool_format.bare_json_calls else None
        # Held after a call closed, while the text may still be its closer written again (None: not).
        self._after_call: str | None = None

    def feed(self, text: str) -> list[ParsedPart]:
        if not self.enabled:
            return [TextPart(text)] if text else []
        if self._reply_head is not None:
            text = self._read_reply_head(text)
        self._state, segments = TextStateMachine.split(self._state, text)
        parts: list[ParsedPart] = []
        for at, (state, piece) in enumerate(segments):
            if state != "normal":
                if self._after_call:  # whitespace between two calls: the reply's text
                    parts.append(TextPart(self._after_call))
                self._after_call = None
                if self._call_opener is None:
                    self._call_opener = self._format.start if state == "tool" else self._format.inner_start
                self._call_text += piece
                continue
            if self._call_opener is not None:
                if not self._is_inner and _ends_inside_a_json_string(self._call_text):
                    return parts + self._reread_as_call(_rejoin(segments[at:], self._format))
                parts += self._close_call(self._format.inner_end if self._is_inner else self._format.end)
            if self._after_call is not None:
                piece = self._past_a_stray_closer(piece)
            if piece:
                parts.append(TextPart(piece))
        return parts

    def _past_a_stray_closer(self, piece: str) -> str:
        """The text after a closed call, less the block's closer where the model wrote it again; held
        back while it may still be that closer."""
        held = (self._after_call or "") + piece
        stripped, closer = held.lstrip(), self._format.end
        if stripped.startswith(closer):
            self._after_call = None
            self.failures.append(f"a stray {closer} after a call, dropped")
            return stripped[len(closer) :]
        if closer.startswith(stripped):  # whitespace, or the closer's beginning: wait for more
            self._after_call = held
            return ""
        self._after_call = None
        return held

    @property
    def _is_inner(self) -> bool:
        return bool(self._format.inner_start) and self._call_opener == self._format.inner_start

    def _reread_as_call(self, text: str) -> list[ParsedPart]:
        """The closer was inside a JSON string argument: it and what followed are the call's text."""
        self._call_text += self._format.end
        self._state, held_back, _ = TextStateMachine.flush(self._state)
        self._state = self._machine.make_state("tool")
        return self.feed(text + held_back)

    def finish(self) -> list[ParsedPart]:
        """End of generation: settle a call block left open and release held-back text."""
        if not self.enabled:
            return []
        head, self._reply_head = self._reply_head, None
        parts = self.feed(head) if head else []
        self._state, rest, state = TextStateMachine.flush(self._state)
        if state != "normal":
            self._call_text += rest
            self.failures.append(f"the reply ended inside a call: {_preview(self._call_text)}")
            return parts + self._close_call("")
        held, self._after_call = self._after_call or "", None  # not a whole closer: the reply's text
        rest = held + rest
        return parts + ([TextPart(rest)] if rest else [])

    def _read_reply_head(self, text: str) -> str:
        """Hold the reply's start while it may be a bare call; return what the markers should see."""
        head = (self._reply_head or "") + text
        stripped = head.lstrip()
        if stripped.startswith(_BARE_CALL):
            self._reply_head = None
            self._state = self._machine.make_state("tool")
            self._call_opener = ""
            self._call_text = head
            return ""
        if _BARE_CALL.startswith(stripped):
            self._reply_head = head
            return ""
        self._reply_head = None
        return head

    def _close_call(self, closer: str) -> list[ParsedPart]:
        opener, body = self._call_opener or "", self._call_text
        self._call_opener, self._call_text = None, ""
        is_inner = bool(self._format.inner_start) and opener == self._format.inner_start
        calls = self._parse(opener + body + closer if is_inner else body)
        if calls is None:
            self.failures.append(
                f"no parser reads the call, sent as text: {_preview(opener + body + closer)}"
            )
            return [TextPart(opener + body + closer)]
        parts: list[ParsedPart] = []
        for name, arguments in calls:
            index = self.num_calls
            self.num_calls += 1
            json_text = json.dumps(arguments, ensure_ascii=False)
            parts += [ToolCallStart(index, name), ToolArgumentsDelta(index, json_text)]
            parts.append(ToolCallEnd(index, name, arguments))
        if self._format.end:
            self._after_call = ""
        return parts

    def _parse(self, body: str) -> list[tuple[str, dict[str, Any]]] | None:
        for candidate in _readings(body):
            try:
                parsed = self._format.parse(candidate, self._tools)
            except Exception:  # mlx-lm's parsers fail in many ways on what is no call
                continue
            calls = _checked_calls(parsed)
            if calls:
                return calls
        return None


def _readings(body: str) -> list[str]:
    """The block as written, then its first JSON value alone, then closed as if cut off."""
    readings = [body]
    starts = [at for at in (body.find("{"), body.find("[")) if at >= 0]
    if starts:
        start = min(starts)
        try:
            _, end = json.JSONDecoder().raw_decode(body, start)
            readings.append(body[:end])
        except json.JSONDecodeError:
            readings.append(body + _closing(body[start:]))
    return readings


def _checked_calls(parsed: object) -> list[tuple[str, dict[str, Any]]] | None:
    calls = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append((call["name"], arguments))
    return calls or None


def _preview(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _rejoin(segments: list[tuple[str, str]], tool_format: ToolFormat) -> str:
    """The text the state machine split into `segments` (from a normal one on), markers put back."""
    text, previous = "", "normal"
    for state, piece in segments:
        if state != previous:
            markers = {"tool": tool_format.start, "inner": tool_format.inner_start}
            text += markers.get(state, tool_format.inner_end if previous == "inner" else tool_format.end)
        text += piece
        previous = state
    return text


def _ends_inside_a_json_string(call_text: str) -> bool:
    """Whether a JSON call's text so far ends inside a string (where a closer is only text)."""
    body = call_text.lstrip()
    if not body.startswith(("{", "[")):
        return False
    in_string = escaped = False
    for char in body:
        if escaped:
            escaped = False
        elif in_string and char == "\\":
            escaped = True
        elif char == '"':
            in_string = not in_string
    return in_string


def _closing(json_text: str) -> str:
    """What closes a JSON value cut off part-way: an open string, then the open brackets."""
    closers: list[str] = []
    in_string = escaped = False
    for char in json_text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            closers.append("}" if char == "{" else "]")
        elif char in "}]" and closers:
            closers.pop()
    return ('"' if in_string else "") + "".join(reversed(closers))
