"""What every protocol handler shares: app keys, JSON bodies, and the SSE writer."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from semantic.actors.system import AgentSystem
from semantic.protocols.guard import Gate
from semantic.protocols.metrics import Metrics
from semantic.protocols.settings import Settings

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


# What a stream may queue for a client that does not read, in the kernel and again in the
# transport, before its writes wait (and their deadline runs).
STREAM_BUFFER_BYTES = 64 << 10


class StreamStalled(ConnectionResetError):
    """A stream's write waited past its deadline: the connection is aborted, the request ends."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


class SseWriter:
    """One Server-Sent Events response: `text/event-stream`, no caching or proxy buffering.

    Each write must be taken by the client within `server.stream_write_timeout_s`, and by the
    request's own deadline (`deadline_at`, loop time) while that is ahead; else `StreamStalled`.
    """

    def __init__(self, request: web.Request, ping_frame: bytes, deadline_at: float | None = None) -> None:
        self.request = request
        self.ping_frame = ping_frame
        self.write_timeout_s = request.app[SETTINGS_KEY].server.stream_write_timeout_s
        self.deadline_at = deadline_at
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
            _bound_buffers(self.request)
            await self._in_time(lambda: self.response.prepare(self.request))

    async def event(self, name: str | None, data: object) -> None:
        """One event: `event: NAME` (when named) and `data: JSON`."""
        head = f"event: {name}\ndata: ".encode() if name else b"data: "
        await self.raw(head + encode_json(data) + b"\n\n")
        self.num_events += 1

    async def raw(self, frame: bytes) -> None:
        await self.open()
        await self._in_time(lambda: self.response.write(frame))

    async def ping(self) -> None:
        await self.raw(self.ping_frame)

    async def close(self) -> web.StreamResponse:
        await self.open()
        await self._in_time(self.response.write_eof)
        return self.response

    async def _in_time(self, write: Callable[[], Awaitable[object]]) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline_at = write_deadline = now + self.write_timeout_s
        # Past the request's deadline (its in-band error event), a write has its own deadline only.
        if self.deadline_at is not None and now < self.deadline_at < write_deadline:
            deadline_at = self.deadline_at
        is_request_deadline = deadline_at != write_deadline
        try:
            async with asyncio.timeout_at(deadline_at):
                await write()
        except TimeoutError:
            if self.request.transport is not None:
                self.request.transport.abort()  # drops what the client never took
            raise StreamStalled(
                "request timeout (server.request_timeout_s)"
                if is_request_deadline
                else "write deadline passed (server.stream_write_timeout_s)"
            ) from None


def _bound_buffers(request: web.Request) -> None:
    transport = request.transport
    if transport is None:
        return
    transport.set_write_buffer_limits(high=STREAM_BUFFER_BYTES)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_BUFFER_BYTES)
