"""Requests waiting for a batch slot, and which of them join the batch at each tick.

A new prompt batch starts only once the last one is prefilled, except that a short turn (at most
`short_turn_tokens` uncached: by default two prefill chunks on the CPU, one on a GPU) overtakes a
lone long prompt part-way through its prefill; waiting requests go in by the tokens they still have
to prefill, fewest first, and each joins with its KV blocks reserved up front (idle agents' caches
are evicted, least recently used first, to make room; the caches of queued requests are spared
while anything runs; a cache read from disk gets room the same way).
"""

from __future__ import annotations

import time
from collections import deque

from loguru import logger

from semantic.engine.agent_cache import AgentCacheStore
from semantic.engine.cache_tensors import SerializedCache
from semantic.engine.commands import Submit
from semantic.engine.config import EngineConfig
from semantic.engine.errors import EngineError, ModelChangedError, PoolExhaustedError
from semantic.engine.messages import GenerationRequest
from semantic.engine.outbox import Outbox
from semantic.engine.runtime import Runtime
from semantic.engine.sequence import SetAside


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

    def admit(self, runtime: Runtime, config: EngineConfig, outbox: Outbox, now: float | None = None) -> None:
        """Insert waiting requests into the batch while slots and blocks allow; post refusals.
        `now` (monotonic seconds) decides which requests waited too long; in a group, rank 0's."""
        batch = runtime.batch
        slots = min(config.max_batch_size - len(batch), config.num_prefilled_together)
        if not self.waiting or slots <= 0:
            return
        now = time.monotonic() if now is None else now
        # Holding prompts while a batch prefills also lets the order below pick among all that arrived.
        overtaken = self._overtakable(runtime, config, now) if batch.is_prefilling else None
        if batch.is_prefilling and overtaken is None:
            return
        order = self._admission_order(runtime.store, config.shortest_first_max_wait_s, now)
        aside = None
        if overtaken is not None:
            aside = self._set_aside_for(order[0], overtaken, runtime, config)
            if aside is None:
                return
        try:
            self._admit_in_order(order, runtime, outbox, slots, holding=aside is not None)
        finally:
            if aside is not None:
                batch.resume(aside)

    def _admit_in_order(
        self, order: list[Submit], runtime: Runtime, outbox: Outbox, slots: int, holding: bool
    ) -> None:
        """`holding`: a prompt set aside holds blocks outside the batch (it goes back in after)."""
        batch, pool = runtime.batch, runtime.pool
        for submit in order:
            if slots <= 0:
                return
            request = submit.request
            needed = _blocks_needed(runtime, request)
            refusal: Exception | None = None
            if request.model_fingerprint not in (None, runtime.loaded.fingerprint):
                refusal = ModelChangedError("the model changed while the request waited")
            elif needed > pool.num_blocks:
                refusal = ValueError(
                    f"request needs {needed} KV blocks of {pool.block_size} tokens "
                    f"({len(request.prompt_tokens)} prompt + {request.sampling.max_tokens} new tokens) but "
                    f"the cache budget holds {pool.num_blocks} ({pool.num_blocks * pool.block_size} tokens): "
                    "ask for fewer new tokens, or start the server with a larger --cache-budget-mb"
                )
            if refusal is not None:
                self.waiting.remove(submit)
                outbox.post(submit.events, refusal)
                continue
            num_reserved = self._make_room(runtime, request, needed)
            if num_reserved is None and not len(batch) and not holding:
                # Nothing runs that could free blocks, so waiting would never end: fail it loudly.
                logger.error(
                    "{} of {} KV blocks are held with nothing running", pool.num_used_blocks, pool.num_blocks
                )
                self.waiting.remove(submit)
                outbox.post(
                    submit.events,
                    EngineError(
                        f"the KV pool has {pool.num_free_blocks} free blocks of "
                        f"{pool.num_blocks} and nothing running to free more; this request needs {needed}"
                    ),
                )
                continue
            if num_reserved is None:
                return
            self.waiting.remove(submit)
            slots -= 1
            try:
                batch.insert(submit, pool.allocate(num_reserved))
            except Exception as error:
                logger.exception("request {} failed at admission", request.request_id)
                outbox.post(submit.events, error)

    @staticmethod
    def _overtakable(runtime: Runtime, config: EngineConfig, now: float) -> int | None:
        """The lone prompt part-way through a long prefill that a short turn may overtake (its uid):
        one with more than a short turn left, that has not waited `shortest_first_max_wait_s`."""
        lone = runtime.batch.running.lone_prefill()
        if lone is None:
            return None
        uid, prefilling, num_left = lone
        if num_left <= config.num_short_turn_tokens:
            return None
        return uid if now - prefilling.queued_at < config.shortest_first_max_wait_s else None

    def _set_aside_for(
        self, first: Submit, overtaken: int, runtime: Runtime, config: EngineConfig
    ) -> SetAside | None:
        """Set the overtakable prompt aside when the next waiting request is a short turn (its
        uncached part is at most `short_turn_tokens`) that can go in now; it would otherwise wait
        for every chunk of the long prompt: a returning agent's turn behind a cold 30K-token history
        waits a minute here. The long prompt goes back in behind the turn, from the cache it has."""
        if _uncached(runtime.store, first) > config.num_short_turn_tokens:
            return None
        request = first.request
        needed = _blocks_needed(runtime, request)
        if needed > runtime.pool.num_blocks or self._make_room(runtime, request, needed) is None:
            return None  # it could not go in now: the long prompt keeps its place
        return runtime.batch.set_aside(overtaken)

    @property
    def queued_agent_ids(self) -> set[str]:
        return {s.request.agent_id for s in self.waiting if s.request.agent_id is not None}

    def make_room_to_restore(self, runtime: Runtime, cache: SerializedCache, salt: str | None) -> None:
        """Evict idle caches (not those of queued requests) for a cache read from disk, or raise
        PoolExhaustedError, evicting nothing, where even all of them would not make room."""
        store, pool = runtime.store, runtime.pool
        token_ids = [int(t) for t in cache.tensors["tokens"]]
        num_new = store.num_blocks_to_restore(token_ids, len(cache.state_points), cache.kv_starts, salt)
        spared = self.queued_agent_ids
        evictable = {b for a in store.evictable() if a.agent_id not in spared for b in a.block_ids}
        if pool.num_free_blocks + len(evictable) < num_new:
            raise PoolExhaustedError(
                f"{num_new} blocks needed, {pool.num_free_blocks} free, {len(evictable)} in idle caches"
            )
        self.make_room(runtime, num_new, spared)

    def make_room(self, runtime: Runtime, num_blocks: int, spared: set[str]) -> bool:
        """Evict idle agents' caches, least recently used first and never those in `spared`, until
        `num_blocks` are free; whether they are."""
        store, pool = runtime.store, runtime.pool
        evicted = []
        for agent in store.evictable():
            if pool.can_allocate(num_blocks):
                break
            if agent.agent_id not in spared:
                evicted.append(store.evict(agent.agent_id))
        while not pool.can_allocate(num_blocks) and store.drop_shared_state():
            pass
        if evicted:
            logger.info("evicted {} agent caches to free {} blocks", len(evicted), num_blocks)
        return pool.can_allocate(num_blocks)

    def _make_room(self, runtime: Runtime, request: GenerationRequest, needed: int) -> int | None:
        """Free the blocks `request` must reserve (`needed` for its prompt and reply, less the
        full blocks of its agent's cache that it reuses); how many that is, or None to wait.

        The caches of queued requests are about to be used (one may just have been read from
        disk), so they are spared while running requests will free blocks; once nothing runs,
        they go too, this request's own last."""
        own = request.agent_id
        reused = self._num_reused_blocks(runtime.store, request)
        if self.make_room(runtime, needed - reused, self.queued_agent_ids):
            return needed - reused
        if len(runtime.batch):
            return None
        if self.make_room(runtime, needed - reused, {own} if own is not None else set()):
            return needed - reused
        return needed if self.make_room(runtime, needed, set()) else None

    @staticmethod
    def _num_reused_blocks(store: AgentCacheStore, request: GenerationRequest) -> int:
        """Full blocks of the agent's cache that `request` starts from. The cache keeps them while
        the request runs, and its reply's cache shares them (same salt), so they need no reservation."""
        agent = store.agents.get(request.agent_id) if request.agent_id is not None else None
        if agent is None or agent.num_running or agent.salt != request.cache_salt:
            return 0
        block_size = store.spec.block_size
        return store.num_reusable(agent.agent_id, request.prompt_tokens, request.cache_salt) // block_size

    def _admission_order(self, store: AgentCacheStore, max_wait_s: float, now: float) -> list[Submit]:
        """Waiting requests by the tokens they still have to prefill, fewest first, so a returning
        agent's short turn is not queued behind cold prompts; past `max_wait_s` a request goes
        ahead in arrival order, so none waits forever."""
        overdue = [s for s in self.waiting if now - s.queued_at >= max_wait_s]
        rest = [s for s in self.waiting if now - s.queued_at < max_wait_s]
        return overdue + sorted(rest, key=lambda submit: _uncached(store, submit))


def _blocks_needed(runtime: Runtime, request: GenerationRequest) -> int:
    """The KV blocks a request's prompt and reply take (before any reuse of its agent's cache)."""
    return runtime.loaded.spec.num_blocks_reserved(len(request.prompt_tokens) + request.sampling.max_tokens)


def _uncached(store: AgentCacheStore, submit: Submit) -> int:
    """The prompt tokens a waiting request would prefill if it went in now."""
    request = submit.request
    prompt = request.prompt_tokens
    return len(prompt) - store.num_reusable(request.agent_id, prompt, request.cache_salt)
