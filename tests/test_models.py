"""Model registry and hot-swap on a real server process: A -> B -> A, load failures, idle unload."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.agent_api_client import call, cold_continuation, conversation_tokens
from tests.waiting import wait_until

GREEDY = {"max_tokens": 10, "temperature": 0}
# For the requests of which only the status and the model that answered are read.
BRIEF = {"max_tokens": 2, "temperature": 0}


def chat(server, model: str, content: str) -> tuple[int, dict]:  # type: ignore[no-untyped-def, type-arg]
    body = {"model": model, "messages": [{"role": "user", "content": content}], **BRIEF}
    return call(server, "POST", "/v1/chat/completions", body)  # type: ignore[no-any-return]


@pytest.fixture
def broken_model_dir(tmp_path: Path) -> Path:
    """A directory that looks like a model but whose architecture mlx-lm does not know."""
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    return broken


def test_swap_and_back_resumes_agents_from_disk_token_exactly(  # type: ignore[no-untyped-def]
    server_factory, tiny_llama_dir: Path, tiny_model_dirs: dict[str, Path], broken_model_dir: Path
) -> None:
    server = server_factory(
        "--model",
        str(tiny_llama_dir),
        "--add-model",
        f"tiny={tiny_model_dirs['qwen2']}",
        "--add-model",
        f"broken={broken_model_dir}",
        "--alias",
        "claude-haiku*=tiny",
        "--cache-budget-mb",
        "512",
    ).start()
    served = tiny_llama_dir.name
    status, listing = call(server, "GET", "/v1/models")
    assert [(m["id"], m["loaded"]) for m in listing["data"]] == [
        (served, True),
        ("tiny", False),
        ("broken", False),
    ]
    assert listing["data"][1]["aliases"] == ["claude-haiku*"]
    assert call(server, "GET", "/v1/models/tiny")[1] == listing["data"][1]
    assert call(server, "GET", "/v1/models/claude-haiku-4-5")[1]["id"] == "tiny"  # by its alias
    assert call(server, "GET", "/v1/models/gpt-4o")[1] == listing["data"][0]  # the loaded model's alias
    status, missing = call(server, "GET", "/v1/models/llama-3")
    assert status == 404 and "is not served here" in missing["error"]["message"]  # OpenAI's shape
    assert call(server, "GET", "/health")[1] == {"status": "ok"}

    # Model A: an agent with two kept turns.
    assert call(server, "POST", "/v1/agents", {"id": "ada", "system": "You are terse."})[0] == 201
    for content in ("My name is Ada.", "What is my name?"):
        status, turn = call(server, "POST", "/v1/agents/ada/messages", {"content": content, **GREEDY})
        assert status == 200, turn
    before = conversation_tokens(server.cache_dir, "ada", 2)

    # A -> B by naming B (here through an alias); a request for `claude-sonnet-*` then gets B too.
    status, reply = call(
        server,
        "POST",
        "/v1/messages",
        {"model": "claude-haiku-4-5", "messages": [{"role": "user", "content": "hi"}], **BRIEF},
    )
    assert status == 200 and reply["model"] == "tiny", reply
    status, reply = chat(server, "claude-sonnet-4-5", "hello")
    assert status == 200 and reply["model"] == "tiny"
    assert call(server, "GET", "/health/ready")[1]["model"] == "tiny"
    assert [m["loaded"] for m in call(server, "GET", "/v1/models")[1]["data"]] == [False, True, False]

    # Requests for A and B at once: the later one waits for the swap instead of failing.
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda model: chat(server, model, "Count to three."), [served, "tiny"]))
    assert [(status, reply["model"]) for status, reply in replies] == [(200, served), (200, "tiny")]

    # B -> A: the agent's third turn continues its kept tokens from the disk cache, token-exactly.
    status, third = call(
        server, "POST", "/v1/agents/ada/messages", {"content": "Say it again.", "model": served, **GREEDY}
    )
    assert status == 200, third
    usage = third["usage"]
    assert usage["cache_tier"] == "disk" and usage["cached_tokens"] >= len(before) - 1
    after = conversation_tokens(server.cache_dir, "ada", 3)
    prompt = after[: usage["prompt_tokens"]]
    assert prompt[: len(before)] == before
    assert after[usage["prompt_tokens"] :] == cold_continuation(tiny_llama_dir, prompt, GREEDY["max_tokens"])

    # A model that fails to load is reported, and A serves on.
    status, failed = call(server, "POST", "/admin/models/load", {"model": "broken"})
    assert status == 500 and "could not load model 'broken'" in failed["error"]["message"]
    assert f"still serving '{served}'" in failed["error"]["message"]
    ready = call(server, "GET", "/health/ready")[1]
    assert {key: ready[key] for key in ("status", "model", "loaded")} == {
        "status": "ok",
        "model": served,
        "loaded": True,
    }
    assert chat(server, served, "hi")[0] == 200
    assert call(server, "POST", "/admin/models/load", {"model": "nope"})[0] == 404
    assert chat(server, "nope", "hi")[0] == 404

    # Unloading gives MLX's memory back: within 5% of the model's footprint of where it started.
    status, unloaded = call(server, "POST", "/admin/models/unload")
    swap = unloaded["swap"]
    start = unloaded["active_memory_before_first_load"]
    footprint = swap["active_memory_before_unload"] - start
    assert footprint > 20 * 2**20  # the model and its caches: enough for 5% of it to show a leak
    assert swap["active_memory_after_unload"] - start <= 0.05 * footprint, swap
    assert call(server, "GET", "/health/ready")[1]["loaded"] is False
    assert chat(server, served, "hi")[0] == 200  # loads again on demand
    assert server.stop() == 0


def test_idle_unload_and_reload_on_the_next_request(  # type: ignore[no-untyped-def]
    server_factory, tiny_model_dirs: dict[str, Path]
) -> None:
    server = server_factory("--model", str(tiny_model_dirs["qwen2"]), "--idle-unload-s", "1").start()
    assert chat(server, "qwen2", "hi")[0] == 200
    wait_until(
        lambda: call(server, "GET", "/health/ready")[1].get("loaded") is False, "the model unloaded", 0.2
    )
    status, reply = chat(server, "qwen2", "hi again")
    assert status == 200 and reply["model"] == "qwen2"
    assert "no requests for 1 s: unloading qwen2" in server.log()
    assert server.stop() == 0


def test_kv_bits_is_refused_at_start_up_when_it_cannot_batch(  # type: ignore[no-untyped-def]
    server_factory, tiny_model_dirs: dict[str, Path]
) -> None:
    server = server_factory("--model", str(tiny_model_dirs["qwen2"]), "--kv-bits", "4")
    with pytest.raises(RuntimeError, match="cannot batch quantized KV caches"):
        server.start()
