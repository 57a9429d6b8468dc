"""The direct agent API on a real server process: stateful turns, listing, eviction, restarts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agent_api_client import call, cold_continuation, conversation_tokens
from tests.server_process import ServerProcess


# Tiny random-weight models, full attention (Llama, as the default model) and sliding windows (Gemma 3):
# the oracle is mlx-lm's reply from the same model directory, so the words need not make sense.
@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_kept_conversation_resumes_token_exactly_after_a_restart(  # type: ignore[no-untyped-def]
    server_factory, tiny_llama_dir: Path, tiny_model_dirs: dict[str, Path], model: str
) -> None:
    model_dir = tiny_llama_dir if model == "llama" else tiny_model_dirs[model]
    server = server_factory("--model", str(model_dir), "--cache-budget-mb", "512").start()
    status, created = call(
        server, "POST", "/v1/agents", {"id": "ada", "system": "You are a terse assistant."}
    )
    assert status == 201 and created["id"] == "ada"
    options = {"max_tokens": 12, "temperature": 0}
    status, first = call(server, "POST", "/v1/agents/ada/messages", {"content": "My name is Ada.", **options})
    assert status == 200 and first["usage"]["cached_tokens"] == 0
    status, second = call(
        server, "POST", "/v1/agents/ada/messages", {"content": "What is my name?", **options}
    )
    history = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert second["usage"]["cache_tier"] == "memory"
    assert second["usage"]["cached_tokens"] >= history - 1  # all but an unfed final token
    assert server.stop() == 0
    assert "flushed 1 agent caches" in server.log()

    restarted = server_factory(*server.args, cache_dir=server.cache_dir).start()
    status, listing = call(restarted, "GET", "/v1/agents")
    assert [(a["id"], a["tier"]) for a in listing["data"]] == [("ada", "disk")]
    before = conversation_tokens(restarted.cache_dir, "ada", 2)
    status, third = call(
        restarted, "POST", "/v1/agents/ada/messages", {"content": "Say it again.", **options}
    )
    assert status == 200, third
    usage = third["usage"]
    assert usage["cache_tier"] == "disk" and usage["cached_tokens"] >= len(before) - 1
    after = conversation_tokens(restarted.cache_dir, "ada", 3)
    prompt = after[: usage["prompt_tokens"]]
    assert prompt[: len(before)] == before  # the server continued the kept tokens, not a re-render

    # Oracle: what a cold model produces for the same full prompt, in this process.
    assert after[usage["prompt_tokens"] :] == cold_continuation(model_dir, prompt, options["max_tokens"])
    restarted.stop()


def test_agent_lifecycle_and_errors(shared_server: ServerProcess) -> None:
    server = shared_server
    assert call(server, "POST", "/v1/agents", {"id": "../x"})[0] == 400
    status, created = call(server, "POST", "/v1/agents", {})
    assert status == 201 and created["id"].startswith("agent-")
    assert call(server, "POST", "/v1/agents", {"id": created["id"]})[0] == 409
    # A system prompt that could never fit the context is refused before anything is written.
    status, body = call(
        server, "POST", "/v1/agents", {"id": "lifecycle-verbose", "system": "word " * 2_000_000}
    )
    assert status == 400 and "tokens" in body["error"]["message"], body
    assert call(server, "GET", "/v1/agents/lifecycle-verbose")[0] == 404
    assert not list(server.cache_dir.glob("agents/*/lifecycle-verbose.*"))
    status, body = call(server, "POST", f"/v1/agents/{created['id']}/messages", {})
    assert status == 400 and "content" in body["error"]["message"]
    status, body = call(server, "POST", f"/v1/agents/{created['id']}/messages", {"content": "x", "top_p": 2})
    assert status == 400 and "top_p" in body["error"]["message"]

    status, streamed = call(
        server,
        "POST",
        "/v1/agents/lifecycle-sse/messages",
        {"content": "What is 2+2?", "stream": True, "max_tokens": 8},
    )
    events = [block.split("\n")[0].removeprefix("event: ") for block in streamed.strip().split("\n\n")]
    assert events[0] == "start" and events[-1] == "done" and set(events[1:-1]) == {"delta"}
    done = json.loads(streamed.strip().split("\n\n")[-1].split("data: ", 1)[1])
    assert done["finish_reason"] in {"stop", "length"} and done["usage"]["completion_tokens"] > 0

    status, info = call(server, "GET", "/v1/agents/lifecycle-sse")
    assert status == 200 and info["tier"] == "memory" and info["cached_tokens"] > 0
    assert call(server, "POST", "/v1/agents/lifecycle-sse/evict")[1]["evicted"] is True
    assert call(server, "GET", "/v1/agents/lifecycle-sse")[1]["tier"] == "disk"
    assert call(server, "DELETE", "/v1/agents/lifecycle-sse")[0] == 200
    assert call(server, "GET", "/v1/agents/lifecycle-sse")[0] == 404
    assert call(server, "DELETE", "/v1/agents/lifecycle-sse")[0] == 404
    assert not list(server.cache_dir.glob("agents/*/lifecycle-sse.*"))


def test_creating_an_agent_takes_a_token_from_the_servers_rate_limit(
    server_factory, tiny_llama_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    # The bucket holds 2 and refills once every 5,000 s: however slow the machine, none comes back.
    # No request here reaches the model: the tiny one starts faster.
    args = ("--model", str(tiny_llama_dir), "--rate-per-s", "0.0002", "--rate-burst", "2")
    server = server_factory(*args).start()
    assert call(server, "POST", "/v1/agents", {"id": "first"})[0] == 201
    assert call(server, "POST", "/v1/agents", {"id": "second"})[0] == 201
    status, body = call(server, "POST", "/v1/agents", {"id": "third"})
    assert status == 429 and body["error"]["type"] == "rate_limit_error", body
    assert "rate limit of 0.0002 requests/s (burst 2)" in body["error"]["message"]
    assert call(server, "GET", "/v1/agents/third")[0] == 404  # refused before anything was written
    assert not list(server.cache_dir.glob("agents/*/third.*"))
    # Generations draw on the same bucket.
    assert call(server, "POST", "/v1/agents/first/messages", {"content": "Hi.", "max_tokens": 2})[0] == 429
