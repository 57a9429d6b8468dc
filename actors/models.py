"""The model host: which model is loaded, switching it, and what belongs to one loaded model.

Every turn passes `ready(name)` before it tokenizes: that returns a `ModelSession` (the loaded
model, its chat format and its persistence actor) once the named model is loaded, swapping to it
or reloading it after an idle unload. A transition drains the engine (bounded), flushes every hot
cache through the old model's persistence actor, unloads, and loads the new model (or the old one
back if that fails). Requests arriving meanwhile wait on the transition, up to `model_wait_s`.

A flush writes only the caches whose files do not hold them already (the file's tokens digest
against the cache's), one agent at a time. After `checkpoint_idle_s` without requests the host
flushes on its own: a crash then loses no cache that had been idle that long, and a stop or swap
writes only what changed since.

An unload keeps the model's persistence actor: the agents' folder, not the loaded model, says which
agents exist, so listing, reading and deleting agents work while no model is loaded. A stop wins
over a swap: once `begin_shutdown` is called, requests waiting for a model get ModelUnavailableError
(503) at once and a swap under way drains and flushes but loads nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
from loguru import logger

from semantic.actors.engine_client import Engine, EngineConfig
from semantic.actors.evicted_writes import EvictedWrites
from semantic.actors.model_registry import ModelEntry, ModelRegistry
from semantic.actors.model_session import (
    Holds,
    ModelLoadError,
    ModelSession,
    ModelSwitchForbiddenError,
    ModelUnavailableError,
    SwapReport,
)
from semantic.actors.prompting.chat_format import ChatFormat
from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.engine.decoding.grammar_matcher import GrammarCompiler
from semantic.engine.loop.commands import Drain, ListCaches, LoadModel, SnapshotCaches, UnloadModel
from semantic.storage.cache_file import identity_of
from semantic.storage.persistence import PersistenceActor

T = TypeVar("T")


class ModelHost:
    def __init__(
        self,
        engine_config: EngineConfig,
        registry: ModelRegistry,
        cache_dir: Path,
        persist_caches: bool = True,
        disk_budget_mb: int | None = None,
        swap_drain_timeout_s: float = 30.0,
        model_wait_s: float = 300.0,
        idle_unload_s: float | None = None,
        checkpoint_idle_s: float | None = None,
        num_tokenizer_workers: int = 2,
    ) -> None:
        self.registry = registry
        self.engine = Engine(engine_config, on_evicted=self._write_evicted)
        self.cache_dir = cache_dir
        self.persist_caches = persist_caches
        self.disk_budget_bytes = None if disk_budget_mb is None else disk_budget_mb * 2**20
        self.swap_drain_timeout_s = swap_drain_timeout_s
        self.model_wait_s = model_wait_s
        self.idle_unload_s = idle_unload_s
        self.checkpoint_idle_s = checkpoint_idle_s
        self.session: ModelSession | None = None
        self._parked: PersistenceActor | None = None  # the unloaded model's, until a load needs another
        self._shutdown = asyncio.Event()
        self.entry: ModelEntry | None = None
        self._last_entry = registry.initial
        self._transition: asyncio.Task[SwapReport] | None = None
        self.transition_target: str | None = None
        self.last_swap: SwapReport | None = None
        self.swap_history: list[SwapReport] = []
        self.evicted_writes = EvictedWrites(engine_config.cache_budget_mb * 2**20)
        self._last_used = time.monotonic()
        self._idle_watch: asyncio.Task[None] | None = None
        self._checkpoint_watch: asyncio.Task[None] | None = None
        self.last_checkpoint_at = -float("inf")  # monotonic; when the last idle checkpoint wrote a cache
        self.active_memory_before_load = 0
        # Turns between `ready` and their submit: a transition waits for them before it drains;
        # turns between their submit and their commit: it waits for them before the files close.
        self._leases = Holds()
        self._commits = Holds()
        # Templates and tokenizers run here, never on the event loop; a few at once, queued beyond.
        self._tokenizer = ThreadPoolExecutor(num_tokenizer_workers, thread_name_prefix="semantic-tokenize")

    @property
    def is_switching(self) -> bool:
        return self._transition is not None

    @property
    def persistence(self) -> PersistenceActor | None:
        """The loaded model's agents' folder, or while none is loaded, the last loaded model's."""
        return self.session.persistence if self.session is not None else self._parked

    @property
    def is_shutting_down(self) -> bool:
        return self._shutdown.is_set()

    def begin_shutdown(self) -> None:
        """From now on no model is loaded: waiting requests fail with 503 and a swap loads nothing."""
        self._shutdown.set()

    async def start(self) -> None:
        self.active_memory_before_load = mx.get_active_memory()
        await self.engine.start()
        await self._attach(self.registry.initial)
        if self.idle_unload_s:
            self._idle_watch = asyncio.create_task(self._unload_when_idle(self.idle_unload_s))
        if self.checkpoint_idle_s and self.persist_caches:
            self._checkpoint_watch = asyncio.create_task(self._checkpoint_when_idle(self.checkpoint_idle_s))

    async def stop(self, flush: bool = True) -> None:
        self.begin_shutdown()
        for watch in (self._idle_watch, self._checkpoint_watch):
            if watch is not None:
                watch.cancel()
        while self._transition is not None:
            await asyncio.wait([self._transition])
        await self._settle_writes()
        if flush and self.session is not None:
            written = await self.flush()
            logger.info("flushed {} agent caches to disk", len(written))
        await self.engine.stop()
        if self.persistence is not None:
            await self.persistence.stop()
        self._tokenizer.shutdown(wait=False, cancel_futures=True)

    async def in_tokenizer_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the tokenizer workers, off the event loop: templates and tokenizing, grammar
        compiles, cache explanations and heap releases."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer, fn, *args)

    async def ready(self, name: str | None = None, may_switch: bool = True) -> ModelSession:
        """The session of the model `name` resolves to (None: whichever is loaded), once loaded.
        Without `may_switch` only the loaded model, or the last one loaded back, is served.

        Raises UnknownModelError (not configured), ModelSwitchForbiddenError (another model without
        `may_switch`), ModelLoadError (it failed to load) or ModelUnavailableError (not ready within
        `model_wait_s`, or shutting down).
        """
        entry = self.registry.resolve(name)
        deadline = time.monotonic() + self.model_wait_s
        while True:
            if self._shutdown.is_set():
                raise ModelUnavailableError("the server is shutting down; retry shortly")
            self._last_used = time.monotonic()
            if self._transition is not None:
                await self._wait_for(self._transition, deadline)
                continue
            if self.session is not None and entry in (None, self.entry):
                return self.session
            target = entry or self._last_entry
            if not may_switch and target != self._last_entry:
                raise ModelSwitchForbiddenError(target.name, self._last_entry.name)
            report = await self._wait_for(self._begin(target), deadline)
            if report.error is not None and not self._shutdown.is_set():
                raise ModelLoadError(report.error)

    @contextlib.asynccontextmanager
    async def lease(self, name: str | None = None, may_switch: bool = True) -> AsyncIterator[ModelSession]:
        """`ready(name)`, and the model stays loaded until the block ends (a turn submits in it)."""
        session = await self.ready(name, may_switch)
        with self._leases.hold():
            yield session

    def committing(self) -> contextlib.AbstractContextManager[None]:
        """Held by a submitted turn until its conversation is saved; enter it inside `lease`."""
        return self._commits.hold()

    async def swap(self, name: str) -> SwapReport | None:
        """Make `name` the loaded model now; the report of the swap, or None if it was loaded."""
        before = self.last_swap
        await self.ready(name)
        return self.last_swap if self.last_swap is not before else None

    async def unload(self) -> SwapReport | None:
        """Flush the agents' caches and drop the model; the next request loads it again."""
        while self._transition is not None:
            await asyncio.wait([self._transition])
        if self.session is None:
            return None
        return await self._begin(None)

    async def flush(self) -> list[str]:
        """Write every hot named agent's cache that its file does not hold already (they stay in
        memory); the agents written. One agent at a time: one cache at once is copied out of the pool."""
        persistence = self.persistence
        if persistence is None or self.engine.loaded is None:
            return []
        on_disk = await persistence.on_disk()
        file_digests = {str(a): e.tokens_digest for a, e in on_disk.items() if e.has_cache}
        written: list[str] = []
        for cached in await self.engine.ask(ListCaches()):
            file_digest = file_digests.get(cached.agent_id, "")
            taken_at = time.monotonic()
            caches = await self.engine.ask(SnapshotCaches(cached.agent_id, file_digest))
            if caches:
                written += await persistence.save(caches, taken_at)
        return written

    def _begin(self, target: ModelEntry | None) -> asyncio.Task[SwapReport]:
        assert self._transition is None, "a transition is already under way: model host bug"
        self.transition_target = target.name if target is not None else None
        transition = asyncio.get_running_loop().create_task(self._switch_to(target))
        self._transition = transition
        transition.add_done_callback(self._transition_done)
        return transition

    def _transition_done(self, task: asyncio.Task[SwapReport]) -> None:
        if self._transition is task:
            self._transition = None
            self.transition_target = None

    async def _wait_for(self, transition: asyncio.Task[SwapReport], deadline: float) -> SwapReport:
        """The transition's report; a shutdown or the deadline ends the wait (503), not the transition."""
        shutdown = asyncio.ensure_future(self._shutdown.wait())
        try:
            await asyncio.wait(
                [transition, shutdown],
                timeout=max(0.0, deadline - time.monotonic()),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            shutdown.cancel()
        if transition.done():
            return transition.result()
        if self._shutdown.is_set():
            raise ModelUnavailableError(
                f"the server is shutting down; the switch to {self.transition_target or 'unloaded'} "
                "is abandoned; retry shortly"
            )
        raise ModelUnavailableError(
            f"waited {self.model_wait_s:.0f} s (the limit) for the model to switch to "
            f"{self.transition_target or 'unloaded'}"
        )

    async def _switch_to(self, target: ModelEntry | None) -> SwapReport:
        """Drain, flush and unload the current model, then load `target` (the old one if that fails)."""
        started = time.perf_counter()
        old = self.entry
        report = SwapReport(old.name if old else None, target.name if target else None)
        if self.session is not None:
            report = await self._detach(report, keeps_files=target is None)
        if target is not None and self._shutdown.is_set():
            report = replace(report, error="abandoned: the server is shutting down")
        elif target is not None:
            report = await self._load(target, old, report)
        report = replace(report, total_s=time.perf_counter() - started)
        logger.info(
            "{} {} -> {} in {:.2f} s (drain {:.2f}, flush {:.2f}, unload {:.2f}, load {:.2f}){}",
            "failed to switch" if report.error else "switched",
            report.from_model,
            report.to_model or "unloaded",
            report.total_s,
            report.drain_s,
            report.flush_s,
            report.unload_s,
            report.load_s,
            f": {report.error}" if report.error else "",
        )
        self.last_swap = report
        self.swap_history = [*self.swap_history[-99:], report]
        return report

    async def _load(self, target: ModelEntry, fallback: ModelEntry | None, report: SwapReport) -> SwapReport:
        started = time.perf_counter()
        try:
            await self.engine.ask(LoadModel(target.source, target.name))
            await self._attach(target)
        except Exception as error:
            message = f"could not load model {target.name!r} from {target.source!r}: {error}"
            logger.error("{}", message)
            if fallback is not None:
                await self.engine.ask(LoadModel(fallback.source, fallback.name))
                await self._attach(fallback)
                message += f"; still serving {fallback.name!r}"
            return replace(report, error=message)
        return replace(
            report, load_s=time.perf_counter() - started, active_memory_after_load=mx.get_active_memory()
        )

    async def _attach(self, entry: ModelEntry) -> None:
        loaded = self.engine.model
        persistence, parked = None, self._parked
        self._parked = None
        if parked is not None and self.persist_caches and parked.identity == identity_of(loaded):
            persistence = parked  # the same model loaded back: its folder's actor never stopped
        elif self.persist_caches:
            if parked is not None:
                await parked.stop()
            persistence = PersistenceActor(self.cache_dir, identity_of(loaded), self.disk_budget_bytes)
            await persistence.start()
        grammars = GrammarCompiler(loaded.tokenizer, sorted(loaded.eos_token_ids))
        self.session = ModelSession(loaded, ChatFormat(loaded.tokenizer), persistence, grammars)
        self.entry = self._last_entry = entry

    async def _detach(self, report: SwapReport, keeps_files: bool) -> SwapReport:
        """Let the batch finish (bounded), write every hot cache to disk, drop the model; with
        `keeps_files` (an unload) its persistence actor stays, for the agents' folder."""
        started = time.perf_counter()
        await self._leases.none_held()  # turns that got the model submit first; new ones wait for us
        reason = f"the model is switching to {report.to_model or 'unloaded'}"
        num_cancelled = await self.engine.ask(Drain(self.swap_drain_timeout_s, reason))
        await self._commits.none_held()  # their conversations are saved before persistence stops
        drained = time.perf_counter()
        await self._settle_writes()
        written = await self.flush()
        flushed = time.perf_counter()
        memory_before = mx.get_active_memory()
        persistence = self.session.persistence if self.session is not None else None
        self.session = self.entry = None  # no reference to the model may outlive the unload
        if keeps_files:
            self._parked = persistence
        elif persistence is not None:
            await persistence.stop()
        await self.engine.ask(UnloadModel())
        return replace(
            report,
            drain_s=drained - started,
            num_cancelled=num_cancelled,
            flush_s=flushed - drained,
            num_flushed=len(written),
            unload_s=time.perf_counter() - flushed,
            active_memory_before_unload=memory_before,
            active_memory_after_unload=mx.get_active_memory(),
        )

    def _quiet_for_s(self) -> float:
        """Seconds since a request last ran (0 while one runs or waits, or the model switches)."""
        stats = self.engine.stats
        if stats.num_running or stats.num_waiting or self._transition is not None:
            self._last_used = time.monotonic()
        return time.monotonic() - self._last_used

    async def _unload_when_idle(self, idle_s: float) -> None:
        while True:
            await asyncio.sleep(min(idle_s / 4, 5.0))
            if self.session is not None and self._quiet_for_s() >= idle_s and not self._shutdown.is_set():
                logger.info("no requests for {:.0f} s: unloading {}", idle_s, self.session.loaded.name)
                await self._begin(None)

    async def _checkpoint_when_idle(self, quiet_s: float) -> None:
        """Flush once the server has had no requests for `quiet_s`, once per quiet spell. Holding a
        lease, so that a swap or unload waits for it rather than closing the files under it."""
        checkpointed_at = time.monotonic()
        while True:
            await asyncio.sleep(min(quiet_s / 4, 5.0))
            if self._quiet_for_s() < quiet_s or self.session is None or self._last_used <= checkpointed_at:
                continue  # busy, unloaded, or checkpointed in this quiet spell already
            checkpointed_at = time.monotonic()
            started = time.perf_counter()
            try:
                with self._leases.hold():
                    await self._settle_writes()
                    written = await self.flush()
            except Exception as error:  # a failed write is logged by persistence; keep watching
                logger.warning("checkpoint failed: {}", error)
                continue
            if written:
                self.last_checkpoint_at = time.monotonic()
                logger.info(
                    "checkpoint after {:.0f} s without requests: wrote {} agent caches in {:.2f} s",
                    quiet_s,
                    len(written),
                    time.perf_counter() - started,
                )

    def _write_evicted(self, caches: list[SerializedCache]) -> None:
        """Event loop: the engine evicted these caches to make room; write them to disk."""
        persistence = self.persistence
        if persistence is None:
            logger.warning("dropping {} evicted caches: no persistence for this model", len(caches))
            return
        self.evicted_writes.hand(caches, persistence)

    async def _settle_writes(self) -> None:
        await self.evicted_writes.settle()
