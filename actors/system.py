"""AgentSystem: the model host (engine, persistence) and the agent actors, started and stopped together.

Usable from any asyncio program without HTTP (see actors/handle.py and scripts/embed_example.py):

    async with AgentSystem(SystemConfig()) as system:
        agent = await system.open("my-agent", system_prompt="You are terse.")
        async for text in agent.say("Hello"): ...
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from semantic.actors.agent import AgentActor
from semantic.actors.agent_messages import EvictCache, IfExists, OpenConversation, StartTurn
from semantic.actors.cache_notes import CacheNotes
from semantic.actors.engine_client import Engine, EngineConfig
from semantic.actors.handle import AgentHandle
from semantic.actors.history_marks import HistoryMarks
from semantic.actors.model_registry import ModelEntry, ModelRegistry
from semantic.actors.models import ModelHost
from semantic.actors.restore_cost import RestoreCosts
from semantic.actors.turns import PromptBound, TurnRequest, TurnStarted, prepare_stateless
from semantic.engine.cache_store.cache_matching import is_anonymous
from semantic.engine.loop.commands import ListCaches
from semantic.engine.model.default_model import user_cache_dir
from semantic.storage.agent_id import AgentId


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
    checkpoint_idle_s: float | None = 120.0  # write changed caches after this long without requests
    actor_idle_s: float = 60.0  # an agent actor with an empty mailbox stops after this long
    max_prompt_tokens: int | None = None  # longer prompts are refused (the context also applies)
    disk_budget_mb: int | None = None  # agents' cache files per model; the least recently used go first


@dataclass(frozen=True, slots=True)
class AgentInfo:
    agent_id: str
    num_cached_tokens: int
    tier: str
    last_used_s_ago: float | None
    num_turns: int | None = None  # the direct API's kept conversation (asked of one agent only)


class AgentSystem:
    def __init__(self, config: SystemConfig, restore_costs: RestoreCosts | None = None) -> None:
        """`restore_costs`: the learnt rates that decide whether a returning agent's cache is read or
        computed (restore_cost.py); None learns them from scratch (tests pass fixed ones)."""
        self.config = config
        registry = ModelRegistry(
            [ModelEntry.from_source(config.engine.model, config.engine.model_name), *config.extra_models],
            config.model_aliases,
        )
        self.models = ModelHost(
            replace(config.engine, model_name=registry.initial.name),
            registry,
            config.cache_dir,
            persist_caches=config.persist_caches,
            disk_budget_mb=config.disk_budget_mb,
            swap_drain_timeout_s=config.swap_drain_timeout_s,
            model_wait_s=config.model_wait_s,
            idle_unload_s=config.idle_unload_s,
            checkpoint_idle_s=config.checkpoint_idle_s,
        )
        self._agents: dict[AgentId, AgentActor] = {}
        self._anonymous: set[AgentActor] = set()
        self._marks = HistoryMarks()  # outlives actors that idle out, so side requests still fork
        self.cache_notes = CacheNotes()  # why turns missed the cache: outlives actors, read by the API
        self.restore_costs = restore_costs if restore_costs is not None else RestoreCosts()
        self._group: asyncio.TaskGroup | None = None

    @property
    def engine(self) -> Engine:
        return self.models.engine

    @property
    def num_live_actors(self) -> int:
        return len(self._agents) + len(self._anonymous)

    @property
    def num_active_agents(self) -> int:
        return max(len(self._agents), self.engine.stats.num_agents_cached)

    async def start(self) -> None:
        await self.models.start()
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()

    async def stop(self, flush: bool = True) -> None:
        """Stop every agent (queued asks fail), flush hot caches to disk, stop the engine."""
        for actor in [*self._agents.values(), *self._anonymous]:
            actor.stop_nowait()
        if self._group is not None:
            await self._group.__aexit__(None, None, None)
            self._group = None
        await self.models.stop(flush=flush)

    async def __aenter__(self) -> AgentSystem:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # ---- the actors ----

    def _actor(self, agent_id: AgentId | None) -> AgentActor:
        """The actor for `agent_id` (started on first use), or a new one for an anonymous request."""
        if self._group is None:
            raise RuntimeError("the agent system is not running")
        actor = self._agents.get(agent_id) if agent_id is not None else None
        if actor is not None and not actor.is_stopped:
            return actor
        actor = AgentActor(
            agent_id,
            self.engine,
            self.models,
            self._retire,
            mailbox_size=self.config.mailbox_size,
            idle_s=self.config.actor_idle_s,
            max_prompt_tokens=self.config.max_prompt_tokens,
            marks=self._marks,
            cache_notes=self.cache_notes,
            restore_costs=self.restore_costs,
        )
        if agent_id is None:
            self._anonymous.add(actor)
        else:
            self._agents[agent_id] = actor
        self._group.create_task(actor.run(), name=f"agent-{agent_id or 'anonymous'}")
        return actor

    def _retire(self, actor: AgentActor) -> None:
        if actor.agent_id is None:
            self._anonymous.discard(actor)
        elif self._agents.get(actor.agent_id) is actor:
            del self._agents[actor.agent_id]

    # ---- what requests and embedding apps ask for ----

    async def start_turn(self, turn: TurnRequest) -> TurnStarted:
        """Hand a turn to its agent's actor; returns once it is in the engine."""
        reply = self._actor(turn.agent_id).ask(StartTurn(turn))
        try:
            started: TurnStarted = await reply
        except asyncio.CancelledError:
            # Cancelled (a client that left) after the actor answered but before this task resumed:
            # nobody else holds the stream, so end its generation here.
            if reply.done() and not reply.cancelled() and reply.exception() is None:
                reply.result().stream.cancel()
            raise
        return started

    async def count_tokens(self, turn: TurnRequest) -> int:
        session = await self.models.ready(turn.model, may_switch=turn.may_switch_model)
        loaded = session.loaded
        bound = PromptBound.of(loaded, self.config.max_prompt_tokens)
        prompt = await self.models.in_tokenizer_worker(prepare_stateless, session.chat, turn, bound)
        return len(prompt.token_ids)

    async def open_agent(
        self,
        agent_id: AgentId,
        system_prompt: str | None,
        if_exists: IfExists = "refuse",
    ) -> None:
        """Create an agent's kept conversation with a system prompt; where the agent exists already,
        `if_exists` says what happens (refuse: AgentExistsError). A system prompt that alone is
        obviously over the prompt limits is refused (PromptTooLongError, PromptLimitError) before
        anything is written."""
        if system_prompt:
            loaded = (await self.models.ready()).loaded
            PromptBound.of(loaded, self.config.max_prompt_tokens).refuse_obviously_long(system_prompt)
        await self._actor(AgentId(agent_id)).ask(OpenConversation(system_prompt, if_exists))

    async def open(self, agent_id: str, system_prompt: str | None = None, resume: bool = True) -> AgentHandle:
        """A handle on an agent for embedding: resumes its kept conversation if it has one."""
        agent = AgentId(agent_id)
        await self.open_agent(agent, system_prompt, "resume" if resume else "reset")
        return AgentHandle(self, agent)

    async def evict(self, agent_id: AgentId) -> bool:
        """Write an agent's cache to disk and free its memory; False if it had none in memory."""
        evicted: bool = await self._actor(AgentId(agent_id)).ask(EvictCache())
        return evicted

    async def forget(self, agent_id: AgentId) -> bool:
        """Drop an agent's cache and conversation from memory and disk: its running turn is
        cancelled and its queued turns fail (AgentDeletedError). False if the agent was unknown."""
        existed: bool = await self._actor(AgentId(agent_id)).ask_forget()
        return existed

    async def flush(self) -> list[str]:
        """Write every hot named agent's cache to disk (they stay in memory)."""
        return await self.models.flush()

    async def list_agents(self, only: AgentId | None = None) -> list[AgentInfo]:
        """Every known agent (or just `only`) with its cached tokens and where its cache is."""
        infos: dict[str, AgentInfo] = {}
        if self.engine.loaded is not None:
            for cached in await self.engine.ask(ListCaches(only)):
                if not is_anonymous(cached.agent_id):
                    infos[cached.agent_id] = AgentInfo(
                        cached.agent_id, cached.num_tokens, "memory", cached.last_used_s_ago
                    )
        persistence = self.models.persistence
        if persistence is not None:
            for agent_id, entry in (await persistence.on_disk(only)).items():
                if agent_id not in infos:
                    tier = "disk" if entry.has_cache else "none"
                    infos[agent_id] = AgentInfo(agent_id, entry.num_cached_tokens, tier, None)
        return sorted(infos.values(), key=lambda info: info.agent_id)

    async def agent_info(self, agent_id: AgentId) -> AgentInfo | None:
        """One agent, with its kept conversation's number of turns (0 for a chat API's agent)."""
        agent = AgentId(agent_id)
        found = await self.list_agents(only=agent)
        if not found:
            return None
        persistence = self.models.persistence
        conversation = await persistence.load_conversation(agent) if persistence is not None else None
        return replace(found[0], num_turns=conversation.num_turns if conversation is not None else 0)
