"""The persistence actor: agents' caches to and from disk, one file per agent per model.

A single worker thread is its mailbox, so writes and reads happen in order, never on the engine
thread and never on the event loop. Files that cannot be used are moved to `quarantine/`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from loguru import logger

from semantic.storage.cache_file import (
    CacheFileError,
    CacheIdentity,
    SerializedCache,
    read_cache_file,
    write_cache_file,
)
from semantic.storage.conversation_file import ConversationRecord, read_conversation, write_conversation

SUFFIX = ".safetensors"
CONVERSATION_SUFFIX = ".conversation.json"
T = TypeVar("T")


class PersistenceActor:
    def __init__(self, cache_dir: Path, identity: CacheIdentity) -> None:
        self.identity = identity
        self.agents_dir = cache_dir / "agents" / identity.fingerprint[:16]
        self.quarantine_dir = cache_dir / "quarantine"
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="semantic-persist")
        self._on_disk: set[str] = set()
        self._conversations: set[str] = set()
        self.num_writes = 0
        self.num_loads = 0
        self.num_quarantined = 0
        self.last_write_s = 0.0
        self.write_seconds_total = 0.0

    async def start(self) -> None:
        self._on_disk = await self._run(self._scan, SUFFIX)
        self._conversations = await self._run(self._scan, CONVERSATION_SUFFIX)

    async def stop(self) -> None:
        await asyncio.to_thread(self._executor.shutdown, wait=True)

    def path_for(self, agent_id: str) -> Path:
        return self.agents_dir / f"{agent_id}{SUFFIX}"

    def is_on_disk(self, agent_id: str) -> bool:
        return agent_id in self._on_disk

    @property
    def agent_ids_on_disk(self) -> set[str]:
        """Agents with a cache file or a kept conversation on disk."""
        return self._on_disk | self._conversations

    async def save(self, caches: list[SerializedCache]) -> list[str]:
        """Write caches; returns the agent ids written. A failed write is logged and leaves no file."""
        written = []
        for cache in caches:
            try:
                seconds = await self._run(self._write, cache)
            except OSError as error:
                logger.error("could not write the cache of agent {}: {}", cache.agent_id, error)
                continue
            self._on_disk.add(cache.agent_id)
            written.append(cache.agent_id)
            self.last_write_s = seconds
            self.write_seconds_total += seconds
        return written

    async def load(self, agent_id: str) -> SerializedCache | None:
        """Read an agent's cache; a bad file is quarantined and None returned (start cold)."""
        if agent_id not in self._on_disk:
            return None
        try:
            cache = await self._run(read_cache_file, self.path_for(agent_id), self.identity)
        except CacheFileError as error:
            logger.warning("quarantining the cache of agent {}: {}", agent_id, error)
            await self._run(self._quarantine, agent_id)
            return None
        except FileNotFoundError:
            self._on_disk.discard(agent_id)
            return None
        self.num_loads += 1
        return cache

    async def delete(self, agent_id: str) -> None:
        self._on_disk.discard(agent_id)
        self._conversations.discard(agent_id)

        def unlink() -> None:
            self.path_for(agent_id).unlink(missing_ok=True)
            self.conversation_path_for(agent_id).unlink(missing_ok=True)

        await self._run(unlink)

    def conversation_path_for(self, agent_id: str) -> Path:
        return self.agents_dir / f"{agent_id}{CONVERSATION_SUFFIX}"

    async def save_conversation(self, agent_id: str, record: ConversationRecord) -> None:
        await self._run(write_conversation, self.conversation_path_for(agent_id), record)
        self._conversations.add(agent_id)

    async def load_conversation(self, agent_id: str) -> ConversationRecord | None:
        return await self._run(read_conversation, self.conversation_path_for(agent_id))

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _scan(self, suffix: str) -> set[str]:
        if not self.agents_dir.exists():
            return set()
        return {
            p.name.removesuffix(suffix)
            for p in self.agents_dir.glob(f"*{suffix}")
            if not p.name.startswith(".")
        }

    def _write(self, cache: SerializedCache) -> float:
        start = time.perf_counter()
        write_cache_file(self.path_for(cache.agent_id), cache, self.identity)
        self.num_writes += 1
        return time.perf_counter() - start

    def _quarantine(self, agent_id: str) -> None:
        self._on_disk.discard(agent_id)
        source = self.path_for(agent_id)
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        target = self.quarantine_dir / f"{agent_id}.{int(time.time() * 1000)}{SUFFIX}"
        try:
            os.replace(source, target)
        except FileNotFoundError:
            return
        self.num_quarantined += 1
