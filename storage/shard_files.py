"""A follower rank's cache files: its shard of each agent's cache, in a folder of its own.

Rank 0's `PersistenceActor` writes its shard where a single process would, under a fingerprint
that names the group's layout; rank r of n writes beside it under `rank-r-of-n/`, with the same
checks (format, fingerprint, layout, agent id, checksum, token ids) and the same quarantine.
The follower's engine thread calls it between ticks: writes go to one worker thread in order,
and a read waits for the writes queued before it, so a cache evicted and then restored is read
back whole.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from loguru import logger

from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.engine.group.distributed import GroupLayout
from semantic.engine.model.loading import LoadedModel
from semantic.storage.agent_id import AgentId
from semantic.storage.agents_folder import SUFFIX, move_aside
from semantic.storage.cache_file import (
    CacheFileError,
    CacheIdentity,
    identity_of,
    read_cache_file,
    write_cache_file,
)


class ShardFiles:
    def __init__(self, cache_dir: Path, layout: GroupLayout) -> None:
        self.root = (cache_dir / f"rank-{layout.rank}-of-{layout.size}").resolve()
        self.quarantine_dir = self.root / "quarantine"
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="semantic-shards")

    def path_for(self, agent_id: str, loaded: LoadedModel) -> Path:
        folder = self.root / "agents" / loaded.fingerprint[:16]
        return folder / f"{AgentId(agent_id)}{SUFFIX}"

    def save(self, caches: list[SerializedCache], loaded: LoadedModel) -> None:
        identity = identity_of(loaded)
        for cache in caches:
            path = self.path_for(cache.agent_id, loaded)
            self._worker.submit(write_cache_file, path, cache, identity).add_done_callback(_log_failure)

    def holds(self, agent_id: str, loaded: LoadedModel) -> bool:
        return self.path_for(agent_id, loaded).exists()

    def load(self, agent_id: str, loaded: LoadedModel) -> SerializedCache | None:
        """The agent's shard, or None if there is none or it fails a check (then it is quarantined)."""
        return self._worker.submit(
            self._read, self.path_for(agent_id, loaded), identity_of(loaded), agent_id
        ).result()

    def delete(self, agent_id: str, loaded: LoadedModel) -> None:
        path = self.path_for(agent_id, loaded)
        self._worker.submit(path.unlink, missing_ok=True).add_done_callback(_log_failure)

    def close(self) -> None:
        """Wait for every queued write."""
        self._worker.shutdown(wait=True)

    def _read(self, path: Path, identity: CacheIdentity, agent_id: str) -> SerializedCache | None:
        if not path.exists():
            return None
        try:
            return read_cache_file(path, identity, agent_id)
        except CacheFileError as error:
            if move_aside(path, self.quarantine_dir):
                logger.warning("quarantined {} ({}): the agent starts cold on every rank", path.name, error)
            return None


def _log_failure(future: Future[Any]) -> None:
    error = future.exception()
    if error is not None:
        logger.error("a shard file write failed: {}", error)
