"""Anthropic Messages API: `POST /v1/messages` (SSE or JSON) and `POST /v1/messages/count_tokens`.

The handlers parse the body into a turn (`anthropic_wire`) and render the turn's events as
Anthropic's content blocks; the pipeline does the rest.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import string
from typing import Any, Literal

import msgspec
from aiohttp import web

from semantic.actors.turns import PromptLimitError, TurnRequest, TurnStarted, UnsupportedContentError
from semantic.engine.engine import PromptTooLongError
from semantic.engine.messages import Finished, FinishReason, PromptStarted
from semantic.protocols.anthropic_wire import (
    MessagesRequest,
    decode_request,
    output_schema,
    split_prefill,
    to_chat_messages,
    tool_choice,
    tool_schemas,
)
from semantic.protocols.common import SYSTEM_KEY, SseWriter, json_response
from semantic.protocols.errors import ApiError
from semantic.protocols.observe import admit
from semantic.protocols.pipeline import CollectedReply, TurnEvent, TurnReply, answer_turn, sampling_params
from semantic.protocols.reasoning import ThinkingEnd, ThinkingPart
from semantic.protocols.tenancy import request_agent_id, scoped_cache_salt
from semantic.protocols.tool_parser import TextPart, ToolArgumentsDelta, ToolCallEnd, ToolCallStart

_ID_ALPHABET = string.ascii_letters + string.digits
PING_FRAME = b'event: ping\ndata: {"type":"ping"}\n\n'


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


class TokenCount(msgspec.Struct):
    input_tokens: int


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
    """An opaque signature for a thinking block (clients echo it back; we never replay reasoning)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def to_turn(request: web.Request, body: MessagesRequest, counting: bool = False) -> TurnRequest:
    """The turn a Messages request asks for, validated as Anthropic validates it."""
    if not body.messages:
        raise ApiError("messages: at least one message is required")
    if body.max_tokens is None and not counting:
        raise ApiError("max_tokens: Field required")
    if body.temperature is not None and not 0.0 <= body.temperature <= 1.0:
        raise ApiError(f"temperature: {body.temperature} is out of range: 0..1")
    messages = to_chat_messages(body)
    if not messages:
        raise UnsupportedContentError("messages: none has content the model can read (only thinking blocks)")
    prefill = split_prefill(messages)
    sampling = sampling_params(
        request,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=None,  # the Messages API has no seed
        max_tokens=body.max_tokens,
        stop=tuple(body.stop_sequences),
    )
    return TurnRequest(
        request_id=new_id("msg_"),
        agent_id=request_agent_id(request),
        cache_salt=scoped_cache_salt(request, body.cache_salt),
        messages=messages,
        sampling=sampling,
        model=body.model,
        tools=tool_schemas(body.tools),
        tool_choice=tool_choice(body.tool_choice),
        prefill=prefill,
        output_schema=output_schema(body),
    )


async def messages(request: web.Request) -> web.StreamResponse:
    body = decode_request(await request.read())
    turn = to_turn(request, body)

    def reply(started: TurnStarted, sse: SseWriter | None) -> TurnReply:
        return MessageStream(started, turn.request_id, sse) if sse else MessageReply(started, turn.request_id)

    try:
        return await answer_turn(request, turn, body.stream, reply, PING_FRAME)
    except (PromptTooLongError, PromptLimitError) as error:  # the wording Claude Code acts on
        raise ApiError(f"prompt is too long: {error.num_tokens} tokens > {error.limit} maximum") from error


async def count_tokens(request: web.Request) -> web.Response:
    turn = to_turn(request, decode_request(await request.read()), counting=True)
    admit(request, turn.agent_id)
    num_tokens = await request.app[SYSTEM_KEY].count_tokens(turn)
    return json_response(TokenCount(num_tokens))


def _stop_reason(finished: Finished, called_tool: bool) -> str:
    if finished.reason is FinishReason.LENGTH:  # also a call cut off (a forced one stops once closed)
        return "max_tokens"
    if called_tool:
        return "tool_use"
    if finished.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def _usage(started: PromptStarted | None, num_output: int) -> Usage:
    if started is None:
        return Usage(0, num_output)
    return Usage(
        input_tokens=started.num_prompt_tokens - started.num_cached_tokens,
        output_tokens=num_output,
        cache_read_input_tokens=started.num_cached_tokens,
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
            _usage(self.prompt, finished.num_generated_tokens),
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
                    "usage": msgspec.to_builtins(_usage(event, 0)),
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
        if self.index < 0:
            await self._open_block("text", {"type": "text", "text": ""})
        await self._close_block()
        delta = {
            "stop_reason": _stop_reason(finished, self.called_tool),
            "stop_sequence": finished.stop_sequence,
        }
        usage = msgspec.to_builtins(_usage(self.prompt, finished.num_generated_tokens))
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


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
