"""The eviction policy (engine/cache_store/eviction.py) without a model: victims' order, the spared sets, the
disk tier, and a replaced policy taking effect in the disk budget and the store's order."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import TypeVar, cast

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from semantic.engine.cache_store.agent_cache import AgentCacheStore
from semantic.engine.cache_store.block_pool import BlockPool
from semantic.engine.cache_store.cache_matching import ANONYMOUS_PREFIX
from semantic.engine.cache_store.cache_spec import LayerKind, ModelCacheSpec
from semantic.engine.cache_store.cache_tensors import from_tensors, to_tensors
from semantic.engine.cache_store.eviction import LRU, EvictionPolicy
from semantic.engine.loop.errors import PoolExhaustedError
from semantic.engine.loop.served_model import ServedModel
from semantic.engine.scheduling.scheduler import Scheduler, make_room, pool_summary
from semantic.engine.scheduling.tick_schedule import Evict, plan_room
from semantic.storage.agent_id import AgentId
from semantic.storage.disk_budget import DiskBudget

T = TypeVar("T")


def test_least_recently_used_go_first() -> None:
    used = {"a": 3.0, "b": 1.0, "c": 2.0}
    assert LRU.order(used, used.__getitem__) == ["b", "c", "a"]


def test_queued_caches_are_spared_first_then_only_the_requests_own_then_none() -> None:
    queued = frozenset({"q1", "own"})
    assert LRU.spared_tiers(queued, "own") == [queued, frozenset({"own"}), frozenset()]
    assert LRU.spared_tiers(queued, None)[1] == frozenset()
    assert LRU.spared_for_restore(queued) == queued


def test_named_agents_go_to_disk_anonymous_ones_are_dropped() -> None:
    assert LRU.goes_to_disk("session-1")
    assert not LRU.goes_to_disk(f"{ANONYMOUS_PREFIX}3")


def test_evicted_caches_wait_for_the_disk_within_the_bound_and_one_batch_always_goes() -> None:
    assert LRU.writes_now(0, 500, max_bytes=100)
    assert LRU.writes_now(40, 60, max_bytes=100)
    assert not LRU.writes_now(40, 61, max_bytes=100)


def test_disk_victims_oldest_first_the_file_just_written_last() -> None:
    files = {"a": (10, 5.0), "b": (10, 1.0), "c": (10, 3.0)}
    assert LRU.disk_victims(files, 15, keep=None) == ["b", "c"]
    assert LRU.disk_victims(files, 25, keep="b") == ["c", "a", "b"]
    assert LRU.disk_victims(files, 0, keep=None) == []


class _LargestFirst(EvictionPolicy):
    """A replacement: the largest cache file goes first, whatever its age."""

    def disk_victims(
        self, files: dict[AgentId, tuple[int, float]], num_excess_bytes: int, keep: AgentId | None
    ) -> list[AgentId]:
        victims = []
        for agent_id, (num_bytes, _) in sorted(files.items(), key=lambda item: -item[1][0]):
            if num_excess_bytes <= 0:
                break
            victims.append(agent_id)
            num_excess_bytes -= num_bytes
        return victims


class _MostRecentFirst(EvictionPolicy):
    def order(self, candidates: Iterable[T], last_used: Callable[[T], float]) -> list[T]:
        return sorted(candidates, key=last_used, reverse=True)


def test_the_disk_budget_asks_its_policy() -> None:
    old, big = AgentId("old"), AgentId("big")
    files = {old: (10, 1.0), big: (50, 9.0)}
    lru, largest = DiskBudget(50), DiskBudget(50, policy=_LargestFirst())
    for budget in (lru, largest):
        for agent_id, (num_bytes, used_at) in files.items():
            budget.note(agent_id, num_bytes, used_at)
    assert lru.over() == [old]
    assert largest.over() == [big]


def test_a_replaced_order_reverses_the_victims() -> None:
    used = {"a": 3.0, "b": 1.0, "c": 2.0}
    assert _MostRecentFirst().order(used, used.__getitem__) == ["a", "c", "b"]


LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 16, 16


def _store(policy: EvictionPolicy, num_blocks: int = 16) -> AgentCacheStore:
    spec = ModelCacheSpec(LAYERS, HEADS, HEAD_DIM, "float16", (LayerKind.FULL,) * LAYERS, None, BLOCK)
    pool = BlockPool(num_blocks, BLOCK, spec.bytes_per_block)
    return AgentCacheStore(spec, pool, lambda: [KVCache() for _ in range(LAYERS)], policy=policy)


def _file(store: AgentCacheStore, agent_id: str, tokens: list[int], used_at: float) -> None:
    caches = []
    for _ in range(LAYERS):
        cache = KVCache()
        keys, values = (mx.random.normal((1, HEADS, len(tokens), HEAD_DIM)).astype(mx.float16) for _ in "kv")
        cache.update_and_fetch(keys, values)
        caches.append(cache)
    store.store(agent_id, tokens, caches, [])
    store.agents[agent_id].last_used = used_at


def test_the_store_orders_its_victims_by_its_policy() -> None:
    for policy, expected in ((LRU, ["b", "a"]), (_MostRecentFirst(), ["a", "b"])):
        store = _store(policy)
        _file(store, "a", list(range(2 * BLOCK)), used_at=2.0)
        _file(store, "b", list(range(100, 100 + 2 * BLOCK)), used_at=1.0)
        assert [agent.agent_id for agent in store.evictable()] == expected
        assert [
            snapshot.agent_id for snapshot in store.evict_until(store.pool.num_free_blocks + 1)
        ] == expected[:1]


def _three_agents() -> AgentCacheStore:
    """Eight blocks: "first" and "second" share a prefix's two blocks, "third" holds two of its own."""
    store = _store(LRU, num_blocks=8)
    shared = list(range(2 * BLOCK))
    _file(store, "first", [*shared, *range(500, 500 + BLOCK)], used_at=1.0)
    _file(store, "second", [*shared, *range(600, 600 + BLOCK)], used_at=2.0)
    _file(store, "third", list(range(900, 900 + 2 * BLOCK)), used_at=3.0)
    return store


