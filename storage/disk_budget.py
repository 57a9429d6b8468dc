"""How many bytes of agents' cache files a model's folder may hold, and which files go to stay within.

A daemon that serves agents for days would otherwise fill the disk: every named agent that is
evicted from memory (a Claude Code session, an agent id) leaves a file of its whole KV cache, up to
gigabytes each. Past the budget, the files used longest ago are deleted first. Only cache files:
a cache can be computed again from the conversation it came from, a kept conversation cannot, so
conversation files never count and are never deleted here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from semantic.engine.cache_store.eviction import LRU, EvictionPolicy
from semantic.storage.agent_id import AgentId


@dataclass(frozen=True, slots=True)
class CacheFileUse:
    num_bytes: int
    last_used: float  # wall-clock seconds: the file's mtime, which a load refreshes


@dataclass(slots=True)
class DiskBudget:
    max_bytes: int | None  # None: no limit
    files: dict[AgentId, CacheFileUse] = field(default_factory=dict)
    # A cache file being written is on the disk already, beside the file it replaces: counted until
    # then (its rename, or its removal when the write fails), so room is made before it is written.
    num_writing_bytes: int = 0
    policy: EvictionPolicy = LRU  # which files go first (`engine/cache_store/eviction.py`)

    @property
    def num_bytes(self) -> int:
        return sum(use.num_bytes for use in self.files.values()) + self.num_writing_bytes

    def fits(self, num_bytes: int) -> bool:
        """Whether a file this large can be kept at all (with every other file deleted)."""
        return self.max_bytes is None or num_bytes <= self.max_bytes

    def note(self, agent_id: AgentId, num_bytes: int, used_at: float) -> None:
        self.files[agent_id] = CacheFileUse(num_bytes, used_at)

    def touch(self, agent_id: AgentId, used_at: float) -> None:
        use = self.files.get(agent_id)
        if use is not None:
            self.files[agent_id] = CacheFileUse(use.num_bytes, max(use.last_used, used_at))

    def forget(self, agent_id: AgentId) -> None:
        self.files.pop(agent_id, None)

    def over(self, keep: AgentId | None = None) -> list[AgentId]:
        """The agents whose files to delete, in the policy's order (least recently used first), to
        get within the budget; `keep` (the file just written) goes only if it alone is over."""
        if self.max_bytes is None:
            return []
        files = {agent_id: (use.num_bytes, use.last_used) for agent_id, use in self.files.items()}
        return self.policy.disk_victims(files, self.num_bytes - self.max_bytes, keep)
