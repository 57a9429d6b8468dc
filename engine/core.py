"""The engine thread: it alone touches the model, the batch, the block pool and the MLX stream.

The thread blocks on its inbox while idle; while work is in flight it runs ticks of at least
`tick_s`: take messages, admit what fits, step the batch once, post every request's new events
with one `call_soon_threadsafe`. Tells (submit, cancel, shutdown) and asks arrive in one inbox.
"""

from __future__ import annotations

import asyncio
import gc
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from loguru import logger

from semantic.engine import cpu_attention, mlx_seams
from semantic.engine.agent_cache import is_anonymous
from semantic.engine.cache_tensors import SerializedCache, to_tensors
from semantic.engine.commands import (
    Cancel,
    Drain,
    DropCache,
    EngineAsk,
    Envelope,
    InspectPool,
    ListCaches,
    LoadModel,
    Message,
    NeedsRestore,
    ReferenceGenerate,
    RestoreCache,
    Shutdown,
    SnapshotCaches,
    Submit,
    TakeCache,
    UnloadModel,
    reject,
    resolve,
)
from semantic.engine.config import EngineConfig, EngineStats
from semantic.engine.errors import EngineError
from semantic.engine.loading import LoadedModel
from semantic.engine.messages import Finished, FinishReason
from semantic.engine.outbox import Outbox
from semantic.engine.runtime import Runtime
from semantic.engine.scheduler import Scheduler


@dataclass(slots=True)
class _PendingDrain:
    deadline: float
    reason: str
    envelope: Envelope
    num_failed: int = 0


