"""What one engine tick does to the queue, the batch and the pool, decided by one pure function.

`schedule_tick` takes plain data (the waiting requests, a summary of the batch, the pool's counts and
its evictable caches in the eviction policy's order, the clock) and returns a `TickSchedule`: an ordered
list of actions (evict, drop a shared state, refuse, set aside the lone long prefill, admit with
its reservation) and the prefill chunk; `Scheduler.apply` carries it out, in order, and puts a
prefill it set aside back last. The
rules, as vLLM's scheduler or nano-vllm's `schedule()` keep them in one place:
- a new prompt batch starts only once the last one is prefilled, except that a short turn (at most
  `short_turn_tokens` uncached) overtakes a lone long prompt part-way through its prefill;
- waiting requests go in by the tokens they still have to prefill, fewest first; past
  `max_wait_s` in arrival order, so none waits forever;
- each reserves its KV blocks up front; idle caches are evicted to make room in the policy's order,
  sparing the policy's spared set (queued requests' caches while anything runs).
The chunk is the prefill budget's (`prefill_budget.py`, chosen before the tick's messages);
`Batch.step` still lets admitted short turns go in whole chunks, from the prompts it inserted.
In a group every rank schedules its own tick from rank 0's clock and chunk (`group_tick.py`).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from semantic.engine.cache_store.eviction import LRU, EvictionPolicy


class WaitingEntry(msgspec.Struct, frozen=True):
    """A waiting request as the plan sees it; `position` is its place in the queue."""

    position: int
    queued_at: float  # monotonic seconds
    num_uncached_tokens: int  # what it would prefill if it went in now
    num_blocks_needed: int  # its prompt and reply, before reuse of its agent's cache
    num_reused_blocks: int  # full blocks of its agent's cache it starts from (no reservation)
    agent_id: str | None = None  # its explicit agent (spared while it waits)
    pins: str | None = None  # the cached agent its insert pins (not evictable once it runs)
    same_model: bool = True  # False: the model changed while it waited


class LonePrefill(msgspec.Struct, frozen=True):
    uid: int
    queued_at: float
    num_left_tokens: int


class BatchSummary(msgspec.Struct, frozen=True):
    num_running: int
    num_free_slots: int  # sequences that may join this tick
    is_prefilling: bool
    lone_prefill: LonePrefill | None = None


class HeldCache(msgspec.Struct, frozen=True):
    agent_id: str
    block_ids: list[int]  # every block it holds a reference to (state blocks too)


class PoolSummary(msgspec.Struct, frozen=True):
    num_blocks: int
    num_free_blocks: int  # free and reclaimable
    evictable: list[HeldCache]  # idle caches, in the eviction policy's order
    shared_states: list[list[int]] = []  # their blocks, oldest first (dropped in that order)
    block_refs: dict[int, int] = {}  # ref counts of the blocks above (default 1)
    block_worth: dict[int, int] = {}  # free blocks a block gives when its last ref goes (default 1)


class Evict(msgspec.Struct, frozen=True, tag=True):
    agent_id: str


class DropSharedState(msgspec.Struct, frozen=True, tag=True):
    pass


class Refuse(msgspec.Struct, frozen=True, tag=True):
    position: int
    reason: Literal["model_changed", "too_large", "pool_stuck"]
    num_blocks_needed: int


class Overtake(msgspec.Struct, frozen=True, tag=True):
    """Set the lone long prefill aside (back in once the admissions are applied, whatever became of them)."""

    uid: int


class Admit(msgspec.Struct, frozen=True, tag=True):
    position: int
    num_reserved_blocks: int


Action = Evict | DropSharedState | Refuse | Overtake | Admit


class TickSchedule(msgspec.Struct, frozen=True):
    actions: list[Action]
    chunk: int  # prompt tokens per prompt the step may prefill (before short turns go whole)

    @property
    def admissions(self) -> list[Admit]:
        return [a for a in self.actions if isinstance(a, Admit)]

    @property
    def evictions(self) -> list[str]:
        return [a.agent_id for a in self.actions if isinstance(a, Evict)]

    @property
    def refusals(self) -> list[Refuse]:
        return [a for a in self.actions if isinstance(a, Refuse)]

    @property
    def overtaken(self) -> int | None:
        return next((a.uid for a in self.actions if isinstance(a, Overtake)), None)


class PoolView:
    """The pool's free count as the plan's evictions change it (ref counts simulated)."""

    def __init__(self, pool: PoolSummary, policy: EvictionPolicy) -> None:
        self.num_blocks = pool.num_blocks
        self.num_free = pool.num_free_blocks
        self._refs = dict(pool.block_refs)
        self._worth = pool.block_worth
        self._idle = {c.agent_id: c for c in pool.evictable}  # in the policy's order
        self._shared = list(pool.shared_states)
        self._policy = policy

    def take(self, num_blocks: int, pins: str | None) -> None:
        """An admission: its reservation leaves the free blocks, the cache it starts from is in use."""
        self.num_free -= num_blocks
        self._idle.pop(pins or "", None)

    def holds(self, agent_id: str | None) -> bool:
        return agent_id is not None and agent_id in self._idle

    def make_room(self, num_blocks: int, spared: frozenset[str], actions: list[Action]) -> bool:
        """Evict idle caches in order, never those in `spared`, then shared states, until
        `num_blocks` are free (what was evicted stays evicted even where that is not enough)."""
        for cache in list(self._idle.values()):
            if self.num_free >= num_blocks:
                break
            if cache.agent_id not in spared:
                del self._idle[cache.agent_id]
                self._free(cache.block_ids)
                actions.append(Evict(cache.agent_id))
        while self.num_free < num_blocks and self._shared:
            self._free(self._shared.pop(0))
            actions.append(DropSharedState())
        return self.num_free >= num_blocks

    def _free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            refs = self._refs.get(block_id, 1) - 1
            self._refs[block_id] = refs
            if refs == 0:
                self.num_free += self._worth.get(block_id, 1)


def admission_order(waiting: list[WaitingEntry], max_wait_s: float, now: float) -> list[WaitingEntry]:
    """Fewest uncached tokens first, so a returning agent's short turn is not queued behind cold
    prompts; those that waited `max_wait_s` go ahead, in arrival order."""
    overdue = [w for w in waiting if now - w.queued_at >= max_wait_s]
    rest = [w for w in waiting if now - w.queued_at < max_wait_s]
    return overdue + sorted(rest, key=lambda w: w.num_uncached_tokens)


def schedule_tick(
    waiting: list[WaitingEntry],
    batch: BatchSummary,
    pool: PoolSummary,
    *,
    now: float,
    chunk: int,
    short_turn_tokens: int,
    max_wait_s: float,
    policy: EvictionPolicy = LRU,
) -> TickSchedule:
    """The tick's plan (see the module's docstring); `now` and `chunk` are rank 0's in a group."""
    actions: list[Action] = []
    if not waiting or batch.num_free_slots <= 0:
        return TickSchedule(actions, chunk)
    # Holding prompts while a batch prefills also lets the order pick among all that arrived.
    overtaken = _overtakable(batch, short_turn_tokens, max_wait_s, now) if batch.is_prefilling else None
    if batch.is_prefilling and overtaken is None:
        return TickSchedule(actions, chunk)
    view = PoolView(pool, policy)
    queue = _Queue(waiting, view, policy, batch.num_running)
    order = admission_order(waiting, max_wait_s, now)
    if overtaken is not None:
        first = order[0]
        if first.num_uncached_tokens > short_turn_tokens:
            return TickSchedule(actions, chunk)
        if first.num_blocks_needed > pool.num_blocks or queue.make_room(first, actions) is None:
            return TickSchedule(
                actions, chunk
            )  # the short turn cannot go in now: the long one keeps its place
        actions.append(Overtake(overtaken))
        queue.num_running -= 1
    slots = batch.num_free_slots
    for entry in order:
        if slots <= 0:
            break
        refusal = _refusal(entry, pool.num_blocks)
        if refusal is not None:
            queue.leave(entry)
            actions.append(Refuse(entry.position, refusal, entry.num_blocks_needed))
            continue
        num_reserved = queue.make_room(entry, actions)
        if num_reserved is None and not queue.num_running and overtaken is None:
            queue.leave(entry)  # nothing runs that could free blocks: waiting would never end
            actions.append(Refuse(entry.position, "pool_stuck", entry.num_blocks_needed))
            continue
        if num_reserved is None:
            break
        queue.leave(entry)
        view.take(num_reserved, entry.pins)
        queue.num_running += 1
        slots -= 1
        actions.append(Admit(entry.position, num_reserved))
    return TickSchedule(actions, chunk)


