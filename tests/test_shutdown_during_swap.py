"""Shutdown wins over a model swap (issue 63, item 8): a SIGTERM while a swap drains abandons it, the
request that asked for the other model gets a 503 with Retry-After, and the process exits 0."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from tests.agent_api_client import call
from tests.test_shutdown import post, stream_in_thread
from tests.waiting import wait_until


def is_switching_to(server: Any, target: str) -> bool:
    status, ready = call(server, "GET", "/health/ready")
    return status == 503 and ready.get("reason") == f"switching the model to {target}"


def test_sigterm_during_a_swap_answers_its_waiting_request_with_503(  # type: ignore[no-untyped-def]
    server_factory, default_model_dir: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    """Today's main: the swap drained and loaded the new model, and its request got no response."""
    server = server_factory(
        "--model",
        str(default_model_dir),
        "--add-model",
        f"tiny={tiny_model_dirs['qwen2']}",
        "--swap-drain-timeout-s",
        "600",  # the running stream holds the swap in its drain until the shutdown
        "--shutdown-timeout-s",
        "1",
        "--cache-budget-mb",
        "256",
    ).start()
    running, streamed = stream_in_thread(server, "storyteller", max_tokens=4000)
    assert streamed["first"].wait(300) and not streamed["errors"], streamed["errors"]

    asked: dict[str, Any] = {}

    def ask_for_tiny() -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
        asked["status"], asked["headers"], asked["body"] = post(server, body, "switcher")

    switching = threading.Thread(target=ask_for_tiny, daemon=True)
    switching.start()
    wait_until(lambda: is_switching_to(server, "tiny"), "the swap to tiny has begun")

    assert server.stop(timeout=300) == 0, server.log()[-3000:]
    switching.join(60)
    running.join(60)
    assert asked["status"] == 503, asked
    assert asked["headers"]["Retry-After"], asked["headers"]
    error = json.loads(asked["body"])["error"]  # OpenAI's error shape
    assert "shutting down" in error["message"], error
    log = server.log()
    assert "abandoned: the server is shutting down" in log, log[-3000:]
    assert f"switched {default_model_dir.name} -> tiny" not in log  # the new model was never loaded
    assert "Traceback" not in log, log[-3000:]
