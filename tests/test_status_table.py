"""The same condition gets the same status on all three APIs, each in its own error shape.

One real server (the tiny random-weight Llama, whose words do not matter here, one batch slot and no
queue) and, per condition, one request to the Anthropic, OpenAI and direct agent APIs.
"""

from __future__ import annotations

import errno
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors import SafetensorError

from semantic.protocols.errors import api_error_response, as_api_error
from tests.server_process import ServerProcess
from tests.waiting import wait_until

APIS = ("anthropic", "openai", "agents")


def turn_request(api: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    """A small turn on `api`; `fields` override the body (`agent` names the agent)."""
    agent = fields.pop("agent", "table-agent")
    messages = [{"role": "user", "content": "Tell me a long story about a dragon."}]
    if api == "anthropic":
        return "/v1/messages", {"model": "claude-x", "max_tokens": 8, "messages": messages, **fields}
    if api == "openai":
        return "/v1/chat/completions", {"max_tokens": 8, "messages": messages, **fields}
    return f"/v1/agents/{agent}/messages", {"content": messages[0]["content"], "max_tokens": 8, **fields}


def post(
    server: ServerProcess, path: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        server.base_url + path, data=data, headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, dict(reply.headers), json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read() or b"null")


def message_of(api: str, body: dict[str, Any]) -> str:
    """The error message, from the API's own error shape."""
    if api == "anthropic":
        assert body["type"] == "error", body
    message: str = body["error"]["message"]
    return message


def metric(server: ServerProcess, name: str) -> float:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def open_stream(server: ServerProcess, path: str, body: dict[str, Any]) -> socket.socket:
    """A request sent whole on a raw connection; the caller reads (or not) and closes it."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    connection = socket.create_connection(("127.0.0.1", server.port), timeout=120)
    connection.sendall(head + data)
    return connection


def wait_until_idle(server: ServerProcess) -> None:
    wait_until(
        lambda: (
            metric(server, "semantic_requests_in_flight") == 0 and metric(server, "semantic_batch_size") == 0
        ),
        "the server is idle",
    )


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("status-table")
    broken = tmp / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    process = ServerProcess(
        tmp / "cache",
        "--model",
        str(tiny_llama_dir),
        "--add-model",
        f"broken={broken}",
        "--max-batch-size",
        "1",
        "--max-queued",
        "0",
        "--temperature",
        "0",
    ).start()
    yield process
    process.stop()


@pytest.mark.parametrize("api", APIS)
def test_bad_input_is_400_with_what_was_wrong(server: ServerProcess, api: str) -> None:
    path, _ = turn_request(api)
    status, _, body = post(server, path, b'{"messages": [')
    assert status == 400 and "not valid JSON" in message_of(api, body)
    path, body_fields = turn_request(api, max_tokens=10**9)
    status, _, body = post(server, path, body_fields)
    assert status == 400 and "limits.max_tokens" in message_of(api, body)
    path, body_fields = turn_request(api, temperature=-1)
    status, _, body = post(server, path, body_fields)
    assert status == 400 and "temperature" in message_of(api, body)


@pytest.mark.parametrize("api", APIS)
def test_a_bad_agent_id_is_400(server: ServerProcess, api: str) -> None:
    path, body_fields = turn_request(api, agent=".hidden")
    status, _, body = post(server, path, body_fields, headers={"x-agent-id": "../escape"})
    assert status == 400 and "invalid agent id" in message_of(api, body)


@pytest.mark.parametrize("api", APIS)
def test_an_unknown_model_is_404(server: ServerProcess, api: str) -> None:
    path, body_fields = turn_request(api, model="no-such-model")
    status, _, body = post(server, path, body_fields)
    assert status == 404 and "no-such-model" in message_of(api, body)


@pytest.mark.parametrize("api", APIS)
def test_a_model_that_cannot_load_is_503_and_the_old_one_keeps_serving(
    server: ServerProcess, api: str
) -> None:
    path, body_fields = turn_request(api, model="broken")
    status, headers, body = post(server, path, body_fields)
    assert status == 503 and "could not load model 'broken'" in message_of(api, body)
    assert headers.get("Retry-After")
    path, body_fields = turn_request(api)
    assert post(server, path, body_fields)[0] == 200


@pytest.mark.parametrize("api", APIS)
def test_overload_is_429_with_retry_after(server: ServerProcess, api: str) -> None:
    """One slot and no queue: while a streaming turn holds the slot, every API refuses the next."""
    with open_stream(server, *turn_request("openai", max_tokens=2000, stream=True)) as holder:
        assert holder.recv(1)  # the holder's turn has started streaming
        path, body_fields = turn_request(api, agent="other-agent")
        status, headers, body = post(server, path, body_fields)
    assert status == 429 and headers.get("Retry-After") == "1"
    assert "limit of 1 requests in flight" in message_of(api, body)
    wait_until_idle(server)


@pytest.mark.parametrize("api", APIS)
def test_a_client_that_leaves_before_the_first_read_frees_its_slot(server: ServerProcess, api: str) -> None:
    """The request is sent whole and the connection closed at once: the generation is cancelled."""
    path, body_fields = turn_request(api, max_tokens=2000, stream=True, agent=f"leaver-{api}")
    generated_before = metric(server, "semantic_generated_tokens_total")
    for _ in range(5):  # the client can leave at any point of the turn's start: try a few
        with open_stream(server, path, body_fields):
            pass  # sent whole, closed before reading anything
        wait_until_idle(server)
    # Each was cancelled long before its 2,000 tokens, and the next request is served.
    assert metric(server, "semantic_generated_tokens_total") - generated_before < 2000
    path, body_fields = turn_request(api)
    assert post(server, path, body_fields)[0] == 200


@pytest.mark.parametrize("api", APIS)
def test_hostile_bodies_get_a_4xx_in_the_protocol_shape(server: ServerProcess, api: str) -> None:
    path, valid = turn_request(api, max_tokens=2)
    hostile = [
        b"\xff\xfe" + json.dumps(valid).encode(),  # not UTF-8
        b"[" * 100_000,  # nested past any sane depth
        json.dumps({**valid, "max_tokens": "many"}).encode(),
        json.dumps({**valid, "seed": -1, "temperature": 0.5}).encode(),
        json.dumps({**valid, "seed": 2**64, "temperature": 0.5}).encode(),
        json.dumps({**valid, "stop": ["\u0000"] * 100}).encode(),
    ]
    for body in hostile:
        status, headers, reply = post(server, path, body)
        assert status < 500, (body[:40], status, reply)
        if status >= 400:
            assert headers["Content-Type"].startswith("application/json") and message_of(api, reply)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("max_tokens", None, "max_tokens: Field required"),
        ("max_tokens", 0, "max_tokens must be >= 1"),
        ("temperature", 1.5, "out of range: 0..1"),
        ("temperature", -0.1, "out of range: 0..1"),
        ("top_p", 0, "top_p"),
        ("top_k", -1, "top_k"),
        ("messages", [], "at least one message"),
    ],
)
def test_anthropic_validates_as_anthropic_does(
    server: ServerProcess, field: str, value: Any, expected: str
) -> None:
    path, body = turn_request("anthropic")
    if value is None:
        del body[field]
    else:
        body[field] = value
    status, _, reply = post(server, path, body)
    assert status == 400 and reply["error"]["type"] == "invalid_request_error", reply
    assert expected in reply["error"]["message"], reply


def test_openai_keeps_its_own_ranges(server: ServerProcess) -> None:
    path, body = turn_request("openai", temperature=1.5, max_tokens=2)
    assert post(server, path, body)[0] == 200
    path, body = turn_request("openai", temperature=2.5)
    assert post(server, path, body)[0] == 400


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_past_the_context_says_prompt_is_too_long(server: ServerProcess, stream: bool) -> None:
    path, body = turn_request("anthropic", stream=stream)
    body["messages"] = [{"role": "user", "content": "hello " * 9000}]
    status, _, reply = post(server, path, body)
    message = message_of("anthropic", reply)
    assert status == 400 and message.startswith("prompt is too long: "), reply
    # The tiny Llama's context: its max_position_embeddings.
    assert message.endswith(" tokens > 4096 maximum") and int(message.split()[4]) > 4096


class _WriteFailed(OSError):
    """A library's own OSError subclass, as storage code may raise."""


def _raised_from(cause: BaseException) -> RuntimeError:
    try:
        raise RuntimeError("could not write the cache file") from cause
    except RuntimeError as error:
        return error


# What a full disk or a process out of descriptors raises, as it reaches a handler.
OS_FAILURES = [
    (OSError(errno.ENOSPC, "No space left on device"), 507),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), 507),
    (_WriteFailed(errno.ENOSPC, "No space left on device"), 507),
    (_raised_from(OSError(errno.ENOSPC, "No space left on device")), 507),
    # safetensors' save_file on a full tmpfs (0.8): a Rust io::Error in the message, no errno
    (SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"), 507),
    (OSError(errno.EMFILE, "Too many open files"), 503),
    (OSError(errno.ENFILE, "Too many open files in system"), 503),
]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize(("error", "status"), OS_FAILURES)
def test_a_full_disk_is_507_and_no_descriptors_is_503_with_retry_after(
    api: str, error: BaseException, status: int
) -> None:
    path, _ = turn_request(api)
    response = api_error_response(path, as_api_error(error))
    assert isinstance(response.body, bytes)
    body = json.loads(response.body)
    assert response.status == status
    message = message_of(api, body)
    assert ("disk is full" if status == 507 else "out of file descriptors") in message
    if status == 503:
        assert response.headers["Retry-After"] == "1"
    kind = body["error"]["type"]
    if api == "anthropic":
        assert kind == ("api_error" if status == 507 else "overloaded_error")
    else:
        assert kind == ("insufficient_storage" if status == 507 else "overloaded_error")
    if api == "openai":
        assert body["error"]["code"] == str(status)
