"""AgentSystem: the engine, the persistence actor and the agent actors, started and stopped together.

Usable from any asyncio program without HTTP (see actors/handle.py and scripts/embed_example.py):

    async with AgentSystem(SystemConfig()) as system:
        agent = await system.open("my-agent", system_prompt="You are terse.")
        async for text in agent.say("Hello"): ...
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
from loguru import logger

from semantic.actors.agent import AgentActor, Converse, Evict, Generate, Open
from semantic.actors.handle import AgentHandle
from semantic.actors.identity import validate_agent_id
from semantic.engine.chat_format import ChatFormat, ChatMessage
from semantic.engine.default_model import user_cache_dir
from semantic.engine.engine import Engine, EngineConfig, EngineError, RequestStream
from semantic.engine.loading import LoadedModel
from semantic.engine.messages import GenerationRequest
from semantic.engine.registry import ModelEntry, ModelRegistry
from semantic.engine.sampling import SamplingParams
from semantic.storage.cache_file import CacheIdentity, SerializedCache, from_tensors, to_tensors
from semantic.storage.conversation_file import ConversationRecord
from semantic.storage.persistence import PersistenceActor


@dataclass(frozen=True, slots=True)
class SystemConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    cache_dir: Path = field(default_factory=user_cache_dir)
    mailbox_size: int = 8
    persist_caches: bool = True
    # Models that requests may switch to, besides `engine.model`; alias glob -> model name ("" = loaded).
    extra_models: tuple[ModelEntry, ...] = ()
    model_aliases: Mapping[str, str] = field(default_factory=dict)
    swap_drain_timeout_s: float = 30.0  # running requests get this long to finish before a swap
    model_wait_s: float = 300.0  # requests wait this long for a swap or reload before failing
    idle_unload_s: float | None = None  # unload the model after this long without requests


class ModelUnavailableError(EngineError):
    """No model could be made ready in time for a request (a swap failed or took too long)."""


class ModelLoadError(ModelUnavailableError):
    """The requested model failed to load (the previous one, if any, was loaded back)."""


@dataclass(frozen=True, slots=True)
class SwapReport:
    """What one model transition did and how long each phase took."""

    from_model: str | None
    to_model: str | None
    drain_s: float = 0.0
    num_cancelled: int = 0
    flush_s: float = 0.0
    num_flushed: int = 0
    unload_s: float = 0.0
    load_s: float = 0.0
    total_s: float = 0.0
    active_memory_before_unload: int = 0
    active_memory_after_unload: int = 0
    active_memory_after_load: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class AgentInfo:
    agent_id: str
    num_cached_tokens: int
    tier: str
    last_used_s_ago: float | None


class AgentSystem:
    def __init__(self, config: SystemConfig) -> None:
        self.config = config
        self.registry = ModelRegistry(
            [ModelEntry.from_source(config.engine.model, config.engine.model_name), *config.extra_models],
            config.model_aliases,
        )
        self.engine = Engine(replace(config.engine, model_name=self.registry.initial.name))
        self.persistence: PersistenceActor | None = None
        self._agents: dict[str, AgentActor] = {}
        self._group: asyncio.TaskGroup | None = None
        self._pending_writes: set[asyncio.Task[list[str]]] = set()
        self._chat_format: ChatFormat | None = None
        # The model gate: which entry is loaded (None when unloaded), the transition under way.
        self.model_entry: ModelEntry | None = None
        self._last_entry = self.registry.initial
        self._transition: asyncio.Task[SwapReport] | None = None
        self.transition_target: str | None = None
        self.last_swap: SwapReport | None = None
        self.swap_history: list[SwapReport] = []
        self._last_used = time.monotonic()
        self._idle_watch: asyncio.Task[None] | None = None
        self.active_memory_before_load = 0  # MLX's, before the first model loaded

    @property
    def chat_format(self) -> ChatFormat:
        if self._chat_format is None:
            raise ModelUnavailableError("no model is loaded (it is being swapped or was unloaded)")
        return self._chat_format

    async def start(self) -> None:
        self.active_memory_before_load = mx.get_active_memory()
        await self.engine.start()
        await self._attach(self.registry.initial)
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        if self.config.idle_unload_s:
            self._idle_watch = asyncio.create_task(self._unload_when_idle(self.config.idle_unload_s))

    async def stop(self, flush: bool = True) -> None:
        """Stop every agent (queued asks fail), flush hot caches to disk, stop the engine."""
        if self._idle_watch is not None:
            self._idle_watch.cancel()
        if self._transition is not None:
            await asyncio.wait([self._transition])
        for actor in list(self._agents.values()):
            actor.stop_nowait()
        if self._group is not None:
            await self._group.__aexit__(None, None, None)
            self._group = None
        if self._pending_writes:
            await asyncio.gather(*self._pending_writes, return_exceptions=True)
        if flush and self.persistence is not None and self.engine.loaded is not None:
            written = await self.flush()
            logger.info("flushed {} agent caches to disk", len(written))
        await self.engine.stop()
        if self.persistence is not None:
            await self.persistence.stop()

    # ---- the model gate: every request passes here before it tokenizes ----

    @property
    def num_active_agents(self) -> int:
        return max(len(self._agents), self.engine.stats.num_agents_cached)

    @property
    def is_switching(self) -> bool:
        return self._transition is not None

    async def use_model(self, name: str | None = None) -> LoadedModel:
        """The loaded model once it is `name` (None: whichever is loaded, reloading after idle).

        Swaps when another registry model is named; requests arriving meanwhile wait here, up to
        `model_wait_s`. Raises ModelLoadError if it fails to load, ModelUnavailableError on timeout.
        """
        deadline = time.monotonic() + self.config.model_wait_s
        while True:
            self._last_used = time.monotonic()
            if self._transition is not None:
                await self._wait_for_transition(self._transition, deadline)
                continue
            wanted = self.registry.get(name) if name else None
            if self.engine.loaded is not None and wanted in (None, self.model_entry):
                return self.engine.loaded
            target = wanted or self._last_entry
            report = await self._wait_for_transition(self._begin_transition(target), deadline)
            if report.error is not None:
                raise ModelLoadError(report.error)

    async def swap_model(self, name: str) -> SwapReport | None:
        """Make `name` the loaded model now; the report of the swap, or None if it was loaded."""
        before = self.last_swap
        await self.use_model(name)
        return self.last_swap if self.last_swap is not before else None

    async def unload_model(self) -> SwapReport | None:
        """Flush the agents' caches and drop the model; the next request loads it again."""
        while self._transition is not None:
            await asyncio.wait([self._transition])
        if self.engine.loaded is None:
            return None
        return await self._begin_transition(None)

    def _begin_transition(self, target: ModelEntry | None) -> asyncio.Task[SwapReport]:
        assert self._transition is None
        self.transition_target = target.name if target is not None else None
        transition = asyncio.get_running_loop().create_task(self._switch_to(target))
        self._transition = transition

        def done(task: asyncio.Task[SwapReport]) -> None:
            if self._transition is task:
                self._transition = None
                self.transition_target = None

        transition.add_done_callback(done)
        return transition

    async def _wait_for_transition(self, transition: asyncio.Task[SwapReport], deadline: float) -> SwapReport:
        try:
            return await asyncio.wait_for(asyncio.shield(transition), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise ModelUnavailableError(
                f"waited {self.config.model_wait_s:.0f} s (the limit) for the model to switch to "
                f"{self.transition_target or 'unloaded'}"
            ) from None

    async def _switch_to(self, target: ModelEntry | None) -> SwapReport:
        """Drain, flush and unload the current model, then load `target` (the old one if that fails)."""
        started = time.perf_counter()
        old = self.model_entry
        report = SwapReport(old.name if old else None, target.name if target else None)
        if self.engine.loaded is not None:
            report = await self._detach(report)
        if target is not None:
            report = await self._load(target, old, report)
        report = replace(report, total_s=time.perf_counter() - started)
        logger.info(
            "{} {} -> {} in {:.2f} s (drain {:.2f}, flush {:.2f}, unload {:.2f}, load {:.2f})",
            "failed to switch" if report.error else "switched",
            report.from_model,
            report.to_model or "unloaded",
            report.total_s,
            report.drain_s,
            report.flush_s,
            report.unload_s,
            report.load_s,
        )
        self.last_swap = report
        self.swap_history = [*self.swap_history[-99:], report]
        return report

    async def _load(self, target: ModelEntry, fallback: ModelEntry | None, report: SwapReport) -> SwapReport:
        started = time.perf_counter()
        try:
            await self.engine.load(target.source, target.name)
            await self._attach(target)
        except Exception as error:
            message = f"could not load model {target.name!r} from {target.source!r}: {error}"
            logger.error("{}", message)
            if fallback is not None:
                await self.engine.load(fallback.source, fallback.name)
                await self._attach(fallback)
                message += f"; still serving {fallback.name!r}"
            return replace(report, error=message)
        return replace(
            report, load_s=time.perf_counter() - started, active_memory_after_load=mx.get_active_memory()
        )

    async def _attach(self, entry: ModelEntry) -> None:
        loaded = self.engine.model
        self._chat_format = ChatFormat(loaded.tokenizer)
        if self.config.persist_caches:
            identity = CacheIdentity(
                loaded.name, loaded.fingerprint, loaded.spec.block_size, loaded.spec.to_dict()
            )
            self.persistence = PersistenceActor(self.config.cache_dir, identity)
            await self.persistence.start()
            self.engine.serialize_evicted = to_tensors
            self.engine.on_evict = self._write_evicted
        self.model_entry = self._last_entry = entry

    async def _detach(self, report: SwapReport) -> SwapReport:
        """Let the batch finish (bounded), write every hot cache to disk, drop the model."""
        started = time.perf_counter()
        reason = f"the model is switching to {report.to_model or 'unloaded'}"
        num_cancelled = await self.engine.drain(self.config.swap_drain_timeout_s, reason)
        drained = time.perf_counter()
        if self._pending_writes:
            await asyncio.gather(*self._pending_writes, return_exceptions=True)
        written = await self.flush()
        flushed = time.perf_counter()
        memory_before = mx.get_active_memory()
        self._chat_format = None
        self.model_entry = None
        await self.engine.unload()
        if self.persistence is not None:
            await self.persistence.stop()
            self.persistence = None
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

    async def _unload_when_idle(self, idle_s: float) -> None:
        while True:
            await asyncio.sleep(min(idle_s / 4, 5.0))
            stats = self.engine.stats
            if stats.num_running or stats.num_waiting or self._transition is not None:
                self._last_used = time.monotonic()
                continue
            if self.engine.loaded is not None and time.monotonic() - self._last_used >= idle_s:
                logger.info("no requests for {:.0f} s: unloading {}", idle_s, self.engine.loaded.name)
                await self._begin_transition(None)

    def agent(self, agent_id: str) -> AgentActor:
        """The actor for `agent_id`, started on first use."""
        actor = self._agents.get(agent_id)
        if actor is None or actor.is_stopped:
            if self._group is None:
                raise RuntimeError("the agent system is not running")
            actor = AgentActor(self, validate_agent_id(agent_id), self.config.mailbox_size)
            self._agents[agent_id] = actor
            self._group.create_task(actor.run(), name=f"agent-{agent_id}")
        return actor

    def forget(self, actor: AgentActor) -> None:
        if self._agents.get(actor.agent_id) is actor:
            del self._agents[actor.agent_id]

    async def generate(
        self,
        agent_id: str | None,
        prompt_tokens: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        model_fingerprint: str | None = None,
    ) -> RequestStream:
        """Start a turn: through the agent's actor with an id, straight to the engine without one.

        `model_fingerprint` names the model `prompt_tokens` came from; if another model is loaded
        by the time the request reaches the engine, it fails with ModelChangedError.
        """
        request = GenerationRequest(request_id or uuid.uuid4().hex, list(prompt_tokens), sampling)
        request.model_fingerprint = model_fingerprint
        if agent_id is None:
            return self.engine.submit(request)
        stream: RequestStream = await self.agent(agent_id).ask(Generate(request))
        return stream

    async def restore_from_disk(self, agent_id: str) -> bool:
        """Load an agent's cache into the engine if it is on disk and not in memory."""
        persistence = self.persistence
        if persistence is None or not persistence.is_on_disk(agent_id):
            return False
        fingerprint = persistence.identity.fingerprint

        def loaded_here(engine: Engine) -> bool:
            return engine.loaded is not None and engine.loaded.fingerprint == fingerprint

        if await self.engine.call(lambda e: not loaded_here(e) or agent_id in e.store.agents):
            return False
        cache = await persistence.load(agent_id)
        if cache is None:
            return False

        def restore(engine: Engine) -> bool:
            if not loaded_here(engine):  # the model was swapped while the file was read
                return False
            spec = engine.model.spec
            snapshot = from_tensors(cache, spec.dtype, len(spec.full_layer_ids), len(spec.sliding_layer_ids))
            engine.store.restore(snapshot)
            return True

        return await self.engine.call(restore)

    async def evict_to_disk(self, agent_id: str) -> bool:
        """Write an agent's cache to disk and free its blocks; False if it had none in memory."""

        def take(engine: Engine) -> SerializedCache | None:
            if engine.loaded is None:
                return None
            store = engine.store
            agent = store.agents.get(agent_id)
            if agent is None or agent.num_running:
                return None
            serialized = to_tensors(store.snapshot(agent_id))
            store.drop(agent_id)
            return serialized

        serialized = await self.engine.call(take)
        if serialized is None or self.persistence is None:
            return False
        return bool(await self.persistence.save([serialized]))

    async def flush(self) -> list[str]:
        """Write every hot named agent's cache to disk (they stay in memory)."""
        if self.persistence is None:
            return []

        def snapshot_all(engine: Engine) -> list[SerializedCache]:
            if engine.loaded is None:
                return []
            store = engine.store
            return [to_tensors(store.snapshot(a)) for a in list(store.agents) if not a.startswith("anon-")]

        return await self.persistence.save(await self.engine.call(snapshot_all))

    async def forget_agent(self, agent_id: str) -> bool:
        """Stop the agent and drop its cache and conversation from memory and disk; False if unknown."""
        known = agent_id in self._agents or await self.agent_info(agent_id) is not None
        actor = self._agents.pop(agent_id, None)
        if actor is not None:
            actor.stop_nowait()

        def drop(engine: Engine) -> None:
            if engine.loaded is not None:
                engine.store.drop(agent_id)

        await self.engine.call(drop)
        if self.persistence is not None:
            await self.persistence.delete(agent_id)
        return known

    async def converse(
        self,
        agent_id: str,
        messages: list[ChatMessage],
        sampling: SamplingParams,
        request_id: str | None = None,
    ) -> RequestStream:
        """A stateful turn: the agent keeps the conversation; send only what is new."""
        stream: RequestStream = await self.agent(agent_id).ask(
            Converse(messages, sampling, request_id or uuid.uuid4().hex)
        )
        return stream

    async def open_agent(self, agent_id: str, system_prompt: str | None) -> None:
        """Create (or reset) an agent's kept conversation with a system prompt."""
        await self.agent(agent_id).ask(Open(system_prompt))

    async def open(self, agent_id: str, system_prompt: str | None = None, resume: bool = True) -> AgentHandle:
        """A handle on an agent for embedding: resumes its kept conversation if it has one."""
        await self.use_model()
        existing = await self.load_conversation(agent_id) if resume else None
        if existing is None:
            await self.open_agent(agent_id, system_prompt)
        return AgentHandle(self, agent_id)

    async def __aenter__(self) -> AgentSystem:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def save_conversation(self, agent_id: str, record: ConversationRecord) -> None:
        if self.persistence is not None:
            await self.persistence.save_conversation(agent_id, record)

    async def load_conversation(self, agent_id: str) -> ConversationRecord | None:
        if self.persistence is None:
            return None
        return await self.persistence.load_conversation(agent_id)

    async def list_agents(self, only: str | None = None) -> list[AgentInfo]:
        """Every known agent (or just `only`) with its cached tokens and where its cache is."""

        def wanted(agent_id: str) -> bool:
            return only is None or agent_id == only

        def in_memory(engine: Engine) -> list[AgentInfo]:
            if engine.loaded is None:
                return []
            now = time.monotonic()
            agents = engine.store.agents
            cached = agents.values() if only is None else [agents[only]] if only in agents else []
            return [AgentInfo(a.agent_id, a.num_tokens, "memory", now - a.last_used) for a in cached]

        infos = {info.agent_id: info for info in await self.engine.call(in_memory)}
        if self.persistence is not None:
            for agent_id in filter(wanted, self.persistence.agent_ids_on_disk - infos.keys()):
                cache_on_disk = self.persistence.is_on_disk(agent_id)
                infos[agent_id] = AgentInfo(agent_id, 0, "disk" if cache_on_disk else "none", None)
        for agent_id, actor in self._agents.items():
            if wanted(agent_id) and agent_id not in infos and actor.conversation is not None:
                infos[agent_id] = AgentInfo(agent_id, 0, "none", None)
        return sorted(infos.values(), key=lambda info: info.agent_id)

    async def agent_info(self, agent_id: str) -> AgentInfo | None:
        found = await self.list_agents(only=agent_id)
        return found[0] if found else None

    def _write_evicted(self, caches: list[SerializedCache]) -> None:
        assert self.persistence is not None
        task = asyncio.get_running_loop().create_task(self.persistence.save(caches))
        self._pending_writes.add(task)
        task.add_done_callback(self._pending_writes.discard)

    async def evict(self, agent_id: str) -> bool:
        result: bool = await self.agent(agent_id).ask(Evict())
        return result
