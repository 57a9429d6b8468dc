"""The Anthropic Messages request as Claude Code and the SDKs send it, and its conversion to a turn.

What Claude Code sends is accepted as it is: system messages mid-conversation, tool results as
strings or blocks, thinking blocks echoed back (an assistant message's `reasoning_content`, for the
templates that re-render it), and top-level fields we have no use for. Volatile
system lines (the per-request billing header) are dropped before rendering so consecutive turns
share their cached prefix. `cache_control` on a system block, a tool or a content block becomes a
breakpoint (a chat message and an offset in its content) whose prefix the engine keeps for its ttl.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from semantic.actors.interface import ChatMessage
from semantic.actors.turns import ToolChoice as TurnToolChoice
from semantic.actors.turns import UnsupportedContentError
from semantic.protocols.tenancy import CacheSalt

_VOLATILE_LINES = re.compile(r"^x-anthropic-billing-header:.*(?:\n|$)", re.MULTILINE)
TTL_S = {"5m": 300.0, "1h": 3600.0}


class CacheControl(msgspec.Struct):
    type: Literal["ephemeral"] = "ephemeral"
    ttl: Literal["5m", "1h"] = "5m"

    @property
    def ttl_s(self) -> float:
        return TTL_S[self.ttl]


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str
    cache_control: CacheControl | None = None


class ImageBlock(msgspec.Struct, tag="image", tag_field="type"):
    source: dict[str, Any] = msgspec.field(default_factory=dict)
    cache_control: CacheControl | None = None


class DocumentBlock(msgspec.Struct, tag="document", tag_field="type"):
    source: dict[str, Any] = msgspec.field(default_factory=dict)
    cache_control: CacheControl | None = None


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any] = msgspec.field(default_factory=dict)
    cache_control: CacheControl | None = None


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None


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
    strict: bool | None = None
    cache_control: CacheControl | None = None


class ToolChoice(msgspec.Struct):
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(msgspec.Struct, tag="json_schema", tag_field="type"):
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct):
    format: OutputFormat | None = None
    effort: str | None = None


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
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's older field
    cache_salt: CacheSalt | None = None  # vLLM's: only requests with the same salt share prefix blocks


def output_schema(body: MessagesRequest) -> dict[str, Any] | None:
    """The JSON schema the reply must follow (`output_config.format`, or the beta `output_format`)."""
    if body.output_config is not None and body.output_config.format is not None:
        return body.output_config.format.schema
    return body.output_format.schema if body.output_format is not None else None


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


Breakpoint = tuple[int, int, float]  # a chat message's index, an offset in its content, a ttl in s


def to_chat_messages(body: MessagesRequest) -> list[ChatMessage]:
    """Anthropic messages in the chat-template form (tool results become `tool` turns)."""
    return chat_and_breakpoints(body)[0]


def chat_and_breakpoints(body: MessagesRequest) -> tuple[list[ChatMessage], list[Breakpoint]]:
    """The chat messages, and where the request's `cache_control` breakpoints fall in them."""
    chat: list[ChatMessage] = []
    breakpoints: list[Breakpoint] = _system_breakpoints(body.system)
    system = system_text(body.system)
    if system:
        chat.append({"role": "system", "content": system})
    else:
        breakpoints = []
    # Tools render in the prompt's head (the system turn): a tool's breakpoint keeps all before the
    # first message.
    tool_ttls = [tool.cache_control.ttl_s for tool in body.tools if tool.cache_control is not None]
    if tool_ttls and body.messages:
        breakpoints.append((len(chat), 0, max(tool_ttls)))
    call_ids: set[str] = set()  # the tool_use blocks of the assistant messages so far
    for at, message in enumerate(body.messages):
        if isinstance(message.content, str):
            chat.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        thoughts: list[str] = []  # thinking blocks: the message's `reasoning_content`
        calls: list[dict[str, Any]] = []
        marks: list[tuple[int, float]] = []  # breakpoints in this message's text: (offset, ttl_s)
        separator = "" if message.role == "assistant" else "\n\n"
        for block_at, block in enumerate(message.content):
            match block:
                case TextBlock(text=text):
                    texts.append(text)
                    if block.cache_control is not None:
                        marks.append((len(separator.join(texts)), block.cache_control.ttl_s))
                case ToolUseBlock(id=call_id, name=name, input=arguments):
                    if block.cache_control is not None:  # the calls render after the message's text
                        marks.append((len(separator.join(texts)), block.cache_control.ttl_s))
                    calls.append(
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": arguments},
                        }
                    )
                case ToolResultBlock(tool_use_id=call_id, content=content, is_error=is_error):
                    if call_id not in call_ids:
                        raise ValueError(
                            f"messages.{at}.content.{block_at}: tool_result names tool_use_id {call_id!r}, "
                            "which no tool_use block of an earlier assistant message has"
                        )
                    result = f"Error: {_text_of(content)}" if is_error else _text_of(content)
                    if block.cache_control is not None:
                        breakpoints.append((len(chat), len(result), block.cache_control.ttl_s))
                    chat.append({"role": "tool", "tool_call_id": call_id, "content": result})
                case ImageBlock() | DocumentBlock():
                    raise UnsupportedContentError(_NO_VISION)
                case ThinkingBlock(thinking=thinking):
                    thoughts.append(thinking)  # the template decides whether to re-render it
                case RedactedThinkingBlock():
                    pass  # encrypted text our models never wrote
        if message.role == "assistant":
            call_ids.update(call["id"] for call in calls)
            if texts or calls:
                entry: ChatMessage = {"role": "assistant", "content": "".join(texts)}
                if calls:
                    entry["tool_calls"] = calls
                if any(thoughts):
                    entry["reasoning_content"] = "".join(thoughts)
                breakpoints += [(len(chat), offset, ttl_s) for offset, ttl_s in marks]
                chat.append(entry)
        elif texts:
            breakpoints += [(len(chat), offset, ttl_s) for offset, ttl_s in marks]
            chat.append({"role": message.role, "content": "\n\n".join(texts)})
    return chat, breakpoints


