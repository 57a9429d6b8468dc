"""Anthropic Messages API: `POST /v1/messages` (SSE or JSON) and `POST /v1/messages/count_tokens`.

What Claude Code sends is accepted as it is: system blocks with `cache_control`, system messages
mid-conversation, tool results as strings or blocks, thinking blocks echoed back, and top-level
fields we have no use for. Volatile system lines (the per-request billing header) are dropped
before rendering so consecutive turns share their cached prefix.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import secrets
import string
from typing import Any, Literal

import msgspec
from aiohttp import web

from semantic.actors.agent import AgentStoppedError, MailboxFullError
from semantic.actors.identity import InvalidAgentIdError, agent_id_from
from semantic.actors.system import AgentSystem, ModelUnavailableError
from semantic.engine.chat_format import ChatFormat, ChatMessage, ChatTemplateError
from semantic.engine.engine import ModelChangedError, PromptTooLongError
from semantic.engine.messages import Finished, FinishReason, PromptProgress, PromptStarted
from semantic.engine.registry import UnknownModelError
from semantic.engine.sampling import SamplingParams
from semantic.protocols.common import (
    SETTINGS_KEY,
    SYSTEM_KEY,
    parsed_events,
    ready_model,
    sse_response,
)
from semantic.protocols.errors import ApiError
from semantic.protocols.errors import anthropic_error as error_response
from semantic.protocols.observe import admit, check_bounds, watch
from semantic.protocols.reasoning import ReasoningSplitter, ThinkingEnd, ThinkingPart, prompt_opens_thinking
from semantic.protocols.tool_parser import (
    TextPart,
    ToolArgumentsDelta,
    ToolCallEnd,
    ToolCallParser,
    ToolCallStart,
)

PING_INTERVAL_S = 5.0
_VOLATILE_LINES = re.compile(r"^x-anthropic-billing-header:.*(?:\n|$)", re.MULTILINE)
_ID_ALPHABET = string.ascii_letters + string.digits


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImageBlock(msgspec.Struct, tag="image", tag_field="type"):
    source: dict[str, Any] = msgspec.field(default_factory=dict)


class DocumentBlock(msgspec.Struct, tag="document", tag_field="type"):
    source: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", tag_field="type"):
    data: str = ""


ContentBlock = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class Message(msgspec.Struct):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(msgspec.Struct):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = msgspec.field(default_factory=dict)
    type: str | None = None


class ToolChoice(msgspec.Struct):
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(msgspec.Struct):
    messages: list[Message]
    model: str | None = None
    max_tokens: int | None = None
    system: str | list[TextBlock] | None = None
    stream: bool = False
    stop_sequences: list[str] = msgspec.field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Tool] = msgspec.field(default_factory=list)
    tool_choice: ToolChoice | None = None


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


_decode_request = msgspec.json.Decoder(MessagesRequest).decode
_encode = msgspec.json.Encoder().encode


def new_id(prefix: str) -> str:
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


class UnsupportedContentError(ValueError):
    pass


def system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None:
        return None
    text = system if isinstance(system, str) else "\n\n".join(block.text for block in system)
    return _VOLATILE_LINES.sub("", text).strip("\n") or None


def _text_of(blocks: str | list[Any] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    texts = []
    for block in blocks:
        if isinstance(block, ImageBlock | DocumentBlock):
            raise UnsupportedContentError(_NO_VISION)
        texts.append(block.text)
    return "\n".join(texts)


_NO_VISION = "image and document blocks are not supported: the served model reads text only"


def to_chat_messages(body: MessagesRequest) -> list[ChatMessage]:
    """Anthropic messages in the chat-template form (tool results become `tool` turns)."""
    chat: list[ChatMessage] = []
    system = system_text(body.system)
    if system:
        chat.append({"role": "system", "content": system})
    for message in body.messages:
        if isinstance(message.content, str):
            chat.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in message.content:
            match block:
                case TextBlock(text=text):
                    texts.append(text)
                case ToolUseBlock(id=call_id, name=name, input=arguments):
                    calls.append(
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": arguments},
                        }
                    )
                case ToolResultBlock(tool_use_id=call_id, content=content, is_error=is_error):
                    result = _text_of(content)
                    chat.append(
                        {
                            "role": "tool",
                            "tool_call_id": call_id,
                            "content": f"Error: {result}" if is_error else result,
                        }
                    )
                case ImageBlock() | DocumentBlock():
                    raise UnsupportedContentError(_NO_VISION)
                case ThinkingBlock() | RedactedThinkingBlock():
                    pass  # our models' reasoning is not replayed; keeps the prompt stable
        if message.role == "assistant":
            if texts or calls:
                entry: ChatMessage = {"role": "assistant", "content": "".join(texts)}
                if calls:
                    entry["tool_calls"] = calls
                chat.append(entry)
        elif texts:
            chat.append({"role": message.role, "content": "\n\n".join(texts)})
    return chat


def tool_schemas(tools: list[Tool]) -> list[dict[str, Any]] | None:
    """Client tools as JSON-schema function specs; server tools (no schema) are left out."""
    specs = [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description or "",
                "parameters": tool.input_schema,
            },
        }
        for tool in tools
        if tool.input_schema
    ]
    return specs or None


def forced_prefix(chat: ChatFormat, choice: ToolChoice | None, tool_names: list[str]) -> str:
    """Text to start the reply with so the model must call a tool (`any`) or a named one (`tool`)."""
    if choice is None or not tool_names or choice.type in ("auto", "none"):
        return ""
    name = choice.name if choice.type == "tool" else (tool_names[0] if len(tool_names) == 1 else None)
    return chat.forced_call_prefix(name)


class PreparedRequest(msgspec.Struct):
    prompt: list[int]
    prefix: str
    parse_tools: bool
    starts_in_thinking: bool

    def reasoning(self) -> ReasoningSplitter | None:
        """How to read the reply's `<think>` block; none after a forced tool call's opening."""
        return None if self.prefix else ReasoningSplitter(inside=self.starts_in_thinking)


def prepare(system: AgentSystem, body: MessagesRequest) -> PreparedRequest:
    chat = system.chat_format
    tools = tool_schemas(body.tools)
    messages = to_chat_messages(body)
    if not messages:
        raise UnsupportedContentError("messages: none has content the model can read (only thinking blocks)")
    # A final assistant message is a prefill: the reply continues it (it is not echoed back).
    prefill = ""
    last = messages[-1]
    if last["role"] == "assistant" and isinstance(last.get("content"), str) and not last.get("tool_calls"):
        prefill = messages.pop()["content"]
    prefix = forced_prefix(chat, body.tool_choice, [t["function"]["name"] for t in tools or ()])
    text = chat.render(messages, tools) + prefill + prefix
    parse_tools = tools is not None and not (body.tool_choice and body.tool_choice.type == "none")
    return PreparedRequest(chat.encode(text), prefix, parse_tools, prompt_opens_thinking(text))


async def _decode(request: web.Request) -> MessagesRequest | web.Response:
    try:
        body = _decode_request(await request.read())
    except msgspec.ValidationError as error:
        return error_response(400, f"invalid request body: {error}")
    except msgspec.DecodeError as error:
        return error_response(400, f"request body is not valid JSON: {error}")
    if not body.messages:
        return error_response(400, "messages: at least one message is required")
    return body


async def count_tokens(request: web.Request) -> web.Response:
    system = request.app[SYSTEM_KEY]
    body = await _decode(request)
    if isinstance(body, web.Response):
        return body
    try:
        await ready_model(system, body.model)
        prepared = prepare(system, body)
    except UnknownModelError as error:
        return error_response(404, str(error))
    except ModelUnavailableError as error:
        return error_response(529, str(error))
    except (UnsupportedContentError, ChatTemplateError) as error:
        return error_response(400, str(error))
    return web.Response(body=_encode(TokenCount(len(prepared.prompt))), content_type="application/json")


def _stop_reason(finished: Finished, called_tool: bool) -> str:
    if called_tool:
        return "tool_use"
    if finished.reason is FinishReason.LENGTH:
        return "max_tokens"
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


async def messages(request: web.Request) -> web.StreamResponse:
    system = request.app[SYSTEM_KEY]
    settings = request.app[SETTINGS_KEY]
    body = await _decode(request)
    if isinstance(body, web.Response):
        return body
    check_bounds(
        request, max_tokens=body.max_tokens, num_messages=len(body.messages), num_tools=len(body.tools or ())
    )
    try:
        model = await ready_model(system, body.model)
        agent_id = agent_id_from(request.headers)
        sampling = SamplingParams(
            temperature=settings.model.temperature if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            max_tokens=body.max_tokens or settings.model.default_max_tokens,
            stop=tuple(body.stop_sequences),
        )
        prepared = prepare(system, body)
        check_bounds(request, num_prompt_tokens=len(prepared.prompt))
        admit(request, agent_id)
        stream = watch(
            request,
            await system.generate(agent_id, prepared.prompt, sampling, model_fingerprint=model.fingerprint),
        )
    except UnknownModelError as error:
        return error_response(404, str(error))
    except (ModelUnavailableError, ModelChangedError) as error:
        return error_response(529, str(error))
    except (InvalidAgentIdError, UnsupportedContentError, ChatTemplateError, PromptTooLongError) as error:
        return error_response(400, str(error))
    except ValueError as error:
        return error_response(400, str(error))
    except MailboxFullError as error:
        return error_response(429, str(error))
    except AgentStoppedError as error:
        return error_response(529, str(error))
    parser = ToolCallParser(enabled=prepared.parse_tools)
    message_id = new_id("msg_")
    if body.stream:
        return await _stream(request, stream, parser, prepared, message_id, model.name)

    content: list[OutThinking | OutText | OutToolUse] = []
    started: PromptStarted | None = None
    finished: Finished | None = None
    try:
        async for event in parsed_events(stream, parser, prepared.prefix, prepared.reasoning()):
            match event:
                case ThinkingPart(text=text):
                    if content and isinstance(content[-1], OutThinking) and not content[-1].signature:
                        content[-1].thinking += text
                    else:
                        content.append(OutThinking(text))
                case ThinkingEnd():
                    block = content[-1] if content else None
                    if not isinstance(block, OutThinking):
                        block = OutThinking("")
                        content.append(block)
                    block.signature = thinking_signature(block.thinking)
                case PromptStarted():
                    started = event
                case TextPart(text=text):
                    if content and isinstance(content[-1], OutText):
                        content[-1].text += text
                    else:
                        content.append(OutText(text))
                case ToolCallEnd(name=name, arguments=arguments):
                    content.append(OutToolUse(new_id("toolu_"), name, arguments))
                case Finished():
                    finished = event
    except ValueError as error:
        return error_response(400, str(error))
    except ApiError:
        raise
    except Exception as error:
        return error_response(500, f"generation failed: {error}")
    assert finished is not None, "stream ended without Finished: engine bug"
    content = [c for c in content if not (isinstance(c, OutText) and not c.text.strip())] or [OutText("")]
    called_tool = any(isinstance(c, OutToolUse) for c in content)
    reply = MessageResponse(
        message_id,
        model.name,
        content,
        _stop_reason(finished, called_tool),
        finished.stop_sequence,
        _usage(started, finished.num_generated_tokens),
    )
    return web.Response(body=_encode(reply), content_type="application/json")


def thinking_signature(thinking: str) -> str:
    """An opaque signature for a thinking block (clients echo it back; we never replay reasoning)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


