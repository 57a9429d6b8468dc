"""OpenAI chat completions: `POST /v1/chat/completions`, streamed (SSE) or not, and `/v1/models`.

The handler parses the body into a turn (`openai_wire`) and renders the turn's events as
completion chunks or one completion; the pipeline does the rest.
"""

from __future__ import annotations

import json
import time
import uuid

import msgspec
from aiohttp import web

from semantic.actors.interface import Finished, PromptStarted, TokenLogprob
from semantic.actors.turns import TurnRequest, TurnStarted
from semantic.protocols.answer_turn import CollectedReply, Logprobs, TurnEvent, TurnReply, answer_turn
from semantic.protocols.errors import ApiError
from semantic.protocols.openai_reply import (
    FINISH_REASONS,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChunkChoice,
    Delta,
    FunctionDelta,
    ToolCallDelta,
    Usage,
    usage_of,
    wire_logprobs,
)
from semantic.protocols.openai_stream import OpenAIStream, reply_factory
from semantic.protocols.openai_wire import (
    ChatCompletionRequest,
    FunctionCall,
    ToolCall,
    decode_request,
    output_schema,
    to_chat_messages,
    tool_choice,
    top_logprobs,
)
from semantic.protocols.reasoning import ThinkingPart
from semantic.protocols.tenancy import request_agent_id, scoped_cache_salt
from semantic.protocols.tool_parser import TextPart, ToolArgumentsDelta, ToolCallEnd, ToolCallStart
from semantic.protocols.wire_sampling import sampling_of

PING_FRAME = b": ping\n\n"


def to_turn(request: web.Request, body: ChatCompletionRequest) -> TurnRequest:
    if body.n not in (None, 1):
        raise ApiError(f"n={body.n} is not supported; only n=1")
    if not body.messages:
        raise ApiError("messages must not be empty")
    messages = to_chat_messages(body.messages)
    prefill = ""
    if body.continue_final_message:
        if messages[-1]["role"] != "assistant" or not isinstance(messages[-1].get("content"), str):
            raise ApiError("continue_final_message needs a final assistant message with text content")
        prefill = messages.pop()["content"]
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = sampling_of(request, body, max_tokens, top_logprobs(body))
    return TurnRequest(
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        agent_id=request_agent_id(request, body.session_id),
        cache_salt=scoped_cache_salt(request, body.cache_salt),
        messages=messages,
        sampling=sampling,
        model=body.model,
        tools=[msgspec.to_builtins(tool) for tool in body.tools] if body.tools else None,
        tool_choice=tool_choice(body),
        prefill=prefill,
        output_schema=output_schema(body),
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = decode_request(await request.read())
    turn = to_turn(request, body)

    def collected(started: TurnStarted) -> TurnReply:
        return CompletionReply(started, turn.request_id, bool(body.logprobs))

    reply = reply_factory(collected, ChatCompletionStream, turn.request_id, body.stream_options)
    return await answer_turn(request, turn, body.stream, reply, PING_FRAME)


def _finish_reason(finished: Finished, called_tool: bool) -> str:
    return "tool_calls" if called_tool else FINISH_REASONS[finished.reason]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CompletionReply(CollectedReply):
    """A non-streaming reply: one chat.completion."""

    def __init__(self, started: TurnStarted, completion_id: str, with_logprobs: bool) -> None:
        self.started = started
        self.completion_id = completion_id
        self.texts: list[str] = []
        self.thinking: list[str] = []
        self.calls: list[ToolCall] = []
        self.logprobs: Logprobs | None = Logprobs([]) if with_logprobs else None

    async def event(self, event: TurnEvent) -> None:
        match event:
            case Logprobs(tokens=tokens) if self.logprobs is not None:
                self.logprobs.tokens.extend(tokens)
            case ThinkingPart(text=text):
                self.thinking.append(text)
            case TextPart(text=text):
                self.texts.append(text)
            case ToolCallEnd(name=name, arguments=arguments):
                self.calls.append(ToolCall(_call_id(), FunctionCall(name, json.dumps(arguments))))
            case Finished():
                self.started.check_output_complete()
                self.finished = event

    def body(self) -> ChatCompletion:
        finished = self.final
        text, calls = "".join(self.texts), self.calls
        message = AssistantMessage(
            "assistant",
            text if text.strip() or not calls else None,
            calls or None,
            "".join(self.thinking) or None,
        )
        logprobs = None if self.logprobs is None else wire_logprobs(self.logprobs.tokens)
        choice = Choice(0, message, _finish_reason(finished, bool(calls)), logprobs)
        return ChatCompletion(
            self.completion_id, int(time.time()), self.started.model_name, [choice], usage_of(finished)
        )


class ChatCompletionStream(OpenAIStream[Delta, ChunkChoice]):
    """A streaming reply: chat.completion.chunk deltas, a usage chunk on request, then [DONE]."""

    num_calls = 0  # tool calls started so far

    async def part(self, event: TurnEvent) -> None:
        match event:
            case PromptStarted():
                await self.send(Delta(role="assistant", content=""))
            case ThinkingPart(text=text) if text:
                await self.send(Delta(reasoning_content=text))
            case TextPart(text=text) if text:
                await self.send(Delta(content=text))
            case ToolCallStart(index=index, name=name):
                self.num_calls += 1
                call = ToolCallDelta(index, FunctionDelta(name=name), id=_call_id(), type="function")
                await self.send(Delta(tool_calls=[call]))
            case ToolArgumentsDelta(index=index, json_text=json_text):
                await self.send(Delta(tool_calls=[ToolCallDelta(index, FunctionDelta(arguments=json_text))]))

    def last_piece(self) -> Delta:
        return Delta()

    def finish_reason(self, finished: Finished) -> str:
        self.started.check_output_complete()  # raised before the last chunk: an in-band error instead
        return _finish_reason(finished, self.num_calls > 0)

    def choice(self, piece: Delta, finish_reason: str | None, tokens: list[TokenLogprob]) -> ChunkChoice:
        return ChunkChoice(0, piece, finish_reason, wire_logprobs(tokens) if tokens else None)

    def chunk(self, choices: list[ChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        model = self.started.model_name
        return ChatCompletionChunk(self.completion_id, self.created, model, choices, usage or msgspec.UNSET)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
