"""Caches the engine evicted to make room, on their way to disk: bounded while they wait.

Each eviction hands over host copies of an agent's keys and values, written by the persistence
actor as it can. Where the disk is slower than the evictions, those copies would pile up outside
the KV budget, so what waits is bounded by it: past the bound, newly evicted caches are dropped
(their agents' next turns compute them again; conversation records are written apart, never here).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from loguru import logger

from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.engine.cache_store.eviction import LRU, EvictionPolicy
from semantic.storage.persistence import PersistenceActor


def num_bytes_of(caches: list[SerializedCache]) -> int:
    return sum(array.nbytes for cache in caches for array in cache.tensors.values())


class EvictedWrites:
    """The writes of evicted caches in flight (event loop only), at most `max_bytes` of them
    waiting; one batch always goes, however large, when nothing else waits."""

    def __init__(self, max_bytes: int, policy: EvictionPolicy = LRU) -> None:
        self.max_bytes = max_bytes
        self.policy = policy  # whether a cache goes to disk or is dropped (`engine/cache_store/eviction.py`)
        self.num_waiting_bytes = 0
        self.num_dropped = 0
        self._tasks: set[asyncio.Task[Any]] = set()

    def hand(self, caches: list[SerializedCache], persistence: PersistenceActor) -> bool:
        """Start writing `caches`; False where they were dropped to stay within the bound."""
        num_bytes = num_bytes_of(caches)
        if not self.policy.writes_now(self.num_waiting_bytes, num_bytes, self.max_bytes):
            self.num_dropped += len(caches)
            logger.warning(
                "dropping {} evicted caches ({:.0f} MiB): {:.0f} MiB of evicted caches already wait "
                "for the disk (at most the KV budget, {:.0f} MiB); their agents' next turns compute them",
                len(caches),
                num_bytes / 2**20,
                self.num_waiting_bytes / 2**20,
                self.max_bytes / 2**20,
            )
            return False
        self.num_waiting_bytes += num_bytes
        task = asyncio.get_running_loop().create_task(persistence.save(caches, time.monotonic()))
        self._tasks.add(task)
        num_caches = len(caches)  # not the caches: their arrays must not outlive the write

        def written(task: asyncio.Task[Any]) -> None:
            self._tasks.discard(task)
            self.num_waiting_bytes -= num_bytes
            # A failed write is logged by persistence; what is left (it stopped) is logged here.
            if not task.cancelled() and (error := task.exception()) is not None:
                logger.warning("{} evicted caches not written: {}", num_caches, error)

        task.add_done_callback(written)
        return True

    async def settle(self) -> None:
        """Wait for every write in flight (before the files close or the model changes)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