def plan_room(
    pool: PoolSummary, num_blocks: int, spared: frozenset[str], policy: EvictionPolicy = LRU
) -> list[Action] | None:
    """The evictions (and shared states dropped) that free `num_blocks`, sparing `spared`; None
    where even all of them would not (a cache read from disk makes room with this). Blocks another
    cache still holds free nothing."""
    actions: list[Action] = []
    return actions if PoolView(pool, policy).make_room(num_blocks, spared, actions) else None


class _Queue:
    """The waiting requests while the plan admits them: whose caches are spared, what runs."""

    def __init__(
        self, waiting: list[WaitingEntry], view: PoolView, policy: EvictionPolicy, num_running: int
    ) -> None:
        self._queued = {w.position: w.agent_id for w in waiting}
        self._view = view
        self._policy = policy
        self.num_running = num_running

    def leave(self, entry: WaitingEntry) -> None:
        del self._queued[entry.position]

    def make_room(self, entry: WaitingEntry, actions: list[Action]) -> int | None:
        """The blocks `entry` reserves once room is made for them, or None to wait: the policy's
        spared sets in turn, past the first only while nothing runs; a set that does not spare the
        request's own cache reserves as if none were reused."""
        own = entry.agent_id
        queued = frozenset(a for a in self._queued.values() if a is not None)
        reused = entry.num_reused_blocks if self._view.holds(own) else 0
        for tier, spared in enumerate(self._policy.spared_tiers(queued, own)):
            if tier and self.num_running:
                return None
            needed = entry.num_blocks_needed - (reused if own in spared else 0)
            if self._view.make_room(needed, spared, actions):
                return needed
        return None


def _overtakable(batch: BatchSummary, short_turn_tokens: int, max_wait_s: float, now: float) -> int | None:
    """The lone prompt part-way through a long prefill that a short turn may overtake: one with more
    than a short turn left, that has not waited `max_wait_s`."""
    lone = batch.lone_prefill
    if lone is None or lone.num_left_tokens <= short_turn_tokens:
        return None
    return lone.uid if now - lone.queued_at < max_wait_s else None


def _refusal(entry: WaitingEntry, num_pool_blocks: int) -> Literal["model_changed", "too_large"] | None:
    if not entry.same_model:
        return "model_changed"
    return "too_large" if entry.num_blocks_needed > num_pool_blocks else None
