"""The OpenAI chat completions request as the SDK sends it, and its conversion to a turn's parts."""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from semantic.actors.interface import ChatMessage as TemplateMessage
from semantic.actors.turns import ToolChoice, UnsupportedContentError
from semantic.protocols.tenancy import CacheSalt
from semantic.protocols.wire_sampling import SamplingFields

# OpenAI's content part types and roles: any other is refused (400, naming its JSON path), not skipped.
PartType = Literal["text", "image_url", "input_audio", "file", "refusal"]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
# Roles chat templates do not know, as the ones they do: `developer` is OpenAI's newer `system`,
# `function` the deprecated form of `tool`.
_TEMPLATE_ROLES = {"developer": "system", "function": "tool"}


class ContentPart(msgspec.Struct):
    type: PartType
    text: str | None = None
    refusal: str | None = None  # an assistant's refusal, in place of its text


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str = "{}"


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant's reasoning as DeepSeek, Qwen and vLLM clients send it back: templates re-render it.
    reasoning_content: str | None = None


class FunctionSpec(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)
    strict: bool | None = None


class ToolSpec(msgspec.Struct):
    function: FunctionSpec
    type: str = "function"


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    function: NamedFunction
    type: str = "function"


class JsonSchemaFormat(msgspec.Struct):
    name: str = "response"
    schema: dict[str, Any] = msgspec.field(default_factory=dict)
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    model: str = "default"
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None  # 1 (null: 1); more is refused
    session_id: str | None = None
    stream_options: StreamOptions | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # vLLM's extension: the final assistant message is a prefill the reply continues.
    continue_final_message: bool = False
    response_format: ResponseFormat | None = None
    cache_salt: CacheSalt | None = None  # vLLM's: only requests with the same salt share prefix blocks
    logprobs: bool | None = None
    top_logprobs: int | None = None


def _text_of(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    if any(part.type not in ("text", "refusal") for part in message.content):
        raise UnsupportedContentError(
            "image, audio and file content parts are not supported: the served model reads text only"
        )
    return "".join((part.text if part.type == "text" else part.refusal) or "" for part in message.content)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def to_chat_messages(messages: list[ChatMessage]) -> list[TemplateMessage]:
    chat: list[TemplateMessage] = []
    for message in messages:
        role = _TEMPLATE_ROLES.get(message.role, message.role)
        entry: TemplateMessage = {"role": role, "content": _text_of(message)}
        if message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if role == "assistant" and message.reasoning_content:
            entry["reasoning_content"] = message.reasoning_content
        chat.append(entry)
    return chat


def tool_choice(body: ChatCompletionRequest) -> ToolChoice:
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        return ToolChoice("required", choice.function.name)
    if choice == "required":
        return ToolChoice("required")
    if choice == "none":
        return ToolChoice("none")
    return ToolChoice()


def output_schema(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema `response_format` asks the reply to follow (enforced, `strict` or not)."""
    form = body.response_format
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return {"type": "object"}
    if form.json_schema is None:
        raise ValueError("response_format.json_schema: required when type is json_schema")
    return form.json_schema.schema or {"type": "object"}


def top_logprobs(body: ChatCompletionRequest) -> int | None:
    """How many alternatives each token's log-probability comes with; None: no log-probabilities."""
    if not body.logprobs:
        if body.top_logprobs is not None:
            raise ValueError("top_logprobs needs logprobs: true")
        return None
    return body.top_logprobs or 0


decode_request = msgspec.json.Decoder(ChatCompletionRequest).decode
