"""Which caches go when room is needed, in memory and on disk: one policy object, LRU by default.

Every place that evicts asks it: the admission plan (`step_plan.py`, the order of victims and the
caches spared while the request that needs the room is planned), the store when a block must be
found mid-step (`agent_cache.py`), the engine when it hands evicted caches on (`core.py`: to the
disk tier, or dropped), the writes waiting for the disk (`actors/evicted_writes.py`) and the
persistence actor's disk budget (`storage/disk_budget.py`). Pass another policy to
`AgentCacheStore`, `EvictedWrites` or `DiskBudget` to change a decision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from semantic.engine.cache_matching import is_anonymous

T = TypeVar("T")
K = TypeVar("K", bound=str)


class EvictionPolicy:
    """Least recently used first; the caches of queued requests are spared while anything runs.

    Subclass and override a method to change one decision; the rest keep LRU's."""

    def order(self, candidates: Iterable[T], last_used: Callable[[T], float]) -> list[T]:
        """Victims in the order they go (`last_used`: monotonic or wall seconds, per caller)."""
        return sorted(candidates, key=last_used)

    def spared_tiers(self, queued: frozenset[str], own: str | None) -> list[frozenset[str]]:
        """The agents spared when making room for a request of agent `own`, tried in turn: the
        first while anything runs (running requests will free blocks; queued requests are about to
        use theirs), the next only once nothing runs (then the others' caches go before the
        request's own, which goes last)."""
        return [queued, frozenset({own} if own is not None else ()), frozenset()]

    def spared_for_restore(self, queued: frozenset[str]) -> frozenset[str]:
        """The agents spared when a cache read from disk needs room: those of queued requests."""
        return queued

    def goes_to_disk(self, agent_id: str) -> bool:
        """Whether an evicted cache is written to the disk tier (else dropped): anonymous agents are
        matched by content in memory only, their ids do not survive a restart."""
        return not is_anonymous(agent_id)

    def writes_now(self, num_waiting_bytes: int, num_bytes: int, max_bytes: int) -> bool:
        """Whether evicted caches of `num_bytes` go to the disk tier while `num_waiting_bytes` of
        others wait for it (else dropped: their agents' next turns compute them); one batch always
        goes when nothing else waits."""
        return not num_waiting_bytes or num_waiting_bytes + num_bytes <= max_bytes

    def disk_victims(
        self, files: dict[K, tuple[int, float]], num_excess_bytes: int, keep: K | None
    ) -> list[K]:
        """Cache files to delete to free `num_excess_bytes` ({agent: (bytes, last used)}), oldest
        first; `keep` (the file just written) goes last."""
        victims: list[K] = []
        by_age = sorted(files.items(), key=lambda item: (item[0] == keep, item[1][1], item[0]))
        for agent_id, (num_bytes, _) in by_age:
            if num_excess_bytes <= 0:
                break
            victims.append(agent_id)
            num_excess_bytes -= num_bytes
        return victims


LRU = EvictionPolicy()  # the default; stateless, so one is shared
