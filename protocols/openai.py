"""OpenAI chat completions: `POST /v1/chat/completions`, streamed (SSE) or not."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec
from aiohttp import web

from actors.identity import InvalidAgentIdError, agent_id_from
from engine.engine import PromptTooLongError
from engine.messages import Finished, FinishReason, PromptStarted, TokenDelta
from engine.sampling import SamplingParams
from protocols.common import SETTINGS_KEY, SYSTEM_KEY, ServerSettings, sse_response

_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "stop"}


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


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


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str


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


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


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


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


_decode_request = msgspec.json.Decoder(ChatCompletionRequest).decode
_encode = msgspec.json.Encoder().encode


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> web.Response:
    body = ErrorBody(ErrorDetail(message=message, type=kind, param=param, code=str(status)))
    return web.Response(status=status, body=_encode(body), content_type="application/json")


def _text_of(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    return "".join(part.text or "" for part in message.content if part.type == "text")


def _sampling(body: ChatCompletionRequest, settings: ServerSettings) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    max_tokens = body.max_completion_tokens or body.max_tokens or settings.default_max_tokens
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
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
    try:
        agent_id = agent_id_from(request.headers, body.session_id)
        sampling = _sampling(body, settings)
    except (InvalidAgentIdError, ValueError) as error:
        return error_response(400, str(error))
    tokenizer = system.engine.model.tokenizer
    messages = [{"role": m.role, "content": _text_of(m)} for m in body.messages]
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as error:
        return error_response(
            400, f"the model's chat template rejected the messages: {error}", param="messages"
        )
    try:
        stream = await system.generate(agent_id, prompt, sampling)
    except PromptTooLongError as error:
        return error_response(400, str(error), param="messages")
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model_name = system.engine.model.name
    if not body.stream:
        parts: list[str] = []
        finished: Finished | None = None
        try:
            async for event in stream:
                if isinstance(event, TokenDelta):
                    parts.append(event.text)
                elif isinstance(event, Finished):
                    finished = event
        except ValueError as error:
            return error_response(400, str(error))
        except Exception as error:
            return error_response(500, f"generation failed: {error}", kind="server_error")
        assert finished is not None
        choice = Choice(0, AssistantMessage("assistant", "".join(parts)), _FINISH_REASONS[finished.reason])
        completion = ChatCompletion(completion_id, created, model_name, [choice], _usage(finished))
        return web.Response(body=_encode(completion), content_type="application/json")

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    response = await sse_response(request)

    async def send(chunk: ChatCompletionChunk) -> None:
        await response.write(b"data: " + _encode(chunk) + b"\n\n")

    try:
        async for event in stream:
            if isinstance(event, PromptStarted):
                await send(
                    ChatCompletionChunk(
                        completion_id,
                        created,
                        model_name,
                        [ChunkChoice(0, Delta(role="assistant", content=""), None)],
                    )
                )
            elif isinstance(event, TokenDelta) and event.text:
                await send(
                    ChatCompletionChunk(
                        completion_id, created, model_name, [ChunkChoice(0, Delta(content=event.text), None)]
                    )
                )
            elif isinstance(event, Finished):
                reason = _FINISH_REASONS[event.reason]
                await send(
                    ChatCompletionChunk(completion_id, created, model_name, [ChunkChoice(0, Delta(), reason)])
                )
                if include_usage:
                    await send(
                        ChatCompletionChunk(completion_id, created, model_name, [], usage=_usage(event))
                    )
        await response.write(b"data: [DONE]\n\n")
    except Exception as error:  # the stream has started: report in-band, then end it
        detail = ErrorBody(ErrorDetail(message=str(error), type="server_error"))
        await response.write(b"data: " + _encode(detail) + b"\n\n")
    await response.write_eof()
    return response


def model_list(system: Any) -> dict[str, Any]:
    loaded = system.engine.model
    return {
        "object": "list",
        "data": [{"id": loaded.name, "object": "model", "created": 0, "owned_by": "semantic"}],
    }
