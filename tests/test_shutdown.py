"""Graceful shutdown on a real server process, and a disk that fills up during a flush.

The servers serve the tiny random-weight Llama: what is tested is what the server does around the
model (draining, flushing, cancelling, exiting), where the words do not matter."""

from __future__ import annotations

import errno
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from semantic.storage import cache_file
from semantic.storage.cache_file import SerializedCache, read_cache_file
from semantic.storage.persistence import PersistenceActor
from tests.agent_api_client import call
from tests.server_process import ServerProcess
from tests.test_cache_file import IDENTITY, a_cache

STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
# Long enough that the stream is still decoding when the late request comes, at a tiny model's steps
# of milliseconds.
DRAINED_TOKENS = 400


def chat_request(server: ServerProcess, body: dict[str, Any], session: str) -> urllib.request.Request:
    return urllib.request.Request(
        f"{server.base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-session-id": session},
    )


def post(server: ServerProcess, body: dict[str, Any], session: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(chat_request(server, body, session), timeout=120) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def stream_in_thread(
    server: ServerProcess, session: str, max_tokens: int
) -> tuple[threading.Thread, dict[str, Any]]:
    """Start a streaming request; `result` gets its chunks, and `first` is set at the first token."""
    result: dict[str, Any] = {"chunks": [], "first": threading.Event(), "errors": []}

    def run() -> None:
        body = {"messages": STORY, "stream": True, "max_tokens": max_tokens, "temperature": 0}
        body["stream_options"] = {"include_usage": True}
        try:
            with urllib.request.urlopen(chat_request(server, body, session), timeout=120) as reply:
                for line in reply:
                    if line.startswith(b"data: {"):
                        chunk = json.loads(line[6:])
                        result["chunks"].append(chunk)
                        result["first"].set()
        except Exception as error:
            result["errors"].append(error)
        result["first"].set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_sigterm_during_a_stream_finishes_it_flushes_and_the_restart_resumes(
    server_factory, tiny_llama_dir: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    server = server_factory("--model", str(tiny_llama_dir), "--temperature", "0").start()
    thread, result = stream_in_thread(server, "keeper", max_tokens=DRAINED_TOKENS)
    assert result["first"].wait(60)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    status, headers, body = post(server, {"messages": STORY, "max_tokens": 4}, "late")
    assert status == 503 and headers["Retry-After"] == "5"
    assert "shutting down" in json.loads(body)["error"]["message"]
    thread.join(120)
    assert server.proc.wait(60) == 0
    chunks = result["chunks"]
    finished = chunks[-1]["usage"]
    assert not result["errors"] and finished["completion_tokens"] == DRAINED_TOKENS  # finished, not cut
    reply = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert "flushed 1 agent caches to disk" in server.log()
    assert list((tmp_path / "cache" / "agents").glob("*/keeper.safetensors"))

    restarted = server_factory("--model", str(tiny_llama_dir), "--temperature", "0").start()
    # The flushed file holds the whole finished stream: its prompt and every token it sent (all but an
    # unfed final token).
    status, kept = call(restarted, "GET", "/v1/agents/keeper")
    assert status == 200 and kept["tier"] == "disk", kept
    assert kept["cached_tokens"] >= finished["prompt_tokens"] + DRAINED_TOKENS - 1
    # The next turn resumes from that file (a fresh server holds nothing else). A random model's reply,
    # sent back as text, need not tokenize as it was generated, so only its prompt is sure to match.
    follow_up = [*STORY, {"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
    status, _, body = post(restarted, {"messages": follow_up, "max_tokens": 4}, "keeper")
    usage = json.loads(body)["usage"]
    assert status == 200 and usage["prompt_tokens_details"]["cached_tokens"] >= finished["prompt_tokens"]


def test_shutdown_timeout_cancels_what_is_left_and_a_second_signal_exits_at_once(
    server_factory, tiny_llama_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    server = server_factory("--model", str(tiny_llama_dir), "--shutdown-timeout-s", "0.5").start()
    thread, result = stream_in_thread(server, "long", max_tokens=2000)
    assert result["first"].wait(60)
    server.proc.send_signal(signal.SIGTERM)
    thread.join(60)
    assert server.proc.wait(60) == 0
    errors = [c["error"] for c in result["chunks"] if "error" in c]
    assert errors and "shutting down" in errors[0]["message"]

    again = server_factory("--model", str(tiny_llama_dir)).start()
    thread, result = stream_in_thread(again, "twice", max_tokens=2000)
    assert result["first"].wait(60)
    again.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    again.proc.send_signal(signal.SIGTERM)
    assert again.proc.wait(10) == 128 + signal.SIGTERM
    thread.join(60)
    assert "second SIGTERM: exiting now" in again.log()


def test_a_disk_that_fills_up_during_a_flush_is_reported_and_leaves_no_broken_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    identity = IDENTITY  # a model of one full-attention layer, 2 KV heads of 8
    tensors, newer = a_cache(256).tensors, a_cache(512, seed=1).tensors
    disk_is_full = False
    real_save = cache_file.save_file

    def save_until_full(data: Any, filename: str, metadata: Any = None) -> None:
        if disk_is_full:  # the write runs out of space half-way through
            with open(filename, "wb") as partial:
                partial.write(b"\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(data, filename, metadata=metadata)

    monkeypatch.setattr(cache_file, "save_file", save_until_full)

    async def flush() -> tuple[list[str], list[str], PersistenceActor]:
        nonlocal disk_is_full
        actor = PersistenceActor(tmp_path, identity)
        await actor.start()
        before = await actor.save(
            [SerializedCache("kept", tensors, [], 256), SerializedCache("full", tensors, [], 256)]
        )
        disk_is_full = True
        during = await actor.save([SerializedCache("full", newer, [], 512)])
        return before, during, actor

    from loguru import logger

    messages: list[str] = []
    sink = logger.add(messages.append, level="ERROR")
    try:
        before, during, actor = asyncio.run(flush())
    finally:
        logger.remove(sink)
    assert before == ["kept", "full"] and during == []
    assert any("No space left on device" in m and "full" in m for m in messages)
    files = sorted(p.name for p in actor.agents_dir.iterdir())
    assert files == ["full.safetensors", "kept.safetensors"]  # no partial file, no temp file
    kept = read_cache_file(actor.path_for("full"), identity)  # the previous copy, still whole
    assert kept.num_tokens == 256 and (kept.tensors["attn.0.keys"] == tensors["attn.0.keys"]).all()
