"""Requests waiting for a batch slot, and the tick's plan for them: `plan` reads the queue, the
batch and the pool into plain data for `tick_schedule.schedule_tick` (which decides: who joins, who is
refused, what is evicted, whether a short turn overtakes a lone long prefill), and `apply` carries
that plan out in order. The eviction policy (`eviction.py`, the store's) orders the victims and
names the caches spared.
"""

from __future__ import annotations

import time
from collections import deque

from loguru import logger

from semantic.engine.cache_store.agent_cache import AgentCacheStore
from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.engine.decoding.sequence import SetAside
from semantic.engine.loop.commands import Submit
from semantic.engine.loop.config import EngineConfig
from semantic.engine.loop.errors import EngineError, ModelChangedError, PoolExhaustedError
from semantic.engine.loop.outbox import Outbox
from semantic.engine.loop.served_model import ServedModel
from semantic.engine.scheduling.tick_schedule import (
    Action,
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


class Scheduler:
    def __init__(self) -> None:
        self.waiting: deque[Submit] = deque()

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, submit: Submit) -> None:
        self.waiting.append(submit)

    def cancel(self, request_id: str) -> Submit | None:
        """Take a waiting request out of the queue; None if it is not waiting."""
        for submit in self.waiting:
            if submit.request.request_id == request_id:
                self.waiting.remove(submit)
                return submit
        return None

    def take_all(self) -> list[Submit]:
        waiting = list(self.waiting)
        self.waiting.clear()
        return waiting

    def plan_and_apply(
        self,
        served: ServedModel,
        config: EngineConfig,
        outbox: Outbox,
        now: float | None = None,
        chunk: int = 0,
    ) -> TickSchedule:
        """Plan the tick and carry the plan out; `now` (monotonic seconds) decides which requests
        waited too long and `chunk` is the step's prefill chunk: in a group, rank 0's."""
        plan = self.plan(served, config, time.monotonic() if now is None else now, chunk)
        self.apply(plan, served, outbox)
        return plan

    def plan(self, served: ServedModel, config: EngineConfig, now: float, chunk: int) -> TickSchedule:
        """The tick's plan from the queue, the batch and the pool as they are now."""
        batch = served.batch
        slots = min(config.max_batch_size - len(batch), config.num_prefilled_together)
        if not self.waiting or slots <= 0:
            return TickSchedule([], chunk)
        lone = batch.running.lone_prefill() if batch.is_prefilling else None
        summary = BatchSummary(
            len(batch),
            slots,
            batch.is_prefilling,
            LonePrefill(lone[0], lone[1].queued_at, lone[2]) if lone is not None else None,
        )
        if summary.is_prefilling and summary.lone_prefill is None:
            return TickSchedule([], chunk)  # nothing to overtake: no need to read the pool
        return schedule_tick(
            [self._entry(position, submit, served) for position, submit in enumerate(self.waiting)],
            summary,
            pool_summary(served.store),
            now=now,
            chunk=chunk,
            short_turn_tokens=config.num_short_turn_tokens,
            max_wait_s=config.shortest_first_max_wait_s,
            policy=served.store.policy,
        )

    def apply(self, plan: TickSchedule, served: ServedModel, outbox: Outbox) -> None:
        """Carry `plan` out in order: a plan is applied in the tick it was made for."""
        batch, store = served.batch, served.store
        waiting = list(self.waiting)
        aside: SetAside | None = None
        num_evicted = 0
        try:
            for action in plan.actions:
                match action:
                    case Evict() | DropSharedState():
                        num_evicted += make_room(store, action)
                    case Refuse(position=position):
                        submit = waiting[position]
                        self.waiting.remove(submit)
                        outbox.post(submit.events, _refusal(action, submit, served))
                    case Overtake(uid=uid):
                        aside = batch.set_aside(uid)
                        if aside is None:
                            return  # its cache cannot be read as views: it keeps its place
                    case Admit(position=position, num_reserved_blocks=num_reserved):
                        submit = waiting[position]
                        self.waiting.remove(submit)
                        try:
                            batch.insert(submit, served.pool.allocate(num_reserved))
                        except Exception as error:
                            logger.exception("request {} failed at admission", submit.request.request_id)
                            outbox.post(submit.events, error)
        finally:
            if aside is not None:
                batch.resume(aside)
            if num_evicted:
                logger.info("evicted {} agent caches to make room", num_evicted)

    def make_room_to_restore(self, served: ServedModel, cache: SerializedCache, salt: str | None) -> None:
        """Evict idle caches (not those the policy spares for queued requests) for a cache read from
        disk, or raise PoolExhaustedError, evicting nothing, where even all of them would not make room
        (their blocks that running sequences or spared caches share stay held)."""
        store = served.store
        token_ids = [int(t) for t in cache.tensors["tokens"]]
        num_new = store.num_blocks_to_restore(token_ids, len(cache.state_points), cache.kv_starts, salt)
        spared = store.policy.spared_for_restore(self.queued_agent_ids)
        actions = plan_room(pool_summary(store), num_new, spared, store.policy)
        if actions is None:
            raise PoolExhaustedError(
                f"{num_new} blocks needed, {served.pool.num_free_blocks} free, and evicting every idle "
                "cache that may be evicted would not free enough"
            )
        for action in actions:
            make_room(store, action)

    @property
    def queued_agent_ids(self) -> frozenset[str]:
        return frozenset(s.request.agent_id for s in self.waiting if s.request.agent_id is not None)

    @staticmethod
    def _entry(position: int, submit: Submit, served: ServedModel) -> WaitingEntry:
        request, store = submit.request, served.store
        prompt, salt, agent_id = request.prompt_tokens, request.cache_salt, request.agent_id
        num_tokens = len(prompt) + request.sampling.max_tokens
        agent = store.agents.get(agent_id) if agent_id is not None else None
        num_reusable = store.num_reusable(agent_id, prompt, salt)
        reused = 0
        # The agent's full blocks the request starts from stay with the cache while it runs, and its
        # reply's cache shares them (same salt): they need no reservation.
        if (
            agent is not None
            and not agent.num_running
            and agent.salt == store.turn_salt(agent.agent_id, num_reusable, salt)
        ):
            reused = num_reusable // store.spec.block_size
        pins = agent_id if agent_id is not None else store.find_anonymous(prompt, salt)
        return WaitingEntry(
            position,
            submit.queued_at,
            len(prompt) - num_reusable,
            served.loaded.spec.num_blocks_reserved(num_tokens),
            reused,
            agent_id,
            pins,
            request.model_fingerprint in (None, served.loaded.fingerprint),
        )


