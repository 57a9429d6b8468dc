"""A step that raises for one sequence fails that sequence only: a cache that cannot be stepped (here
keys and values of the wrong head dim, put in the pool past every check a file meets) fails its own
turn, and a bystander's reply goes on token for token as it would have without it."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from semantic import AgentSystem, EngineConfig, SystemConfig
from semantic.engine.cache_store.cache_tensors import HostSnapshot
from semantic.engine.loop.commands import RestoreCache
from semantic.engine.loop.errors import UnsteppableCacheError
from semantic.engine.loop.messages import Finished, TokenDelta
from semantic.engine.loop.outbox import Outbox
from semantic.engine.loop.served_model import ServedModel
from semantic.storage.cache_file import read_cache_file
from tests.batch_driver import chat, deliver, drain, loop, outbox, served, submit

__all__ = ["loop", "outbox", "served"]  # the module's fixtures

MAX_TOKENS = 24


def malformed_cache(served: ServedModel, agent_id: str, prompt: list[int]) -> None:
    """The agent's cache in the pool with half the model's head dim in every layer."""
    spec = served.loaded.spec
    num_tokens = len(prompt) - 1
    layers: list[tuple[np.ndarray | None, np.ndarray | None]] = []
    for heads, key_dim, value_dim in spec.kv_widths:
        keys = np.zeros((1, heads, num_tokens, key_dim // 2), dtype=np.float32)
        values = np.zeros((1, heads, num_tokens, value_dim // 2), dtype=np.float32)
        layers.append((keys, values))
    snapshot = HostSnapshot(agent_id, prompt[:num_tokens], layers, [0] * len(layers), [], mx.float32)
    served.store.restore(snapshot)


def test_a_step_that_fails_for_one_sequence_fails_that_sequence_only(
    served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop
) -> None:
    prompt = chat(served, "Tell me a long story about a lighthouse keeper.")
    reference = served.reference_generate(prompt, MAX_TOKENS)
    bystander = submit(served, loop, prompt, MAX_TOKENS, agent_id="bystander")
    events = []
    for _ in range(4):  # it decodes
        served.batch.step()
        deliver(served, outbox, loop)
        events += drain(bystander)
    bad_prompt = chat(served, "Hello there, who are you?")
    malformed_cache(served, "malformed", bad_prompt)
    bad = submit(served, loop, bad_prompt, 4, agent_id="malformed")
    bad_events = []
    while len(served.batch):
        served.batch.step()
        deliver(served, outbox, loop)
        events += drain(bystander)
        bad_events += drain(bad)

    tokens = [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]
    assert isinstance(events[-1], Finished), events[-1]
    assert tokens == reference
    assert isinstance(bad_events[-1], UnsteppableCacheError)  # its agent quarantines its file
    assert "malformed" not in served.store.agents  # a cache that cannot be stepped is not kept


async def test_an_agent_whose_cache_cannot_be_stepped_has_its_file_quarantined(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """The file behind a cache the engine could not step (here a second batch row, sent past the
    file checks) goes to quarantine/; the agent's next turn computes its history from the
    conversation record and nothing acknowledged is lost."""
    config = SystemConfig(
        engine=EngineConfig(model=str(default_model_dir), cache_budget_mb=128),
        cache_dir=tmp_path,
        checkpoint_idle_s=None,
    )
    async with AgentSystem(config) as system:
        ada = await system.open("ada")
        await ada.reply("Hello, I am Ada.", max_tokens=4)
        assert await ada.evict()  # its cache is a file now, and not in memory
        (path,) = tmp_path.glob("agents/*/ada.safetensors")
        cache = read_cache_file(path, system.models.persistence.identity)  # type: ignore[union-attr]
        doubled = {
            name: np.concatenate([array, array]) if name.startswith("attn.") else array
            for name, array in cache.tensors.items()
        }
        crafted = dataclasses.replace(cache, tensors=doubled)
        loaded = system.engine.loaded
        assert loaded is not None
        assert await system.engine.send(RestoreCache(crafted, loaded.fingerprint))

        with pytest.raises(UnsteppableCacheError):
            await ada.reply("Who are you?", max_tokens=4)
        await ada.reply("Who are you?", max_tokens=4)  # after the failed turn is settled
        assert list(tmp_path.glob("quarantine/ada.safetensors.*"))
        assert ada.last_turn is not None and ada.last_turn.num_cached_tokens == 0
        info = await system.agent_info(ada.agent_id)
        assert info is not None and info.num_turns == 2
