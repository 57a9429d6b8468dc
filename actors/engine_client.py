"""The engine's asyncio side: start and stop its thread, submit and cancel requests, ask commands.

Everything the model touches lives on the engine thread (`engine_loop.py`); this side only puts messages
in its inbox and awaits replies, so nothing here takes a lock.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import mlx.core as mx
import msgspec

from semantic.actors.request_stream import RequestStream
from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.engine.group.distributed import Collectives, GroupLayout, heartbeat_s, launched_group, layout_of
from semantic.engine.group.lockstep import Leader
from semantic.engine.loop.commands import Cancel, EngineAsk, Message, PendingAsk, Shutdown, Submit, reject
from semantic.engine.loop.config import EngineConfig, EngineStats
from semantic.engine.loop.errors import EngineError, ModelChangedError, PromptTooLongError
from semantic.engine.loop.leader_loop import LeaderLoop
from semantic.engine.loop.messages import EventChannel, GenerationRequest
from semantic.engine.model.loading import LoadedModel

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "ModelChangedError",
    "PromptTooLongError",
    "RequestStream",
]

T = TypeVar("T")


class Engine:
    def __init__(
        self, config: EngineConfig, on_evicted: Callable[[list[SerializedCache]], None] | None = None
    ) -> None:
        """`on_evicted` runs on the event loop with the named agents' caches evicted to make room,
        already serialized; caches of requests without an agent id are never handed over."""
        self._config = config
        self.stats = EngineStats()
        self._on_evicted = on_evicted
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._core: LeaderLoop | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False  # the thread has ended and what it left in the inbox was failed
        self.layout: GroupLayout | None = None  # this rank's part of a group, if launched into one
        # Set when a rank of the group is lost: the engine has failed everything and stopped.
        self.group_lost: asyncio.Event | None = None
        self._open: weakref.WeakSet[EventChannel] = weakref.WeakSet()  # requests a stalled group fails

    @property
    def config(self) -> EngineConfig:
        return self._config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        """Settings read per tick (admission order, tick length) apply from the next tick."""
        self._config = config
        if self._core is not None:
            self._core.config = config

    @property
    def loaded(self) -> LoadedModel | None:
        return self._core.loaded if self._core is not None else None

    def holds_cache(self, agent_id: str, fingerprint: str) -> bool:
        """Whether the engine holds the agent's cache for model `fingerprint` now, read without a
        message: an ask waits for the engine thread's tick to end (seconds on a CPU under load).
        The engine may evict the cache before the agent's next request goes in, as after an ask."""
        return self._core is not None and self._core.holds_cache(agent_id, fingerprint)

    @property
    def model(self) -> LoadedModel:
        if self.loaded is None:
            raise EngineError("the engine has no model loaded")
        return self.loaded

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        """Start the engine thread and wait until the model is loaded (or raise its load error)."""
        self._loop = asyncio.get_running_loop()
        self.group_lost = asyncio.Event()
        leader = self._lead_group()
        self._core = LeaderLoop(
            self._config,
            self.stats,
            self._inbox,
            self._loop,
            self._on_evicted,
            leader,
            self._on_group_lost,
        )
        ready: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(self._core, ready), name="semantic-engine", daemon=True
        )
        self._thread.start()
        await ready

    def _lead_group(self) -> Leader | None:
        """Rank 0 of a group `mlx.launch` started leads every tick; other ranks run `semantic.follower`."""
        group = launched_group()
        if group is None:
            return None
        if group.rank() != 0:
            raise EngineError(f"rank {group.rank()} follows rank 0; it runs no engine of its own")
        self.layout = layout_of(group, self._config.pipeline)
        collectives = Collectives(group, self._config.rank_timeout_s)
        collectives.watchdog.on_stall = self._on_stall
        return Leader(collectives, self.layout, heartbeat_s(self._config.rank_timeout_s))

    def _on_stall(self, reason: str) -> None:
        """Watchdog thread: the engine thread is stuck in a collective; fail every open request from
        the loop so each client gets an error, and let the server stop (the watchdog then exits)."""
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._fail_open, EngineError(reason))

    def _fail_open(self, error: EngineError) -> None:
        for events in list(self._open):
            if not events.done.done():
                events.put(error)
        self._on_group_lost(error)

    def group_report(self) -> dict[str, Any] | None:
        """The group this engine leads, for health, metrics and /v1/models (None when alone)."""
        layout = self.layout
        if layout is None:
            return None
        return {
            "world_size": layout.size,
            "parallel": layout.parallel,
            "backend": layout.backend,
            "rank_active_memory_bytes": list(self.stats.rank_memory_bytes),
            "lost": self.group_lost is not None and self.group_lost.is_set(),
        }

    def _on_group_lost(self, error: BaseException) -> None:
        if self.group_lost is not None:
            self.group_lost.set()

    async def stop(self) -> None:
        """Let running requests finish, then end the thread; later asks and submissions fail."""
        if self._thread is None:
            return
        self._inbox.put(Shutdown())
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self._fail_inbox()

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; raises PromptTooLongError at once if it cannot fit the context."""
        if self._closed:
            raise EngineError("the engine has stopped")
        loaded = self.model
        if request.model_fingerprint not in (None, loaded.fingerprint):
            raise ModelChangedError(f"the model changed to {loaded.name} while the request was prepared")
        limit = loaded.context_length
        num_prompt = len(request.prompt_tokens)
        if num_prompt == 0:
            raise ValueError("the prompt is empty")
        if num_prompt >= limit:
            raise PromptTooLongError(num_prompt, limit)
        if num_prompt + request.sampling.max_tokens > limit:
            request.sampling = msgspec.structs.replace(request.sampling, max_tokens=limit - num_prompt)
        events = EventChannel(asyncio.get_running_loop())
        if self.layout is not None:
            self._open.add(events)
        self._inbox.put(Submit(request, events))
        return RequestStream(request, events, self.cancel)

    def cancel(self, request_id: str) -> None:
        self._inbox.put(Cancel(request_id))

    async def ask(self, command: EngineAsk[T]) -> T:
        """Have the engine thread answer `command` between steps; its failure is raised here."""
        return await self.send(command)

    def send(self, command: EngineAsk[T]) -> asyncio.Future[T]:
        """Queue `command` now and return the future of its answer (its failure is raised there):
        what is queued after it, a submit, reaches the engine thread after it, in the same tick or
        a later one."""
        if self._loop is None or self._closed:
            raise EngineError("the engine is not running")
        reply: asyncio.Future[T] = self._loop.create_future()
        self._inbox.put(PendingAsk(command, reply, self._loop))
        return reply

    def _thread_main(self, core: LeaderLoop, ready: asyncio.Future[None]) -> None:
        assert self._loop is not None, "engine thread started without a loop: engine bug"
        try:
            core.run(ready)
        finally:
            # MLX leaves a thread's streams to be destroyed by hand before the thread ends; left to
            # the process's exit they sometimes abort it ("terminate called without an active exception").
            mx.clear_streams()
            self._loop.call_soon_threadsafe(self._fail_inbox)

    def _fail_inbox(self) -> None:
        """Loop side, once the thread is gone: fail whatever it left unread, so no caller waits forever."""
        self._closed = True
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            match message:
                case PendingAsk(reply=reply):
                    reject(reply, EngineError("the engine stopped before answering"))
                case Submit(events=events):
                    events.put(EngineError("the engine stopped before this request ran"))
