"""Anthropic Messages replies: a non-streamed MessageResponse gathered from the turn's events, or
the streamed events (message_start, content blocks with running indices, message_delta,
message_stop) that the official SDKs and Claude Code read."""

from __future__ import annotations

import base64
import hashlib
import secrets
import string
from typing import Any, Literal

import msgspec

from semantic.actors.interface import Finished, FinishReason, PromptStarted
from semantic.actors.turns import TurnStarted
from semantic.protocols.answer_turn import CollectedReply, TurnEvent
from semantic.protocols.common import SseWriter
from semantic.protocols.errors import ApiError
from semantic.protocols.reasoning import ThinkingEnd, ThinkingPart
from semantic.protocols.tool_parser import TextPart, ToolArgumentsDelta, ToolCallEnd, ToolCallStart

_ID_ALPHABET = string.ascii_letters + string.digits


class Usage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class OutText(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class OutThinking(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""


class OutToolUse(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


class MessageResponse(msgspec.Struct):
    id: str
    model: str
    content: list[OutThinking | OutText | OutToolUse]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"


def new_id(prefix: str) -> str:
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def thinking_signature(thinking: str) -> str:
    """An opaque signature for a thinking block (clients echo it back with the block; it is not checked)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def _stop_reason(finished: Finished, called_tool: bool) -> str:
    if finished.reason is FinishReason.LENGTH:  # also a call cut off (a forced one stops once closed)
        return "max_tokens"
    if called_tool:
        return "tool_use"
    if finished.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def _usage(started: PromptStarted | None, num_output: int, turn: TurnStarted) -> Usage:
    """As Anthropic counts: tokens read from the cache, tokens of `cache_control` prefixes written to
    it (the pinned prefix past what was read), and the uncached rest."""
    if started is None:
        return Usage(0, num_output)
    num_pinned = max((pin.num_tokens for pin in turn.stream.request.cache_pins), default=0)
    num_created = max(0, min(num_pinned, started.num_prompt_tokens) - started.num_cached_tokens)
    return Usage(
        input_tokens=started.num_prompt_tokens - started.num_cached_tokens - num_created,
        output_tokens=num_output,
        cache_read_input_tokens=started.num_cached_tokens,
        cache_creation_input_tokens=num_created,
    )


class MessageReply(CollectedReply):
    """A non-streaming reply: content blocks gathered into one MessageResponse."""

    def __init__(self, started: TurnStarted, message_id: str) -> None:
        self.started = started
        self.message_id = message_id
        self.content: list[OutThinking | OutText | OutToolUse] = []
        self.prompt: PromptStarted | None = None

    async def event(self, event: TurnEvent) -> None:
        content = self.content
        last = content[-1] if content else None
        match event:
            case PromptStarted():
                self.prompt = event
            case ThinkingPart(text=text):
                if isinstance(last, OutThinking) and not last.signature:
                    last.thinking += text
                else:
                    content.append(OutThinking(text))
            case ThinkingEnd():
                if not isinstance(last, OutThinking):
                    last = OutThinking("")
                    content.append(last)
                last.signature = thinking_signature(last.thinking)
            case TextPart(text=text):
                if isinstance(last, OutText):
                    last.text += text
                else:
                    content.append(OutText(text))
            case ToolCallEnd(name=name, arguments=arguments):
                content.append(OutToolUse(new_id("toolu_"), name, arguments))
            case Finished():
                self.started.check_output_complete()
                self.finished = event

    def body(self) -> MessageResponse:
        finished = self.final
        content = [c for c in self.content if not (isinstance(c, OutText) and not c.text.strip())]
        called_tool = any(isinstance(c, OutToolUse) for c in content)
        return MessageResponse(
            self.message_id,
            self.started.model_name,
            content or [OutText("")],
            _stop_reason(finished, called_tool),
            finished.stop_sequence,
            _usage(self.prompt, finished.num_generated_tokens, self.started),
        )


class MessageStream:
    """A streaming reply: message_start, content_block_start/delta/stop with running indices,
    message_delta, message_stop."""

    def __init__(self, started: TurnStarted, message_id: str, sse: SseWriter) -> None:
        self.started = started
        self.message_id = message_id
        self.sse = sse
        self.prompt: PromptStarted | None = None
        self.index = -1
        self.open_kind: str | None = None
        self.pending_space = ""
        self.called_tool = False
        self.thinking_text = ""

    async def event(self, event: TurnEvent) -> None:
        match event:
            case PromptStarted():
                self.prompt = event
                message = {
                    "id": self.message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": self.started.model_name,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": msgspec.to_builtins(_usage(event, 0, self.started)),
                }
                await self.sse.event("message_start", {"type": "message_start", "message": message})
                await self.sse.ping()
            case ThinkingPart(text=text):
                await self._thinking(text)
            case ThinkingEnd():
                if self.open_kind != "thinking":
                    await self._thinking("")
                await self._delta(
                    {"type": "signature_delta", "signature": thinking_signature(self.thinking_text)}
                )
                await self._close_block()
            case TextPart(text=text):
                await self._text(text)
            case ToolCallStart(name=name):
                self.pending_space = ""
                self.called_tool = True
                block = {"type": "tool_use", "id": new_id("toolu_"), "name": name, "input": {}}
                await self._open_block("tool_use", block)
            case ToolArgumentsDelta(json_text=json_text):
                await self._delta({"type": "input_json_delta", "partial_json": json_text})
            case ToolCallEnd():
                await self._close_block()
            case Finished():
                await self._finish(event)

    async def error(self, error: ApiError) -> None:
        await self.sse.event("error", {"type": "error", "error": {"type": error.kind, "message": str(error)}})

    def body(self) -> object:
        raise AssertionError("a streamed reply has no body: pipeline bug")

    async def _finish(self, finished: Finished) -> None:
        self.started.check_output_complete()
        if self.index < 0:
            await self._open_block("text", {"type": "text", "text": ""})
        await self._close_block()
        delta = {
            "stop_reason": _stop_reason(finished, self.called_tool),
            "stop_sequence": finished.stop_sequence,
        }
        usage = msgspec.to_builtins(_usage(self.prompt, finished.num_generated_tokens, self.started))
        await self.sse.event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        await self.sse.event("message_stop", {"type": "message_stop"})

    async def _close_block(self) -> None:
        if self.open_kind is not None:
            await self.sse.event("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.open_kind = None

    async def _open_block(self, kind: str, block: dict[str, Any]) -> None:
        await self._close_block()
        self.index += 1
        self.open_kind = kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        await self.sse.event("content_block_start", start)

    async def _delta(self, delta: dict[str, Any]) -> None:
        data = {"type": "content_block_delta", "index": self.index, "delta": delta}
        await self.sse.event("content_block_delta", data)

    async def _text(self, text: str) -> None:
        if self.open_kind != "text":
            if not text.strip():
                self.pending_space += text  # whitespace alone does not open a block
                return
            text, self.pending_space = self.pending_space + text, ""
            await self._open_block("text", {"type": "text", "text": ""})
        await self._delta({"type": "text_delta", "text": text})

    async def _thinking(self, text: str) -> None:
        if self.open_kind != "thinking":
            self.thinking_text = ""
            await self._open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        self.thinking_text += text
        await self._delta({"type": "thinking_delta", "thinking": text})
