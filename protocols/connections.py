"""What one client may hold of the server: a cap on open connections, and deadlines for a request's
head, its body and an idle keep-alive.

Without them a client that opens sockets and sends a few bytes, or nothing, holds a descriptor each
for ever; about 2,100 of them used up the process's descriptors, and then every request failed. The
cap sits in the listener's protocol factory, so a connection past it never reaches aiohttp: it gets
a canned 503 and is closed. The head deadline is armed when a connection opens and when the first
byte of a later request arrives, and disarmed when the request reaches the app
(`requests_in_connection`); `body_in_time` bounds the body; the idle keep-alive is aiohttp's own
`keepalive_timeout` (semantic/server.py).
"""

from __future__ import annotations

import asyncio
import math
import resource
import time
from collections.abc import Callable
from typing import cast

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError
from loguru import logger

from semantic.protocols.common import SETTINGS_KEY
from semantic.protocols.errors import api_error_response, as_api_error, error_response
from semantic.protocols.settings import ServerSection

# Descriptors kept back from connections: model and cache files, the tokenizer workers' pipes, the
# log, the event loop and thread pools need some while every connection is open.
DESCRIPTOR_RESERVE = 256
MAX_DEFAULT_CONNECTIONS = 1024
REFUSAL_LINGER_S = 1.0  # a refused client's request is read before closing, so it gets FIN, not RST
WARN_EVERY_S = 10.0


def default_max_connections(num_descriptors: int) -> int:
    """Below the descriptor soft limit by the reserve (half of a small limit), at most 1024."""
    if num_descriptors == resource.RLIM_INFINITY or num_descriptors <= 0:
        return MAX_DEFAULT_CONNECTIONS
    return min(MAX_DEFAULT_CONNECTIONS, max(num_descriptors // 2, num_descriptors - DESCRIPTOR_RESERVE))


def max_connections_of(server: ServerSection) -> int:
    if server.max_connections is not None:
        return server.max_connections
    soft_limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return default_max_connections(soft_limit)


class ConnectionCap:
    """The listener's protocol factory: aiohttp's protocol for each connection up to the cap, each
    behind a head deadline; past the cap, a `Refusal`."""

    def __init__(
        self, make_handler: Callable[[], asyncio.Protocol], max_connections: int, header_timeout_s: float
    ) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.num_open = 0
        self._make_handler = make_handler
        self._refusal = _refusal_bytes(max_connections)
        self._num_refused_unreported = 0
        self._warned_at = -math.inf

    def __call__(self) -> asyncio.Protocol:
        if self.num_open >= self.max_connections:
            self._note_refusal()
            return Refusal(self._refusal)
        # Counted here, not at connection_made: a burst of accepts makes every protocol first.
        self.num_open += 1
        return Connection(self._make_handler(), self)

    def release(self) -> None:
        assert self.num_open > 0, "released a connection that was never counted: ConnectionCap bug"
        self.num_open -= 1

    def _note_refusal(self) -> None:
        self._num_refused_unreported += 1
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            logger.warning(
                "at the limit of {} open connections (server.max_connections): refused {} new ones",
                self.max_connections,
                self._num_refused_unreported,
            )
            self._warned_at = now
            self._num_refused_unreported = 0


class Connection(asyncio.Protocol):
    """aiohttp's protocol for one connection, closed when a request's head is late."""

    def __init__(self, handler: asyncio.Protocol, cap: ConnectionCap) -> None:
        self._handler = handler
        self._cap = cap
        self._transport: asyncio.Transport | None = None
        self._head_deadline: asyncio.TimerHandle | None = None
        self._is_in_request = False
        self._is_counted = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio subclasses
        self._arm_head_deadline()
        self._handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._head_deadline is None and not self._is_in_request:
            self._arm_head_deadline()  # the first byte of the next request
        self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received()

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        self._transport = None
        if self._is_counted:
            self._is_counted = False
            self._cap.release()
        self._handler.connection_lost(exc)

    def head_arrived(self) -> None:
        self._is_in_request = True
        self._disarm_head_deadline()

    def request_ended(self) -> None:
        self._is_in_request = False

    def _arm_head_deadline(self) -> None:
        loop = asyncio.get_running_loop()
        self._head_deadline = loop.call_later(self._cap.header_timeout_s, self._head_is_late)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_is_late(self) -> None:
        self._head_deadline = None
        if self._transport is None or self._is_in_request:
            return
        if self._transport.get_write_buffer_size():  # a pipelined head came while a reply is sent
            self._arm_head_deadline()
            return
        self._transport.abort()


class Refusal(asyncio.Protocol):
    """A connection past the cap: the canned 503, then closed once the client's request is read."""

    def __init__(self, response: bytes) -> None:
        self._response = response
        self._transport: asyncio.Transport | None = None
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._transport.write(self._response)
        self._linger = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.close()

    def eof_received(self) -> bool:
        return False  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger is not None:
            self._linger.cancel()


def _refusal_bytes(max_connections: int) -> bytes:
    message = (
        f"the server is at its limit of {max_connections} open connections (server.max_connections); "
        "retry shortly"
    )
    body = msgspec.json.encode({"error": {"type": "overloaded_error", "message": message}})
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class CappedSite(web.BaseSite):
    """aiohttp's TCPSite with a `ConnectionCap` between the listener and aiohttp's protocol."""

    def __init__(self, runner: web.BaseRunner, server: ServerSection) -> None:
        super().__init__(runner)
        self._host = server.host
        self._port = server.port
        self._max_connections = max_connections_of(server)
        self._header_timeout_s = server.header_timeout_s

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        assert self._runner.server is not None, "start the site after runner.setup(): caller bug"
        cap = ConnectionCap(self._runner.server, self._max_connections, self._header_timeout_s)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(cap, self._host, self._port, backlog=self._backlog)
        logger.debug("at most {} open connections (server.max_connections)", self._max_connections)


def _connection_of(request: web.Request) -> Connection | None:
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    return protocol if isinstance(protocol, Connection) else None


@web.middleware
async def requests_in_connection(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: the request's head has arrived, so its connection's head deadline is off until
    the next request's first byte."""
    connection = _connection_of(request)
    if connection is not None:
        connection.head_arrived()
    try:
        return await handler(request)
    finally:
        if connection is not None:
            connection.request_ended()


@web.middleware
async def body_in_time(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Innermost: read the whole body within `server.body_timeout_s` (aiohttp keeps it for the
    handler's `request.read()`), or answer 408 and close at once (400 for a body aiohttp cannot
    decode, and close)."""
    if request.can_read_body:
        timeout_s = request.app[SETTINGS_KEY].server.body_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await request.read()
        except TimeoutError:
            message = f"the request body did not arrive within {timeout_s:g} s (server.body_timeout_s)"
            response = error_response(request.path, 408, message, "timeout_error")
            response.force_close()
            # Sent here and the connection closed behind it: left to aiohttp, the connection would
            # linger for its `lingering_time` reading a body that is not coming, holding a slot.
            await response.prepare(request)
            await response.write_eof()
            request.protocol.force_close()
            return response
        except RequestPayloadError as error:
            # aiohttp's parser feeds this body nothing more; at its end, aiohttp does not read it
            # again after the reply (which would log the error as unhandled).
            request.content.feed_eof()
            response = api_error_response(request.path, as_api_error(error))
            response.force_close()
            return response
    return await handler(request)
