"""What every protocol handler shares: app keys, JSON bodies, and the SSE writer."""

from __future__ import annotations

import msgspec
from aiohttp import web

from semantic.actors.system import AgentSystem
from semantic.config import Settings
from semantic.protocols.guard import Gate
from semantic.protocols.metrics import Metrics

SYSTEM_KEY = web.AppKey("system", AgentSystem)
SETTINGS_KEY = web.AppKey("settings", Settings)
GATE_KEY = web.AppKey("gate", Gate)
METRICS_KEY = web.AppKey("metrics", Metrics)


def _encode_other(value: object) -> object:
    if isinstance(value, str):  # str subclasses such as AgentId
        return str(value)
    raise NotImplementedError(f"cannot encode {type(value).__name__} as JSON")


encode_json = msgspec.json.Encoder(enc_hook=_encode_other).encode


def json_response(body: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode_json(body), content_type="application/json")


class SseWriter:
    """One Server-Sent Events response: `text/event-stream`, no caching or proxy buffering."""

    def __init__(self, request: web.Request, ping_frame: bytes) -> None:
        self.request = request
        self.ping_frame = ping_frame
        self.response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "Connection": "keep-alive",
                "X-Accel-Buffering": "no",
            }
        )
        self.num_events = 0

    @property
    def is_open(self) -> bool:
        return self.response.prepared

    async def open(self) -> None:
        if not self.response.prepared:
            await self.response.prepare(self.request)

    async def event(self, name: str | None, data: object) -> None:
        """One event: `event: NAME` (when named) and `data: JSON`."""
        await self.open()
        head = f"event: {name}\ndata: ".encode() if name else b"data: "
        await self.response.write(head + encode_json(data) + b"\n\n")
        self.num_events += 1

    async def raw(self, frame: bytes) -> None:
        await self.open()
        await self.response.write(frame)

    async def ping(self) -> None:
        await self.raw(self.ping_frame)

    async def close(self) -> web.StreamResponse:
        await self.open()
        await self.response.write_eof()
        return self.response
