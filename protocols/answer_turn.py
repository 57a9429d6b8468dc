"""One turn, whatever the protocol: bounds, admission, the agent's actor, streaming, errors, cleanup.

A protocol handler parses its body into a `TurnRequest` and says how to render the turn's events
(a `TurnReply`); everything else lives here once: the request bounds and admission (429), handing
the turn to its agent actor, reading its one stream as reasoning, text and tool-call parts (its
Finished comes once the actor made the turn durable), keep-alive pings, errors (raised before the
first byte, in-band after it) and cancelling the generation however the handler ends, including a
client that disconnects before the first read, and one that stops reading (its writes' deadlines).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from aiohttp import web
from loguru import logger

from semantic.actors.interface import (
    Event,
    Finished,
    PromptProgress,
    PromptStarted,
    SamplingParams,
    TokenDelta,
    TokenLogprob,
)
from semantic.actors.turns import TurnRequest, TurnStarted
from semantic.protocols.common import SETTINGS_KEY, SYSTEM_KEY, SseWriter, StreamStalled, json_response
from semantic.protocols.errors import ApiError, as_api_error
from semantic.protocols.observe import admit, check_bounds, record_of, watch
from semantic.protocols.reasoning import ReasoningSplitter, ThinkingEnd, ThinkingPart, prompt_opens_thinking
from semantic.protocols.tenancy import is_admin
from semantic.protocols.tool_parser import ParsedPart, TextPart, ToolCallParser

KEEPALIVE_S = 5.0


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """No event for KEEPALIVE_S (a long prefill or a queue): a stream sends a ping."""


@dataclass(frozen=True, slots=True)
class Logprobs:
    """The log-probabilities of the tokens whose text (if any) comes in the parts that follow."""

    tokens: list[TokenLogprob]


TurnEvent = (
    PromptStarted | PromptProgress | Logprobs | ParsedPart | ThinkingPart | ThinkingEnd | Finished | KeepAlive
)


class TurnReply(Protocol):
    """How one protocol answers: SSE events as the turn runs, or one JSON body at its end."""

    async def event(self, event: TurnEvent) -> None: ...

    async def error(self, error: ApiError) -> None:
        """In-band, once a stream has started: the status line is already sent."""

    def body(self) -> object:
        """The JSON reply of a non-streaming turn, after its Finished event."""


ReplyFactory = Callable[[TurnStarted, SseWriter | None], TurnReply]


def sampling_params(
    request: web.Request, *, max_tokens: int | None, temperature: float | None = None, **fields: Any
) -> SamplingParams:
    """A request's sampling, the one place each API's becomes a SamplingParams: the server's default
    temperature and max_tokens where it sets none; `fields` are SamplingParams fields, None unset."""
    model = request.app[SETTINGS_KEY].model
    return SamplingParams(
        temperature=model.temperature if temperature is None else temperature,
        max_tokens=model.default_max_tokens if max_tokens is None else max_tokens,
        top_p=fields.pop("top_p", None),  # None: the served model's generation defaults fill it in
        top_k=fields.pop("top_k", None),
        **{name: value for name, value in fields.items() if value is not None},  # null: the default
    )


class CollectedReply:
    """A non-streaming reply's common part: nothing is sent before the end, so errors are raised."""

    finished: Finished | None = None

    async def error(self, error: ApiError) -> None:
        raise error

    @property
    def final(self) -> Finished:
        assert self.finished is not None, "turn ended without Finished: pipeline bug"
        return self.finished


