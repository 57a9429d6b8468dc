"""The tick's plan (engine/scheduling/tick_schedule.py) from plain data, without a model: order, the
max-wait rule, overtaking, refusals, room made by eviction, and what the slots and the pool allow."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from semantic.engine.cache_store.eviction import EvictionPolicy
from semantic.engine.scheduling.tick_schedule import (
    Admit,
    BatchSummary,
    DropSharedState,
    Evict,
    HeldCache,
    LonePrefill,
    Overtake,
    PoolSummary,
    Refuse,
    TickSchedule,
    WaitingEntry,
    plan_room,
    schedule_tick,
)

NOW = 100.0
SHORT = 1024
MAX_WAIT_S = 30.0


def entry(position: int, uncached: int, blocks: int = 1, **fields: object) -> WaitingEntry:
    queued_at = fields.pop("queued_at", NOW - 1.0)
    return WaitingEntry(position, queued_at, uncached, blocks, 0, **fields)  # type: ignore[arg-type]


def batch(running: int = 0, slots: int = 8, lone: LonePrefill | None = None) -> BatchSummary:
    return BatchSummary(running, slots, lone is not None, lone)


def pool(
    free: int, evictable: list[HeldCache] | None = None, num_blocks: int = 100, **fields: object
) -> PoolSummary:
    return PoolSummary(num_blocks, free, evictable or [], **fields)  # type: ignore[arg-type]


def plan(
    waiting: list[WaitingEntry], batch_: BatchSummary, pool_: PoolSummary, **kwargs: object
) -> TickSchedule:
    options: dict[str, object] = {
        "now": NOW,
        "chunk": 64,
        "short_turn_tokens": SHORT,
        "max_wait_s": MAX_WAIT_S,
    }
    return schedule_tick(waiting, batch_, pool_, **(options | kwargs))  # type: ignore[arg-type]


def admitted(step: TickSchedule) -> list[int]:
    return [a.position for a in step.admissions]


def test_fewest_uncached_tokens_go_first() -> None:
    step = plan([entry(0, 3000), entry(1, 40), entry(2, 700)], batch(), pool(free=50))
    assert admitted(step) == [1, 2, 0]
    assert step.chunk == 64


def test_a_request_past_the_max_wait_goes_ahead_in_arrival_order() -> None:
    waiting = [
        entry(0, 40),
        entry(1, 5000, queued_at=NOW - MAX_WAIT_S - 5),
        entry(2, 9000, queued_at=NOW - MAX_WAIT_S - 9),
    ]
    assert admitted(plan(waiting, batch(), pool(free=50))) == [1, 2, 0]


def test_the_slots_bound_the_admissions() -> None:
    step = plan([entry(0, 10), entry(1, 20), entry(2, 30)], batch(running=3, slots=2), pool(free=50))
    assert admitted(step) == [0, 1]


def test_a_request_the_pool_cannot_hold_now_waits_while_others_run() -> None:
    step = plan([entry(0, 10, blocks=6), entry(1, 20, blocks=6)], batch(running=1), pool(free=10))
    assert admitted(step) == [0]
    assert not step.refusals  # the second waits: the running requests will free blocks


def test_a_stuck_pool_refuses_when_nothing_runs() -> None:
    step = plan([entry(0, 10, blocks=6)], batch(running=0), pool(free=2))
    assert step.actions == [Refuse(0, "pool_stuck", 6)]


def test_a_request_larger_than_the_pool_and_one_of_another_model_are_refused() -> None:
    waiting = [entry(0, 10, blocks=101), entry(1, 20, same_model=False), entry(2, 30)]
    step = plan(waiting, batch(running=1), pool(free=50))
    assert step.refusals == [Refuse(0, "too_large", 101), Refuse(1, "model_changed", 1)]
    assert admitted(step) == [2]


def test_a_short_turn_overtakes_a_lone_long_prefill() -> None:
    lone = LonePrefill(uid=7, queued_at=NOW - 2, num_left_tokens=20_000)
    step = plan([entry(0, 300, agent_id="a")], batch(running=1, lone=lone), pool(free=10))
    assert step.actions == [Overtake(7), Admit(0, 1)]
    assert step.overtaken == 7


def test_no_overtaking_by_a_long_prompt_past_the_wait_or_of_a_nearly_done_prefill() -> None:
    lone = LonePrefill(uid=7, queued_at=NOW - 2, num_left_tokens=20_000)
    assert plan([entry(0, SHORT + 1)], batch(running=1, lone=lone), pool(free=10)).actions == []
    old = LonePrefill(uid=7, queued_at=NOW - MAX_WAIT_S, num_left_tokens=20_000)
    assert plan([entry(0, 30)], batch(running=1, lone=old), pool(free=10)).actions == []
    nearly = LonePrefill(uid=7, queued_at=NOW - 2, num_left_tokens=SHORT)
    assert plan([entry(0, 30)], batch(running=1, lone=nearly), pool(free=10)).actions == []


def test_no_overtaking_when_the_short_turn_cannot_get_its_blocks() -> None:
    lone = LonePrefill(uid=7, queued_at=NOW - 2, num_left_tokens=20_000)
    assert plan([entry(0, 30, blocks=5)], batch(running=1, lone=lone), pool(free=4)).actions == []


def test_nothing_joins_a_batch_that_prefills_more_than_one_prompt() -> None:
    prefilling = BatchSummary(2, 6, True, None)
    assert plan([entry(0, 30)], prefilling, pool(free=10)).actions == []


def test_idle_caches_are_evicted_least_recently_used_first_sparing_queued_agents() -> None:
    idle = [HeldCache("old", [1, 2]), HeldCache("queued", [3, 4]), HeldCache("newer", [5, 6])]
    waiting = [entry(0, 10, blocks=4), entry(1, 999, blocks=1, agent_id="queued")]
    step = plan(waiting, batch(running=1), pool(free=0, evictable=idle))
    assert step.evictions == ["old", "newer"]
    assert admitted(step) == [0]


def test_once_nothing_runs_queued_caches_go_and_the_requests_own_last() -> None:
    idle = [HeldCache("own", [1, 2]), HeldCache("queued", [3, 4])]
    waiting = [entry(0, 10, blocks=4, agent_id="own"), entry(1, 999, agent_id="queued")]
    reused = WaitingEntry(0, NOW - 1, 10, 4, 2, "own", "own")
    assert plan([reused, waiting[1]], batch(running=0), pool(free=0, evictable=idle)).evictions == ["queued"]
    step = plan(waiting, batch(running=0), pool(free=0, evictable=idle))
    assert step.evictions == ["queued", "own"]
    assert step.admissions == [Admit(0, 4)]


def test_a_reused_cache_needs_no_reservation_for_its_blocks() -> None:
    waiting = [WaitingEntry(0, NOW - 1, 10, 5, 3, "a", "a")]
    idle = [HeldCache("a", [1, 2, 3])]
    assert plan(waiting, batch(running=1), pool(free=2, evictable=idle)).actions == [Admit(0, 2)]


def test_shared_blocks_free_nothing_until_their_last_holder_goes() -> None:
    idle = [HeldCache("x", [1, 2]), HeldCache("y", [2, 3])]
    room = plan_room(pool(free=0, evictable=idle, block_refs={1: 1, 2: 2, 3: 1}), 2, frozenset())
    assert room == [Evict("x"), Evict("y")]  # x alone frees only block 1
    room = plan_room(pool(free=0, shared_states=[[8], [9]]), 1, frozenset())
    assert room == [DropSharedState()]


def test_a_replaced_policy_changes_the_victims() -> None:
    class MostRecentFirst(EvictionPolicy):
        def order(self, candidates, last_used):  # type: ignore[no-untyped-def]
            return sorted(candidates, key=last_used, reverse=True)

    # The plan takes the evictable caches in the order the policy gave them (pool_summary).
    idle = MostRecentFirst().order(
        [HeldCache("old", [1]), HeldCache("new", [2])], lambda c: 1 if c.agent_id == "new" else 0
    )
    assert plan_room(pool(free=0, evictable=idle), 1, frozenset()) == [Evict("new")]


@st.composite
def situations(draw: st.DrawFn) -> tuple[list[WaitingEntry], BatchSummary, PoolSummary]:
    num_blocks = draw(st.integers(1, 40))
    agents = [f"agent-{i}" for i in range(draw(st.integers(0, 5)))]
    evictable = [
        HeldCache(agent, draw(st.lists(st.integers(0, num_blocks - 1), max_size=6, unique=True)))
        for agent in agents
    ]
    held = {b for cache in evictable for b in cache.block_ids}
    refs = {b: draw(st.integers(1, 3)) for b in held}
    free = draw(st.integers(0, num_blocks))
    waiting = []
    for position in range(draw(st.integers(0, 6))):
        agent_id = draw(st.sampled_from([None, *agents]))
        waiting.append(
            WaitingEntry(
                position,
                NOW - draw(st.floats(0, 2 * MAX_WAIT_S)),
                draw(st.integers(1, 3000)),
                draw(st.integers(1, num_blocks + 2)),
                0,
                agent_id,
                agent_id,
            )
        )
    running = draw(st.integers(0, 4))
    return (
        waiting,
        batch(running=running, slots=draw(st.integers(0, 4))),
        pool(free, evictable, num_blocks, block_refs=refs),
    )


@settings(max_examples=300, deadline=None)
@given(situations())
def test_a_plan_never_reserves_more_than_is_free_or_reclaimable(
    situation: tuple[list[WaitingEntry], BatchSummary, PoolSummary],
) -> None:
    waiting, batch_, pool_ = situation
    step = plan(waiting, batch_, pool_)
    reclaimable = sum(_all_refs_idle(b, refs, pool_) for b, refs in pool_.block_refs.items())
    assert sum(a.num_reserved_blocks for a in step.admissions) <= pool_.num_free_blocks + reclaimable
    assert len(step.admissions) <= batch_.num_free_slots
    positions = [a.position for a in step.actions if isinstance(a, Admit | Refuse)]
    assert len(positions) == len(set(positions))  # each request is decided at most once
    evicted = step.evictions
    assert len(evicted) == len(set(evicted))
    if batch_.num_running:  # while anything runs, a queued or admitted agent's cache is not evicted
        refused = {r.position for r in step.refusals}
        assert not set(evicted) & {w.agent_id for w in waiting if w.position not in refused}


def _all_refs_idle(block_id: int, refs: int, pool_: PoolSummary) -> bool:
    return sum(block_id in cache.block_ids for cache in pool_.evictable) >= refs