def test_the_planned_room_is_the_room_the_pool_has_after_the_evictions() -> None:
    """The plan counts shared blocks as the pool does: they are freed when their last holder goes."""
    assert _three_agents().pool.num_free_blocks == 2
    for wanted, victims, num_free in (
        (3, ["first"], 3),
        (4, ["first", "second"], 6),
        (6, ["first", "second"], 6),
    ):
        store = _three_agents()
        actions = plan_room(pool_summary(store), wanted, frozenset({"third"}))
        assert actions is not None
        assert [a.agent_id for a in actions if isinstance(a, Evict)] == victims
        for action in actions:
            make_room(store, action)
        assert store.pool.num_free_blocks == num_free


def test_a_restore_evicts_nothing_where_the_idle_caches_blocks_are_still_shared() -> None:
    """ "first" is the one idle cache, but "second", running, shares two of its three blocks: evicting
    it frees one. A cache read from disk that needs more than that (free blocks included) is
    refused with nothing evicted; one that needs no more evicts "first" and is restored."""
    writer = _store(LRU, num_blocks=16)
    for num_blocks in (4, 3):
        store = _three_agents()
        store.pin("second")
        store.pin("third")
        assert [a.agent_id for a in store.evictable()] == ["first"]
        tokens = list(range(3000, 3000 + num_blocks * BLOCK - 5))
        _file(writer, "returning", tokens, used_at=4.0)
        cache = to_tensors(writer.snapshot("returning"))  # as read from its file
        served = cast(ServedModel, SimpleNamespace(store=store, pool=store.pool))
        if num_blocks > store.pool.num_free_blocks + 1:
            with pytest.raises(PoolExhaustedError):
                Scheduler().make_room_to_restore(served, cache, None)
            assert "first" in store.agents and store.pool.num_free_blocks == 2
        else:
            Scheduler().make_room_to_restore(served, cache, None)
            store.restore(from_tensors(cache, store.spec))
            assert "first" not in store.agents and store.agents["returning"].token_ids == tokens
