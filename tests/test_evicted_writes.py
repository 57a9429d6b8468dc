"""Evicted caches waiting for the disk stay within a bound: past it new ones are dropped, and
what was handed over is written, on a real disk through the persistence actor."""

from __future__ import annotations

import asyncio
from pathlib import Path

from semantic.actors.evicted_writes import EvictedWrites, num_bytes_of
from semantic.storage.persistence import PersistenceActor
from tests.test_cache_file import IDENTITY
from tests.test_disk_budget import a_cache_of


def test_evicted_caches_past_the_bound_are_dropped_and_the_rest_written(tmp_path: Path) -> None:
    one = num_bytes_of([a_cache_of("ada")])

    async def run() -> None:
        actor = PersistenceActor(tmp_path, IDENTITY)
        await actor.start()
        writes = EvictedWrites(max_bytes=one + one // 2)  # room for one cache waiting, not two
        try:
            # Handed over in one go, before the actor writes anything: the second would exceed it.
            assert writes.hand([a_cache_of("ada")], actor)
            assert not writes.hand([a_cache_of("bob")], actor)
            assert writes.num_waiting_bytes == one and writes.num_dropped == 1
            await writes.settle()
            assert writes.num_waiting_bytes == 0
            # Nothing waits now: a batch goes even where it alone is over the bound.
            assert writes.hand([a_cache_of("cy"), a_cache_of("dee")], actor)
            await writes.settle()
            on_disk = await actor.on_disk()
            assert {agent for agent, entry in on_disk.items() if entry.has_cache} == {"ada", "cy", "dee"}
        finally:
            await actor.stop()

    asyncio.run(run())