class EngineCore:
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
        self._runtime: Runtime | None = None
        self._stream: mx.Stream | None = None
        self._drains: list[_PendingDrain] = []

    def run(self, ready: asyncio.Future[None]) -> None:
        """The thread's body: load the configured model (resolving `ready`), then serve until shutdown."""
        try:
            self._stream = mx.new_stream(mx.default_device())
            with mx.stream(self._stream), mlx_seams.cpu_attention_on_this_thread():
                self._load(self.config.model, self.config.model_name)
        except BaseException as error:
            logger.exception("model load failed")
            self._loop.call_soon_threadsafe(reject, ready, error)
            return
        self._loop.call_soon_threadsafe(resolve, ready, None)
        with mx.stream(self._stream), mlx_seams.cpu_attention_on_this_thread():
            try:
                self._serve()
            finally:
                self._close()

    def _load(self, source: str, name: str | None) -> LoadedModel:
        assert self._stream is not None, "model loaded off the engine thread: engine bug"
        runtime = Runtime.load(source, name, self.config, self._stream, self.stats, self._outbox)
        self._runtime, self.loaded = runtime, runtime.loaded
        self.stats.pool_budget_bytes = runtime.pool.budget_bytes
        return runtime.loaded

    def _unload(self) -> None:
        runtime = self._runtime
        if runtime is None:
            return
        if self._is_busy:
            raise EngineError("cannot unload while requests run or wait; drain first")
        self._hand_over_evicted(runtime)
        runtime.batch.close()
        name = runtime.loaded.name
        self._runtime = self.loaded = runtime = None
        self.stats.pool_budget_bytes = self.stats.pool_used_bytes = self.stats.num_agents_cached = 0
        gc.collect()
        mx.clear_cache()
        logger.info("unloaded {}; MLX active memory now {:.1f} MiB", name, mx.get_active_memory() / 2**20)

    @property
    def _is_busy(self) -> bool:
        return bool(self._scheduler) or (self._runtime is not None and len(self._runtime.batch) > 0)

    def _serve(self) -> None:
        stopping = False
        while not (stopping and not self._is_busy):
            tick_start = time.perf_counter()
            stopping |= self._take_messages(block=not self._is_busy)
            runtime = self._runtime
            if runtime is not None:
                self._scheduler.admit(runtime, self.config, self._outbox)
                if len(runtime.batch):
                    runtime.batch.step()
            self._flush()
            self._check_drains()
            self._update_stats()
            if self._is_busy:
                remaining = self.config.tick_s - (time.perf_counter() - tick_start)
                if remaining > 0:
                    stopping |= self._take_messages(block=True, timeout=remaining)

    def _take_messages(self, block: bool, timeout: float | None = None) -> bool:
        """Handle every queued message (waiting for one if `block`); True once told to stop."""
        try:
            message: Message | None = self._inbox.get(block=block, timeout=timeout)
        except queue.Empty:
            return False
        stopping = False
        while message is not None:
            match message:
                case Submit():
                    self._scheduler.add(message)
                case Cancel(request_id=request_id):
                    self._cancel(request_id)
                case Shutdown():
                    stopping = True
                case Envelope(command=Drain(timeout_s=timeout_s, reason=reason)):
                    self._drains.append(_PendingDrain(time.perf_counter() + timeout_s, reason, message))
                case Envelope(command=command):
                    try:
                        message.answer(self._answer(command))
                    except Exception as error:
                        message.fail(error)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                message = None
        return stopping

    def _answer(self, command: EngineAsk[Any]) -> Any:
        runtime = self._runtime
        match command:
            case LoadModel(source=source, name=name):
                if runtime is not None:
                    raise EngineError(f"{runtime.loaded.name} is still loaded; unload it first")
                return self._load(source, name)
            case UnloadModel():
                return self._unload()
            case NeedsRestore(agent_id=agent_id, fingerprint=fingerprint):
                return runtime is not None and runtime.needs_restore(agent_id, fingerprint)
            case RestoreCache(cache=cache, fingerprint=fingerprint, cache_salt=salt):
                if runtime is None or runtime.loaded.fingerprint != fingerprint:
                    return False  # the model was swapped while the file was read
                num_blocks = runtime.loaded.spec.num_blocks_for(cache.num_tokens)
                self._scheduler.make_room(runtime, num_blocks, self._scheduler.queued_agent_ids)
                runtime.restore(cache, salt)
                return True
            case TakeCache(agent_id=agent_id):
                return runtime.take(agent_id) if runtime is not None else None
            case SnapshotCaches():
                return runtime.snapshot_named() if runtime is not None else []
            case DropCache(agent_id=agent_id):
                if runtime is not None:
                    runtime.store.drop(agent_id)
                return None
            case ListCaches(agent_id=agent_id):
                return runtime.list_caches(agent_id) if runtime is not None else []
            case InspectPool():
                return self._loaded_runtime().inspect()
            case ReferenceGenerate(prompt_tokens=prompt_tokens, max_tokens=max_tokens):
                return self._loaded_runtime().reference_generate(prompt_tokens, max_tokens)
            case _:
                raise TypeError(f"the engine does not answer {type(command).__name__}")

    def _loaded_runtime(self) -> Runtime:
        if self._runtime is None:
            raise EngineError("the engine has no model loaded")
        return self._runtime

    def _cancel(self, request_id: str) -> None:
        waiting = self._scheduler.cancel(request_id)
        if waiting is not None:
            num_prompt = len(waiting.request.prompt_tokens)
            self._outbox.post(waiting.events, Finished(FinishReason.CANCELLED, None, num_prompt, 0, 0))
        elif self._runtime is not None:
            self._runtime.batch.cancel(request_id)

    def _fail_everything(self, error: BaseException) -> int:
        waiting = self._scheduler.take_all()
        for submit in waiting:
            self._outbox.post(submit.events, error)
        num_running = self._runtime.batch.fail_all(error) if self._runtime is not None else 0
        return len(waiting) + num_running

    def _check_drains(self) -> None:
        if not self._drains:
            return
        now = time.perf_counter()
        for drain in self._drains:
            if self._is_busy and now >= drain.deadline:
                error = EngineError(f"cancelled: {drain.reason}, and the drain timeout passed")
                drain.num_failed += self._fail_everything(error)
        if not self._is_busy:
            drains, self._drains = self._drains, []
            self._flush()  # every request's last events reach the loop before the drains' replies
            for drain in drains:
                drain.envelope.answer(drain.num_failed)

    def _close(self) -> None:
        error = EngineError("the engine stopped before this request ran")
        for submit in self._scheduler.take_all():
            self._outbox.post(submit.events, error)
        if self._runtime is not None:
            self._runtime.batch.cancel_all()
        self._flush()
        for drain in self._drains:
            drain.envelope.fail(EngineError("the engine stopped during the drain"))
        if self._runtime is not None:
            self._runtime.batch.close()
        # mlx-lm evaluates the next step asynchronously; let every stream this thread used finish
        # before the thread ends, or a process exiting soon after can abort inside MLX's scheduler.
        mx.synchronize()
        cpu_attention.synchronize_streams()

    def _flush(self) -> None:
        if self._runtime is not None:
            self._hand_over_evicted(self._runtime)
            self._runtime.batch.flush()
        self._outbox.flush()

    def _hand_over_evicted(self, runtime: Runtime) -> None:
        evicted = runtime.take_evicted()
        if not evicted:
            return
        self.stats.num_evictions += len(evicted)
        if self._on_evicted is None:
            return
        # Anonymous agents are matched by content in memory only; their ids do not survive a restart.
        serialized = [to_tensors(s) for s in evicted if not is_anonymous(s.agent_id)]
        if serialized:
            self._loop.call_soon_threadsafe(self._on_evicted, serialized)

    def _update_stats(self) -> None:
        runtime = self._runtime
        if runtime is None:
            return
        self.stats.num_running = len(runtime.batch)
        self.stats.num_waiting = len(self._scheduler)
        self.stats.pool_used_bytes = runtime.pool.used_bytes
        self.stats.num_agents_cached = len(runtime.store.agents)
