"""A server that cannot be held open (issue 63, item 3): a connection that sends half a head, half a
body or nothing more after its reply is closed; past `server.max_connections` a new connection gets
503 with Retry-After, and requests are served again once the held ones go; a body labelled gzip that
is not gzip is a 400 in the protocol's error shape.

Two real servers on loopback: `quick` with short deadlines, and `capped` with a cap of 20 and long
deadlines but the head's, so only the head deadline can close a socket that never finishes its head.
Both serve the tiny random-weight model: no request here reaches it.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import resource
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from loguru import logger

from semantic.protocols import connections
from semantic.protocols.connections import ConnectionCap, Refusal, default_max_connections
from tests.server_process import ServerProcess
from tests.waiting import wait_until

CLOSE_PATIENCE_S = 60.0  # far past every deadline the servers below are given; far short of aiohttp's own
MAX_CONNECTIONS = 20


def start_server(model_dir: Path, cache_dir: Path, *flags: str) -> ServerProcess:
    return ServerProcess(cache_dir, "--model", str(model_dir), "--heap-reserve-mb", "0", *flags).start()


@pytest.fixture(scope="module")
def quick(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = ("--header-timeout-s", "2", "--body-timeout-s", "1", "--keepalive-timeout-s", "1")
    server = start_server(tiny_llama_dir, tmp_path_factory.mktemp("quick"), *flags)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def capped(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = ("--max-connections", str(MAX_CONNECTIONS), "--header-timeout-s", "2")
    long_deadlines = ("--body-timeout-s", "300", "--keepalive-timeout-s", "300")
    server = start_server(tiny_llama_dir, tmp_path_factory.mktemp("capped"), *flags, *long_deadlines)
    yield server
    server.stop()


def connect(server: ServerProcess) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", server.port), timeout=CLOSE_PATIENCE_S)
    connection.settimeout(CLOSE_PATIENCE_S)
    return connection


def read_until_closed(connection: socket.socket) -> tuple[bytes, bool]:
    """What the server sent, and whether it closed the connection (False: still open after
    CLOSE_PATIENCE_S without a byte)."""
    received = b""
    try:
        while chunk := connection.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        return received, False
    return received, True


def parse_reply(raw: bytes) -> tuple[str, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (h.partition(":") for h in header_lines)}
    return status_line, headers, json.loads(body[: int(headers["content-length"])])


def request_head(method: str, path: str, content_length: int | None = None) -> bytes:
    length = (
        f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n" if content_length else ""
    )
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{length}\r\n".encode()


@pytest.mark.parametrize("after_a_reply", [False, True])
def test_a_half_sent_request_head_is_closed(capped: ServerProcess, after_a_reply: bool) -> None:
    """Keep-alive and body deadlines are 300 s here: only the head deadline (2 s) can close it."""
    with connect(capped) as connection:
        if after_a_reply:
            connection.sendall(request_head("GET", "/health/live"))
            assert connection.recv(65536).startswith(b"HTTP/1.1 200")
        connection.sendall(b"GET /health/li")
        received, is_closed = read_until_closed(connection)
    assert is_closed and received == b""


def test_a_partial_body_gets_408_in_the_protocol_shape_and_is_closed(quick: ServerProcess) -> None:
    with connect(quick) as connection:
        connection.sendall(request_head("POST", "/v1/messages", content_length=1000) + b'{"model": ')
        received, is_closed = read_until_closed(connection)
    assert is_closed and received.startswith(b"HTTP/1.1 408"), received
    _, headers, body = parse_reply(received)
    assert headers["connection"] == "close"
    assert body["type"] == "error" and body["error"]["type"] == "timeout_error"
    assert "server.body_timeout_s" in body["error"]["message"]


def test_an_idle_keep_alive_connection_is_closed(quick: ServerProcess) -> None:
    client = http.client.HTTPConnection("127.0.0.1", quick.port, timeout=CLOSE_PATIENCE_S)
    client.request("GET", "/health/live")
    reply = client.getresponse()
    assert reply.status == 200 and json.loads(reply.read()) == {"status": "ok"}
    assert not reply.will_close  # kept alive, until the server's keep-alive deadline
    assert client.sock is not None
    _, is_closed = read_until_closed(client.sock)
    client.close()
    assert is_closed


def health(server: ServerProcess) -> tuple[int, dict[str, str], Any]:
    try:
        with urllib.request.urlopen(server.base_url + "/health/live", timeout=CLOSE_PATIENCE_S) as reply:
            return reply.status, dict(reply.headers), json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def test_past_max_connections_a_new_connection_gets_503_until_they_go(capped: ServerProcess) -> None:
    # Each holder is in a request whose body never comes (the body deadline is 300 s).
    holders = [connect(capped) for _ in range(MAX_CONNECTIONS)]
    try:
        for holder in holders:
            holder.sendall(request_head("POST", "/v1/messages", content_length=10))
        with connect(capped) as silent:  # sends nothing and is still answered
            received, is_closed = read_until_closed(silent)
        assert is_closed and received.startswith(b"HTTP/1.1 503"), received
        _, headers, body = parse_reply(received)
        assert headers["retry-after"] == "1" and headers["connection"] == "close"
        assert "server.max_connections" in body["error"]["message"]
        status, headers, body = health(capped)  # a client that sends its request first
        assert status == 503 and headers["Retry-After"] == "1", (status, body)
        assert "(server.max_connections): refused" in capped.log()
    finally:
        for holder in holders:
            holder.close()
    wait_until(lambda: health(capped)[0] == 200, "served again once the held connections closed")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_a_body_labelled_gzip_that_is_not_is_400_in_the_protocol_shape(
    quick: ServerProcess, path: str
) -> None:
    data = json.dumps({"model": "x", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    request = urllib.request.Request(
        quick.base_url + path,
        data=data.encode(),
        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=CLOSE_PATIENCE_S)
    body = json.loads(refused.value.read())
    assert refused.value.code == 400, body
    assert body["error"]["type"] == "invalid_request_error"
    assert "content-encoding" in body["error"]["message"].lower()
    if path == "/v1/messages":
        assert body["type"] == "error"
    else:
        assert body["error"]["code"] == "400"


def test_the_default_cap_leaves_descriptors_for_files_under_any_limit() -> None:
    assert default_max_connections(1024) == 768  # Linux's usual soft limit: 256 kept back
    assert default_max_connections(256) == 128  # a small limit: half
    assert default_max_connections(1 << 20) == 1024
    assert default_max_connections(resource.RLIM_INFINITY) == 1024


def test_refused_connections_are_warned_about_once_a_period(monkeypatch: pytest.MonkeyPatch) -> None:
    now_s = [1000.0]
    monkeypatch.setattr(connections, "time", SimpleNamespace(monotonic=lambda: now_s[0]))
    cap = ConnectionCap(asyncio.Protocol, max_connections=1, header_timeout_s=10.0)
    assert not isinstance(cap(), Refusal)
    warnings: list[str] = []
    sink = logger.add(warnings.append, level="WARNING", format="{message}")
    try:
        assert all(isinstance(cap(), Refusal) for _ in range(100))
        now_s[0] += connections.WARN_EVERY_S
        assert isinstance(cap(), Refusal)
    finally:
        logger.remove(sink)
    assert [w.strip() for w in warnings] == [
        "at the limit of 1 open connections (server.max_connections): refused 1 new ones",
        "at the limit of 1 open connections (server.max_connections): refused 100 new ones",
    ]
