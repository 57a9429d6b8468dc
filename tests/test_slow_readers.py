"""A client that stops reading a stream gives its slot back (issue 78): a write that waits past
`server.stream_write_timeout_s` ends the request, cancels its turn and releases its admission slot,
and the request's log line says why; a client that reads a long stream as it comes is not affected.

A real server on loopback with one slot (one in the batch, none queued) and a short write deadline,
serving the tiny random-weight model (what is tested is the server's writing, not the words); the
stalled client is a raw socket with a small receive buffer that reads the status line and then
nothing more. Its chunks carry 20 alternatives per token, so the buffers between fill early.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.server_process import ServerProcess
from tests.waiting import PATIENCE_S, wait_until

WRITE_TIMEOUT_S = 2
PROBE_INTERVAL_S = 0.5
NUM_READ_TOKENS = 200  # each chunk carries 20 alternatives: more than STREAM_BUFFER_BYTES, twice
# The stalled reply: as long as the tiny model's context (4096) allows, many times what the buffers
# between the server and the stalled client hold.
NUM_STALLED_TOKENS = 4000
# SmolLM2's <|endoftext|> and <|im_end|> (the tiny model has its tokenizer): biased away, so replies
# run long.
EOS_TOKEN_IDS = (0, 2)
NO_END = {str(token): -100 for token in EOS_TOKEN_IDS}
PROMPT = "Tell me a very long story about a lighthouse."


def start_server(model_dir: Path, cache_dir: Path, *flags: str) -> ServerProcess:
    one_slot = ("--max-batch-size", "1", "--max-queued", "0")
    return ServerProcess(
        cache_dir, "--model", str(model_dir), "--heap-reserve-mb", "0", *one_slot, *flags
    ).start()


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = ("--stream-write-timeout-s", str(WRITE_TIMEOUT_S))
    process = start_server(tiny_llama_dir, tmp_path_factory.mktemp("slow-readers"), *flags)
    yield process
    process.stop()


def long_stream_body(max_tokens: int) -> dict[str, object]:
    return {
        "model": "default",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 20,
        "logit_bias": NO_END,
    }


def stall(server: ServerProcess, request_id: str) -> socket.socket:
    """A streaming request whose client reads the status line and then never reads again."""
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.settimeout(PATIENCE_S)
    client.connect(("127.0.0.1", server.port))
    body = json.dumps(long_stream_body(NUM_STALLED_TOKENS)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    client.sendall(head.encode() + body)
    assert client.recv(12) == b"HTTP/1.1 200"  # admitted and streaming
    return client


def probe(server: ServerProcess) -> int:
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    request = urllib.request.Request(
        server.base_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=PATIENCE_S) as reply:
            reply.read()
            return int(reply.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def in_flight(server: ServerProcess) -> float:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=PATIENCE_S) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("semantic_requests_in_flight "):
                return float(line.split()[1])
    raise AssertionError("no semantic_requests_in_flight in /metrics")


def test_a_client_that_stops_reading_gives_its_slot_back(server: ServerProcess) -> None:
    stalled = stall(server, "req_stalled_reader")
    try:
        statuses: list[int] = []

        def probe_succeeds() -> bool:
            statuses.append(probe(server))
            return statuses[-1] == 200

        deadline = time.monotonic() + PATIENCE_S
        while not probe_succeeds():
            assert time.monotonic() < deadline, f"no request admitted in {PATIENCE_S:g} s: {statuses[-3:]}"
            time.sleep(PROBE_INTERVAL_S)
        assert statuses[0] == 429, statuses  # the stalled request held the only slot
        wait_until(lambda: "req_stalled_reader" in server.log(), "the stalled request's log line")
        line = next(line for line in server.log().splitlines() if "req_stalled_reader" in line)
        assert "write deadline passed" in line, line
        assert in_flight(server) == 0
    finally:
        stalled.close()


def test_a_reader_of_a_long_stream_gets_all_of_it(server: ServerProcess) -> None:
    """More than the server buffers for a client, taken as it comes, well within the deadlines."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=NUM_READ_TOKENS,
            stream=True,
            logprobs=True,
            top_logprobs=20,
            logit_bias=NO_END,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == NUM_READ_TOKENS
    finish_reasons = [choice.finish_reason for chunk in chunks for choice in chunk.choices]
    assert finish_reasons[-1] == "length"
    num_logprobs = sum(
        len(choice.logprobs.content or []) for chunk in chunks for choice in chunk.choices if choice.logprobs
    )
    assert num_logprobs == NUM_READ_TOKENS
    assert in_flight(server) == 0
