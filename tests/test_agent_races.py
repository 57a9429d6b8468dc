"""An agent's existence has one owner, its actor: creates racing a first turn or each other, deletes
racing a running turn, and agents while the model is unloaded (issue 63, items 1, 2 and DELETE).

The server runs the tiny random-weight model: what races is the agents' bookkeeping, not the words."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from semantic.storage.agent_id import AgentId
from semantic.storage.persistence import PersistenceActor
from tests.agent_api_client import call
from tests.server_process import ServerProcess
from tests.test_cache_file import IDENTITY
from tests.test_disk_budget import a_cache_of

LONG_TURN = {"max_tokens": 400, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("agent-races"), "--model", str(tiny_llama_dir), "--cache-budget-mb", "256"
    ).start()
    yield process
    process.stop()


class StreamedTurn(threading.Thread):
    """A streaming direct-API turn read in a thread; `started` is set once its `start` event came."""

    def __init__(self, server: ServerProcess, agent: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.server, self.agent, self.body = server, agent, body
        self.started = threading.Event()
        self.status = 0
        self.events: list[tuple[str, Any]] = []

    def run(self) -> None:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=300)
            connection.request(
                "POST",
                f"/v1/agents/{self.agent}/messages",
                json.dumps(self.body),
                {"content-type": "application/json"},
            )
            reply = connection.getresponse()
            self.status = reply.status
            name = ""
            for raw in reply:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    self.events.append((name, json.loads(line[6:])))
                    if name == "start":
                        self.started.set()
        finally:
            self.started.set()  # a turn that failed before its start must not hang the test

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


def conversation(server: ServerProcess, agent: str) -> dict[str, Any]:
    (path,) = server.cache_dir.glob(f"agents/*/{agent}.conversation.json")
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def test_a_create_beside_a_running_first_turn_never_wipes_it(server: ServerProcess) -> None:
    """Today's main: the create got 201 and the acknowledged turn was forgotten (5 of 5 runs)."""
    turn = StreamedTurn(server, "first-turn", {"content": "Count to fifty.", **LONG_TURN, "max_tokens": 48})
    turn.start()
    assert turn.started.wait(300), "the turn never started"
    status, created = call(server, "POST", "/v1/agents", {"id": "first-turn", "system": "You are terse."})
    turn.join(300)
    assert turn.status == 200 and turn.names()[-1] == "done", turn.events
    assert status == 409 and "already exists" in created["error"]["message"], created
    status, info = call(server, "GET", "/v1/agents/first-turn")
    assert status == 200 and info["turns"] == 1, info
    record = conversation(server, "first-turn")
    assert record["num_turns"] == 1 and record["system"] is None and record["token_ids"]


def test_of_eight_simultaneous_creates_one_wins_and_its_system_prompt_is_stored(
    server: ServerProcess,
) -> None:
    """Today's main: up to five 201s, and clients told a system prompt was stored that was not."""

    def create(number: int) -> tuple[int, Any]:
        return call(
            server, "POST", "/v1/agents", {"id": "eight", "system": f"You are agent number {number}."}
        )

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(create, range(8)))
    winners = [number for number, (status, _) in enumerate(results) if status == 201]
    assert len(winners) == 1, results
    assert sorted(status for status, _ in results) == [201] + [409] * 7, results
    assert conversation(server, "eight")["system"] == f"You are agent number {winners[0]}."


