"""Caches reach disk without a shutdown: a flush writes only what changed since each file, and a
server that has been idle for `checkpoint_idle_s` writes on its own, so a kill -9 after it loses
no cache. The tiny random-weight Llama serves: what is tested is when caches are written, not what
the model says."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from semantic import AgentSystem, EngineConfig, SystemConfig
from semantic.engine.cache_store.cache_tensors import SerializedCache, tokens_digest
from semantic.storage.agent_id import AgentId
from semantic.storage.cache_file import read_stated_tokens, write_cache_file
from semantic.storage.persistence import PersistenceActor
from tests.server_process import ServerProcess
from tests.test_cache_file import IDENTITY
from tests.waiting import wait_until


async def test_a_flush_writes_only_the_caches_that_changed_since_their_files(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    config = SystemConfig(
        engine=EngineConfig(model=str(tiny_llama_dir), cache_budget_mb=256),
        cache_dir=tmp_path,
        checkpoint_idle_s=None,
    )
    async with AgentSystem(config) as system:
        ada, bob = await system.open("ada"), await system.open("bob")
        await ada.reply("Hello, I am Ada.", max_tokens=4)
        await bob.reply("Hello, I am Bob.", max_tokens=4)
        assert sorted(await system.flush()) == ["ada", "bob"]
        persistence = system.models.persistence
        assert persistence is not None and persistence.num_writes == 2
        assert await system.flush() == []  # both files hold their caches
        assert persistence.num_writes == 2
        await ada.reply("Say it again.", max_tokens=4)
        assert await system.flush() == ["ada"]
        assert persistence.num_writes == 3
        (ada_file,) = tmp_path.glob("agents/*/ada.safetensors")
        num_tokens, digest = read_stated_tokens(ada_file)
        assert num_tokens == (await system.agent_info(ada.agent_id)).num_cached_tokens  # type: ignore[union-attr]
        assert digest and digest == (await persistence.on_disk(ada.agent_id))[ada.agent_id].tokens_digest


def _cache(agent_id: str, tokens: list[int]) -> SerializedCache:
    keys = np.ones((1, 2, 16, 4), dtype=np.float32)
    tensors = {"tokens": np.array(tokens, dtype=np.int32), "attn.0.keys": keys, "attn.0.values": keys * 2}
    return SerializedCache(agent_id, tensors, [], len(tokens))


async def test_a_restarted_persistence_knows_which_tokens_each_file_holds(tmp_path: Path) -> None:
    persistence = PersistenceActor(tmp_path, IDENTITY)
    await persistence.start()
    await persistence.save([_cache("ada", [1, 2, 3])])
    path = persistence.path_for(AgentId("ada"))
    await persistence.stop()
    # A file from before digests: its header states no digest, so it is written again when flushed.
    old = persistence.agents_dir / "old.safetensors"
    write_cache_file(old, _cache("old", [4, 5]), IDENTITY)
    with open(old, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    metadata = {k: v for k, v in header.pop("__metadata__").items() if k != "tokens_digest"}
    tensors = {"tokens": np.array([4, 5], dtype=np.int32)}
    save_file(tensors, str(old), metadata=metadata)

    again = PersistenceActor(tmp_path, IDENTITY)
    await again.start()
    try:
        entries = await again.on_disk()
        assert entries["ada"].tokens_digest == tokens_digest([1, 2, 3]) == read_stated_tokens(path)[1]
        assert entries["old"].has_cache and entries["old"].tokens_digest == ""
    finally:
        await again.stop()


def chat(server: ServerProcess, messages: list[dict[str, str]], agent: str) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(
        f"{server.base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-agent-id": agent},
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
    return answer


def test_a_server_killed_after_an_idle_checkpoint_resumes_its_agents_from_disk(
    server_factory: type[ServerProcess], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    args = ("--model", str(tiny_llama_dir), "--checkpoint-idle-s", "1", "--cache-budget-mb", "256")
    server = server_factory(*args).start()
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    first = chat(server, messages, "painter")
    wait_until(lambda: "checkpoint after" in server.log(), "an idle checkpoint wrote the cache")
    assert list((tmp_path / "cache").glob("agents/*/painter.safetensors"))
    assert server.proc is not None
    server.proc.kill()  # no shutdown flush: what is on disk is what the checkpoint wrote
    server.proc.wait()

    server = server_factory(*args).start()
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And three more?"},
    ]
    second = chat(server, messages, "painter")
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    server.stop()
