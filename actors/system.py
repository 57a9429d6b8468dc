"""AgentSystem: the engine, the persistence actor and the agent actors, started and stopped together.

Usable from any asyncio program without HTTP:

    system = AgentSystem(SystemConfig())
    await system.start()
    stream = await system.generate("my-agent", prompt_tokens, SamplingParams(max_tokens=64))
    async for event in stream: ...
    await system.stop()
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from actors.agent import AgentActor, Converse, Evict, Generate, Open
from actors.identity import validate_agent_id
from engine.agent_cache import CacheSnapshot
from engine.chat_format import ChatFormat, ChatMessage
from engine.default_model import user_cache_dir
from engine.engine import Engine, EngineConfig, RequestStream
from engine.messages import GenerationRequest
from engine.sampling import SamplingParams
from storage.cache_file import CacheIdentity, SerializedCache, from_tensors, to_tensors
from storage.conversation_file import ConversationRecord
from storage.persistence import PersistenceActor


@dataclass(frozen=True, slots=True)
class SystemConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    cache_dir: Path = field(default_factory=user_cache_dir)
    mailbox_size: int = 8
    persist_caches: bool = True


@dataclass(frozen=True, slots=True)
class AgentInfo:
    agent_id: str
    num_cached_tokens: int
    tier: str
    last_used_s_ago: float | None


class AgentSystem:
    def __init__(self, config: SystemConfig) -> None:
        self.config = config
        self.engine = Engine(config.engine)
        self.persistence: PersistenceActor | None = None
        self._agents: dict[str, AgentActor] = {}
        self._group: asyncio.TaskGroup | None = None
        self._pending_writes: set[asyncio.Task[list[str]]] = set()
        self._chat_format: ChatFormat | None = None

    @property
    def chat_format(self) -> ChatFormat:
        assert self._chat_format is not None, "chat_format used before start(): caller bug"
        return self._chat_format

    async def start(self) -> None:
        await self.engine.start()
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
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()

    async def stop(self, flush: bool = True) -> None:
        """Stop every agent (queued asks fail), flush hot caches to disk, stop the engine."""
        for actor in list(self._agents.values()):
            actor.stop_nowait()
        if self._group is not None:
            await self._group.__aexit__(None, None, None)
            self._group = None
        if self._pending_writes:
            await asyncio.gather(*self._pending_writes, return_exceptions=True)
        if flush and self.persistence is not None and self.engine.is_running:
            written = await self.flush()
            logger.info("flushed {} agent caches to disk", len(written))
        await self.engine.stop()
        if self.persistence is not None:
            await self.persistence.stop()

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
    ) -> RequestStream:
        """Start a turn: through the agent's actor with an id, straight to the engine without one."""
        request = GenerationRequest(request_id or uuid.uuid4().hex, list(prompt_tokens), sampling)
        if agent_id is None:
            return self.engine.submit(request)
        stream: RequestStream = await self.agent(agent_id).ask(Generate(request))
        return stream

    async def restore_from_disk(self, agent_id: str) -> bool:
        """Load an agent's cache into the engine if it is on disk and not in memory."""
        if self.persistence is None or not self.persistence.is_on_disk(agent_id):
            return False
        if await self.engine.call(lambda e: agent_id in e.store.agents):
            return False
        cache = await self.persistence.load(agent_id)
        if cache is None:
            return False
        await self.engine.call(lambda e: e.store.restore(self._snapshot_of(cache)))
        return True

    def _snapshot_of(self, cache: SerializedCache) -> CacheSnapshot:
        spec = self.engine.model.spec
        return from_tensors(cache, spec.dtype, len(spec.full_layer_ids), len(spec.sliding_layer_ids))

    async def evict_to_disk(self, agent_id: str) -> bool:
        """Write an agent's cache to disk and free its blocks; False if it had none in memory."""

        def take(engine: Engine) -> SerializedCache | None:
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
            store = engine.store
            return [to_tensors(store.snapshot(a)) for a in list(store.agents) if not a.startswith("anon-")]

        return await self.persistence.save(await self.engine.call(snapshot_all))

    async def forget_agent(self, agent_id: str) -> bool:
        """Stop the agent and drop its cache and conversation from memory and disk; False if unknown."""
        known = agent_id in self._agents or any(a.agent_id == agent_id for a in await self.list_agents())
        actor = self._agents.pop(agent_id, None)
        if actor is not None:
            actor.stop_nowait()
        await self.engine.call(lambda e: e.store.drop(agent_id))
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

    async def save_conversation(self, agent_id: str, record: ConversationRecord) -> None:
        if self.persistence is not None:
            await self.persistence.save_conversation(agent_id, record)

    async def load_conversation(self, agent_id: str) -> ConversationRecord | None:
        if self.persistence is None:
            return None
        return await self.persistence.load_conversation(agent_id)

    async def list_agents(self) -> list[AgentInfo]:
        def in_memory(engine: Engine) -> list[AgentInfo]:
            now = time.monotonic()
            return [
                AgentInfo(a.agent_id, a.num_tokens, "memory", now - a.last_used)
                for a in engine.store.agents.values()
            ]

        infos = {info.agent_id: info for info in await self.engine.call(in_memory)}
        if self.persistence is not None:
            for agent_id in self.persistence.agent_ids_on_disk - infos.keys():
                cache_on_disk = self.persistence.is_on_disk(agent_id)
                infos[agent_id] = AgentInfo(agent_id, 0, "disk" if cache_on_disk else "none", None)
        for agent_id, actor in self._agents.items():
            if agent_id not in infos and actor.conversation is not None:
                infos[agent_id] = AgentInfo(agent_id, 0, "none", None)
        return sorted(infos.values(), key=lambda info: info.agent_id)

    def _write_evicted(self, caches: list[SerializedCache]) -> None:
        assert self.persistence is not None
        task = asyncio.get_running_loop().create_task(self.persistence.save(caches))
        self._pending_writes.add(task)
        task.add_done_callback(self._pending_writes.discard)

    async def evict(self, agent_id: str) -> bool:
        result: bool = await self.agent(agent_id).ask(Evict())
        return result
