"""Which caches go when room is needed, in memory and on disk: one policy object, LRU by default.

Every place that evicts asks it: the admission plan (`tick_schedule.py`, the order of victims and the
caches spared while the request that needs the room is planned), the store when a block must be
found mid-step (`agent_cache.py`), the engine when it hands evicted caches on (`engine_loop.py`: to the
disk tier, or dropped), the writes waiting for the disk (`actors/evicted_writes.py`) and the
persistence actor's disk budget (`storage/disk_budget.py`). Pass another policy to
`AgentCacheStore`, `EvictedWrites` or `DiskBudget` to change a decision.

Idle caches go in three groups, least recently used first within each: an agent's superseded
states (another cache holds all their full blocks), then the rest, then those whose prefix a running
sub-agent or fork started from. Prefixes pinned by `cache_control` hold blocks of their own for
their ttl (`prefix_pins.py`), up to `pinned_share` of the pool, on this policy's clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from semantic.engine.cache_store.cache_matching import is_anonymous

T = TypeVar("T")
K = TypeVar("K", bound=str)


@dataclass(frozen=True, slots=True)
class IdleCache:
    """What the policy weighs about one idle cache (the store works it out)."""

    agent_id: str
    last_used: float
    is_superseded: bool = False  # a longer cache holds all its full blocks: it adds only its tail
    is_shared_by_running: bool = False  # a running sub-agent or fork started from its prefix


class EvictionPolicy:
    """Least recently used first within the groups above; the caches of queued requests are spared
    while anything runs. `clock` (seconds) times the pins.

    Subclass and override a method to change one decision; the rest keep theirs."""

    def __init__(self, pinned_share: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 <= pinned_share <= 1.0:
            raise ValueError(f"pinned_share is a share of the cache budget, 0 to 1, got {pinned_share}")
        self.pinned_share = pinned_share
        self.clock = clock

    def order(self, candidates: Iterable[T], last_used: Callable[[T], float]) -> list[T]:
        """Victims in the order they go (`last_used`: monotonic or wall seconds, per caller)."""
        return sorted(candidates, key=last_used)

    def retention_rank(self, cache: IdleCache) -> int:
        """The group an idle cache goes in, first evicted first: superseded states cost at most
        their last block to lose; a prefix a running one started from is what it, its siblings
        and its parent's next turn read."""
        if cache.is_shared_by_running:
            return 2
        return 0 if cache.is_superseded else 1

    def order_idle(self, caches: Iterable[IdleCache]) -> list[IdleCache]:
        """Idle caches in the order they go: by group, then by `order` within each."""
        groups: dict[int, list[IdleCache]] = {}
        for cache in caches:
            groups.setdefault(self.retention_rank(cache), []).append(cache)
        return [c for rank in sorted(groups) for c in self.order(groups[rank], _last_used)]

    def max_pinned_blocks(self, num_blocks: int) -> int:
        """How many of a pool's `num_blocks` `cache_control` pins may hold."""
        return int(num_blocks * self.pinned_share)

    def pin_expires_at(self, ttl_s: float) -> float:
        return self.clock() + ttl_s

    def is_pin_live(self, expires_at: float) -> bool:
        return self.clock() < expires_at

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


def _last_used(cache: IdleCache) -> float:
    return cache.last_used


LRU = EvictionPolicy()  # the default; it keeps no state, so one is shared
