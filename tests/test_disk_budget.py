"""The disk budget: agents' cache files past it are deleted, least recently used first, on a real
disk through the persistence actor; conversations never are."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.storage.agent_id import AgentId
from semantic.storage.agents_folder import MAX_QUARANTINED, move_aside
from semantic.storage.conversation_file import ConversationRecord
from semantic.storage.disk_budget import CacheFileUse, DiskBudget
from semantic.storage.persistence import PersistenceActor
from tests.test_cache_file import IDENTITY, a_cache

uses = st.dictionaries(
    st.sampled_from([AgentId(f"agent-{i}") for i in range(8)]),
    st.builds(CacheFileUse, st.integers(1, 1000), st.floats(0, 1e6)),
)


@given(uses, st.integers(0, 3000), st.booleans())
def test_what_goes_is_the_least_recently_used_and_no_more_than_needed(
    files: dict[AgentId, CacheFileUse], max_bytes: int, keeps_newest: bool
) -> None:
    budget = DiskBudget(max_bytes, dict(files))
    keep = max(files, key=lambda a: files[a].last_used) if keeps_newest and files else None
    victims = budget.over(keep)
    left = {a: u for a, u in files.items() if a not in victims}
    assert sum(u.num_bytes for u in left.values()) <= max_bytes  # within the budget after
    if victims:  # and no victim could have stayed: without the last one it is still over
        assert sum(u.num_bytes for u in left.values()) + files[victims[-1]].num_bytes > max_bytes
    others = [a for a in left if a != keep]
    for victim in victims:
        if victim != keep:
            assert all(files[victim].last_used <= files[a].last_used for a in others)
    if keep is not None and keep in victims:
        assert files[keep].num_bytes > max_bytes or victims[-1] == keep  # it went only as the last


def a_cache_of(agent: str, num_tokens: int = 40) -> SerializedCache:
    return replace(a_cache(num_tokens), agent_id=agent)


def file_bytes(num_tokens: int = 40) -> int:
    return sum(tensor.nbytes for tensor in a_cache(num_tokens).tensors.values())


def test_past_the_budget_the_least_recently_used_cache_files_go(tmp_path: Path) -> None:
    budget = 2 * file_bytes() + 4096  # room for two files (each with a header of ~1 KB), not three

    async def run() -> None:
        actor = PersistenceActor(tmp_path, IDENTITY, budget)
        await actor.start()
        try:
            conversation = ConversationRecord(token_ids=[1, 2, 3], system=None, num_turns=1)
            await actor.save_conversation(AgentId("ada"), conversation)
            for agent in ("ada", "bob", "cy"):
                assert await actor.save([a_cache_of(agent)]) == [agent]
                await asyncio.sleep(0.01)  # distinct times of use
            on_disk = await actor.on_disk()
            assert {a for a, e in on_disk.items() if e.has_cache} == {"bob", "cy"}
            assert on_disk[AgentId("ada")].has_conversation  # a kept conversation is never deleted
            assert await actor.load_conversation(AgentId("ada")) == conversation
            assert await actor.load(AgentId("ada")) is None and actor.num_disk_evictions == 1

            assert await actor.load(AgentId("bob")) is not None  # bob is used again: cy is oldest now
            await asyncio.sleep(0.01)
            assert await actor.save([a_cache_of("dee")]) == ["dee"]
            assert {a for a, e in (await actor.on_disk()).items() if e.has_cache} == {"bob", "dee"}
            assert actor.disk_budget.num_bytes <= budget

            too_big = a_cache_of("eve", 40 * 3)  # larger than the whole budget: not written at all
            assert await actor.save([too_big]) == []
            assert not actor.path_for(AgentId("eve")).exists()
        finally:
            await actor.stop()
        assert sorted(p.name for p in actor.agents_dir.glob("*.safetensors")) == [
            "bob.safetensors",
            "dee.safetensors",
        ]

        os.utime(actor.path_for(AgentId("dee")), (1, 1))  # long unused, as a restart reads it
        smaller = PersistenceActor(tmp_path, IDENTITY, file_bytes() + 4096)
        await smaller.start()  # a smaller budget than last time: kept at start
        try:
            assert {a for a, e in (await smaller.on_disk()).items() if e.has_cache} == {"bob"}
        finally:
            await smaller.stop()

    asyncio.run(run())


def test_no_budget_keeps_every_file(tmp_path: Path) -> None:
    async def run() -> int:
        actor = PersistenceActor(tmp_path, IDENTITY)
        await actor.start()
        try:
            for i in range(5):
                await actor.save([a_cache_of(f"agent-{i}")])
            return len([e for e in (await actor.on_disk()).values() if e.has_cache])
        finally:
            await actor.stop()

    assert asyncio.run(run()) == 5
    assert len(list(tmp_path.rglob("*.safetensors"))) == 5


def test_the_quarantine_keeps_the_newest_files(tmp_path: Path) -> None:
    quarantine = tmp_path / "quarantine"
    for i in range(MAX_QUARANTINED + 5):
        bad = tmp_path / f"agent-{i}.safetensors"
        bad.write_bytes(b"not a cache")
        assert move_aside(bad, quarantine)
    left = sorted(int(p.name.split(".")[0].removeprefix("agent-")) for p in quarantine.iterdir())
    assert left == list(range(5, MAX_QUARANTINED + 5))  # the five moved first are gone
    assert not move_aside(tmp_path / "missing.safetensors", quarantine)