def test_delete_cancels_the_running_turn_and_fails_the_queued_ones(server: ServerProcess) -> None:
    """Today's main: DELETE waited behind the running turn, which ran to its end."""
    assert call(server, "POST", "/v1/agents", {"id": "doomed"})[0] == 201
    running = StreamedTurn(server, "doomed", {"content": "Write a long story.", **LONG_TURN})
    running.start()
    assert running.started.wait(300), "the turn never started"
    queued = StreamedTurn(server, "doomed", {"content": "And another.", **LONG_TURN})
    queued.start()
    status, deleted = call(server, "DELETE", "/v1/agents/doomed")
    running.join(300)
    queued.join(300)
    assert status == 200 and deleted == {"id": "doomed", "deleted": True}, deleted
    assert running.names()[-1] == "error", running.events[-3:]
    assert "was deleted while this turn ran" in running.events[-1][1]["error"]["message"]
    assert "done" not in running.names()
    if queued.status == 409:  # it waited behind the running turn: the delete failed it
        assert call(server, "GET", "/v1/agents/doomed")[0] == 404
        assert not list(server.cache_dir.glob("agents/*/doomed.*"))
    else:  # it reached the server after the delete: a new agent of that id, whose turn is kept
        assert queued.status == 200 and queued.names()[-1] == "done", (queued.status, queued.events)
        assert call(server, "GET", "/v1/agents/doomed")[1]["turns"] == 1


def test_agents_stay_while_the_model_is_unloaded(server: ServerProcess) -> None:
    """Today's main: while unloaded, list was empty, get 404, a create of an existing id 201 (its
    history overwritten), and DELETE 404 with the files left on disk."""
    for agent in ("kept", "dropped"):
        assert call(server, "POST", "/v1/agents", {"id": agent, "system": "You are terse."})[0] == 201
        status, result = call(
            server, "POST", f"/v1/agents/{agent}/messages", {"content": "Hi.", "max_tokens": 4}
        )
        assert status == 200, result
    status, unloaded = call(server, "POST", "/admin/models/unload")
    assert status == 200 and unloaded["loaded"] is False, unloaded
    assert call(server, "GET", "/health/ready")[1]["loaded"] is False

    listed = {agent["id"]: agent for agent in call(server, "GET", "/v1/agents")[1]["data"]}
    assert {"kept", "dropped"} <= set(listed), listed
    status, info = call(server, "GET", "/v1/agents/kept")
    assert status == 200 and info["turns"] == 1 and info["tier"] == "disk", info
    assert call(server, "GET", "/health/ready")[1]["loaded"] is False  # reading agents loads nothing

    status, deleted = call(server, "DELETE", "/v1/agents/dropped")
    assert status == 200 and deleted["deleted"] is True, deleted
    assert not list(server.cache_dir.glob("agents/*/dropped.*"))
    assert call(server, "GET", "/v1/agents/dropped")[0] == 404

    status, refused = call(server, "POST", "/v1/agents", {"id": "kept", "system": "Overwrite me."})
    assert status == 409, refused
    assert conversation(server, "kept")["num_turns"] == 1
    assert conversation(server, "kept")["system"] == "You are terse."
    status, result = call(server, "POST", "/v1/agents/kept/messages", {"content": "Again.", "max_tokens": 4})
    assert status == 200 and result["usage"]["cached_tokens"] > 0, result
    assert call(server, "GET", "/v1/agents/kept")[1]["turns"] == 2


def test_a_cache_copied_before_its_agent_was_deleted_is_never_written_after(tmp_path: Path) -> None:
    """An idle checkpoint or an eviction copies a cache, then writes it; a delete in between must
    not be undone by the write (the agent would come back from disk)."""

    async def run() -> None:
        actor = PersistenceActor(tmp_path, IDENTITY)
        await actor.start()
        try:
            copied_at = time.monotonic()  # the checkpoint copies ada's cache ...
            await actor.delete(AgentId("ada"))  # ... ada is deleted ...
            assert await actor.save([a_cache_of("ada")], copied_at) == []  # ... the copy is dropped
            assert await actor.on_disk() == {}
            assert not list(tmp_path.glob("agents/*/ada.*"))
            # A copy taken after the delete is the agent's new life: written.
            assert await actor.save([a_cache_of("ada")], time.monotonic()) == ["ada"]
        finally:
            await actor.stop()

    asyncio.run(run())
