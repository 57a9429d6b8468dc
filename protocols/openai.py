"""OpenAI chat completions: `POST /v1/chat/completions`, streamed (SSE) or not."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

import msgspec
from aiohttp import web

from semantic.actors.agent import AgentStoppedError, MailboxFullError
from semantic.actors.identity import InvalidAgentIdError, agent_id_from
from semantic.actors.system import ModelUnavailableError
from semantic.config import Settings
from semantic.engine.chat_format import ChatFormat, ChatTemplateError
from semantic.engine.chat_format import ChatMessage as TemplateMessage
from semantic.engine.engine import ModelChangedError, PromptTooLongError
from semantic.engine.messages import Finished, FinishReason, PromptStarted
from semantic.engine.registry import UnknownModelError
from semantic.engine.sampling import SamplingParams
from semantic.protocols.common import (
    SETTINGS_KEY,
    SYSTEM_KEY,
    parsed_events,
    ready_model,
    sse_response,
)
from semantic.protocols.errors import ApiError, OpenAIError, OpenAIErrorDetail
from semantic.protocols.errors import openai_error as error_response
from semantic.protocols.observe import admit, check_bounds, watch
from semantic.protocols.reasoning import ReasoningSplitter, ThinkingPart, prompt_opens_thinking
from semantic.protocols.tool_parser import (
    TextPart,
    ToolArgumentsDelta,
    ToolCallEnd,
    ToolCallParser,
    ToolCallStart,
)

_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "stop"}


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str = "{}"


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionSpec(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolSpec(msgspec.Struct):
    function: FunctionSpec
    type: str = "function"


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    function: NamedFunction
    type: str = "function"


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct):
    messages: list[ChatMessage]
    model: str = "default"
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    session_id: str | None = None
    stream_options: StreamOptions | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # vLLM's extension: the final assistant message is a prefill the reply continues.
    continue_final_message: bool = False


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # a reasoning model's <think> block, as DeepSeek and vLLM send it


class Choice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str = ""


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    index: int
    function: FunctionDelta
    id: str | None = None
    type: str | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


_decode_request = msgspec.json.Decoder(ChatCompletionRequest).decode
_encode = msgspec.json.Encoder().encode


def _text_of(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    return "".join(part.text or "" for part in message.content if part.type == "text")


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def to_chat_messages(messages: list[ChatMessage]) -> list[TemplateMessage]:
    chat: list[TemplateMessage] = []
    for message in messages:
        entry: TemplateMessage = {"role": message.role, "content": _text_of(message)}
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
        chat.append(entry)
    return chat


def _forced_prefix(body: ChatCompletionRequest, chat: ChatFormat) -> str:
    if not body.tools or body.tool_choice in (None, "auto", "none"):
        return ""
    if isinstance(body.tool_choice, NamedToolChoice):
        return chat.forced_call_prefix(body.tool_choice.function.name)
    names = [tool.function.name for tool in body.tools]
    return chat.forced_call_prefix(names[0] if len(names) == 1 else None)


def _sampling(body: ChatCompletionRequest, settings: Settings) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    max_tokens = body.max_completion_tokens or body.max_tokens or settings.model.default_max_tokens
    return SamplingParams(
        temperature=settings.model.temperature if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        max_tokens=max_tokens,
        stop=stop,
        seed=body.seed,
    )


def _usage(finished: Finished) -> Usage:
    return Usage(
        prompt_tokens=finished.num_prompt_tokens,
        completion_tokens=finished.num_generated_tokens,
        total_tokens=finished.num_prompt_tokens + finished.num_generated_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=finished.num_cached_tokens),
    )


def _finish_reason(finished: Finished, called_tool: bool) -> str:
    return "tool_calls" if called_tool else _FINISH_REASONS[finished.reason]


async def chat_completions(request: web.Request) -> web.StreamResponse:
    system = request.app[SYSTEM_KEY]
    settings = request.app[SETTINGS_KEY]
    try:
        body = _decode_request(await request.read())
    except msgspec.ValidationError as error:
        return error_response(400, f"invalid request body: {error}")
    except msgspec.DecodeError as error:
        return error_response(400, f"request body is not valid JSON: {error}")
    if body.n != 1:
        return error_response(400, f"n={body.n} is not supported; only n=1", param="n")
    if not body.messages:
        return error_response(400, "messages must not be empty", param="messages")
    check_bounds(
        request,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        num_messages=len(body.messages),
        num_tools=len(body.tools or ()),
    )
    try:
        model = await ready_model(system, body.model)
    except UnknownModelError as error:
        return error_response(404, str(error), kind="model_not_found", param="model")
    except ModelUnavailableError as error:
        return error_response(503, str(error), kind="server_error", param="model")
    model_name = model.name
    try:
        agent_id = agent_id_from(request.headers, body.session_id)
        sampling = _sampling(body, settings)
    except (InvalidAgentIdError, ValueError) as error:
        return error_response(400, str(error))
    chat = system.chat_format
    tools = [msgspec.to_builtins(tool) for tool in body.tools] if body.tools else None
    prefix = _forced_prefix(body, chat)
    try:
        messages = to_chat_messages(body.messages)
        prefill = ""
        if body.continue_final_message:
            if messages[-1]["role"] != "assistant" or not isinstance(messages[-1].get("content"), str):
                raise ApiError("continue_final_message needs a final assistant message with text content")
            prefill = messages.pop()["content"]
        text = chat.render(messages, tools) + prefill + prefix
        prompt = chat.encode(text)
        reasoning = None if prefix else ReasoningSplitter(inside=prompt_opens_thinking(text))
        check_bounds(request, num_prompt_tokens=len(prompt))
        admit(request, agent_id)
        stream = watch(
            request, await system.generate(agent_id, prompt, sampling, model_fingerprint=model.fingerprint)
        )
    except (ChatTemplateError, PromptTooLongError) as error:
        return error_response(400, str(error), param="messages")
    except (ModelUnavailableError, ModelChangedError) as error:
        return error_response(503, str(error), kind="server_error")
    except MailboxFullError as error:
        return error_response(429, str(error), kind="rate_limit_exceeded")
    except AgentStoppedError as error:
        return error_response(503, str(error), kind="server_error")
    parser = ToolCallParser(enabled=tools is not None and body.tool_choice != "none")
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if not body.stream:
        texts: list[str] = []
        thinking: list[str] = []
        calls: list[ToolCall] = []
        finished: Finished | None = None
        try:
            async for event in parsed_events(stream, parser, prefix, reasoning):
                if isinstance(event, ThinkingPart):
                    thinking.append(event.text)
                elif isinstance(event, TextPart):
                    texts.append(event.text)
                elif isinstance(event, ToolCallEnd):
                    calls.append(ToolCall(_call_id(), FunctionCall(event.name, json.dumps(event.arguments))))
                elif isinstance(event, Finished):
                    finished = event
        except ValueError as error:
            return error_response(400, str(error))
        except ApiError:
            raise
        except Exception as error:
            return error_response(500, f"generation failed: {error}", kind="server_error")
        assert finished is not None, "stream ended without Finished: engine bug"
        text = "".join(texts)
        message = AssistantMessage(
            "assistant", text if text.strip() or not calls else None, calls or None, "".join(thinking) or None
        )
        choice = Choice(0, message, _finish_reason(finished, bool(calls)))
        completion = ChatCompletion(completion_id, created, model_name, [choice], _usage(finished))
        return web.Response(body=_encode(completion), content_type="application/json")

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    response = await sse_response(request)

    async def send(delta: Delta | None, finish_reason: str | None = None, usage: Usage | None = None) -> None:
        choices = [] if delta is None else [ChunkChoice(0, delta, finish_reason)]
        chunk = ChatCompletionChunk(completion_id, created, model_name, choices, usage=usage)
        await response.write(b"data: " + _encode(chunk) + b"\n\n")

    num_calls = 0
    try:
        async for event in parsed_events(stream, parser, prefix, reasoning):
            match event:
                case PromptStarted():
                    await send(Delta(role="assistant", content=""))
                case ThinkingPart(text=text) if text:
                    await send(Delta(reasoning_content=text))
                case TextPart(text=text) if text:
                    await send(Delta(content=text))
                case ToolCallStart(index=index, name=name):
                    num_calls += 1
                    call = ToolCallDelta(index, FunctionDelta(name=name), id=_call_id(), type="function")
                    await send(Delta(tool_calls=[call]))
                case ToolArgumentsDelta(index=index, json_text=json_text):
                    await send(Delta(tool_calls=[ToolCallDelta(index, FunctionDelta(arguments=json_text))]))
                case Finished():
                    await send(Delta(), _finish_reason(event, num_calls > 0))
                    if include_usage:
                        await send(None, usage=_usage(event))
        await response.write(b"data: [DONE]\n\n")
    except Exception as error:  # the stream has started: report in-band, then end it
        detail = OpenAIError(OpenAIErrorDetail(message=str(error), type="server_error"))
        await response.write(b"data: " + _encode(detail) + b"\n\n")
    await response.write_eof()
    return response


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def model_list(system: Any) -> dict[str, Any]:
    """Configured models in the shape both OpenAI's and Anthropic's SDKs read, with what is loaded."""
    loaded = system.model_entry
    data = [
        {
            "id": entry.name,
            "object": "model",
            "type": "model",
            "display_name": entry.name,
            "created": 0,
            "created_at": "1970-01-01T00:00:00Z",
            "owned_by": "semantic",
            "source": entry.source,
            "aliases": list(entry.aliases),
            "loaded": entry == loaded,
        }
        for entry in system.registry.entries
    ]
    return {
        "object": "list",
        "data": data,
        "has_more": False,
        "first_id": data[0]["id"],
        "last_id": data[-1]["id"],
        "loaded_model_aliases": system.registry.loaded_aliases,
    }
