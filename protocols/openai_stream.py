"""What OpenAI's two streamed replies share (chat completion chunks, text completion chunks): the
log-probabilities held for the next chunk, the last chunk, the usage chunk on request, `[DONE]`, and
errors in-band once the stream has started."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Generic, TypeVar

from semantic.actors.interface import Finished, TokenLogprob
from semantic.actors.turns import TurnStarted
from semantic.protocols.answer_turn import Logprobs, ReplyFactory, TurnEvent, TurnReply
from semantic.protocols.common import SseWriter
from semantic.protocols.errors import ApiError, OpenAIError, OpenAIErrorDetail
from semantic.protocols.openai_reply import Usage, usage_of
from semantic.protocols.openai_wire import StreamOptions

Piece = TypeVar("Piece")  # what one chunk carries: a chat delta, or text
Choice = TypeVar("Choice")


class OpenAIStream(ABC, Generic[Piece, Choice]):
    def __init__(self, started: TurnStarted, completion_id: str, sse: SseWriter, include_usage: bool) -> None:
        self.started = started
        self.completion_id = completion_id
        self.sse = sse
        self.include_usage = include_usage
        self.created = int(time.time())
        self.logprobs: list[TokenLogprob] = []  # for the next chunk: its tokens' (or earlier ones')

    async def event(self, event: TurnEvent) -> None:
        match event:
            case Logprobs(tokens=tokens):
                self.logprobs += tokens
            case Finished():
                await self.send(self.last_piece(), self.finish_reason(event))
                if self.include_usage:
                    await self.sse.event(None, self.chunk([], usage_of(event)))
                await self.sse.raw(b"data: [DONE]\n\n")
            case _:
                await self.part(event)

    async def send(self, piece: Piece, finish_reason: str | None = None) -> None:
        tokens, self.logprobs = self.logprobs, []
        await self.sse.event(None, self.chunk([self.choice(piece, finish_reason, tokens)]))

    async def error(self, error: ApiError) -> None:
        await self.sse.event(None, OpenAIError(OpenAIErrorDetail(message=str(error), type=error.kind)))

    def body(self) -> object:
        raise AssertionError("a streamed reply has no body: pipeline bug")

    @abstractmethod
    async def part(self, event: TurnEvent) -> None:
        """Send what a part of the reply (text, a tool call's piece, …) makes in this API."""

    @abstractmethod
    def last_piece(self) -> Piece: ...

    @abstractmethod
    def finish_reason(self, finished: Finished) -> str: ...

    @abstractmethod
    def choice(self, piece: Piece, finish_reason: str | None, tokens: list[TokenLogprob]) -> Choice: ...

    @abstractmethod
    def chunk(self, choices: list[Choice], usage: Usage | None = None) -> object: ...


def reply_factory(
    collected: Callable[[TurnStarted], TurnReply],
    streamed: type[OpenAIStream[Piece, Choice]],
    completion_id: str,
    options: StreamOptions | None,
) -> ReplyFactory:
    """Both OpenAI APIs' replies: `collected`'s one JSON body, or `streamed`'s chunks."""
    include_usage = bool(options and options.include_usage)

    def reply(started: TurnStarted, sse: SseWriter | None) -> TurnReply:
        return collected(started) if sse is None else streamed(started, completion_id, sse, include_usage)

    return reply