def pool_summary(store: AgentCacheStore) -> PoolSummary:
    """The pool's free count and its idle caches (in the policy's order) with their blocks' ref
    counts and what each gives back when freed (itself and the blocks charged for its windows)."""
    pool = store.pool
    evictable = [HeldCache(a.agent_id, [*a.block_ids, *a.state_block_ids]) for a in store.evictable()]
    shared = store.droppable_block_ids()  # shared states, then cache_control pins
    held = {b for cache in evictable for b in cache.block_ids} | {b for ids in shared for b in ids}
    blocks = pool.blocks
    return PoolSummary(
        pool.num_blocks,
        pool.num_free_blocks,
        evictable,
        shared,
        {b: blocks[b].ref_count for b in held if blocks[b].ref_count != 1},
        {b: 1 + len(blocks[b].extra_block_ids) for b in held if blocks[b].extra_block_ids},
    )


def make_room(store: AgentCacheStore, action: Action) -> int:
    """Carry out one eviction of a plan; how many agents' caches it evicted."""
    if isinstance(action, Evict):
        store.evict(action.agent_id)
        return 1
    if isinstance(action, DropSharedState):
        store.drop_shared_state()
    return 0


def _refusal(refuse: Refuse, submit: Submit, served: ServedModel) -> Exception:
    request, pool = submit.request, served.pool
    needed = refuse.num_blocks_needed
    if refuse.reason == "model_changed":
        return ModelChangedError("the model changed while the request waited")
    if refuse.reason == "too_large":
        return ValueError(
            f"request needs {needed} KV blocks of {pool.block_size} tokens "
            f"({len(request.prompt_tokens)} prompt + {request.sampling.max_tokens} new tokens) but "
            f"the cache budget holds {pool.num_blocks} ({pool.num_blocks * pool.block_size} tokens): "
            "ask for fewer new tokens, or start the server with a larger --cache-budget-mb"
        )
    logger.error("{} of {} KV blocks are held with nothing running", pool.num_used_blocks, pool.num_blocks)
    return EngineError(
        f"the KV pool has {pool.num_free_blocks} free blocks of "
        f"{pool.num_blocks} and nothing running to free more; this request needs {needed}"
    )
