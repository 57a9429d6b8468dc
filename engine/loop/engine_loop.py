"""The engine thread's state and what it does each tick: it alone touches the model, the batch,
the block pool and the MLX stream.

A tick applies what arrived (requests, cancels, commands), admits what fits, steps the batch
once and posts every request's new events. Where ticks come from is the subclass's part:
`LeaderLoop` (engine/loop/leader_loop.py) takes them from its inbox, as a lone process or rank 0 of a
group; `FollowerLoop` (engine/group/follower_loop.py) receives them from rank 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import queue
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from loguru import logger

from semantic.engine.cache_store.agent_cache import imported_salt
from semantic.engine.cache_store.cache_tensors import SerializedCache, to_tensors
from semantic.engine.group.lockstep import Lockstep
from semantic.engine.loop.commands import (
    DropCache,
    EngineAsk,
    InspectPool,
    ListCaches,
    LoadModel,
    Message,
    ReferenceGenerate,
    RestoreCache,
    SnapshotCaches,
    TakeCache,
    UnloadModel,
)
from semantic.engine.loop.config import EngineConfig, EngineStats
from semantic.engine.loop.drains import Drains
from semantic.engine.loop.errors import EngineError, PoolExhaustedError
from semantic.engine.loop.messages import Finished, FinishReason
from semantic.engine.loop.outbox import Outbox
from semantic.engine.loop.served_model import ServedModel
from semantic.engine.model.loading import LoadedModel
from semantic.engine.scheduling.scheduler import Scheduler

LOAD_TIMEOUT_S = 1800.0  # in a group, a tick that loads a model: the slowest rank reads its weights
MEMORY_REPORT_S = 2.0  # in a group, how often the ranks report their memory to each other


class EngineLoop:
    """The engine thread's state; built on the event loop, then used by the engine thread only."""

    def __init__(
        self,
        config: EngineConfig,
        stats: EngineStats,
        inbox: queue.SimpleQueue[Message],
        loop: asyncio.AbstractEventLoop,
        on_evicted: Callable[[list[SerializedCache]], None] | None,
    ) -> None:
        self.config = config  # `Engine.config`'s setter may replace it; read afresh every tick
        self.stats = stats
        self.loaded: LoadedModel | None = None  # read from the loop side too
        self._inbox = inbox
        self._loop = loop
        self._on_evicted = on_evicted
        self._outbox = Outbox(loop)
        self._scheduler = Scheduler()
        self._served: ServedModel | None = None
        self._stream: mx.Stream | None = None
        self._drains = Drains()
        self._next_memory_report = 0.0

    def _load(self, source: str, name: str | None) -> LoadedModel:
        assert self._stream is not None, "model loaded off the engine thread: engine bug"
        lockstep = self._lockstep
        served = ServedModel.load(
            source,
            name,
            self.config,
            self._stream,
            self.stats,
            self._outbox,
            lockstep.layout if lockstep is not None else None,
            lockstep.collectives if lockstep is not None else None,
        )
        self._served, self.loaded = served, served.loaded
        self.stats.pool_budget_bytes = served.pool.budget_bytes
        self._update_stats()
        return served.loaded

    def _unload(self) -> None:
        served = self._served
        if served is None:
            return
        if self._is_busy:
            raise EngineError("cannot unload while requests run or wait; drain first")
        self._hand_over_evicted(served)
        served.batch.close()
        name = served.loaded.name
        self._served = self.loaded = served = None
        self.stats.pool_budget_bytes = self.stats.pool_used_bytes = self.stats.num_agents_cached = 0
        gc.collect()
        mx.clear_cache()
        stats = self.stats
        stats.mlx_active_bytes, stats.mlx_cache_bytes = mx.get_active_memory(), mx.get_cache_memory()
        logger.info("unloaded {}; MLX active memory now {:.1f} MiB", name, stats.mlx_active_bytes / 2**20)

    def holds_cache(self, agent_id: str, fingerprint: str) -> bool:
        """`ServedModel.holds` of the model served now (read once: it is replaced whole); any thread."""
        served = self._served
        return served is not None and served.holds(agent_id, fingerprint)

    @property
    def _is_busy(self) -> bool:
        return bool(self._scheduler) or (self._served is not None and len(self._served.batch) > 0)

    @property
    def _lockstep(self) -> Lockstep | None:
        """The group this rank runs ticks with: None alone (`LeaderLoop` and `FollowerLoop` say)."""
        return None

    # No local reference to the served model may live across a tick's messages: an unload must free it.
    def _next_chunk(self) -> int:
        return self._served.batch.next_chunk() if self._served is not None else 0

    def _token_digest(self) -> int:
        return self._served.batch.running.token_digest if self._served is not None else 0

    def _run_tick(self, now: float, chunk: int, fail_reason: str | None) -> None:
        """What every rank does once the tick's messages are applied: admit, step, post."""
        if fail_reason is not None:
            self._drains.count_failed(self._fail_everything(EngineError(fail_reason)))
        served = self._served
        if served is not None:
            plan = self._scheduler.plan_and_apply(served, self.config, self._outbox, now, chunk)
            if len(served.batch):
                served.batch.step(plan.chunk)
        self._update_stats()  # before the events: a client that saw its reply end sees it in the stats
        self._flush()  # the tick's one flush: every event it made
        if served is not None:
            served.batch.keep_caches()  # after the events are out: it waits on the step MLX queued
            assert not self._outbox, "keeping caches posted events, which would wait a tick: engine bug"
            self._hand_over_evicted(served)  # the caches keeping them evicted
        self._check_drains()
        self._update_stats()
        self._gather_memory(now)

    def _tick_allowance(self, loads: bool) -> contextlib.AbstractContextManager[None]:
        """In a group, how long a tick may keep this rank waiting on the others (longer with a load)."""
        lockstep = self._lockstep
        if lockstep is None:
            return contextlib.nullcontext()
        timeout_s = max(self.config.rank_timeout_s, LOAD_TIMEOUT_S) if loads else self.config.rank_timeout_s
        return lockstep.collectives.watchdog.allow(
            "a tick" + (" loading a model" if loads else ""), timeout_s
        )

    def _gather_memory(self, now: float) -> None:
        """In a group, each rank's memory for health and metrics, every few seconds of rank 0's clock."""
        lockstep = self._lockstep
        if lockstep is None or now < self._next_memory_report:
            return
        self._next_memory_report = now + MEMORY_REPORT_S
        self.stats.rank_memory_bytes = lockstep.collectives.gather(mx.get_active_memory(), "memory report")

    def _answer(self, command: EngineAsk[Any]) -> Any:
        served = self._served
        match command:
            case LoadModel(source=source, name=name):
                if served is not None:
                    raise EngineError(f"{served.loaded.name} is still loaded; unload it first")
                return self._load(source, name)
            case UnloadModel():
                return self._unload()
            case RestoreCache(cache=cache, fingerprint=fingerprint, cache_salt=salt):
                return self._restore(cache.agent_id, fingerprint, salt, cache.num_tokens, lambda: cache)
            case TakeCache(agent_id=agent_id):
                return served.take(agent_id) if served is not None else None
            case SnapshotCaches(agent_id=agent_id, file_digest=file_digest):
                return served.snapshot_named(agent_id, file_digest) if served is not None else []
            case DropCache(agent_id=agent_id):
                if served is not None:
                    served.store.drop(agent_id)
                return None
            case ListCaches(agent_id=agent_id):
                return served.list_caches(agent_id) if served is not None else []
            case InspectPool():
                return self._served_model().inspect()
            case ReferenceGenerate(prompt_tokens=prompt_tokens, max_tokens=max_tokens):
                return self._served_model().reference_generate(prompt_tokens, max_tokens)
            case _:
                raise TypeError(f"the engine does not answer {type(command).__name__}")

    def _restore(
        self,
        agent_id: str,
        fingerprint: str,
        salt: str | None,
        num_tokens: int,
        read: Callable[[], SerializedCache | None],
    ) -> bool:
        """Put a cache read from disk into memory: in a group, only if every rank has its shard."""
        served, lockstep = self._served, self._lockstep
        if served is None or served.loaded.fingerprint != fingerprint:
            return False  # the model was swapped while the file was read
        cache = read()
        if lockstep is not None and not lockstep.agree(cache is not None, f"restoring {agent_id}"):
            return False
        if cache is None:
            return False
        salt = imported_salt(agent_id) if cache.imported else salt
        try:
            self._scheduler.make_room_to_restore(served, cache, salt)
            served.restore(cache, salt)
            restored = True
        except PoolExhaustedError as error:  # running sequences hold the pool: not the file's fault
            logger.info("no room to restore the cache of {} now ({}); its turn computes it", agent_id, error)
            restored = False
        except Exception:
            if lockstep is None:
                raise
            logger.exception("could not restore the cache of {}", agent_id)
            restored = False
        if lockstep is not None and not lockstep.agree(restored, f"restored {agent_id}"):
            served.store.drop(agent_id)  # some rank could not: none keeps it
            return False
        return restored

    def _served_model(self) -> ServedModel:
        if self._served is None:
            raise EngineError("the engine has no model loaded")
        return self._served

    def _cancel(self, request_id: str) -> None:
        waiting = self._scheduler.cancel(request_id)
        if waiting is not None:
            num_prompt = len(waiting.request.prompt_tokens)
            self._outbox.post(waiting.events, Finished(FinishReason.CANCELLED, None, num_prompt, 0, 0))
        elif self._served is not None:
            self._served.batch.cancel(request_id)

    def _fail_everything(self, error: BaseException) -> int:
        waiting = self._scheduler.take_all()
        for submit in waiting:
            self._outbox.post(submit.events, error)
        num_running = self._served.batch.fail_all(error) if self._served is not None else 0
        return len(waiting) + num_running

    def _check_drains(self) -> None:
        """Answer the drains once nothing runs or waits; after a flush, so every request's last
        events reach the loop before the drains' replies."""
        if self._drains and not self._is_busy:
            self._drains.answer_all()

    def _close(self) -> None:
        error = EngineError("the engine stopped before this request ran")
        for submit in self._scheduler.take_all():
            self._outbox.post(submit.events, error)
        if self._served is not None:
            self._served.batch.cancel_all()
        self._flush()
        self._drains.fail_all(EngineError("the engine stopped during the drain"))
        if self._served is not None:
            self._served.batch.close()
        # mlx-lm evaluates the next step asynchronously; let the engine's stream finish
        # before the thread ends, or a process exiting soon after can abort inside MLX's scheduler.
        mx.synchronize()

    def _flush(self) -> None:
        if self._served is not None:
            self._hand_over_evicted(self._served)
            self._served.batch.flush()
        self._outbox.flush()

    def _hand_over_evicted(self, served: ServedModel) -> None:
        evicted = served.take_evicted()
        if not evicted:
            return
        self.stats.num_evictions += len(evicted)
        if not self._keeps_evicted:
            return
        serialized = [to_tensors(s) for s in evicted if served.store.policy.goes_to_disk(s.agent_id)]
        if serialized:
            self._keep_evicted(serialized, served)

    @property
    def _keeps_evicted(self) -> bool:
        return self._on_evicted is not None

    def _keep_evicted(self, caches: list[SerializedCache], served: ServedModel) -> None:
        """Hand evicted caches to whoever writes them: the persistence actor, on the event loop."""
        assert self._on_evicted is not None
        self._loop.call_soon_threadsafe(self._on_evicted, caches)

    def _update_stats(self) -> None:
        served = self._served
        if served is None:
            return
        self.stats.num_running = len(served.batch)
        self.stats.num_waiting = len(self._scheduler)
        self.stats.pool_used_bytes = served.pool.used_bytes
        self.stats.num_agents_cached = len(served.store.agents)
        self.stats.mlx_active_bytes = mx.get_active_memory()
        self.stats.mlx_cache_bytes = mx.get_cache_memory()
