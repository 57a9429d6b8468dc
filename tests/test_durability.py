"""What the daemon holds for people stays theirs: acknowledged turns survive kill -9, a delete is
final even during a turn, and no id reaches a file outside the cache folder."""

from __future__ import annotations

import http.client
import json
import signal
import threading
from pathlib import Path
from typing import Any

from tests.agent_api_client import call
from tests.server_process import ServerProcess

GREEDY = {"max_tokens": 6, "temperature": 0}


def conversation_record(cache_dir: Path, agent_id: str) -> dict[str, Any] | None:
    found = list(cache_dir.glob(f"agents/*/{agent_id}.conversation.json"))
    return json.loads(found[0].read_bytes()) if found else None


def test_an_acknowledged_turn_survives_kill_9_right_after_it(  # type: ignore[no-untyped-def]
    server_factory, tiny_llama_dir: Path
) -> None:
    # What is kept is the server's, not the model's: the tiny model's words do not matter here.
    args = ("--model", str(tiny_llama_dir), "--cache-budget-mb", "256")
    server: ServerProcess = server_factory(*args).start()
    assert call(server, "POST", "/v1/agents", {"id": "keeper", "system": "You are terse."})[0] == 201
    for turn in range(2):  # a turn before the first kill, and one after a restart from it
        status, reply = call(
            server, "POST", "/v1/agents/keeper/messages", {"content": f"Turn {turn}.", **GREEDY}
        )
        assert status == 200, reply
        assert server.proc is not None
        server.proc.send_signal(signal.SIGKILL)  # no flush, no shutdown: only what was fsynced
        server.proc.wait(30)
        record = conversation_record(server.cache_dir, "keeper")
        assert record is not None and record["num_turns"] == turn + 1
        server = server_factory(*args, cache_dir=server.cache_dir).start()
    kept = conversation_record(server.cache_dir, "keeper")
    status, reply = call(server, "POST", "/v1/agents/keeper/messages", {"content": "Last.", **GREEDY})
    assert status == 200, reply
    after = conversation_record(server.cache_dir, "keeper")
    assert kept is not None and after is not None and after["num_turns"] == 3
    prompt = after["token_ids"][: reply["usage"]["prompt_tokens"]]
    assert prompt[: len(kept["token_ids"])] == kept["token_ids"]  # the whole history is there


def test_ids_that_would_leave_the_cache_folder_are_refused(shared_server: ServerProcess) -> None:
    server = shared_server
    victim = server.cache_dir.parent / "x.safetensors"
    victim.write_bytes(b"not yours to delete")
    for path in ("/v1/agents/..%2F..%2Fx", "/v1/agents/..%2Fx", "/v1/agents/.x"):
        status, reply = call(server, "DELETE", path)
        assert status == 400 and "invalid agent id" in reply["error"]["message"], reply
        status, reply = call(server, "POST", path + "/evict")
        assert status == 400, reply
    assert victim.read_bytes() == b"not yours to delete"


def test_a_delete_during_a_running_turn_is_final(shared_server: ServerProcess) -> None:
    server = shared_server
    assert call(server, "POST", "/v1/agents", {"id": "doomed"})[0] == 201
    started = threading.Event()
    events: list[bytes] = []

    def run_turn() -> None:
        body = json.dumps({"content": "Tell me a long story.", "max_tokens": 24, "stream": True}).encode()
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        connection.request("POST", "/v1/agents/doomed/messages", body, {"content-type": "application/json"})
        reply = connection.getresponse()
        for line in reply:
            events.append(line)
            started.set()

    runner = threading.Thread(target=run_turn)
    runner.start()
    assert started.wait(120)  # the turn is streaming
    status, reply = call(server, "DELETE", "/v1/agents/doomed")  # cancels the turn, then deletes
    runner.join(120)
    assert status == 200 and reply["deleted"], reply
    assert b"event: done\n" not in events and b"event: error\n" in events  # the turn was not kept
    assert call(server, "GET", "/v1/agents/doomed")[0] == 404
    assert conversation_record(server.cache_dir, "doomed") is None
    assert not list(server.cache_dir.glob("agents/*/doomed.*"))
    listing = call(server, "GET", "/v1/agents")[1]
    assert "doomed" not in [agent["id"] for agent in listing["data"]]