class _BlockWriter:
    """Turns parsed parts into content_block_start/delta/stop events with running indices."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self.index = -1
        self.open_kind: str | None = None
        self.pending_space = ""
        self.called_tool = False
        self.thinking_text = ""

    async def event(self, name: str, data: dict[str, Any]) -> None:
        await self.response.write(f"event: {name}\ndata: ".encode() + _encode(data) + b"\n\n")

    async def close(self) -> None:
        if self.open_kind is not None:
            await self.event("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.open_kind = None

    async def open(self, kind: str, block: dict[str, Any]) -> None:
        await self.close()
        self.index += 1
        self.open_kind = kind
        await self.event(
            "content_block_start",
            {"type": "content_block_start", "index": self.index, "content_block": block},
        )

    async def delta(self, delta: dict[str, Any]) -> None:
        await self.event(
            "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
        )

    async def text(self, text: str) -> None:
        if self.open_kind != "text":
            if not text.strip():
                self.pending_space += text  # whitespace alone does not open a block
                return
            text, self.pending_space = self.pending_space + text, ""
            await self.open("text", {"type": "text", "text": ""})
        await self.delta({"type": "text_delta", "text": text})

    async def thinking(self, text: str) -> None:
        if self.open_kind != "thinking":
            self.thinking_text = ""
            await self.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        self.thinking_text += text
        await self.delta({"type": "thinking_delta", "thinking": text})

    async def end_thinking(self) -> None:
        if self.open_kind != "thinking":
            await self.thinking("")
        await self.delta({"type": "signature_delta", "signature": thinking_signature(self.thinking_text)})
        await self.close()

    async def tool_start(self, name: str) -> None:
        self.pending_space = ""
        self.called_tool = True
        await self.open("tool_use", {"type": "tool_use", "id": new_id("toolu_"), "name": name, "input": {}})


async def _stream(
    request: web.Request,
    stream: Any,
    parser: ToolCallParser,
    prepared: PreparedRequest,
    message_id: str,
    model_name: str,
) -> web.StreamResponse:
    response = await sse_response(request)
    blocks = _BlockWriter(response)
    started: PromptStarted | None = None
    pinger: asyncio.Task[None] | None = None

    async def ping_while_prefilling() -> None:
        while True:
            await blocks.event("ping", {"type": "ping"})
            await asyncio.sleep(PING_INTERVAL_S)

    try:
        async for event in parsed_events(stream, parser, prepared.prefix, prepared.reasoning()):
            if isinstance(event, PromptStarted):
                started = event
                start_usage = msgspec.to_builtins(_usage(started, 0))
                message = {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": model_name,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": start_usage,
                }
                await blocks.event("message_start", {"type": "message_start", "message": message})
                pinger = asyncio.create_task(ping_while_prefilling())
                continue
            if pinger is not None and not isinstance(event, PromptProgress):
                pinger.cancel()
                pinger = None
            match event:
                case ThinkingPart(text=text):
                    await blocks.thinking(text)
                case ThinkingEnd():
                    await blocks.end_thinking()
                case TextPart(text=text):
                    await blocks.text(text)
                case ToolCallStart(name=name):
                    await blocks.tool_start(name)
                case ToolArgumentsDelta(json_text=json_text):
                    await blocks.delta({"type": "input_json_delta", "partial_json": json_text})
                case ToolCallEnd():
                    await blocks.close()
                case Finished():
                    if blocks.index < 0:
                        await blocks.open("text", {"type": "text", "text": ""})
                    await blocks.close()
                    usage = msgspec.to_builtins(_usage(started, event.num_generated_tokens))
                    delta = {
                        "stop_reason": _stop_reason(event, blocks.called_tool),
                        "stop_sequence": event.stop_sequence,
                    }
                    await blocks.event(
                        "message_delta", {"type": "message_delta", "delta": delta, "usage": usage}
                    )
                    await blocks.event("message_stop", {"type": "message_stop"})
    except Exception as error:  # the stream has started: report in-band, then end it
        kind = "invalid_request_error" if isinstance(error, ValueError) else "api_error"
        await blocks.event("error", {"type": "error", "error": {"type": kind, "message": str(error)}})
    finally:
        if pinger is not None:
            pinger.cancel()
    await response.write_eof()
    return response


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
