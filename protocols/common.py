"""What every protocol handler shares: app keys, server settings, SSE response setup."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from actors.system import AgentSystem


@dataclass(frozen=True, slots=True)
class ServerSettings:
    default_max_tokens: int = 1024


SYSTEM_KEY = web.AppKey("system", AgentSystem)
SETTINGS_KEY = web.AppKey("settings", ServerSettings)


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
