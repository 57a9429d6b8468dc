"""On a disk that ignores case (macOS's and Windows' default), agent ids differing only in case
would share files: `bob` would continue `Bob`'s conversation, overwrite his cache, or delete his
files. The persistence actor refuses such an id while the other has files, and writes none of
its caches; on a disk that keeps case apart both ids are simply two agents."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.storage.agent_id import AgentId
from semantic.storage.agents_folder import AgentIdCollisionError
from semantic.storage.cache_file import CacheIdentity
from semantic.storage.conversation_file import ConversationRecord
from semantic.storage.persistence import PersistenceActor

# One full-attention layer of one KV head of 4, float32 (a file holds its bits as uint32).
SPEC = {"num_layers": 1, "layer_kinds": ["full"], "dtype": "float32", "kv_widths": [[1, 4, 4]]}
IDENTITY = CacheIdentity("tiny", "f" * 32, 256, {**SPEC, "state_arrays": [], "block_size": 256}, 1000)


def a_cache(agent_id: str) -> SerializedCache:
    tensors = {
        "tokens": np.arange(8, dtype=np.int32),
        "attn.0.keys": np.zeros((1, 1, 8, 4), dtype=np.uint32),
        "attn.0.values": np.ones((1, 1, 8, 4), dtype=np.uint32),
    }
    return SerializedCache(agent_id, tensors, [], 8)


async def a_persistence(cache_dir: Path, ignores_case: bool) -> PersistenceActor:
    persistence = PersistenceActor(cache_dir, IDENTITY, ignores_case=ignores_case)
    await persistence.start()
    return persistence


def test_an_id_differing_only_in_case_is_refused_where_the_disk_ignores_case(tmp_path: Path) -> None:
    async def scenario() -> None:
        persistence = await a_persistence(tmp_path, ignores_case=True)
        bob, other_bob = AgentId("Bob"), AgentId("bob")
        record = ConversationRecord(system="Bob's", token_ids=[1, 2, 3], num_turns=1)
        await persistence.save_conversation(bob, record)
        assert await persistence.save([a_cache("Bob")]) == [bob]

        for refused in (
            persistence.load_conversation(other_bob),
            persistence.save_conversation(other_bob, ConversationRecord(system="not Bob's")),
            persistence.load(other_bob),
            persistence.delete(other_bob),
        ):
            with pytest.raises(AgentIdCollisionError, match="'bob' names the same files as agent 'Bob'"):
                await refused
        assert await persistence.save([a_cache("bob")]) == []  # an evicted cache is not written

        assert await persistence.load_conversation(bob) == record
        assert (await persistence.load(bob)) is not None
        await persistence.delete(bob)  # Bob gone, the id is free
        await persistence.save_conversation(other_bob, ConversationRecord(system="bob's own"))
        await persistence.stop()

    asyncio.run(scenario())


def test_ids_differing_in_case_are_two_agents_where_the_disk_keeps_case(tmp_path: Path) -> None:
    async def scenario() -> None:
        persistence = await a_persistence(tmp_path, ignores_case=False)
        await persistence.save_conversation(AgentId("Bob"), ConversationRecord(system="Bob's"))
        await persistence.save_conversation(AgentId("bob"), ConversationRecord(system="bob's"))
        loaded = await persistence.load_conversation(AgentId("Bob"))
        assert loaded is not None and loaded.system == "Bob's"
        await persistence.stop()

    if (tmp_path / "Probe").touch() or (tmp_path / "probe").exists():
        pytest.skip("this machine's temporary folder ignores case")
    asyncio.run(scenario())