def _system_breakpoints(system: str | list[TextBlock] | None) -> list[Breakpoint]:
    """Breakpoints on system blocks: the system turn (message 0) up to the end of the block's text."""
    if not isinstance(system, list):
        return []
    whole = system_text(system) or ""
    found: list[Breakpoint] = []
    for at, block in enumerate(system):
        prefix = system_text(system[: at + 1]) or ""
        if block.cache_control is not None and prefix and whole.startswith(prefix):
            found.append((0, len(prefix), block.cache_control.ttl_s))
    return found


def tool_schemas(tools: list[Tool]) -> list[dict[str, Any]] | None:
    """Client tools as JSON-schema function specs; server tools (no schema) are left out."""
    specs = [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description or "",
                "parameters": tool.input_schema,
                "strict": tool.strict,
            },
        }
        for tool in tools
        if tool.input_schema
    ]
    return specs or None


def tool_choice(choice: ToolChoice | None) -> TurnToolChoice:
    if choice is None or choice.type == "auto":
        return TurnToolChoice()
    if choice.type == "none":
        return TurnToolChoice("none")
    if choice.type == "tool" and not choice.name:
        raise ValueError("tool_choice.name: required when type is tool")
    return TurnToolChoice("required", choice.name if choice.type == "tool" else None)


def split_prefill(messages: list[ChatMessage]) -> str:
    """A final assistant message is a prefill: the reply continues it (it is not echoed back)."""
    last = messages[-1] if messages else None
    if (
        last
        and last["role"] == "assistant"
        and isinstance(last.get("content"), str)
        and not last.get("tool_calls")
    ):
        return str(messages.pop()["content"])
    return ""


decode_request = msgspec.json.Decoder(MessagesRequest).decode
