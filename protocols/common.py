"""What every protocol handler shares: app keys, settings, model names, SSE, parsed turn events."""

from __future__ import annotations

import fnmatch
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

from actors.system import AgentSystem
from engine.engine import RequestStream
from engine.messages import Finished, PromptProgress, PromptStarted, TokenDelta
from protocols.tool_parser import ParsedPart, ToolCallParser

DEFAULT_ALIASES = {"default": "", "claude*": "", "gpt-*": ""}


@dataclass(frozen=True, slots=True)
class ServerSettings:
    default_max_tokens: int = 1024
    default_temperature: float = 1.0
    # Requested model name (glob) -> served model; "" means whatever model is served.
    model_aliases: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_ALIASES))


SYSTEM_KEY = web.AppKey("system", AgentSystem)
SETTINGS_KEY = web.AppKey("settings", ServerSettings)


class UnknownModelError(LookupError):
    pass


def resolve_model(requested: str | None, served: str, settings: ServerSettings) -> str:
    """The served model a request's `model` names, directly or through an alias."""
    if not requested or requested == served:
        return served
    for pattern, target in settings.model_aliases.items():
        if fnmatch.fnmatchcase(requested, pattern) and target in ("", served):
            return served
    aliases = ", ".join(sorted(settings.model_aliases))
    raise UnknownModelError(
        f"model {requested!r} is not served here; this server runs {served!r} "
        f"(aliases accepted: {aliases}; add more with --alias NAME=MODEL)"
    )


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


TurnEvent = PromptStarted | PromptProgress | ParsedPart | Finished


async def parsed_events(
    stream: RequestStream, parser: ToolCallParser, prefix: str = ""
) -> AsyncIterator[TurnEvent]:
    """The engine's events with generated text split into text and tool-call parts.

    `prefix` is reply text that was written into the prompt (a forced tool call's opening); it is
    parsed as if generated, right after the prompt starts.
    """
    async for event in stream:
        if isinstance(event, TokenDelta):
            for part in parser.feed(event.text):
                yield part
        elif isinstance(event, Finished):
            for part in parser.finish():
                yield part
            yield event
        elif isinstance(event, PromptStarted):
            yield event
            for part in parser.feed(prefix):
                yield part
        elif isinstance(event, PromptProgress):
            yield event