async def answer_turn(
    request: web.Request, turn: TurnRequest, streaming: bool, make_reply: ReplyFactory, ping_frame: bytes
) -> web.StreamResponse:
    check_bounds(
        request,
        max_tokens=turn.sampling.max_tokens,
        num_messages=len(turn.messages),
        num_tools=len(turn.tools or ()),
    )
    admit(request, turn.agent_id)
    turn.may_switch_model = is_admin(request)  # a switch drains every namespace's requests
    turn.guided_tool_calls = request.app[SETTINGS_KEY].model.tool_calls == "guided"
    started = await request.app[SYSTEM_KEY].start_turn(turn)
    stream = watch(request, started.stream)
    record = record_of(request)
    record.cache = started.cache  # the x-semantic-cache header, set as the reply prepares
    record.restore = started.restore.summary() if started.restore is not None else None
    sse = SseWriter(request, ping_frame, record.deadline_at) if streaming else None
    reply = make_reply(started, sse)
    try:
        return await _answer(request, started, sse, reply)
    except StreamStalled as stalled:
        record.outcome = stalled.outcome  # its connection is aborted: aiohttp sends nothing more
        assert sse is not None, "only a stream's writes stall: pipeline bug"
        return sse.response
    finally:
        stream.cancel()


async def _answer(
    request: web.Request, started: TurnStarted, sse: SseWriter | None, reply: TurnReply
) -> web.StreamResponse:
    try:
        async for event in turn_events(started):
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("the client closed the connection")
            if isinstance(event, KeepAlive):
                if sse is not None and sse.num_events:
                    await sse.ping()
                continue
            await reply.event(event)
        if sse is None:
            return json_response(reply.body())
        return await sse.close()
    except (ConnectionResetError, asyncio.CancelledError):
        raise  # the client left (or stalled): nothing to answer; the caller frees the batch slot
    except Exception as error:
        api_error = as_api_error(error)
        if sse is None or not sse.is_open:
            raise api_error from error
        await reply.error(api_error)
        return await sse.close()


async def turn_events(started: TurnStarted) -> AsyncIterator[TurnEvent]:
    """The engine's events with the reply split into reasoning, text and tool-call parts.

    A forced tool call's opening, written into the prompt, is parsed as if generated, right after
    the prompt starts; a reply that starts inside a `<think>` block begins as reasoning.
    """
    prompt = started.prompt
    parser = ToolCallParser(prompt.tool_format, prompt.tools, enabled=prompt.parses_tools)
    splits_reasoning = not (prompt.reply_prefix or prompt.is_raw)
    reasoning = ReasoningSplitter(prompt_opens_thinking(prompt.text_tail)) if splits_reasoning else None

    def split(text: str, final: bool = False) -> list[TurnEvent]:
        pieces = (reasoning.finish() if final else reasoning.feed(text)) if reasoning else [text]
        parts: list[TurnEvent] = []
        for piece in pieces:
            parts += parser.feed(piece) if isinstance(piece, str) else [piece]
        return parts + (list(parser.finish()) if final else [])

    async for event in _with_keepalives(started):
        match event:
            case TokenDelta(text=text, logprobs=logprobs):
                if logprobs:
                    yield Logprobs(logprobs)
                for part in split(text):
                    yield part
            case Finished():
                for part in split("", final=True):
                    yield part
                for failure in parser.failures:
                    logger.warning("tool call in the {} format: {}", prompt.tool_format.name, failure)
                if event.stop_sequence is not None and event.stop_sequence == prompt.stop_after_call:
                    event = replace(event, stop_sequence=None)  # our stop, not the client's
                yield event
            case PromptStarted():
                yield event
                for part in parser.feed(prompt.reply_prefix):
                    yield part
                for part in parser.feed(prompt.prefill):  # the client's text: only a call it opens
                    if not isinstance(part, TextPart):
                        yield part
            case PromptProgress() | KeepAlive():
                yield event


async def _with_keepalives(started: TurnStarted) -> AsyncIterator[Event | KeepAlive]:
    """The turn's events, with a KeepAlive after each KEEPALIVE_S without one: the wait for the
    next event is what times out (reading is safe to cancel), so no task or queue of our own."""
    stream = started.stream
    while stream.finished is None:
        try:  # not asyncio.wait_for: on 3.11 it can swallow a cancellation (a client leaving)
            async with asyncio.timeout(KEEPALIVE_S):
                event = await stream.read()
        except TimeoutError:
            yield KeepAlive()
            continue
        yield event
