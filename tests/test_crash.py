"""kill -9 at random points of turns and of the shutdown flush: every acknowledged turn is on disk
afterwards, no file is left that fails to load, and every agent continues token-exactly."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.agent_api_client import call, cold_continuation
from tests.server_process import ServerProcess

AGENTS = ("crash-a", "crash-b", "crash-c")
ROUNDS = int(os.environ.get("CRASH_ROUNDS", "4"))  # kills per run (half in a flush); more to soak
REPLY_TOKENS = 12


def stream_turn(server: ServerProcess, agent_id: str, text: str, acknowledged: list[str]) -> None:
    """One streamed turn; records the agent id if `done` arrived (the turn was acknowledged)."""
    body = json.dumps({"content": text, "max_tokens": REPLY_TOKENS, "temperature": 0, "stream": True})
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        connection.request(
            "POST", f"/v1/agents/{agent_id}/messages", body, {"content-type": "application/json"}
        )
        for line in connection.getresponse():
            if line.startswith(b"event: done"):
                acknowledged.append(agent_id)
    except (OSError, http.client.HTTPException):
        pass  # the server was killed under it


def record(cache_dir: Path, agent_id: str) -> dict[str, Any]:
    (path,) = cache_dir.glob(f"agents/*/{agent_id}.conversation.json")
    loaded: dict[str, Any] = json.loads(path.read_bytes())
    return loaded


@pytest.mark.slow  # a soak of kill -9s; test_durability.py kills one turn in the default suite
def test_kill_9_during_turns_and_flushes_loses_no_acknowledged_turn(  # type: ignore[no-untyped-def]
    server_factory, default_model_dir: Path
) -> None:
    chance = random.Random(20261123)
    args = ("--model", str(default_model_dir), "--cache-budget-mb", "256")
    server: ServerProcess = server_factory(*args).start()
    for agent_id in AGENTS:
        assert call(server, "POST", "/v1/agents", {"id": agent_id, "system": "You are terse."})[0] == 201
    num_acknowledged = dict.fromkeys(AGENTS, 0)
    acknowledged_total = 0
    for round_index in range(ROUNDS):
        acknowledged: list[str] = []
        threads = [
            threading.Thread(
                target=stream_turn, args=(server, agent_id, f"Round {round_index}.", acknowledged)
            )
            for agent_id in AGENTS
        ]
        for thread in threads:
            thread.start()
        time.sleep(chance.uniform(0.2, 3.0))
        assert server.proc is not None
        if round_index % 2:  # kill it during the shutdown flush rather than mid-turn
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(chance.uniform(0.0, 0.3))
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(30)
        for thread in threads:
            thread.join(60)
        for agent_id in acknowledged:
            num_acknowledged[agent_id] += 1
        for agent_id in AGENTS:  # acknowledged turns are on disk; unacknowledged ones may be too
            on_disk = record(server.cache_dir, agent_id)["num_turns"]
            assert on_disk >= num_acknowledged[agent_id]
            num_acknowledged[agent_id] = on_disk
        acknowledged_total += len(acknowledged)
        server = server_factory(*args, cache_dir=server.cache_dir).start()

    assert not list(server.cache_dir.glob("agents/*/.*.tmp"))  # the restart removed what kills left
    on_disk_total = sum(record(server.cache_dir, agent_id)["num_turns"] for agent_id in AGENTS)
    for agent_id in AGENTS:
        before = record(server.cache_dir, agent_id)
        status, reply = call(
            server,
            "POST",
            f"/v1/agents/{agent_id}/messages",
            {"content": "Last one.", "max_tokens": 8, "temperature": 0},
        )
        assert status == 200, reply
        after = record(server.cache_dir, agent_id)
        prompt = after["token_ids"][: reply["usage"]["prompt_tokens"]]
        assert prompt[: len(before["token_ids"])] == before["token_ids"]  # the history, whole
        generated = after["token_ids"][reply["usage"]["prompt_tokens"] :]
        assert generated == cold_continuation(default_model_dir, prompt, 8)
    assert not list(server.cache_dir.glob("quarantine/*"))  # no file was torn or had to be set aside
    print(
        f"kill -9: {ROUNDS}; turns acknowledged {acknowledged_total}, on disk after the kills {on_disk_total}"
    )
