"""OpenAI's legacy text completions: `POST /v1/completions`, streamed (SSE) or not.

The prompt (text, or token ids) is continued as is, without the chat template, and the reply is
plain text: no tool calls, no reasoning split. What mlx_lm.server and vLLM serve at this path, for
clients that complete text (code completion, evaluation harnesses) rather than chat.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

import msgspec
from aiohttp import web

from semantic.actors.interface import MAX_TOP_LOGPROBS, Finished, TokenLogprob
from semantic.actors.turns import TurnRequest, TurnStarted
from semantic.protocols.answer_turn import CollectedReply, Logprobs, TurnEvent, TurnReply, answer_turn
from semantic.protocols.errors import ApiError
from semantic.protocols.openai import PING_FRAME
from semantic.protocols.openai_reply import FINISH_REASONS, LOWEST_LOGPROB, Usage, usage_of
from semantic.protocols.openai_stream import OpenAIStream, reply_factory
from semantic.protocols.openai_wire import StreamOptions
from semantic.protocols.tenancy import CacheSalt, request_agent_id, scoped_cache_salt
from semantic.protocols.tool_parser import TextPart
from semantic.protocols.wire_sampling import SamplingFields, sampling_of


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    model: str = "default"
    stream: bool = False
    max_tokens: int | None = 16  # OpenAI's default for this API
    logprobs: int | None = None  # how many alternatives each token's log-probability comes with
    echo: bool | None = None
    suffix: str | None = None
    n: int | None = None
    best_of: int | None = None
    session_id: str | None = None
    stream_options: StreamOptions | None = None
    cache_salt: CacheSalt | None = None


class CompletionLogprobs(msgspec.Struct):
    """The legacy shape: parallel lists, alternatives as {token text: log-probability}."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    text: str
    index: int
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | msgspec.UnsetType = msgspec.UNSET  # streamed: only in the usage chunk
    object: Literal["text_completion"] = "text_completion"


decode_request = msgspec.json.Decoder(CompletionRequest).decode


def to_turn(request: web.Request, body: CompletionRequest) -> TurnRequest:
    if body.n not in (None, 1) or body.best_of not in (None, 1):
        raise ApiError("n and best_of must be 1")
    if body.echo:
        raise ApiError("echo is not supported: the prompt's own log-probabilities are not computed")
    if body.suffix:
        raise ApiError("suffix is not supported: the prompt is continued at its end")
    if not body.prompt:
        raise ApiError("prompt must not be empty")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.logprobs}")
    sampling = sampling_of(request, body, body.max_tokens, body.logprobs)
    text, token_ids = (body.prompt, None) if isinstance(body.prompt, str) else (None, body.prompt)
    return TurnRequest(
        request_id=f"cmpl-{uuid.uuid4().hex}",
        agent_id=request_agent_id(request, body.session_id),
        cache_salt=scoped_cache_salt(request, body.cache_salt),
        messages=[],
        sampling=sampling,
        model=body.model,
        raw_prompt=text,
        prompt_token_ids=token_ids,
    )


async def completions(request: web.Request) -> web.StreamResponse:
    body = decode_request(await request.read())
    turn = to_turn(request, body)
    with_logprobs = body.logprobs is not None

    def collected(started: TurnStarted) -> TurnReply:
        return CollectedCompletion(started, turn.request_id, with_logprobs)

    reply = reply_factory(collected, CompletionStream, turn.request_id, body.stream_options)
    return await answer_turn(request, turn, body.stream, reply, PING_FRAME)


def legacy_logprobs(tokens: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """`tokens` in the legacy shape, the first starting `offset` characters into the reply."""
    logprobs = CompletionLogprobs([], [], [], [])
    for token in tokens:
        logprobs.tokens.append(token.text)
        logprobs.token_logprobs.append(max(token.logprob, LOWEST_LOGPROB))
        logprobs.top_logprobs.append({t.text: max(t.logprob, LOWEST_LOGPROB) for t in token.top})
        logprobs.text_offset.append(offset)
        offset += len(token.text)
    return logprobs


class CollectedCompletion(CollectedReply):
    """A non-streaming reply: one text_completion."""

    def __init__(self, started: TurnStarted, completion_id: str, with_logprobs: bool) -> None:
        self.started = started
        self.completion_id = completion_id
        self.texts: list[str] = []
        self.logprobs: list[TokenLogprob] | None = [] if with_logprobs else None

    async def event(self, event: TurnEvent) -> None:
        match event:
            case Logprobs(tokens=tokens) if self.logprobs is not None:
                self.logprobs += tokens
            case TextPart(text=text):
                self.texts.append(text)
            case Finished():
                self.finished = event

    def body(self) -> Completion:
        finished = self.final
        logprobs = None if self.logprobs is None else legacy_logprobs(self.logprobs, 0)
        choice = CompletionChoice("".join(self.texts), 0, logprobs, FINISH_REASONS[finished.reason])
        return Completion(
            self.completion_id, int(time.time()), self.started.model_name, [choice], usage_of(finished)
        )


class CompletionStream(OpenAIStream[str, CompletionChoice]):
    """A streaming reply: text_completion chunks, a usage chunk on request, then [DONE]."""

    num_chars = 0  # sent so far: where the next chunk's log-probabilities start

    async def part(self, event: TurnEvent) -> None:
        if isinstance(event, TextPart) and event.text:
            await self.send(event.text)

    def last_piece(self) -> str:
        return ""

    def finish_reason(self, finished: Finished) -> str:
        return FINISH_REASONS[finished.reason]

    def choice(self, piece: str, finish_reason: str | None, tokens: list[TokenLogprob]) -> CompletionChoice:
        logprobs = legacy_logprobs(tokens, self.num_chars) if tokens else None
        self.num_chars += len(piece)
        return CompletionChoice(piece, 0, logprobs, finish_reason)

    def chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        model = self.started.model_name
        return Completion(self.completion_id, self.created, model, choices, usage or msgspec.UNSET)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
