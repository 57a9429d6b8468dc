"""The engine: one thread owns the model, the BatchGenerator, the MLX stream and the block pool.

The asyncio side talks to it only through `submit`, `cancel` and `call`. The thread blocks on its
inbox while idle; while work is in flight it runs ticks of at least `tick_s`: admit what fits,
step the batch once, post every request's new events with one `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import gc
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import mlx.core as mx
from loguru import logger
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from semantic.engine.agent_cache import AgentCacheStore, CacheSnapshot
from semantic.engine.block_pool import BlockPool
from semantic.engine.loading import LoadedModel, load_model
from semantic.engine.messages import (
    Call,
    Cancel,
    Command,
    Event,
    EventChannel,
    Finished,
    FinishReason,
    GenerationRequest,
    PromptProgress,
    PromptStarted,
    Shutdown,
    Submit,
    TokenDelta,
)
from semantic.engine.sampling import SamplingParams, make_sampler
from semantic.engine.text_stream import TextStream

T = TypeVar("T")


class EngineError(RuntimeError):
    pass


class ModelChangedError(EngineError):
    """The request was tokenized for a model that has since been swapped out; retry it."""


class PromptTooLongError(ValueError):
    def __init__(self, num_tokens: int, limit: int) -> None:
        super().__init__(
            f"prompt has {num_tokens} tokens; the model's context holds {limit} "
            "(at least 1 must be left to generate)"
        )
        self.num_tokens = num_tokens
        self.limit = limit


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "default"
    model_name: str | None = None  # served under this name; None: derived from `model`
    block_size: int = 256
    cache_budget_mb: int = 4096
    max_batch_size: int = 16
    prefill_batch_size: int | None = None  # None: 1 on the CPU, 8 on a GPU
    prefill_step_size: int | None = None  # None: 512 on the CPU, 2048 on a GPU
    # Waiting prompts are admitted shortest uncached part first; one waiting this long goes first.
    shortest_first_max_wait_s: float = 60.0
    tick_s: float = 0.010
    default_dtype: str = "float32"


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    pool_used_bytes: int = 0
    pool_budget_bytes: int = 0
    num_agents_cached: int = 0
    num_evictions: int = 0


@dataclass(slots=True)
class _Drain:
    deadline: float
    reason: str
    reply: asyncio.Future[int]
    loop: asyncio.AbstractEventLoop


@dataclass(slots=True)
class _Running:
    request: GenerationRequest
    events: EventChannel
    agent_id: str
    text: TextStream
    reserved_block_ids: list[int]
    num_cached_tokens: int
    generated_token_ids: list[int] = field(default_factory=list)
    outbox: list[Event] = field(default_factory=list)
    published_block_ids: list[int] = field(default_factory=list)  # its prompt's blocks, shared early


class RequestStream:
    """The asyncio side of one request: iterate its events; `cancel` frees its batch slot."""

    def __init__(self, engine: Engine, request: GenerationRequest, events: EventChannel) -> None:
        self.engine = engine
        self.request = request
        self._events = events
        self.finished: Finished | None = None
        self.observers: list[Callable[[Event], None]] = []  # see every event as it is read

    @property
    def done(self) -> asyncio.Future[Finished | BaseException]:
        """Resolves with the last event when the engine is done with this request, whoever reads."""
        return self._events.done

    def cancel(self) -> None:
        if self.finished is None:
            self.engine.cancel(self.request.request_id)

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (raised to its reader) and free its batch slot."""
        if self.finished is None:
            self._events.put(error)
            self.cancel()

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            while self.finished is None:
                event = await self._events.queue.get()
                for observe in self.observers:
                    observe(event)
                if isinstance(event, BaseException):
                    self.finished = Finished(FinishReason.CANCELLED, None, 0, 0, 0)
                    raise event
                if isinstance(event, Finished):
                    self.finished = event
                yield event
        finally:
            self.cancel()


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.loaded: LoadedModel | None = None
        self.stats = EngineStats()
        # Set by the owner: evicted caches are serialized on the engine thread, then handed over.
        self.serialize_evicted: Callable[[CacheSnapshot], Any] | None = None
        self.on_evict: Callable[[list[Any]], None] | None = None
        # Engine-thread state below.
        self._waiting: deque[Submit] = deque()
        self._running: dict[int, _Running] = {}
        self._cancelled: set[str] = set()
        self._generator: BatchGenerator | None = None
        self._pool: BlockPool | None = None
        self._store: AgentCacheStore | None = None
        self._stream: Any = None
        self._pending: list[tuple[EventChannel, list[Event]]] = []
        self._drain: _Drain | None = None

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
        ready: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="semantic-engine", daemon=True)
        self._thread.start()
        await ready

    async def load(self, source: str, name: str | None = None) -> LoadedModel:
        """Load a model into an engine that has none (after `unload`); raises its load error."""

        def load(engine: Engine) -> LoadedModel:
            if engine.loaded is not None:
                raise EngineError(f"{engine.loaded.name} is still loaded; unload it first")
            engine._load(source, name)
            return engine.model

        return await self.call(load)

    async def unload(self) -> None:
        """Drop the model, its batch and its block pool, and give MLX's memory back (engine idle)."""
        await self.call(Engine._unload)

    async def drain(self, timeout_s: float, reason: str) -> int:
        """Wait until nothing runs or waits; past `timeout_s` fail what is left. Returns how many failed.

        The caller stops new submissions first (the agent system's model gate does).
        """
        assert self._loop is not None, "engine not started"
        reply: asyncio.Future[int] = self._loop.create_future()
        drain = _Drain(time.perf_counter() + timeout_s, reason, reply, self._loop)
        await self.call(lambda engine: setattr(engine, "_drain", drain))
        return await reply

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._inbox.put(Shutdown())
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; raises PromptTooLongError at once if it cannot fit the context."""
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
            sampling = request.sampling
            request.sampling = SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_tokens=limit - num_prompt,
                stop=sampling.stop,
                seed=sampling.seed,
            )
        events = EventChannel(asyncio.get_running_loop())
        self._inbox.put(Submit(request, events))
        return RequestStream(self, request, events)

    def cancel(self, request_id: str) -> None:
        self._inbox.put(Cancel(request_id))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps (for state only the thread may touch)."""
        assert self._loop is not None, "engine not started"
        reply: asyncio.Future[Any] = self._loop.create_future()
        self._inbox.put(Call(fn, reply, self._loop))
        return await reply

    # ---- engine thread ----

    @property
    def store(self) -> AgentCacheStore:
        assert self._store is not None, "store used before the model loaded: engine bug"
        return self._store

    def _run(self, ready: asyncio.Future[None]) -> None:
        assert self._loop is not None
        try:
            self._stream = mx.new_stream(mx.default_device())
            with mx.stream(self._stream):
                self._load(self.config.model, self.config.model_name)
        except BaseException as error:
            logger.exception("model load failed")
            self._loop.call_soon_threadsafe(_set_exception, ready, error)
            return
        self._loop.call_soon_threadsafe(_set_result, ready, None)
        with mx.stream(self._stream):
            self._serve()
        self._close()

    def _load(self, source: str, name: str | None) -> None:
        config = self.config
        self.loaded = load_model(source, config.block_size, config.default_dtype, name)
        spec = self.loaded.spec
        self._pool = BlockPool.from_budget(
            config.cache_budget_mb * 2**20, spec.bytes_per_block, spec.block_size
        )
        model = self.loaded.model
        self._store = AgentCacheStore(spec, self._pool, lambda: make_prompt_cache(model))
        self._generator = self._new_generator()
        self.stats.pool_budget_bytes = self._pool.budget_bytes
        logger.info(
            "loaded {} ({} layers, {} KV heads, head dim {}, {}); pool {} blocks of {} tokens = {:.0f} MiB",
            self.loaded.name,
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            spec.dtype,
            self._pool.num_blocks,
            spec.block_size,
            self._pool.budget_bytes / 2**20,
        )

    def _new_generator(self) -> BatchGenerator:
        loaded = self.model
        step = self.config.prefill_step_size or (512 if mx.default_device() == mx.cpu else 2048)
        return BatchGenerator(
            loaded.model,
            stop_tokens=[[t] for t in loaded.eos_token_ids],
            completion_batch_size=self.config.max_batch_size,
            prefill_batch_size=self._prefill_batch_size,
            prefill_step_size=step,
            stream=self._stream,
        )

    @property
    def _prefill_batch_size(self) -> int:
        """Prompts prefilled together. On the CPU one at a time: prefill is compute-bound there, so a
        batch only makes every prompt in it wait for the slowest (and pads the shorter ones)."""
        size = self.config.prefill_batch_size or (1 if mx.default_device() == mx.cpu else 8)
        return max(1, min(size, self.config.max_batch_size))

    def _unload(self) -> None:
        if self._running or self._waiting:
            raise EngineError("cannot unload while requests run or wait; drain first")
        if self._generator is not None:
            self._generator.close()
        name = self.loaded.name if self.loaded is not None else None
        self._generator = self._store = self._pool = None
        self.loaded = None
        self.stats.pool_budget_bytes = self.stats.pool_used_bytes = self.stats.num_agents_cached = 0
        gc.collect()
        mx.clear_cache()
        logger.info("unloaded {}; MLX active memory now {:.1f} MiB", name, mx.get_active_memory() / 2**20)

    def _check_drain(self) -> None:
        drain = self._drain
        if drain is None:
            return
        failed = 0
        if (self._running or self._waiting) and time.perf_counter() >= drain.deadline:
            error = EngineError(f"cancelled: {drain.reason}, and the drain timeout passed")
            for submit in self._waiting:
                self._post(submit.events, error)
            failed += len(self._waiting)
            self._waiting.clear()
            if self._running:
                assert self._generator is not None
                self._generator.remove(list(self._running))
            for uid in list(self._running):
                running = self._running.pop(uid)
                self._release(running)
                self._post_many(running.events, [*running.outbox, error])
                failed += 1
        if not (self._running or self._waiting):
            self._drain = None
            self._flush()  # every request's last events reach the loop before the drain's reply
            drain.loop.call_soon_threadsafe(_set_result, drain.reply, failed)

    def _close(self) -> None:
        for submit in self._waiting:
            self._post(submit.events, EngineError("the engine stopped before this request ran"))
        for uid in list(self._running):
            self._finish(uid, FinishReason.CANCELLED, from_generator=False)
        self._flush()
        if self._generator is not None:
            self._generator.close()

    def _serve(self) -> None:
        stopping = False
        while not (stopping and not self._running and not self._waiting):
            tick_start = time.perf_counter()
            stopping |= self._handle_commands(block=not (self._running or self._waiting))
            if self.loaded is not None:
                self._admit()
                if self._running:
                    self._step()
            self._flush()
            self._check_drain()
            self._update_stats()
            if self._running or self._waiting:
                remaining = self.config.tick_s - (time.perf_counter() - tick_start)
                if remaining > 0:
                    stopping |= self._handle_commands(block=True, timeout=remaining)

    def _handle_commands(self, block: bool, timeout: float | None = None) -> bool:
        stopping = False
        try:
            command: Command | None = self._inbox.get(block=block, timeout=timeout)
        except queue.Empty:
            return False
        while command is not None:
            match command:
                case Submit():
                    self._waiting.append(command)
                case Cancel(request_id=request_id):
                    self._cancel(request_id)
                case Call(fn=fn, reply=reply, loop=loop):
                    try:
                        result = fn(self)  # type: ignore[operator]
                    except Exception as error:
                        loop.call_soon_threadsafe(_set_exception, reply, error)
                    else:
                        loop.call_soon_threadsafe(_set_result, reply, result)
                case Shutdown():
                    stopping = True
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                command = None
        return stopping

    def _cancel(self, request_id: str) -> None:
        for submit in self._waiting:
            if submit.request.request_id == request_id:
                self._waiting.remove(submit)
                self._post(
                    submit.events,
                    Finished(FinishReason.CANCELLED, None, len(submit.request.prompt_tokens), 0, 0),
                )
                return
        for uid, running in self._running.items():
            if running.request.request_id == request_id:
                assert self._generator is not None
                self._generator.remove([uid])
                self._finish(uid, FinishReason.CANCELLED, from_generator=False)
                return

    def _admit(self) -> None:
        """Start the next prompt batch once the last one is prefilled, shortest uncached part first."""
        assert self._pool is not None and self._generator is not None
        slots = min(self.config.max_batch_size - len(self._running), self._prefill_batch_size)
        if not self._waiting or slots <= 0 or self._is_prefilling():
            return
        spec = self.model.spec
        for submit in self._admission_order():
            if slots <= 0:
                return
            request = submit.request
            if request.model_fingerprint not in (None, self.model.fingerprint):
                self._waiting.remove(submit)
                self._post(submit.events, ModelChangedError("the model changed while the request waited"))
                continue
            needed = spec.num_blocks_for(len(request.prompt_tokens) + request.sampling.max_tokens)
            if needed > self._pool.num_blocks:
                self._waiting.remove(submit)
                self._post(
                    submit.events,
                    ValueError(
                        f"request needs {needed} KV blocks ({len(request.prompt_tokens)} prompt + "
                        f"{request.sampling.max_tokens} new tokens) but the cache budget holds "
                        f"{self._pool.num_blocks}"
                    ),
                )
                continue
            if not self._pool.can_allocate(needed):
                self._evict(needed)
                if not self._pool.can_allocate(needed):
                    return
            self._waiting.remove(submit)
            slots -= 1
            try:
                self._insert(submit, self._pool.allocate(needed))
            except Exception as error:
                logger.exception("request {} failed at admission", request.request_id)
                self._post(submit.events, error)

    def _admission_order(self) -> list[Submit]:
        """Waiting requests by the tokens they still have to prefill, fewest first, so a returning
        agent's short turn is not queued behind cold prompts; past `shortest_first_max_wait_s` a
        request goes ahead in arrival order, so none waits forever."""
        now = time.monotonic()
        limit = self.config.shortest_first_max_wait_s
        overdue = [s for s in self._waiting if now - s.queued_at >= limit]
        rest = [s for s in self._waiting if now - s.queued_at < limit]
        store = self.store

        def uncached(submit: Submit) -> int:
            prompt = submit.request.prompt_tokens
            return len(prompt) - store.num_reusable(submit.request.agent_id, prompt)

        return overdue + sorted(rest, key=uncached)

    def _is_prefilling(self) -> bool:
        """Whether the generator still has a prompt batch to prefill (in chunks of `prefill_step_size`).

        A prompt inserted now would join that batch left-padded to the tokens it has already
        processed, which costs more than waiting for its last chunk; measured here, four
        1,200-token prompts arriving 0.15 s apart took 43 s that way against 32 s arriving together.
        Holding prompts here until then also lets `_admission_order` pick among all that arrived.
        """
        generator = self._generator
        return bool(
            getattr(generator, "_currently_processing", None)
            or getattr(generator, "_unprocessed_sequences", None)
        )

    def _evict(self, num_blocks: int) -> None:
        evicted = self.store.evict_until(num_blocks)
        if evicted:
            logger.info("evicted {} agent caches to free {} blocks", len(evicted), num_blocks)

    def _hand_over_evicted(self) -> None:
        evicted, self.store.evicted = self.store.evicted, []
        if not evicted:
            return
        self.stats.num_evictions += len(evicted)
        if self.on_evict is None or self.serialize_evicted is None or self._loop is None:
            return
        # Anonymous agents are matched by content in memory only; their ids do not survive a restart.
        serialized = [self.serialize_evicted(s) for s in evicted if not s.agent_id.startswith("anon-")]
        if serialized:
            self._loop.call_soon_threadsafe(self.on_evict, serialized)

    def _insert(self, submit: Submit, reserved: list[int]) -> None:
        assert self._generator is not None and self._pool is not None
        request = submit.request
        loaded = self.model
        store = self.store
        try:
            agent_id = store.resolve_agent_id(request.agent_id, request.prompt_tokens)
            prepared = store.prepare(agent_id, request.prompt_tokens)
            if request.cache_tier_hint and prepared.num_cached_tokens:
                prepared.tier = request.cache_tier_hint
            sampler = make_sampler(request.sampling, loaded.vocab_size)
            (uid,) = self._generator.insert(
                [request.prompt_tokens[prepared.num_cached_tokens :]],
                max_tokens=[request.sampling.max_tokens],
                caches=[prepared.caches],
                all_tokens=[list(request.prompt_tokens[: prepared.num_cached_tokens])],
                samplers=[sampler],  # type: ignore[list-item]
            )
        except BaseException:
            self._pool.free(reserved)
            raise
        store.pin(agent_id)
        text = TextStream(loaded.tokenizer.detokenizer, request.sampling.stop, loaded.eos_token_ids)
        self._running[uid] = _Running(
            request, submit.events, agent_id, text, reserved, prepared.num_cached_tokens
        )
        self.stats.num_prompt_tokens += len(request.prompt_tokens)
        self.stats.num_cached_tokens += prepared.num_cached_tokens
        self._post(
            submit.events,
            PromptStarted(len(request.prompt_tokens), prepared.num_cached_tokens, prepared.tier),
        )

    def _step(self) -> None:
        assert self._generator is not None
        try:
            prompt_responses, generation_responses = self._generator.next()
        except Exception as error:
            logger.exception("batch step failed; failing {} requests", len(self._running))
            for uid in list(self._running):
                failed = self._running.pop(uid)
                self._release(failed)
                self._post(failed.events, EngineError(f"generation failed: {error}"))
            self._generator = self._new_generator()
            return
        self.stats.num_steps += 1
        for progress in prompt_responses:
            prefilling = self._running.get(progress.uid)
            if prefilling is None:
                continue
            if progress.end_of_prompt:
                self._publish_prompt(progress.uid, prefilling)
            else:
                done, total = progress.progress
                prefilling.outbox.append(PromptProgress(done, total))
        for response in generation_responses:
            running = self._running.get(response.uid)
            if running is None:
                continue
            running.generated_token_ids.append(response.token)
            self.stats.num_generated_tokens += 1
            text = running.text.add_token(response.token)
            running.outbox.append(TokenDelta([response.token], text))
            if response.finish_reason is not None:
                reason = FinishReason.LENGTH if response.finish_reason == "length" else FinishReason.STOP
                self._finish(
                    response.uid,
                    reason,
                    from_generator=True,
                    cache=(response.prompt_cache, response.all_tokens),
                )
            elif running.text.stop_hit is not None:
                removed = self._generator.remove([response.uid], return_prompt_caches=True)
                self._finish(
                    response.uid, FinishReason.STOP, from_generator=True, cache=removed.get(response.uid)
                )

    def _publish_prompt(self, uid: int, running: _Running) -> None:
        """Share a prompt's full blocks once it is prefilled, not when its reply ends: agents that
        arrive together with one system prompt then prefill it once, not once each."""
        assert self._generator is not None
        size = self.model.spec.block_size
        prompt = running.request.prompt_tokens
        num_blocks = (len(prompt) - 1) // size  # blocks whose tokens are all in the cache by now
        if num_blocks <= running.num_cached_tokens // size or self.model.spec.has_sliding_layers:
            return
        extracted = self._generator.extract_cache([uid]).get(uid)
        if extracted is None:
            return
        try:
            running.published_block_ids = self.store.publish_prefix(
                prompt[: num_blocks * size], extracted[0], running.reserved_block_ids
            )
        except Exception:
            logger.exception("could not share the prompt blocks of request {}", running.request.request_id)

    def _finish(
        self, uid: int, reason: FinishReason, from_generator: bool, cache: tuple[Any, Any] | None = None
    ) -> None:
        running = self._running.pop(uid)
        tail = running.text.finish() if reason is not FinishReason.CANCELLED else ""
        if tail:
            running.outbox.append(TokenDelta([], tail))
        spare = running.reserved_block_ids
        if from_generator and cache is not None and cache[0] is not None:
            layer_caches, tokens = cache
            try:
                spare = self.store.store(running.agent_id, list(tokens), layer_caches, spare)
            except Exception:
                logger.exception("could not keep the cache of agent {}", running.agent_id)
        running.reserved_block_ids = spare
        self._release(running)
        running.outbox.append(
            Finished(
                reason,
                running.text.stop_hit,
                len(running.request.prompt_tokens),
                running.num_cached_tokens,
                len(running.generated_token_ids),
                running.generated_token_ids,
            )
        )
        self._post_many(running.events, running.outbox)
        running.outbox = []

    def _release(self, running: _Running) -> None:
        assert self._pool is not None
        self._pool.free(running.reserved_block_ids)
        self._pool.free(running.published_block_ids)
        running.reserved_block_ids = running.published_block_ids = []
        self.store.unpin(running.agent_id)

    def _post(self, events: EventChannel, event: Event) -> None:
        self._pending.append((events, [event]))

    def _post_many(self, events: EventChannel, batch: list[Event]) -> None:
        if batch:
            self._pending.append((events, list(batch)))

    def _flush(self) -> None:
        if self._store is not None:
            self._hand_over_evicted()
        for running in self._running.values():
            if running.outbox:
                self._pending.append((running.events, running.outbox))
                running.outbox = []
        if self._pending and self._loop is not None:
            pending, self._pending = self._pending, []
            self._loop.call_soon_threadsafe(_deliver, pending)

    def _update_stats(self) -> None:
        if self._pool is None:
            return
        self.stats.num_running = len(self._running)
        self.stats.num_waiting = len(self._waiting)
        self.stats.pool_used_bytes = self._pool.used_bytes
        self.stats.num_agents_cached = len(self.store.agents)


def _deliver(pending: list[tuple[EventChannel, list[Event]]]) -> None:
    for events, batch in pending:
        for event in batch:
            events.put(event)


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
