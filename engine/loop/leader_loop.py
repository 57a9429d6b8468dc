"""The engine thread of a lone process or of rank 0: it takes messages from its inbox and runs ticks.

The thread blocks on its inbox while idle; while work is in flight it runs ticks back to back
(each at least `tick_s` where that is set): take messages, admit what fits, step the batch once,
post every request's new events with one `call_soon_threadsafe`. Tells (submit, cancel, shutdown)
and asks arrive in one inbox.
As rank 0 of a group it first shares each tick (`engine/group/lockstep.py`), and while idle it still
shares an empty one every heartbeat; a lost rank fails every request and stops the thread.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Callable

import mlx.core as mx
from loguru import logger

from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.engine.group.distributed import GroupLostError
from semantic.engine.group.lockstep import Leader, Lockstep, clock_now
from semantic.engine.loop.commands import (
    Cancel,
    Drain,
    LoadModel,
    Message,
    PendingAsk,
    Shutdown,
    Submit,
    reject,
    resolve,
)
from semantic.engine.loop.config import EngineConfig, EngineStats
from semantic.engine.loop.engine_loop import EngineLoop
from semantic.engine.loop.errors import EngineError, as_ordinary
from semantic.engine.mlx_adapter.model_hooks import cpu_kernels_on_this_thread


class LeaderLoop(EngineLoop):
    def __init__(
        self,
        config: EngineConfig,
        stats: EngineStats,
        inbox: queue.SimpleQueue[Message],
        loop: asyncio.AbstractEventLoop,
        on_evicted: Callable[[list[SerializedCache]], None] | None,
        leader: Leader | None = None,
        on_group_lost: Callable[[BaseException], None] | None = None,
    ) -> None:
        super().__init__(config, stats, inbox, loop, on_evicted)
        self._pending: list[Message] = []  # taken while a tick waited out its length; applied next tick
        self._leader = leader  # rank 0 of a group: shares each tick before running it
        self._on_group_lost = on_group_lost

    @property
    def _lockstep(self) -> Lockstep | None:
        return self._leader

    def run(self, ready: asyncio.Future[None]) -> None:
        """The thread's body: load the configured model (resolving `ready`), then serve until shutdown."""
        try:
            self._stream = mx.new_stream(mx.default_device())
            with (
                mx.stream(self._stream),
                cpu_kernels_on_this_thread(self.config.profile.cpu_kernels),
                self._tick_allowance(True),
            ):
                self._load(self.config.model, self.config.model_name)
        except BaseException as error:
            logger.exception("model load failed")
            self._loop.call_soon_threadsafe(reject, ready, error)
            return
        self._loop.call_soon_threadsafe(resolve, ready, None)
        with mx.stream(self._stream), cpu_kernels_on_this_thread(self.config.profile.cpu_kernels):
            try:
                self._serve()
            finally:
                self._close()

    def _serve(self) -> None:
        stopping = False
        leader = self._leader
        while not (stopping and not self._is_busy):
            tick_start = time.perf_counter()
            idle = not self._is_busy and not self._pending
            messages = self._pending + self._take_messages(
                block=idle, timeout=leader.heartbeat_s if leader is not None and idle else None
            )
            self._pending, num_messages = [], len(messages)
            now, began = clock_now(), time.perf_counter()
            chunk, digest = self._next_chunk(), self._token_digest()
            fail_reason = self._drains.expired_reason(now, self._is_busy)
            loads = any(isinstance(m, PendingAsk) and isinstance(m.command, LoadModel) for m in messages)
            with self._tick_allowance(loads):
                try:
                    if leader is not None:
                        leader.share(messages, now, chunk, digest, fail_reason, self.config)
                except Exception as error:  # the others cannot run this tick: the group cannot go on
                    self._lose_group(error, messages)
                    return
                try:
                    stopping |= self._apply(messages)
                    messages = unanswered(messages)
                    self._run_tick(now, chunk, fail_reason)
                except GroupLostError as error:
                    self._lose_group(error, messages)
                    return
                except BaseException as error:
                    failure = as_ordinary(error)
                    if leader is not None:  # the other ranks ran this tick whole: they cannot follow
                        self._lose_group(failure, messages)
                        return
                    self._survive_failed_tick(failure)
            logger.debug("tick: {} messages, {:.1f} ms", num_messages, (time.perf_counter() - began) * 1e3)
            if self._is_busy:
                remaining = self.config.tick_s - (time.perf_counter() - tick_start)
                if remaining > 0:
                    self._pending = self._take_messages(block=True, timeout=remaining)

    def _survive_failed_tick(self, error: Exception) -> None:
        """A tick failed where nothing should (an allocation, an MLX error while admitting or
        keeping caches): the requests in flight fail with it, not the engine, which serves on."""
        logger.opt(exception=error).error("an engine tick failed ({}); failing the requests in flight", error)
        self.stats.num_tick_failures += 1
        self._fail_everything(EngineError(f"the engine failed this request: {type(error).__name__}: {error}"))
        self._flush()
        self._check_drains()
        self._update_stats()

    def _lose_group(self, error: Exception, messages: list[Message]) -> None:
        """A rank is gone: fail every request and ask (those taken this tick too) and stop serving."""
        logger.opt(exception=error).error(
            "the group cannot go on ({}); failing every request and stopping", error
        )
        lost = EngineError(f"a rank of the model's group stopped: {error}")
        self._fail_everything(lost)
        for message in messages:
            match message:
                case Submit(events=events):
                    self._outbox.post(events, lost)
                case PendingAsk():
                    message.fail(lost)
        self._outbox.flush()
        self._drains.answer_all()
        if self._on_group_lost is not None:
            self._loop.call_soon_threadsafe(self._on_group_lost, error)

    def _take_messages(self, block: bool, timeout: float | None = None) -> list[Message]:
        """Every queued message (waiting up to `timeout` for one if `block`)."""
        messages: list[Message] = []
        try:
            messages.append(self._inbox.get(block=block, timeout=timeout))
            while True:
                messages.append(self._inbox.get_nowait())
        except queue.Empty:
            return messages

    def _apply(self, messages: list[Message]) -> bool:
        """Handle the tick's messages in order; True once told to stop."""
        stopping = False
        for message in messages:
            match message:
                case Submit():
                    self._scheduler.add(message)
                case Cancel(request_id=request_id):
                    self._cancel(request_id)
                case Shutdown():
                    stopping = True
                case PendingAsk(command=Drain(timeout_s=timeout_s, reason=reason)):
                    self._drains.add(message, timeout_s, reason)
                case PendingAsk(command=command):
                    try:
                        message.answer(self._answer(command))
                    except GroupLostError:
                        raise
                    except Exception as error:
                        message.fail(error)
        return stopping


def unanswered(messages: list[Message]) -> list[Message]:
    """The tick's messages but the asks it answered, which the tick needs no more: a cache read from
    disk (the whole history's keys and values) is then freed before the turn it was read
    for is admitted, whose history takes that memory rather than fresh pages. A lost group still
    fails what is left (an answered ask has its answer)."""
    return [m for m in messages if not isinstance(m, PendingAsk) or isinstance(m.command, Drain)]
