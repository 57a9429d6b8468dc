"""What every protocol handler shares: app keys, settings, model names, SSE, parsed turn events."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from semantic.actors.system import AgentSystem
from semantic.config import Settings
from semantic.engine.engine import RequestStream
from semantic.engine.loading import LoadedModel
from semantic.engine.messages import Finished, PromptProgress, PromptStarted, TokenDelta
from semantic.protocols.guard import Gate
from semantic.protocols.metrics import Metrics
from semantic.protocols.reasoning import ReasoningSplitter, ThinkingEnd, ThinkingPart
from semantic.protocols.tool_parser import ParsedPart, ToolCallParser

SYSTEM_KEY = web.AppKey("system", AgentSystem)
SETTINGS_KEY = web.AppKey("settings", Settings)
GATE_KEY = web.AppKey("gate", Gate)
METRICS_KEY = web.AppKey("metrics", Metrics)


async def ready_model(system: AgentSystem, requested: str | None) -> LoadedModel:
    """The model a request names, once loaded: swapping to it, or reloading after an idle unload.

    Raises UnknownModelError (not configured) or ModelUnavailableError (could not be made ready).
    """
    entry = system.registry.resolve(requested)
    return await system.use_model(entry.name if entry is not None else None)


async def sse_response(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "Connection": "keep-alive",
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    return response


TurnEvent = PromptStarted | PromptProgress | ParsedPart | ThinkingPart | ThinkingEnd | Finished


async def parsed_events(
    stream: RequestStream,
    parser: ToolCallParser,
    prefix: str = "",
    reasoning: ReasoningSplitter | None = None,
) -> AsyncIterator[TurnEvent]:
    """The engine's events with generated text split into reasoning, text and tool-call parts.

    `prefix` is reply text that was written into the prompt (a forced tool call's opening); it is
    parsed as if generated, right after the prompt starts. `reasoning`, when given, first takes
    the model's `<think>` block out of the reply.
    """

    def split(text: str, final: bool = False) -> list[TurnEvent]:
        pieces = (reasoning.finish() if final else reasoning.feed(text)) if reasoning else [text]
        parts: list[TurnEvent] = []
        for piece in pieces:
            parts += parser.feed(piece) if isinstance(piece, str) else [piece]
        return parts + (list(parser.finish()) if final else [])

    async for event in stream:
        if isinstance(event, TokenDelta):
            for part in split(event.text):
                yield part
        elif isinstance(event, Finished):
            for part in split("", final=True):
                yield part
            yield event
        elif isinstance(event, PromptStarted):
            yield event
            for part in parser.feed(prefix):
                yield part
        elif isinstance(event, PromptProgress):
            yield event
