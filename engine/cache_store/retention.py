"""What the eviction policy weighs about the store's idle caches, and the prefixes running sequences
started from (held while they run). Engine thread only, owned by the `AgentCacheStore`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from semantic.engine.cache_store.block_pool import BlockPool
from semantic.engine.cache_store.eviction import IdleCache

if TYPE_CHECKING:
    from semantic.engine.cache_store.agent_cache import AgentCache


class RunningShares:
    """The blocks a new agent's prompt started from (other caches published them): noted when its
    caches are built, then held, one reference each, while each of its sequences runs, so the
    prefix a sub-agent or fork shares with its parent stays whatever is evicted meanwhile."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._noted: dict[str, list[int]] = {}
        self._held: dict[str, list[list[int]]] = {}

    def note(self, agent_id: str, block_ids: list[int]) -> None:
        """What the agent's next sequence starts from ([]: its own cache, or nothing)."""
        if block_ids:
            self._noted[agent_id] = block_ids
        else:
            self._noted.pop(agent_id, None)

    def start(self, agent_id: str) -> None:
        block_ids = self._noted.pop(agent_id, None)
        if block_ids:
            self._pool.touch(block_ids)
            self._held.setdefault(agent_id, []).append(block_ids)

    def end(self, agent_id: str) -> None:
        held = self._held.get(agent_id)
        if held:
            self._pool.free(held.pop())
            if not held:
                del self._held[agent_id]

    @property
    def tips(self) -> set[int]:
        """The last block each running sequence started from: its parents hold it."""
        return {block_ids[-1] for held in self._held.values() for block_ids in held}


def idle_caches(agents: Iterable[AgentCache], block_size: int, tips: set[int]) -> list[IdleCache]:
    """The idle caches among `agents` (all the store holds) as the policy weighs them: superseded
    where a longer cache holds its last full block (chained hashes: so all of them), shared by a
    running sequence where it holds one of `tips`."""
    agents = list(agents)
    longest: dict[int, int] = {}  # for each block held, the most tokens a cache holding it has
    for agent in agents:
        for block_id in agent.block_ids:
            longest[block_id] = max(longest.get(block_id, 0), agent.num_tokens)
    caches = []
    for agent in agents:
        if agent.num_running:
            continue
        num_full = agent.num_tokens // block_size
        last_full = agent.block_ids[num_full - 1] if num_full else None
        caches.append(
            IdleCache(
                agent.agent_id,
                agent.last_used,
                is_superseded=last_full is not None and longest.get(last_full, 0) > agent.num_tokens,
                is_shared_by_running=not tips.isdisjoint(agent.block_ids),
            )
        )
    return caches
